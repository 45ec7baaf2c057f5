#include "parallel/sharded_data_parallel.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "ops/collectives.h"
#include "simulator/checked_math.h"
#include "simulator/session.h"

namespace memsim {
namespace {

// One fp32 buffer holding every parameter's gradient shard, views handed out.
at::Tensor AllocateShardGrads(std::vector<Parameter*> params, int64_t dp) {
  int64_t elements = 0;
  for (const Parameter* p : params)
    elements = CheckedAdd(elements, ShardElements(p->data.numel(), dp));
  CategoryScope category(Category::kGradient);
  ModuleScope scope(ModuleScope::Absolute{"sharded_dp.grad_shards"});
  at::Tensor buffer =
      at::zeros({elements}, at::TensorOptions().device(at::kMeta).dtype(at::kFloat));
  int64_t offset = 0;
  for (Parameter* p : params) {
    const int64_t n = ShardElements(p->data.numel(), dp);
    p->shard_grad = buffer.narrow(0, offset, n);
    offset += n;
  }
  return buffer;
}

}  // namespace

void AllocateZero2Gradients(ParameterStore* store, int64_t dp) {
  std::vector<Parameter*> params;
  int64_t largest = 0;
  for (Parameter& p : store->parameters()) {
    params.push_back(&p);
    largest = std::max<int64_t>(largest, p.data.numel());
  }
  AllocateShardGrads(params, dp);  // the shard_grad views keep the buffer alive
  // Every main_grad aliases the front of one bucket: on meta the values do not matter,
  // and the bytes are what a rank holds while a bucket fills and is reduce-scattered.
  at::Tensor bucket;
  {
    CategoryScope category(Category::kGradient);
    ModuleScope scope(ModuleScope::Absolute{"sharded_dp.grad_bucket"});
    bucket = at::zeros({std::max(kGradientBucketElements, largest)},
                       at::TensorOptions().device(at::kMeta).dtype(store->grad_dtype()));
  }
  for (Parameter* p : params) {
    p->main_grad = bucket.narrow(0, 0, p->data.numel()).view(p->data.sizes());
  }
}

FullyShardedDataParallel::FullyShardedDataParallel(ParameterStore* store, int64_t dp)
    : store_(store), dp_(dp) {
  store->AllocateGradBuffer(/*root_only=*/true);
  std::vector<Parameter*> sharded;
  for (Parameter& p : store->parameters()) {
    if (p.unit < 0) continue;
    sharded.push_back(&p);
    units_[p.unit].params.push_back(&p);
  }
  AllocateShardGrads(sharded, dp);  // the shard_grad views keep the buffer alive
  for (auto& [index, unit] : units_) {
    ModuleScope scope(ModuleScope::Absolute{"fsdp.layers." + std::to_string(index)});
    int64_t grad_elements = 0;
    for (Parameter* p : unit.params) grad_elements = CheckedAdd(grad_elements, p->data.numel());
    unit.full_grads =
        at::empty({grad_elements}, at::TensorOptions().device(at::kMeta).dtype(at::kFloat));
    int64_t offset = 0;
    for (Parameter* p : unit.params) {
      p->main_grad = unit.full_grads.narrow(0, offset, p->data.numel()).view(p->data.sizes());
      offset += p->data.numel();
      CategoryScope category(Category::kParameter);
      p->shard_data = at::empty({ShardElements(p->data.numel(), dp)}, p->data.options());
      FreeStorage(p->data.storage());
    }
    FreeStorage(unit.full_grads.storage());
  }
}

void FullyShardedDataParallel::Gather(int64_t index) {
  auto it = units_.find(index);
  if (it == units_.end() || it->second.gathered) return;
  CategoryScope category(Category::kParameter);
  for (size_t i = 0; i < it->second.params.size(); ++i) {
    AllocateStorage(it->second.params[i]->data);
    ReceiveInto(it->second.params[i]->data);  // all_gather_into_tensor from the shards
  }
  it->second.gathered = true;
}

void FullyShardedDataParallel::Reshard(int64_t index) {
  auto it = units_.find(index);
  if (it == units_.end() || !it->second.gathered) return;
  for (Parameter* p : it->second.params) FreeStorage(p->data.storage());
  it->second.gathered = false;
}

void FullyShardedDataParallel::PreBackward(int64_t unit) {
  Gather(unit);
  Gather(unit - 1);  // BACKWARD_PRE prefetch of the layer whose backward comes next
  auto it = units_.find(unit);
  if (it == units_.end()) return;
  CategoryScope category(Category::kGradient);
  AllocateStorage(it->second.full_grads);
  it->second.full_grads.zero_();
}

void FullyShardedDataParallel::PostBackward(int64_t unit) {
  auto it = units_.find(unit);
  if (it == units_.end()) return;
  for (Parameter* p : it->second.params) {
    // reduce_scatter_tensor of the full gradient into a fresh shard (over the largest
    // multiple of dp elements), accumulated into the fp32 gradient shard.
    const int64_t even = p->data.numel() / dp_ * dp_;
    if (even == 0) continue;
    const at::Tensor reduced = ReduceScatter(p->main_grad.reshape({-1}).narrow(0, 0, even), dp_);
    p->shard_grad.narrow(0, 0, reduced.numel()).add_(reduced);
  }
  FreeStorage(it->second.full_grads.storage());
  Reshard(unit);
}

}  // namespace memsim
