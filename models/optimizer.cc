#include "models/optimizer.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

#include "models/fp8.h"
#include "ops/fused_optimizers.h"
#include "simulator/session.h"

namespace memsim {

namespace {

// Megatron's quintic Newton-Schulz coefficients (emerging_optimizers, "quintic").
constexpr double kNsA = 3.4445, kNsB = -4.7750, kNsC = 2.0315;

// One Muon update of `master` [m, n] from its gradient (Note [Muon]).
void MuonUpdate(const at::Tensor& master, const at::Tensor& grad, const at::Tensor& momentum,
                int64_t ns_steps) {
  momentum.mul_(0.9).add_(grad);  // --muon-momentum; Nesterov off, Megatron's default
  CategoryScope category(Category::kTemporary);
  const bool tall = momentum.size(0) > momentum.size(1);
  at::Tensor x = momentum / momentum.norm();  // fp32 [m, n]
  if (tall) x = x.t();                        // [s, l]
  x = x.to(at::kBFloat16);
  for (int64_t i = 0; i < ns_steps; ++i) {
    const at::Tensor a = at::mm(x, x.t());                                   // [s, s]
    const at::Tensor b = at::addmm(a, a, a, /*beta=*/kNsB, /*alpha=*/kNsC);  // [s, s]
    x = at::addmm(x, b, x, /*beta=*/kNsA, /*alpha=*/1.0);                    // [s, l]
  }
  at::Tensor update = x.to(at::kFloat);
  x.reset();
  if (tall) update = update.t();
  const double scale = std::sqrt(
      std::max(1.0, static_cast<double>(master.size(0)) / static_cast<double>(master.size(1))));
  // The spectral scale, then --muon-extra-scale-factor (the values change no memory).
  update = update * scale * 0.2;
  master.add_(update);
}

// This rank's shard of a flattened tensor.
at::Tensor Shard(const at::Tensor& t, int64_t shards) {
  if (shards == 1) return t.detach();
  const at::Tensor flat = t.detach().view({-1});
  return flat.narrow(0, 0, ShardElements(flat.numel(), shards));
}

}  // namespace

MixedPrecisionOptimizer::MixedPrecisionOptimizer(
    ParameterStore* store, OptimizerKind kind, int64_t shards, int64_t expert_shards,
    int64_t muon_ns_steps, std::optional<PrecisionAwareStates> precision_aware)
    : store_(store),
      kind_(kind),
      shards_(shards),
      expert_shards_(expert_shards),
      muon_ns_steps_(muon_ns_steps),
      precision_aware_(precision_aware) {
  ModuleScope scope(ModuleScope::Absolute{"optimizer"});
  CategoryScope category(Category::kOptimizerState);
  at::NoGradGuard no_grad;
  for (Parameter& p : store->parameters()) {
    // Transformer Engine's FusedAdam makes its masters in the first step.
    if (p.fp8.fp8_param) {
      // From the 16-bit value Transformer Engine kept on the host (Note [FP8 training]):
      // the parameter has no 16-bit storage to shard.
      const int64_t shards = p.expert ? expert_shards_ : shards_;
      masters_.push_back(
          at::empty({ShardElements(p.data.numel(), shards)}, p.data.options().dtype(at::kFloat)));
    } else if (!precision_aware_) {
      const at::Tensor shard = ParameterShard(p);
      masters_.push_back(store->precision() == Precision::kFp32 ? shard
                                                                : shard.clone().to(at::kFloat));
    }
    // Muon needs whole matrices, so it never runs on shards (Note [Muon]).
    muon_.push_back(kind == OptimizerKind::kMuon && p.data.dim() == 2 && !p.embedding_or_output);
  }
}

at::Tensor MixedPrecisionOptimizer::ParameterShard(const Parameter& p) const {
  return p.shard_data.defined() ? p.shard_data.detach()
                                : Shard(p.data, p.expert ? expert_shards_ : shards_);
}

void MixedPrecisionOptimizer::ZeroGrad() { master_grads_.clear(); }

void MixedPrecisionOptimizer::CreatePrecisionAwareStates() {
  CategoryScope category(Category::kOptimizerState);
  for (Parameter& p : store_->parameters()) {
    const at::Tensor shard = ParameterShard(p);
    exp_avgs_.push_back(at::zeros(shard.sizes(), shard.options().dtype(precision_aware_->exp_avg)));
    exp_avg_sqs_.push_back(
        at::zeros(shard.sizes(), shard.options().dtype(precision_aware_->exp_avg_sq)));
    // A non-fp32 state's scale (_initialize_state's torch.ones([1]), fp32), per parameter.
    for (at::ScalarType dtype : {precision_aware_->exp_avg, precision_aware_->exp_avg_sq}) {
      if (dtype != at::kFloat)
        state_scales_.push_back(at::ones({1}, shard.options().dtype(at::kFloat)));
    }
    if (precision_aware_->param_remainders && shard.scalar_type() == at::kBFloat16) {
      masters_.push_back(at::zeros(shard.sizes(), shard.options().dtype(at::kShort)));
    } else {
      at::Tensor master = at::empty(shard.sizes(), shard.options().dtype(at::kFloat));
      master.copy_(shard.clone().to(at::kFloat));  // set_scaled_state from a clone
      masters_.push_back(master);
    }
  }
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
      // A copy when gradients are 16-bit; FusedAdam's decoupled_grad is the shard itself.
      master_grads_are_copies_ = !precision_aware_ && grad.scalar_type() != at::kFloat;
      master_grads_.push_back(precision_aware_ ? grad : grad.to(at::kFloat));
    }
  }
  if (exp_avgs_.empty() && precision_aware_) CreatePrecisionAwareStates();
  if (exp_avgs_.empty()) {
    CategoryScope category(Category::kOptimizerState);
    for (size_t i = 0; i < masters_.size(); ++i) {
      exp_avgs_.push_back(at::zeros_like(masters_[i]));
      const bool adam =
          kind_ == OptimizerKind::kAdam || (kind_ == OptimizerKind::kMuon && !muon_[i]);
      exp_avg_sqs_.push_back(adam ? at::zeros_like(masters_[i]) : at::Tensor());
    }
  }
  // One fused update over the parameters Adam (or SGD) takes, then Muon's one by one.
  std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs;
  for (size_t i = 0; i < masters_.size(); ++i) {
    if (muon_[i]) continue;
    params.push_back(masters_[i]);
    grads.push_back(master_grads_[i]);
    exp_avgs.push_back(exp_avgs_[i]);
    exp_avg_sqs.push_back(exp_avg_sqs_[i]);
  }
  if (kind_ == OptimizerKind::kSgd) {
    FusedSgdStep(params, grads, exp_avgs, /*lr=*/1e-3, /*momentum=*/0.9, /*weight_decay=*/0.0);
  } else if (!params.empty()) {
    FusedAdamStep(params, grads, exp_avgs, exp_avg_sqs, AdamHyperparameters{}, step_);
  }
  for (size_t i = 0; i < masters_.size(); ++i) {
    if (muon_[i]) MuonUpdate(masters_[i], master_grads_[i], exp_avgs_[i], muon_ns_steps_);
  }
  if (store_->precision() != Precision::kFp32 && !precision_aware_) {  // else the kernel does
    size_t i = 0;
    std::vector<at::Tensor> fp8_masters;
    Fp8Recipe fp8_recipe = Fp8Recipe::kNone;
    for (Parameter& p : store_->parameters()) {
      const at::Tensor& master = masters_[i++];
      if (p.fp8.fp8_param) {
        fp8_masters.push_back(master);
        fp8_recipe = p.fp8.recipe;
        continue;
      }
      (p.shard_data.defined() ? p.shard_data.detach()
                              : Shard(p.data, p.expert ? expert_shards_ : shards_))
          .copy_(master);
    }
    CastMastersToFp8Parameters(fp8_masters, fp8_recipe);
  }
  // Views of the gradients go now; fp32 copies of 16-bit gradients stay until zero_grad.
  if (!master_grads_are_copies_) master_grads_.clear();
}

}  // namespace memsim
