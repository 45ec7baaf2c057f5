#include "parallel/megatron_fsdp.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <numeric>
#include <utility>

#include "models/layers.h"
#include "ops/collectives.h"
#include "simulator/checked_math.h"
#include "simulator/session.h"
#include "simulator/status.h"

namespace memsim {
namespace {

// The product of a parameter's trailing dimensions (1 for a vector).
int64_t RowElements(const at::Tensor& t) { return t.dim() <= 1 ? 1 : t.numel() / t.size(0); }

// The bucket's chunk size factor, as Megatron-FSDP groups parameters: the largest row, made
// the least common multiple with every row that neither divides it (with the parameter a
// whole number of such chunks) nor belongs to a parameter smaller than one chunk.
int64_t ChunkFactor(const std::vector<Parameter*>& params) {
  std::vector<const at::Tensor*> by_row;
  for (const Parameter* p : params) by_row.push_back(&p->data);
  std::stable_sort(by_row.begin(), by_row.end(), [](const at::Tensor* a, const at::Tensor* b) {
    return RowElements(*a) > RowElements(*b);
  });
  int64_t factor = RowElements(*by_row.front());
  for (const at::Tensor* t : by_row) {
    const int64_t row = RowElements(*t);
    const bool fits =
        row == factor || (factor % row == 0 && t->numel() % factor == 0) || t->numel() < factor;
    if (!fits) factor = std::lcm(factor, row);
  }
  return factor;
}

// What a parameter's bucket holds of it: an FP8 parameter's FP8 data, else its data.
at::Tensor& BucketedData(Parameter& p) { return p.fp8.fp8_param ? p.fp8.weight[0] : p.data; }

}  // namespace

MegatronFsdp::MegatronFsdp(ParameterStore* store, const MegatronFsdpOptions& options)
    : gradient_accumulation_fusion_(store->gradient_accumulation_fusion()), options_(options) {
  at::NoGradGuard no_grad;
  // Buckets in the order their parameters first appear.
  for (Parameter& p : store->parameters()) {
    const bool expert = p.expert && p.unit >= 0;
    const bool fp8 = p.fp8.fp8_param;
    // FP8 parameters keep no transposes here (run_spec.cc refuses GPUs that need them).
    MEMSIM_DCHECK(!fp8 || !p.fp8.weight[1].defined());
    auto it = std::find_if(buckets_.begin(), buckets_.end(), [&](const Bucket& b) {
      return b.unit == p.unit && b.expert == expert && b.fp8 == fp8;
    });
    if (it == buckets_.end()) {
      Bucket bucket;
      bucket.unit = p.unit;
      bucket.expert = expert;
      bucket.fp8 = fp8;
      buckets_.push_back(std::move(bucket));
      it = buckets_.end() - 1;
    }
    it->params.push_back(&p);
  }
  // The prefetch window and the reduce-scatter queue's capacity: twice the mean layer,
  // at least a billion elements (suggested_communication_unit_size).
  int64_t unit_elements = 0;
  std::vector<int64_t> units;
  for (const Parameter& p : store->parameters()) {
    if (p.unit < 0) continue;
    unit_elements = CheckedAdd(unit_elements, p.data.numel());
    if (std::find(units.begin(), units.end(), p.unit) == units.end()) units.push_back(p.unit);
  }
  const int64_t mean_unit = units.empty() ? 0 : unit_elements / static_cast<int64_t>(units.size());
  queue_capacity_elements_ = std::max<int64_t>(1'000'000'000, CheckedMul(mean_unit, 2));
  prefetch_elements_ = queue_capacity_elements_ / 2;

  // The shards: per bucket the model's weights (the fp32 main weights are the optimizer's
  // masters, cloned from these), and one gradient shard buffer per gradient dtype.
  std::vector<int64_t> shard_elements;
  for (Bucket& b : buckets_) {
    // auto: bf16 for FP8 parameters, else their own dtype (MixedPrecisionPolicy).
    b.main_grads =
        options.main_grads.value_or(b.fp8 ? at::kBFloat16 : b.params.front()->data.scalar_type());
    const int64_t shards = b.expert ? options.expert_shards : options.shards;
    int64_t elements = 0;
    for (const Parameter* p : b.params) elements = CheckedAdd(elements, p->data.numel());
    // S: the elements rounded up to a multiple of d * c.
    const int64_t pad = CheckedMul(shards, ChunkFactor(b.params));
    b.full_elements = CheckedMul(ShardElements(elements, pad), pad);
    shard_elements.push_back(b.full_elements / shards);
  }
  // Note [Megatron-FSDP double buffers]: the double-buffered layers of each pool.
  std::map<int64_t, int64_t> buckets_in_unit;
  for (Bucket& b : buckets_) {
    if (b.unit >= 0) b.offset_in_unit = buckets_in_unit[b.unit]++;
  }
  if (options.double_buffer) {
    weight_pool_.units = SymmetricUnits(
        [](const Bucket& b) { return BucketedData(*b.params.front()).scalar_type(); });
    grad_pool_.units = SymmetricUnits(
        [&options](const Bucket& b) { return options.grad_comm.value_or(b.main_grads); });
  }
  const at::TensorOptions meta = at::TensorOptions().device(at::kMeta);
  for (size_t i = 0; i < buckets_.size(); ++i) {
    Bucket& b = buckets_[i];
    const int64_t shards = b.expert ? options.expert_shards : options.shards;
    const at::ScalarType dtype = BucketedData(*b.params.front()).scalar_type();
    ModuleScope scope(ModuleScope::Absolute{"megatron_fsdp.buckets." + std::to_string(i)});
    CategoryScope category(Category::kParameter);
    // The parameters move into a temporary full bucket; their shard is copied out.
    // fetch_bucket(strict_assignments=False): a temporary bucket, or the fixed pool's.
    b.weights = EmptyWithoutBytes({b.full_elements}, meta.dtype(dtype));
    TakeStorage(weight_pool_, i, b.weights, Category::kParameter, /*strict=*/false);
    int64_t offset = 0;
    for (Parameter* p : b.params) {
      at::Tensor& data = BucketedData(*p);
      if (options.meta_init) {
        at::Tensor materialized = at::empty_like(data);  // to_empty, then copied in
      }
      data.set_(b.weights.storage(), offset, data.sizes(), data.strides());
      offset += data.numel();
    }
    shards_.push_back(at::empty({shard_elements[i]}, meta.dtype(dtype)));
    offset = 0;
    for (Parameter* p : b.params) {
      const int64_t share =
          std::min(ShardElements(p->data.numel(), shards), shard_elements[i] - offset);
      p->shard_data = shards_.back().narrow(0, offset, share);
      offset += share;
    }
    shards_.back().copy_(b.weights.narrow(0, 0, shard_elements[i]));
    ReleaseStorage(weight_pool_, i, b.weights);
    b.grads = at::empty({b.full_elements}, meta.dtype(options.grad_comm.value_or(b.main_grads)));
    offset = 0;
    for (Parameter* p : b.params) {
      p->main_grad = b.grads.narrow(0, offset, p->data.numel()).view(p->data.sizes());
      offset += p->data.numel();
    }
    FreeStorage(b.grads.storage());
  }
  // The gradient shard buffers, one per dtype in the order the buckets first need it.
  std::vector<at::ScalarType> grad_dtypes;
  for (const Bucket& b : buckets_) {
    if (std::find(grad_dtypes.begin(), grad_dtypes.end(), b.main_grads) == grad_dtypes.end())
      grad_dtypes.push_back(b.main_grads);
  }
  for (at::ScalarType dtype : grad_dtypes) {
    int64_t elements = 0;
    for (size_t i = 0; i < buckets_.size(); ++i) {
      if (buckets_[i].main_grads == dtype) elements = CheckedAdd(elements, shard_elements[i]);
    }
    at::Tensor buffer;
    {
      ModuleScope scope(ModuleScope::Absolute{"megatron_fsdp.grad_shards"});
      CategoryScope category(Category::kGradient);
      buffer = at::zeros({elements}, meta.dtype(dtype));
    }
    shards_.push_back(buffer);
    int64_t offset = 0;
    for (size_t i = 0; i < buckets_.size(); ++i) {
      if (buckets_[i].main_grads != dtype) continue;
      const int64_t shards = buckets_[i].expert ? options.expert_shards : options.shards;
      buckets_[i].grad_shard = buffer.narrow(0, offset, shard_elements[i]);
      int64_t share_offset = 0;
      for (Parameter* p : buckets_[i].params) {
        const int64_t share =
            std::min(ShardElements(p->data.numel(), shards), shard_elements[i] - share_offset);
        p->shard_grad = buckets_[i].grad_shard.narrow(0, share_offset, share);
        share_offset += share;
      }
      offset += shard_elements[i];
    }
  }
}

std::vector<int64_t> MegatronFsdp::SymmetricUnits(
    const std::function<at::ScalarType(const Bucket&)>& dtype_of) const {
  // Each layer's buckets, in order, as (dtype, elements); layers in bucket order.
  std::vector<int64_t> units;
  std::map<int64_t, std::vector<std::pair<at::ScalarType, int64_t>>> signature;
  for (const Bucket& b : buckets_) {
    if (b.unit < 0) continue;
    if (signature.count(b.unit) == 0) units.push_back(b.unit);
    int64_t elements = 0;
    for (const Parameter* p : b.params) elements += p->data.numel();
    signature[b.unit].emplace_back(dtype_of(b), elements);
  }
  std::vector<int64_t> largest;
  for (int64_t unit : units) {
    std::vector<int64_t> same;
    for (int64_t other : units) {
      if (signature[other] == signature[unit]) same.push_back(other);
    }
    if (same.size() > largest.size()) largest = std::move(same);
  }
  return largest;
}

void MegatronFsdp::TakeStorage(FixedPool& pool, size_t id, const at::Tensor& full,
                               Category category, bool strict) {
  const Bucket& b = buckets_[id];
  if (!options_.double_buffer || (!pool.Holds(b.unit) && !options_.persistent_fallback)) {
    AllocateStorage(full);  // StorageResizeBasedBucketAllocator
    return;
  }
  // The bytes live in a persistent buffer; the bucket's own storage only maps them.
  ModuleScope scope(ModuleScope::Absolute{"megatron_fsdp.double_buffers"});
  CategoryScope counted(category);
  PersistentScope persistent;
  const at::TensorOptions options = at::TensorOptions().device(at::kMeta).dtype(full.dtype());
  if (!pool.Holds(b.unit)) {
    at::Tensor& buffer = pool.persistent_fallback[id];
    if (!buffer.defined()) buffer = at::empty({b.full_elements}, options);
  } else {
    auto slot = pool.using_by_bucket.find(id);
    if (slot == pool.using_by_bucket.end()) {
      const auto idle = [&pool](int group, int64_t offset) {
        return pool.in_use.count({group, offset}) == 0;
      };
      const auto planned = pool.planned_group.find(id);
      int group = -1;
      if (planned != pool.planned_group.end() && idle(planned->second, b.offset_in_unit)) {
        group = planned->second;
      } else {
        for (int g = 0; g < 2 && group < 0; ++g) {
          if (idle(g, b.offset_in_unit)) group = g;
        }
        if (group < 0) {
          throw UserError(
              "memsim bug (Note [Megatron-FSDP double buffers]): no idle buffer "
              "for bucket " +
              std::to_string(id));
        }
        if (strict) pool.planned_group.emplace(id, group);  // kept only if none was planned
      }
      slot = pool.using_by_bucket.emplace(id, std::make_pair(group, b.offset_in_unit)).first;
      pool.in_use.insert(slot->second);
    }
    at::Tensor& buffer = pool.buffers[slot->second];
    // get_global_memory_buffer().get_tensor: a larger request replaces the buffer.
    if (!buffer.defined() || buffer.numel() < b.full_elements) {
      buffer = at::empty({b.full_elements}, options);
    }
  }
  MapStorage(full);
}

void MegatronFsdp::ReleaseStorage(FixedPool& pool, size_t id, const at::Tensor& full) {
  FreeStorage(full.storage());  // a mapped storage frees nothing
  const auto slot = pool.using_by_bucket.find(id);
  if (!options_.double_buffer || slot == pool.using_by_bucket.end()) return;
  pool.in_use.erase(slot->second);
  pool.using_by_bucket.erase(slot);
}

void MegatronFsdp::Gather(Bucket& bucket) {
  if (bucket.gathered) return;
  ModuleScope scope(ModuleScope::Absolute{"megatron_fsdp.all_gather"});
  CategoryScope category(Category::kParameter);
  TakeStorage(weight_pool_, IdOf(bucket), bucket.weights, Category::kParameter);
  ReceiveInto(bucket.weights);  // all_gather_into_tensor from the weight shards
  bucket.gathered = true;
}

void MegatronFsdp::GatherWithPrefetch(std::vector<size_t> wanted, Order order) {
  if (wanted.empty()) return;
  std::sort(wanted.begin(), wanted.end());
  auto size_of = [this](const std::vector<size_t>& ids) {
    int64_t elements = 0;
    for (size_t id : ids) elements += buckets_[id].full_elements;
    return elements;
  };
  // The first bucket past the run of consecutive wanted ones, in `order`.
  auto next = [&](const std::vector<size_t>& ids) -> int64_t {
    if (order == Order::kForward) {
      size_t id = ids.front() + 1;
      for (size_t k = 1; k < ids.size() && ids[k] == id; ++k) ++id;
      return id < buckets_.size() ? static_cast<int64_t>(id) : -1;
    }
    int64_t id = static_cast<int64_t>(ids.back()) - 1;
    for (size_t k = ids.size() - 1; k-- > 0 && static_cast<int64_t>(ids[k]) == id;) --id;
    return id;
  };
  // Note [Megatron-FSDP double buffers]: the units the gather spans, at most two.
  std::set<int64_t> units;
  bool any_unit = false;
  for (size_t id : wanted) {
    if (weight_pool_.Holds(buckets_[id].unit)) units.insert(buckets_[id].unit);
    any_unit = any_unit || buckets_[id].unit >= 0;
  }
  const bool prefetch = !(options_.double_buffer && !any_unit);
  const int64_t base = size_of(wanted);
  for (int64_t id = next(wanted); prefetch && id >= 0; id = next(wanted)) {
    if (size_of(wanted) - base >= prefetch_elements_) break;
    if (options_.double_buffer) {
      units.insert(buckets_[static_cast<size_t>(id)].unit);
      if (units.size() > 2) break;
    }
    wanted.insert(std::upper_bound(wanted.begin(), wanted.end(), static_cast<size_t>(id)),
                  static_cast<size_t>(id));
  }
  for (size_t id : wanted) Gather(buckets_[id]);
}

std::vector<size_t> MegatronFsdp::BucketsOf(int64_t unit) const {
  std::vector<size_t> ids;
  for (size_t i = 0; i < buckets_.size(); ++i) {
    if (buckets_[i].unit == unit) ids.push_back(i);
  }
  return ids;
}

void MegatronFsdp::Release(int64_t unit) {
  for (size_t id : BucketsOf(unit)) {
    Bucket& b = buckets_[id];
    if (!b.gathered) continue;
    ReleaseStorage(weight_pool_, id, b.weights);
    b.gathered = false;
  }
}

void MegatronFsdp::EnforceDoubleBufferLimit(int64_t unit) {
  if (!options_.double_buffer) return;
  std::set<int64_t> units;
  if (weight_pool_.Holds(unit)) units.insert(unit);  // the buffer's double_buf_units
  size_t keep = queue_.size();
  for (auto it = queue_.rbegin(); it != queue_.rend(); ++it) {
    units.insert((*it)->unit);
    if (units.size() > 2) --keep;
  }
  while (queue_.size() > keep) FreeOldestQueued();
}

void MegatronFsdp::AllocateGrads(Bucket& bucket) {
  if (bucket.grads_allocated) return;
  EnforceDoubleBufferLimit(bucket.unit);  // main_grad_getter's, before fetch_bucket
  ModuleScope scope(ModuleScope::Absolute{"megatron_fsdp.grad_buckets"});
  CategoryScope category(Category::kGradient);
  TakeStorage(grad_pool_, IdOf(bucket), bucket.grads, Category::kGradient);
  bucket.grads_allocated = true;
}

void MegatronFsdp::ReduceScatter(Bucket& bucket) {
  if (!bucket.grads_allocated) return;
  while (queued_elements_ > queue_capacity_elements_) FreeOldestQueued();
  EnforceDoubleBufferLimit(bucket.unit);
  at::NoGradGuard no_grad;
  const at::Tensor shard = bucket.grads.narrow(0, 0, bucket.grad_shard.numel());
  ReceiveInto(shard);  // reduce_scatter_tensor into the bucket's own shard slot
  bucket.grad_shard.add_(shard);
  queue_.push_back(&bucket);
  queued_elements_ += bucket.full_elements;
}

void MegatronFsdp::FreeOldestQueued() {
  Bucket* bucket = queue_.front();
  queue_.pop_front();
  queued_elements_ -= bucket->full_elements;
  ReleaseStorage(grad_pool_, IdOf(*bucket), bucket->grads);
  bucket->grads_allocated = false;
}

void MegatronFsdp::PreForward(int64_t unit) {
  GatherWithPrefetch(BucketsOf(unit), Order::kForward);
}

void MegatronFsdp::PostForward(int64_t unit, bool recomputing) {
  MEMSIM_DCHECK(!recomputing);  // full recomputation is refused (Note [Megatron-FSDP])
  Release(unit);
}

void MegatronFsdp::PreBackward(int64_t unit) {
  if (unit == ModelShard::kOutputLayerUnit) {
    // The output layer's weight gradient is the first of the non-unit buckets'. Without
    // gradient accumulation fusion it is param.grad, copied in by the post-accumulate hook
    // once the output layer's backward has returned (and let its output gradient go).
    if (gradient_accumulation_fusion_) {
      for (size_t id : BucketsOf(-1)) AllocateGrads(buckets_[id]);
    } else {
      non_unit_grads_pending_ = true;
    }
    return;
  }
  GatherWithPrefetch(BucketsOf(unit), Order::kBackward);
  for (size_t id : BucketsOf(unit)) AllocateGrads(buckets_[id]);
}

void MegatronFsdp::PostBackward(int64_t unit) {
  if (unit == ModelShard::kOutputLayerUnit) {
    // The output layer's backward has returned: its weight gradient's hook fills the
    // non-unit bucket now, before the final norm's backward adds to it.
    if (non_unit_grads_pending_) {
      for (size_t id : BucketsOf(-1)) AllocateGrads(buckets_[id]);
      non_unit_grads_pending_ = false;
    }
    return;
  }
  for (size_t id : BucketsOf(unit)) ReduceScatter(buckets_[id]);
  Release(unit);
}

void MegatronFsdp::BeforeForwardStep() { GatherWithPrefetch(BucketsOf(-1), Order::kForward); }

void MegatronFsdp::BeforeFinalNorm() {
  if (options_.final_norm_gathers_every_forward) GatherWithPrefetch(BucketsOf(-1), Order::kForward);
}

void MegatronFsdp::AfterOptimizerStep() {
  GatherWithPrefetch(BucketsOf(-1), Order::kForward);  // start_param_sync
  if (!options_.log_params_norm) return;
  for (size_t id = 0; id < buckets_.size(); ++id) {  // reset(): the gathered go, not PRESERVED
    Bucket& b = buckets_[id];
    if (!b.gathered || (b.unit < 0 && !options_.reset_releases_non_unit)) continue;
    ReleaseStorage(weight_pool_, id, b.weights);
    b.gathered = false;
  }
}

void MegatronFsdp::AfterBackwardStep() {
  non_unit_grads_pending_ = false;
  for (size_t id : BucketsOf(-1)) {
    AllocateGrads(buckets_[id]);
    ReduceScatter(buckets_[id]);
  }
  while (!queue_.empty()) FreeOldestQueued();
}

}  // namespace memsim
