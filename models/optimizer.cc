#include "models/optimizer.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string_view>
#include <tuple>
#include <vector>

#include "models/fp8.h"
#include "ops/collectives.h"
#include "ops/fused_optimizers.h"
#include "simulator/check.h"
#include "simulator/checked_math.h"
#include "simulator/interceptor.h"
#include "simulator/session.h"

namespace memsim {

namespace {

// Newton-Schulz coefficients (emerging_optimizers' "simple" set; the default "quintic" one
// changes them from iteration to iteration, which changes values, not work).
constexpr double kNsA = 3.4445, kNsB = -4.7750, kNsC = 2.0315;

// How Megatron-Core's TensorParallelMuon sees a parameter (Note [Muon]).
struct MuonView {
  int64_t partition_dim = -1;           // Parameter::tp_partition_dim
  int64_t tp = 1;                       // the group it is split over
  int64_t matrices = 1;                 // Parameter::stacked_experts: updated one by one
  std::vector<int64_t> qkv_split_rows;  // linear_qkv: q, k, v rows per query group
};

// newton_schulz: `x` [m, n] fp32 normalized (F.normalize: norm, clamp_min, div), in bf16
// for the iterations (fp32_matmul_prec "medium"), on its short side.
at::Tensor NewtonSchulz(const at::Tensor& x, int64_t ns_steps) {
  const bool tall = x.size(0) > x.size(1);
  const at::Tensor wide = tall ? x.t() : x;  // [s, l]
  at::Tensor X = wide / wide.norm(2, {-2, -1}, /*keepdim=*/true).clamp_min(1e-7);
  X = X.to(at::kBFloat16);
  for (int64_t i = 0; i < ns_steps; ++i) {
    const at::Tensor a = at::mm(X, X.t());                                   // [s, s]
    const at::Tensor b = at::addmm(a, a, a, /*beta=*/kNsB, /*alpha=*/kNsC);  // [s, s]
    X = at::addmm(X, b, X, /*beta=*/kNsA, /*alpha=*/1.0);                    // [s, l]
  }
  X = X.to(at::kFloat);
  return tall ? X.t() : X;
}

// newton_schulz_tp in its default "duplicated" mode: a split weight's shards all-gathered
// (a list of tp fp32 shards) and concatenated, even at TP 1, the whole matrix orthogonalized
// and this rank's part returned (a view that keeps the whole result); the gathered copies
// go when it returns.
at::Tensor NewtonSchulzTp(const at::Tensor& x, const MuonView& view, int64_t ns_steps) {
  if (view.partition_dim < 0) return NewtonSchulz(x, ns_steps);
  const at::Tensor gathered = AllGather(x, view.tp);  // [tp * m, n]: the list of shards
  const at::Tensor whole = at::cat(gathered.chunk(view.tp, 0), view.partition_dim);
  return NewtonSchulz(whole, ns_steps).chunk(view.tp, view.partition_dim)[0];
}

// scaled_orthogonalize_fn: the orthogonalized momentum scaled twice (the spectral scale and
// --muon-extra-scale-factor; values only).
at::Tensor ScaledOrthogonalize(const at::Tensor& x, const MuonView& view, int64_t ns_steps) {
  return NewtonSchulzTp(x, view, ns_steps) * 0.5 * 0.2;
}

// TensorParallelMuon.orthogonalize: linear_qkv's q, k and v apart (each gathered over its
// query groups by a reshape, a copy when there are several), then concatenated back.
at::Tensor Orthogonalize(const at::Tensor& momentum, const MuonView& view, int64_t ns_steps) {
  if (view.qkv_split_rows.empty()) return ScaledOrthogonalize(momentum, view, ns_steps);
  const int64_t group_rows =
      std::accumulate(view.qkv_split_rows.begin(), view.qkv_split_rows.end(), int64_t{0});
  const int64_t groups = momentum.size(0) / group_rows, n = momentum.size(1);
  std::vector<at::Tensor> parts;
  for (const at::Tensor& part :
       momentum.view({groups, group_rows, n}).split_with_sizes(view.qkv_split_rows, 1)) {
    parts.push_back(
        ScaledOrthogonalize(part.reshape({-1, n}), view, ns_steps).view({groups, -1, n}));
  }
  return at::cat(parts, 1).view(momentum.sizes());
}

// One Muon step of `master` [m, n] from its gradient (Note [Muon]): OrthogonalizedOptimizer.step
// for each of Megatron's parameters it holds.
void MuonUpdate(const at::Tensor& master, const at::Tensor& grad, const at::Tensor& momentum,
                const MuonView& view, int64_t ns_steps) {
  const auto matrices = [&view](const at::Tensor& t) {
    return view.matrices == 1 ? std::vector<at::Tensor>{t}
                              : t.chunk(view.matrices, view.partition_dim);
  };
  const std::vector<at::Tensor> masters = matrices(master), grads = matrices(grad),
                                momenta = matrices(momentum);
  for (size_t k = 0; k < masters.size(); ++k) {
    masters[k].add_(masters[k], /*alpha=*/-1e-6);  // decoupled weight decay (values only)
    momenta[k].lerp_(grads[k], 0.1);               // 1 - --muon-momentum; Nesterov off
    CategoryScope category(Category::kTemporary);
    masters[k].add_(Orthogonalize(momenta[k], view, ns_steps), /*alpha=*/-1e-3);
  }
}

// What TensorParallelMuon reads of parameter `p`: its partition_dim and group, whether it is
// linear_qkv (Megatron's test: the name, and rows a multiple of the split).
MuonView MuonViewOf(const Parameter& p, const OptimizerOptions& options) {
  MuonView view;
  view.partition_dim = p.tp_partition_dim;
  view.tp = p.expert ? options.expert_tp : options.tp;
  view.matrices = p.stacked_experts;
  const int64_t group_rows = std::accumulate(options.muon_qkv_split_rows.begin(),
                                             options.muon_qkv_split_rows.end(), int64_t{0});
  const std::string_view name = p.name;
  const std::string_view qkv = "linear_qkv.weight";
  if (group_rows > 0 && name.size() >= qkv.size() && name.substr(name.size() - qkv.size()) == qkv &&
      p.data.size(0) % group_rows == 0) {
    view.qkv_split_rows = options.muon_qkv_split_rows;
  }
  return view;
}

// This rank's shard of `t`, parameter `p` or its gradient: the slice the distributed
// optimizer's buckets give it, else the first ceil(numel / shards) elements. Views
// allocate nothing, so they skip the interceptor, which added 3% to a layout's
// instructions (benchmarks/PROFILE.md).
at::Tensor Shard(const Parameter& p, const at::Tensor& t, int64_t shards) {
  c10::impl::ExcludeDispatchKeyGuard views_allocate_nothing(kInterceptKey);
  if (!p.optimizer_slice && shards == 1) return t.detach();
  const at::Tensor flat = t.detach().view({-1});
  return p.optimizer_slice ? flat.narrow(0, p.optimizer_slice->offset, p.optimizer_slice->elements)
                           : flat.narrow(0, 0, ShardElements(flat.numel(), shards));
}

// Megatron's default parameter groups (get_standard_config_overrides): weight decay for
// all but biases and 1-D parameters, which form the second group.
bool WithoutWeightDecay(const Parameter& p) {
  const std::string_view suffix = ".bias";
  return p.data.dim() == 1 ||
         (p.name.size() >= suffix.size() &&
          p.name.compare(p.name.size() - suffix.size(), suffix.size(), suffix) == 0);
}

// The order the optimizer makes its per-parameter state in: the store's, or under the
// distributed optimizer's buckets Megatron's (_build_optimizer_group_ranges in each of
// its optimizers, OptimizerOptions): optimizer, then parameter group, model chunk, and
// the buffer's order, which is the reverse of the parameters'. (FP8 parameters' own
// buffer is not told apart.)
std::vector<size_t> StateOrder(const std::deque<Parameter>& params,
                               const OptimizerOptions& options) {
  std::vector<size_t> order(params.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  const bool bucketed = std::any_of(params.begin(), params.end(), [](const Parameter& p) {
    return p.optimizer_slice.has_value();
  });
  if (!bucketed) return order;
  auto key = [&](size_t i) {
    const Parameter& p = params[i];
    return std::make_tuple(p.expert && options.experts_apart,
                           options.first_chunk_apart && p.chunk > 0, WithoutWeightDecay(p), p.chunk,
                           -static_cast<int64_t>(i));
  };
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return key(a) < key(b); });
  return order;
}

}  // namespace

