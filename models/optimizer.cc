#include "models/optimizer.h"

#include <ATen/ATen.h>

#include "ops/fused_optimizers.h"
#include "simulator/session.h"

namespace memsim {

namespace {

// This rank's shard of a flattened tensor: ceil(numel / shards) elements.
at::Tensor Shard(const at::Tensor& t, int64_t shards) {
  if (shards == 1) return t.detach();
  const at::Tensor flat = t.detach().view({-1});
  return flat.narrow(0, 0, (flat.numel() + shards - 1) / shards);
}

}  // namespace

MixedPrecisionOptimizer::MixedPrecisionOptimizer(ParameterStore* store, OptimizerKind kind,
                                                 int64_t shards, int64_t expert_shards)
    : store_(store), kind_(kind), shards_(shards), expert_shards_(expert_shards) {
  ModuleScope scope(ModuleScope::Absolute{"optimizer"});
  CategoryScope category(Category::kOptimizerState);
  at::NoGradGuard no_grad;
  for (Parameter& p : store->parameters()) {
    const at::Tensor shard = p.shard_data.defined()
                                 ? p.shard_data.detach()
                                 : Shard(p.data, p.expert ? expert_shards_ : shards_);
    masters_.push_back(store->precision() == Precision::kFp32 ? shard
                                                              : shard.clone().to(at::kFloat));
  }
}

void MixedPrecisionOptimizer::ZeroGrad() {
  if (store_->precision() == Precision::kFp16) master_grads_.clear();
}

void MixedPrecisionOptimizer::Step() {
  ModuleScope scope(ModuleScope::Absolute{"optimizer"});
  at::NoGradGuard no_grad;
  ++step_;
  master_grads_.clear();
  {
    CategoryScope category(Category::kGradient);
    for (Parameter& p : store_->parameters()) {
      const at::Tensor grad = p.shard_grad.defined()
                                  ? p.shard_grad
                                  : Shard(p.main_grad, p.expert ? expert_shards_ : shards_);
      master_grads_.push_back(store_->precision() == Precision::kFp16 ? grad.to(at::kFloat) : grad);
    }
  }
  if (exp_avgs_.empty()) {
    CategoryScope category(Category::kOptimizerState);
    for (const at::Tensor& master : masters_) {
      exp_avgs_.push_back(at::zeros_like(master));
      if (kind_ == OptimizerKind::kAdam) exp_avg_sqs_.push_back(at::zeros_like(master));
    }
  }
  std::vector<at::Tensor> params = masters_;
  if (kind_ == OptimizerKind::kAdam) {
    FusedAdamStep(params, master_grads_, exp_avgs_, exp_avg_sqs_, AdamHyperparameters{}, step_);
  } else {
    FusedSgdStep(params, master_grads_, exp_avgs_, /*lr=*/1e-3, /*momentum=*/0.9,
                 /*weight_decay=*/0.0);
  }
  if (store_->precision() != Precision::kFp32) {
    size_t i = 0;
    for (Parameter& p : store_->parameters()) {
      (p.shard_data.defined() ? p.shard_data.detach()
                              : Shard(p.data, p.expert ? expert_shards_ : shards_))
          .copy_(masters_[i++]);
    }
  }
  if (store_->precision() != Precision::kFp16) master_grads_.clear();  // views only
}

}  // namespace memsim