MixedPrecisionOptimizer::MixedPrecisionOptimizer(ParameterStore* store,
                                                 const OptimizerOptions& options)
    : store_(store), options_(options) {
  ModuleScope scope(ModuleScope::Absolute{"optimizer"});
  CategoryScope category(Category::kOptimizerState);
  at::NoGradGuard no_grad;
  for (Parameter& p : store->parameters()) {
    // Muon needs whole matrices, so it never runs on shards (Note [Muon]).
    muon_.push_back(options_.kind == OptimizerKind::kMuon && p.data.dim() == 2 &&
                    !p.embedding_or_output);
  }
  owned_.assign(muon_.size(), true);
  param_shards_.resize(muon_.size());
  grad_shards_.resize(muon_.size());
  if (options_.layer_wise) DealWholeParameters(*options_.layer_wise);
  order_ = StateOrder(store->parameters(), options_);
  for (size_t i = 0; i < owned_.size(); ++i) {
    // Another rank's buckets hold all of it (Note [Distributed optimizer buffers]).
    const auto& slice = store->parameters()[i].optimizer_slice;
    if (slice && slice->elements == 0) owned_[i] = false;
  }
  SplitHostShards();
  masters_.resize(owned_.size());
  for (size_t index : order_) {
    Parameter& p = store->parameters()[index];
    if (!owned_[index]) continue;  // another rank's
    if (hybrid()) {
      // HybridDeviceOptimizer's fp32 clones of the device part (Note [Optimizer CPU offload]).
      if (!on_host_[index]) masters_[index] = ParameterShard(index).clone().to(at::kFloat);
    } else if (p.fp8.fp8_param) {
      // From the 16-bit value Transformer Engine kept on the host (Note [FP8 training]):
      // the parameter has no 16-bit storage to shard.
      const int64_t shards = p.expert ? options_.expert_shards : options_.shards;
      const int64_t elements = p.shard_data.defined() ? p.shard_data.numel()
                               : p.optimizer_slice    ? p.optimizer_slice->elements
                                                      : ShardElements(p.data.numel(), shards);
      masters_[index] = at::empty({elements}, p.data.options().dtype(at::kFloat));
    } else if (!options_.precision_aware) {
      // Transformer Engine's FusedAdam makes its masters in the first step.
      const at::Tensor& shard = ParameterShard(index);
      const bool in_place = store->precision() == Precision::kFp32 && !options_.fp32_masters_always;
      masters_[index] = in_place ? shard : shard.clone().to(at::kFloat);
    }
  }
}

void MixedPrecisionOptimizer::SplitHostShards() {
  const auto& params = store_->parameters();
  on_host_.assign(params.size(), false);
  if (!hybrid()) return;
  for (bool experts : {false, true}) {  // each distributed-optimizer instance on its own
    int64_t total = 0;
    for (size_t i = 0; i < params.size(); ++i) {
      if (params[i].expert == experts) total = CheckedAdd(total, ParameterShard(i).numel());
    }
    const double threshold = options_.cpu_offload_fraction * static_cast<double>(total);
    int64_t taken = 0;
    for (size_t i : order_) {  // the optimizer's parameter order
      if (params[i].expert != experts || !owned_[i] || static_cast<double>(taken) >= threshold) {
        continue;
      }
      on_host_[i] = true;
      taken += ParameterShard(i).numel();
    }
  }
}

void MixedPrecisionOptimizer::DealWholeParameters(const LayerWiseGroups& groups) {
  const auto& params = store_->parameters();
  std::vector<size_t> order(params.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const int64_t na = params[a].data.numel(), nb = params[b].data.numel();
    return na != nb ? na < nb : muon_[a] && !muon_[b];
  });
  // The ping-pong deal, and the state each rank ends up with: per element an fp32 master
  // (the parameter itself in fp32 training) and Muon's momentum or Adam's two moments.
  const int64_t master_bytes = store_->precision() == Precision::kFp32 ? 0 : 4;
  auto deal = [&](bool experts, int64_t ranks, std::optional<int64_t> simulated,
                  std::vector<int64_t>* elements) {
    std::vector<int64_t> owner(params.size(), -1), state_bytes(static_cast<size_t>(ranks), 0);
    elements->assign(static_cast<size_t>(ranks), 0);
    int64_t turn = 0;
    for (size_t i : order) {
      if (params[i].expert != experts) continue;
      const int64_t step = turn++ % (2 * ranks);
      const int64_t rank = step < ranks ? step : 2 * ranks - 1 - step;
      owner[i] = rank;
      const int64_t numel = params[i].data.numel();
      (*elements)[static_cast<size_t>(rank)] += numel;
      state_bytes[static_cast<size_t>(rank)] += numel * (master_bytes + (muon_[i] ? 4 : 8));
    }
    const int64_t rank = simulated.value_or(
        std::max_element(state_bytes.begin(), state_bytes.end()) - state_bytes.begin());
    MEMSIM_DCHECK(0 <= rank && rank < ranks);
    for (size_t i = 0; i < params.size(); ++i) {
      if (params[i].expert == experts) owned_[i] = owner[i] == rank;
    }
    return rank;
  };
  dense_rank_ =
      deal(/*experts=*/false, groups.dense_ranks, groups.dense_rank, &dense_rank_elements_);
  expert_rank_ =
      deal(/*experts=*/true, groups.expert_ranks, groups.expert_rank, &expert_rank_elements_);
}

void MixedPrecisionOptimizer::AllGatherParameters(const std::vector<int64_t>& rank_elements,
                                                  int64_t own) const {
  if (rank_elements.size() <= 1) return;
  CategoryScope category(Category::kCommunication);
  const auto options =
      at::TensorOptions().device(at::kMeta).dtype(ScalarTypeOf(store_->precision()));
  std::vector<at::Tensor> gather;  // _flatten_dense_tensors of its own, then torch.empty
  gather.push_back(at::empty({rank_elements[static_cast<size_t>(own)]}, options));
  for (size_t r = 0; r < rank_elements.size(); ++r) {
    if (static_cast<int64_t>(r) != own) gather.push_back(at::empty({rank_elements[r]}, options));
  }
}

const at::Tensor& MixedPrecisionOptimizer::CachedShard(size_t index, bool gradient) const {
  at::Tensor& shard = (gradient ? grad_shards_ : param_shards_)[index];
  if (!shard.defined()) {
    const Parameter& p = store_->parameters()[index];
    // FSDP and ZeRO-2 keep this rank's share apart; else it is a view of the whole.
    const at::Tensor& own = gradient ? p.shard_grad : p.shard_data;
    shard = own.defined() ? own.detach()
                          : Shard(p, gradient ? p.main_grad : p.data,
                                  p.expert ? options_.expert_shards : options_.shards);
  }
  return shard;
}

void MixedPrecisionOptimizer::ZeroGrad() { master_grads_.clear(); }

void MixedPrecisionOptimizer::CreatePrecisionAwareStates() {
  CategoryScope category(Category::kOptimizerState);
  for (size_t index : order_) {
    if (!owned_[index]) continue;
    if (hybrid()) {  // FusedAdam's defaults on the device part (Note [Optimizer CPU offload])
      if (!on_host_[index]) {
        exp_avgs_[index] = at::zeros_like(masters_[index]);
        exp_avg_sqs_[index] = at::zeros_like(masters_[index]);
      }
      continue;
    }
    const at::Tensor& shard = ParameterShard(index);
    exp_avgs_[index] =
        at::zeros(shard.sizes(), shard.options().dtype(options_.precision_aware->exp_avg));
    exp_avg_sqs_[index] =
        at::zeros(shard.sizes(), shard.options().dtype(options_.precision_aware->exp_avg_sq));
    // A non-fp32 state's scale (_initialize_state's torch.ones([1]), fp32), per parameter.
    for (at::ScalarType dtype :
         {options_.precision_aware->exp_avg, options_.precision_aware->exp_avg_sq}) {
      if (dtype != at::kFloat)
        state_scales_.push_back(at::ones({1}, shard.options().dtype(at::kFloat)));
    }
    if (options_.precision_aware->param_remainders && shard.scalar_type() == at::kBFloat16) {
      masters_[index] = at::zeros(shard.sizes(), shard.options().dtype(at::kShort));
    } else {
      at::Tensor master = at::empty(shard.sizes(), shard.options().dtype(at::kFloat));
      master.copy_(shard.clone().to(at::kFloat));  // set_scaled_state from a clone
      masters_[index] = master;
    }
  }
}

void MixedPrecisionOptimizer::CreateStates() {
  if (!exp_avgs_.empty()) return;
  exp_avgs_.resize(masters_.size());
  exp_avg_sqs_.resize(masters_.size());
  if (options_.precision_aware.has_value()) {
    CreatePrecisionAwareStates();
    return;
  }
  ModuleScope scope(ModuleScope::Absolute{"optimizer"});
  CategoryScope category(Category::kOptimizerState);
  for (size_t i : order_) {
    if (!owned_[i]) continue;
    const bool adam = options_.kind == OptimizerKind::kAdam ||
                      (options_.kind == OptimizerKind::kMuon && !muon_[i]);
    exp_avgs_[i] = at::zeros_like(masters_[i]);
    if (adam) exp_avg_sqs_[i] = at::zeros_like(masters_[i]);
  }
}

void MixedPrecisionOptimizer::Step() {
  ModuleScope scope(ModuleScope::Absolute{"optimizer"});
  at::NoGradGuard no_grad;
  const bool precision_aware = options_.precision_aware.has_value();
  ++step_;
  master_grads_.clear();
  master_grads_are_copies_ = false;
  {
    CategoryScope category(Category::kGradient);
    master_grads_.resize(masters_.size());
    for (size_t i : order_) {
      if (!owned_[i]) continue;
      const at::Tensor& grad = GradientShard(i);
      // A copy when gradients are 16-bit; FusedAdam's decoupled_grad is the shard itself.
      master_grads_are_copies_ =
          master_grads_are_copies_ || (!precision_aware && grad.scalar_type() != at::kFloat);
      master_grads_[i] = precision_aware ? grad : grad.to(at::kFloat);
    }
  }
  if (options_.count_zeros_in_grads) CountZerosInGrads();
  CreateStates();
  if (hybrid()) HybridGradients();
  // One fused update over the parameters Adam (or SGD) takes, then Muon's one by one.
  std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs;
  for (size_t i : order_) {
    if (muon_[i] || !owned_[i] || on_host_[i]) continue;
    params.push_back(masters_[i]);
    grads.push_back(hybrid() && hybrid_grads_[i].defined() ? hybrid_grads_[i] : master_grads_[i]);
    exp_avgs.push_back(exp_avgs_[i]);
    exp_avg_sqs.push_back(exp_avg_sqs_[i]);
  }
  if (options_.kind == OptimizerKind::kSgd) {
    FusedSgdStep(params, grads, exp_avgs, /*lr=*/1e-3, /*momentum=*/0.9, /*weight_decay=*/0.0);
  } else if (!params.empty()) {
    FusedAdamStep(params, grads, exp_avgs, exp_avg_sqs, AdamHyperparameters{}, step_);
  }
  for (size_t i = 0; i < masters_.size(); ++i) {
    if (muon_[i] && owned_[i]) {
      MuonUpdate(masters_[i], master_grads_[i], exp_avgs_[i],
                 MuonViewOf(store_->parameters()[i], options_), options_.muon_ns_steps);
    }
  }
  if (store_->precision() != Precision::kFp32 && !precision_aware) {  // else the kernel does
    std::vector<at::Tensor> fp8_masters;
    Fp8Module fp8_kind;  // the recipe and layouts of the FP8 parameters (one for all)
    for (size_t index : order_) {
      const Parameter& p = store_->parameters()[index];
      if (!owned_[index]) continue;
      const at::Tensor& master = masters_[index];
      if (p.fp8.fp8_param) {
        fp8_masters.push_back(master);
        fp8_kind.recipe = p.fp8.recipe;
        fp8_kind.any_layout_gemm = p.fp8.any_layout_gemm;
        continue;
      }
      ParameterShard(index).copy_(master);
    }
    CastMastersToFp8Parameters(fp8_masters, fp8_kind);
  }
  if (hybrid()) CopyUpdatedShards();
  if (options_.layer_wise) {
    AllGatherParameters(dense_rank_elements_, dense_rank_);
    AllGatherParameters(expert_rank_elements_, expert_rank_);
  }
  // Views of the gradients go now; fp32 copies of 16-bit gradients stay until zero_grad.
  if (!master_grads_are_copies_) master_grads_.clear();
}

void MixedPrecisionOptimizer::CountZerosInGrads() const {
  CategoryScope category(Category::kTemporary);
  // Every validation case that fitted the host's time per op counts zeros (Note [Counting
  // zeros in gradients]).
  KernelTimeOnlyScope kernel_time;
  at::Tensor total;  // total_num_zeros: torch.zeros(1, dtype=torch.int64) before the walk
  for (size_t i : order_) {
    if (!master_grads_[i].defined()) continue;
    total = at::zeros({1}, master_grads_[i].options().dtype(at::kLong));
    break;
  }
  for (size_t i : order_) {
    const Parameter& p = store_->parameters()[i];
    // Offloaded shards count too: their device gradients are the optimizer's (Note).
    if (!owned_[i] || p.shared) continue;
    const at::Tensor flat = master_grads_[i].reshape(-1);
    // Megatron holds a parameter per expert where memsim stacks them: this rank's share of
    // expert k is its range's overlap with the k-th of the stacked tensor's equal parts.
    const int64_t experts = std::max<int64_t>(p.stacked_experts, 1);
    const int64_t per_expert = p.data.numel() / experts;
    const int64_t begin = p.optimizer_slice ? p.optimizer_slice->offset : 0;
    const int64_t end = begin + flat.numel();
    for (int64_t k = 0; k < experts; ++k) {
      const int64_t lo = std::max(begin, k * per_expert);
      const int64_t hi = std::min(end, (k + 1) * per_expert);
      if (hi <= lo) continue;
      const at::Tensor one = flat.narrow(0, lo - begin, hi - lo);
      const at::Tensor nonzero = one.ne(0);                  // [N] bool
      const at::Tensor count = nonzero.to(at::kLong).sum();  // the [N] int64 copy, then []
      total = at::rsub(count, one.numel()).add(total);       // numel - count + total
    }
  }
}

void MixedPrecisionOptimizer::HybridGradients() {
  // The device part: fp32_param.grad = grad.to(fp32), a view of an fp32 gradient, else a
  // copy kept until the next step replaces it; the host part: the device-to-host copy of a
  // 16-bit gradient goes through an fp32 device buffer of the shard's size.
  hybrid_grads_.resize(masters_.size());
  CategoryScope category(Category::kGradient);
  for (size_t i : order_) {
    const at::Tensor& grad = master_grads_[i];
    if (!grad.defined() || grad.scalar_type() == at::kFloat) continue;
    if (on_host_[i]) {
      CategoryScope temporary(Category::kTemporary);
      [[maybe_unused]] const at::Tensor staged = grad.to(at::kFloat);
    } else {
      hybrid_grads_[i] = grad.to(at::kFloat);
    }
  }
}

void MixedPrecisionOptimizer::CopyUpdatedShards() {
  // The host's updates come back one shard at a time through an fp32 device buffer; the
  // device part's fp32 clones are cast into the 16-bit shards in place.
  CategoryScope category(Category::kTemporary);
  for (size_t index : order_) {
    if (!owned_[index]) continue;
    if (on_host_[index]) {
      const at::Tensor& shard = ParameterShard(index);
      shard.copy_(at::empty(shard.sizes(), shard.options().dtype(at::kFloat)));
    } else {
      ParameterShard(index).copy_(masters_[index]);
    }
  }
}

}  // namespace memsim
