#include "models/moe.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>

#include "models/fp8.h"
#include "ops/collectives.h"
#include "parallel/regions/expert_parallel.h"
#include "parallel/regions/tensor_parallel.h"
#include "simulator/checked_math.h"
#include "simulator/session.h"

namespace memsim {
namespace {

// A grouped GEMM over the local experts' concatenated weights: memory and FLOPs equal one
// [tokens, in] x [in, out] GEMM against one expert's block (views of the parameter).
// In FP8 the block's FP8 data and transpose are views of the experts' (one cached copy per
// expert, Note [FP8 training]).
at::Tensor GroupedLinear(const at::Tensor& tokens, Parameter& weight, int64_t out, bool rows,
                         const Fp8LinearOptions& fp8 = {}) {
  Parameter block;
  block.name = weight.name;
  // An FP8 parameter's 16-bit data has no bytes (MakeFp8Weight): a view all the same.
  block.data = LeadingSlice(weight.data, rows ? 0 : 1, out);
  block.main_grad = LeadingSlice(weight.main_grad, rows ? 0 : 1, out);
  block.expert = true;
  block.store = weight.store;
  block.fp8 = weight.fp8;
  if (!block.fp8.weight.empty()) {
    // [rows, cols] data and its columnwise data: a [cols, rows] transpose, the same layout
    // (MXFP8), or none (per-tensor recipes where the GPU's FP8 GEMMs read any layout).
    at::Tensor& data = block.fp8.weight[0];
    at::Tensor& columnwise = block.fp8.weight[1];
    const bool transposed = block.fp8.recipe != Fp8Recipe::kMxfp8;
    const int64_t dim = rows ? 0 : 1;
    data = data.narrow(dim, 0, out);
    if (columnwise.defined()) columnwise = columnwise.narrow(transposed ? 1 - dim : dim, 0, out);
  }
  return Linear(tokens, block, nullptr, {}, fp8);
}

// The rows an expert's FP8 GEMM input is aligned to (get_align_size_for_quantization): 32
// for MXFP8, 16 for the other recipes.
int64_t Fp8RowAlignment(Fp8Recipe recipe) { return recipe == Fp8Recipe::kMxfp8 ? 32 : 16; }

// get_align_size_for_quantization for the run: 256 with TE's op fuser, the FP8 recipe's
// row alignment, else 1 (no padding).
int64_t QuantizationAlignment(const TrainingConfig& t) {
  return t.te_op_fuser ? 256 : t.fp8 != Fp8Recipe::kNone ? Fp8RowAlignment(t.fp8) : 1;
}

// `rows` split evenly into `shares` (the remainder one row each to the first ones), each
// share rounded up to a multiple of `align` but not beyond max(its rows, `cap`); the sum.
int64_t PaddedShares(int64_t rows, int64_t shares, int64_t align, int64_t cap) {
  const auto padded = [align, cap](int64_t n) {
    return std::min(CheckedRoundUp(n, align), std::max(n, cap));
  };
  const int64_t base = rows / shares, larger = rows % shares;
  return CheckedAdd(CheckedMul(larger, padded(base + 1)),
                    CheckedMul(shares - larger, padded(base)));
}

// TEGroupedMLP's Fp8Padding in FP8 (Fp8RowAlignment): when an expert's row count is off the
// multiple, every
// expert's rows and probabilities are copied into a padded buffer (zeros after each
// expert's rows); memsim routes evenly, so all experts are padded or none is. Returns
// {rows, probs} padded, or as given.
std::pair<at::Tensor, at::Tensor> PadForFp8(const at::Tensor& x, const at::Tensor& probs,
                                            int64_t experts, Fp8Recipe recipe) {
  const int64_t alignment = Fp8RowAlignment(recipe);
  const int64_t rows = x.size(0) / experts;
  const int64_t pad = (alignment - rows % alignment) % alignment;
  if (pad == 0 || x.size(0) % experts != 0) return {x, probs};
  const int64_t H = x.size(1);
  const at::Tensor padded_x =
      at::cat({x.view({experts, rows, H}), at::zeros({experts, pad, H}, x.options())}, 1);
  const at::Tensor padded_probs =
      at::cat({probs.view({experts, rows}), at::zeros({experts, pad}, probs.options())}, 1);
  return {padded_x.view({-1, H}), padded_probs.view({-1})};
}

// Fp8Unpadding: the rows of each expert, into a new [rows, H].
at::Tensor UnpadForFp8(const at::Tensor& h, int64_t experts, int64_t rows) {
  if (h.size(0) == rows) return h;
  return h.view({experts, h.size(0) / experts, h.size(1)})
      .narrow(1, 0, rows / experts)
      .reshape({rows, h.size(1)});
}

}  // namespace

int64_t ExpertCapacity(const ModelConfig& m, int64_t tokens) {
  // moe_utils.get_capacity: ceil(T*K / E * cf), no minimum. Beyond T*K (every routed token)
  // it would drop nothing either way, so it is capped there, where it fits an int64.
  const double routed = static_cast<double>(tokens) * static_cast<double>(m.moe_router_topk);
  const double capacity =
      std::ceil(routed / static_cast<double>(m.num_experts) * m.moe_capacity_factor);
  return static_cast<int64_t>(std::min(capacity, routed));
}

int64_t DispatchedTokens(const ModelConfig& m, int64_t tokens) {
  const int64_t routed = tokens * m.moe_router_topk;
  if (m.moe_capacity_factor <= 0) return routed;
  const int64_t filled = ExpertCapacity(m, tokens) * m.num_experts;
  // Evenly routed, each expert is offered T*K/E tokens and keeps up to its capacity.
  return m.moe_pad_to_capacity ? filled : std::min(routed, filled);
}

int64_t ReceivedTokens(const ModelConfig& m, int64_t tokens) {
  const int64_t routed = tokens * m.moe_router_topk;
  if (m.moe_pad_to_capacity) return DispatchedTokens(m, tokens);
  const auto busiest =
      static_cast<int64_t>(std::ceil(m.moe_imbalance_factor * static_cast<double>(routed)));
  // From each of ep ranks each local expert takes at most its capacity: E * capacity.
  return m.moe_capacity_factor > 0 ? std::min(busiest, ExpertCapacity(m, tokens) * m.num_experts)
                                   : busiest;
}

int64_t DeepEpBufferBytes(int64_t hidden, int64_t element_bytes, int64_t group, int64_t num_sms) {
  // Buffer.get_dispatch_config / get_combine_config (DeepEP's hybrid-ep branch, the API
  // Megatron-Core 0.20 calls): {NVL chunked recv tokens, RDMA chunked send, RDMA chunked recv}.
  // For 24, 128, 144 and 160 ranks only dispatch configs were read, and serve for both.
  struct Chunks {
    int64_t nvl_recv, rdma_send, rdma_recv;
  };
  struct Configs {
    int64_t group;
    Chunks dispatch, combine;
  };
  static constexpr Configs kConfigs[] = {
      {2, {256, 6, 128}, {256, 6, 128}},     {4, {256, 6, 128}, {256, 6, 128}},
      {8, {256, 6, 128}, {256, 6, 128}},     {16, {288, 20, 128}, {288, 12, 128}},
      {24, {288, 32, 128}, {288, 32, 128}},  {32, {288, 32, 128}, {288, 8, 128}},
      {64, {288, 28, 128}, {288, 20, 128}},  {128, {560, 32, 128}, {560, 32, 128}},
      {144, {720, 12, 128}, {720, 12, 128}}, {160, {720, 12, 128}, {720, 12, 128}},
  };
  const Configs* configs = nullptr;
  for (const Configs& c : kConfigs) {
    if (c.group == group) configs = &c;
  }
  MEMSIM_DCHECK(configs != nullptr && num_sms >= 2 && num_sms % 2 == 0);
  constexpr int64_t kNvlPeers = 8, kMaxTopK = 128, kMaxScales = 128, kSourceMetaBytes = 8;
  const int64_t hidden_bytes = CheckedMul(hidden, std::max<int64_t>(element_bytes, 2));
  const int64_t channels = num_sms / 2;
  const int64_t rdma_ranks = std::max<int64_t>(group / kNvlPeers, 1);
  const int64_t nvl_ranks = std::min(group, kNvlPeers);
  // Bytes per received token: hidden, source meta, top-K indices and weights, scales.
  const int64_t per_token =
      CheckedAdd(hidden_bytes, kSourceMetaBytes + kMaxTopK * 8 + kMaxTopK * 4 + kMaxScales * 4);
  auto align = [](int64_t bytes, int64_t to) { return (bytes + to - 1) / to * to; };
  auto nvl = [&](const Chunks& c) {
    return align(CheckedAdd(channels * nvl_ranks * (2 * rdma_ranks + 3) * 4,
                            CheckedMul(channels * nvl_ranks * c.nvl_recv, per_token)),
                 128);
  };
  auto rdma = [&](const Chunks& c) -> int64_t {
    if (group <= kNvlPeers) return 0;
    const int64_t recv = align(c.rdma_recv, c.rdma_send);
    const int64_t per_rdma_token = CheckedAdd(CheckedMul(per_token, 2), 16 * 2);
    return align(CheckedAdd(channels * rdma_ranks * (kNvlPeers * 2 + 2) * 2 * 4 + 1048576,
                            CheckedMul(channels * rdma_ranks * recv, per_rdma_token)),
                 128);
  };
  constexpr int64_t kWorkspaceBytes = 32 << 20;
  return CheckedAdd(CheckedAdd(std::max(nvl(configs->dispatch), nvl(configs->combine)),
                               std::max(rdma(configs->dispatch), rdma(configs->combine))),
                    kWorkspaceBytes);
}

namespace {

// C(n, k) / C(n0, k) for n <= n0: the chance that k distinct picks among n0 all avoid the
// n0 - n others (0 when fewer than k remain).
double AllPicksAmong(int64_t n, int64_t n0, int64_t k) {
  double p = 1.0;
  for (int64_t i = 0; i < k; ++i) {
    p *= static_cast<double>(std::max<int64_t>(n - i, 0)) / static_cast<double>(n0 - i);
  }
  return p;
}

// The chance that a token sends anything to a given rank of the ep ranks, evenly routed:
// without group-limited routing its K experts avoid the rank's e = E/ep with probability
// C(E - e, K)/C(E, K). With it, the rank covers q groups (1 when it lies inside one) with e/q
// of its experts in each; j of them are among the token's group_topk groups with the
// hypergeometric chance C(q, j) C(ng - q, gt - j) / C(ng, gt), and then its K experts, from
// the M = gt * E/ng experts of the chosen groups, avoid the rank's j * e/q.
double RankHitChance(const ModelConfig& m, int64_t ep) {
  const int64_t E = m.num_experts, K = m.moe_router_topk, e = E / ep;
  const int64_t ng = m.moe_router_num_groups, gt = m.moe_router_group_topk;
  const int64_t per_group = ng > 0 ? E / ng : 0;
  const bool grouped =
      ng > 1 && gt > 0 && gt < ng && E % ng == 0 && (per_group % e == 0 || e % per_group == 0);
  if (!grouped) return 1.0 - AllPicksAmong(E - e, E, K);
  const int64_t q = std::max<int64_t>(1, e / per_group), M = gt * per_group;
  double hit = 0.0;
  for (int64_t j = 1; j <= std::min(q, gt); ++j) {
    // C(q, j) C(ng - q, gt - j) / C(ng, gt), as a ratio of products.
    double chance = 1.0;
    for (int64_t i = 0; i < j; ++i) chance *= static_cast<double>(q - i) / (i + 1);
    for (int64_t i = 0; i < gt - j; ++i) chance *= static_cast<double>(ng - q - i) / (i + 1);
    for (int64_t i = 0; i < gt; ++i) chance *= static_cast<double>(i + 1) / (ng - i);
    hit += chance * (1.0 - AllPicksAmong(M - j * (e / q), M, K));
  }
  return hit;
}

}  // namespace

int64_t HybridEpBufferBytes(int64_t tokens, int64_t hidden, int64_t experts, int64_t group,
                            int64_t domain) {
  const int64_t tm = CheckedRoundUp(std::max<int64_t>(tokens, 512), 64);
  const int64_t rows = CheckedMul(tm, group);
  const int64_t token_bytes = CheckedMul(CheckedMul(rows, hidden), 2);
  const int64_t prob_bytes =
      CheckedMul(CheckedMul(CheckedMul(rows, experts / group), std::min(group, domain)), 4);
  const int64_t scale_bytes = CheckedMul(CheckedMul(rows, hidden / 128), 4);
  const int64_t flag_bytes = CheckedMul(CheckedMul(tm / 64, group), 2 * 4);
  const int64_t gather_bytes = CheckedMul(CheckedMul(experts, tm), group);
  return CheckedAdd(
      CheckedAdd(CheckedAdd(token_bytes, prob_bytes), CheckedAdd(scale_bytes, flag_bytes)),
      gather_bytes);
}

int64_t DeepEpReceivedRows(const ModelConfig& m, const MoeParallelism& p, int64_t tokens) {
  const int64_t senders = CheckedMul(p.etp * p.ep, tokens);
  const double rows =
      std::ceil(m.moe_imbalance_factor * static_cast<double>(senders) * RankHitChance(m, p.ep));
  const int64_t expert_rows = CheckedMul(ReceivedTokens(m, tokens), p.etp);
  return std::min(
      {static_cast<int64_t>(std::min(rows, static_cast<double>(senders))), senders, expert_rows});
}

MoeParameters CreateMoeParameters(const ModelConfig& m, const MoeParallelism& p,
                                  ParameterStore* store,
                                  const std::function<void(Parameter*)>& gemm_weight) {
  const auto gemm = [&gemm_weight](Parameter* weight) {
    if (gemm_weight) gemm_weight(weight);
    return weight;
  };
  const int64_t H = m.hidden_size, local = m.num_experts / p.ep;
  const int64_t fe = m.moe_ffn_hidden_size / p.etp;
  MoeParameters params;
  // With add_bias_linear every linear has a bias (parameters only: Note [MoE biases]).
  const bool bias = m.add_bias_linear;
  {
    ModuleScope s("router");
    params.router = store->Add("weight", {m.num_experts, H});
    if (m.moe_router_expert_bias) {
      // Buffers, not parameters: expert_bias and local_tokens_per_expert, float32 [E].
      const at::TensorOptions fp32 = at::TensorOptions().device(at::kMeta).dtype(at::kFloat);
      params.expert_bias = at::zeros({m.num_experts}, fp32);
      params.local_tokens_per_expert = at::zeros({m.num_experts}, fp32);
    }
    if (bias) store->Add("bias", {m.num_experts});
  }
  {
    ModuleScope s("experts");
    {
      ModuleScope f("linear_fc1");
      params.experts_fc1 = gemm(store->Add("weight", {local * m.Fc1Width(fe), H}, /*expert=*/true));
      params.experts_fc1->tp_partition_dim = 0;
      params.experts_fc1->stacked_experts = local;
      if (bias) store->Add("bias", {local * m.Fc1Width(fe)}, /*expert=*/true);
    }
    ModuleScope f("linear_fc2");
    params.experts_fc2 = gemm(store->Add("weight", {H, local * fe}, /*expert=*/true));
    params.experts_fc2->tp_partition_dim = 1;
    params.experts_fc2->stacked_experts = local;
    if (bias) params.experts_fc2_bias = store->Add("bias", {local * H}, /*expert=*/true);
  }
  if (m.moe_shared_expert_size > 0) {
    ModuleScope s("shared_experts");
    const int64_t fs = m.moe_shared_expert_size / p.tp;
    {
      ModuleScope f("linear_fc1");
      params.shared_fc1 = gemm(store->Add("weight", {m.Fc1Width(fs), H}));
      params.shared_fc1->tp_partition_dim = 0;
      if (bias) store->Add("bias", {m.Fc1Width(fs)});
    }
    {
      ModuleScope f("linear_fc2");
      params.shared_fc2 = gemm(store->Add("weight", {H, fs}));
      params.shared_fc2->tp_partition_dim = 1;
      if (bias) store->Add("bias", {H});
    }
    if (m.moe_shared_expert_gate) params.shared_gate = store->Add("gate_weight", {1, H});
  }
  return params;
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::Function;
using torch::autograd::variable_list;

at::TensorOptions Meta(at::ScalarType dtype) {
  return at::TensorOptions().device(at::kMeta).dtype(dtype);
}

// The ops Megatron-LM d98e8a64 launches per MoE layer and microbatch beyond the model's
// (ChargeUnmodelledOps), from token_dispatcher.py (td), moe_utils.py (mu) and router.py.
struct UnmodelledOps {
  int64_t forward = 0;
  int64_t backward = 0;
};

// MoEAlltoAllTokenDispatcher. Unfused (no --moe-permute-fusion): unpermute's scatter_add_
// (mu 615); in backward the permutation's index_put_ and index_add_ (mu 478, 486) and,
// with several local experts, the cat of sort_chunks_by_idxs' split for the tokens, their
// probabilities and the combine (mu 663-667). Padded to capacity, preprocess fills its
// counts (td 527-539) and returns; else it sums the routing map (td 543), with token
// dropping or router padding the output size too (td 551); with ep * etp > 1 it sums the
// input splits, all-gathers the counts, makes the local slice contiguous and sums three
// times (td 565-592); then copies to the host the tokens per expert, with ep * etp > 1 the
// three splits, the output size where it is a tensor, and with several local experts
// unfused the global counts (td 935-953), and waits for the copies (td 958).
UnmodelledOps AllToAllUnmodelledOps(const ModelConfig& m, const TrainingConfig& t,
                                    const MoeParallelism& p, int64_t local) {
  const bool fused = t.moe_permute_fusion;
  UnmodelledOps ops;
  if (!fused) {
    ops.forward += 1;
    ops.backward += 2 + (local > 1 ? 3 : 0);
  }
  if (m.moe_pad_to_capacity) {
    ops.forward += 1;
    return ops;
  }
  const int64_t dynamic = m.moe_capacity_factor > 0 || t.moe_router_padding ? 1 : 0;
  const int64_t splits = p.ep > 1 || p.etp > 1 ? 1 : 0;
  ops.forward += 1 + dynamic + 6 * splits;                                  // preprocess
  ops.forward += 1 + 3 * splits + dynamic + (local > 1 && !fused ? 1 : 0);  // the copies
  ops.forward += 1;                                                         // the wait
  return ops;
}

// MoEAllGatherTokenDispatcher: local_map.sum(0) and its .cpu(), which waits (td 320),
// masked_select's nonzero, which waits too (td 331); unfused, unpermute's scatter_add_ (mu
// 615) and in backward index_select's index_add_; in backward masked_scatter_ and the
// slice's copy.
UnmodelledOps AllGatherUnmodelledOps(const TrainingConfig& t) {
  const int64_t unfused = t.moe_permute_fusion ? 0 : 1;
  return {3 + unfused, 2 + unfused};
}

// The router's aux loss: the coefficient's multiply, the division by it, the logging add
// (router.py 601, mu 147-149); in backward the multiply's.
constexpr UnmodelledOps kAuxLossUnmodelledOps = {3, 1};

// SequentialMLP (experts.py), which the local spec runs whatever --moe-grouped-gemm says,
// runs each local expert's MLP alone where the model runs one grouped GEMM: for each
// further expert two GEMMs and the activation forward, four GEMMs and the activation's
// backward; and once the backward's two cats of the split (experts.py 1502-1503).
UnmodelledOps SequentialMlpUnmodelledOps(int64_t local) {
  return {CheckedMul(2 + 1, local - 1), CheckedMul(4 + 1, local - 1) + 2};
}

void Charge(const UnmodelledOps& ops) { ChargeUnmodelledOps(ops.forward, ops.backward); }

// Note [Router padding]: pad_routing_map on `map` [X, M] (in place: the transposed bool
// temporaries, the cumsum, the mask and index_put_'s indices of the `added` entries), or with
// --enable-experimental and --moe-permute-fusion fused_pad_routing_map, whose int32 output
// (transposed) replaces the map.
void PadRoutingMap(const TrainingConfig& t, int64_t added, at::Tensor* map) {
  ModuleScope scope("pad_routing_map");
  StandInKernelScope kernels;
  const int64_t X = map->size(0), M = map->size(1);
  if (t.experimental && t.moe_permute_fusion) {
    const at::Tensor input = map->t().contiguous().to(at::kInt);  // [M, X] int32
    *map = at::empty_like(input).t();                             // the kernel's output
    return;
  }
  const at::Tensor num_ones = at::empty({M}, Meta(at::kLong));    // routing_map.sum(dim=1)
  const at::Tensor num_to_pad = at::empty({M}, Meta(at::kLong));  // (-num_ones) % pad
  const at::Tensor is_zero = at::empty({M, X}, Meta(at::kBool));
  at::Tensor zero_ranks;
  {
    const at::Tensor as_int = at::empty({M, X}, Meta(at::kInt));  // is_zero.int()
    zero_ranks = at::empty({M, X}, Meta(at::kLong));              // its cumsum, int64
  }
  const at::Tensor mask = at::empty({M, X}, Meta(at::kBool));
  const at::Tensor indices = at::empty({added, 2}, Meta(at::kLong));  // the mask's nonzero()
}

// TEGroupedMLP._apply_bias on fc2's output `out` [N, H] with the rows' probabilities
// `probs` [N, 1] and the `experts` local experts' biases `bias` [experts * H] (Note [MoE
// biases]); the rows split evenly over the experts, the remainder to the last.
struct ExpertBiasFunction : public Function<ExpertBiasFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& out, const at::Tensor& probs,
                            const at::Tensor& bias, const at::Tensor& main_grad, int64_t experts) {
    StandInKernelScope kernels;
    const int64_t rows = out.size(0), H = out.size(1);
    const at::ScalarType product = at::promote_types(bias.scalar_type(), probs.scalar_type());
    const at::ScalarType sum = at::promote_types(out.scalar_type(), product);
    std::vector<at::Tensor> sums;
    for (int64_t e = 0; e < experts; ++e) {
      const at::Tensor scaled = at::empty({ExpertRows(rows, experts, e), H}, Meta(product));
      sums.push_back(at::empty(scaled.sizes(), Meta(sum)));
    }
    at::Tensor joined = at::empty({rows, H}, Meta(sum));  // torch.cat
    sums.clear();
    ctx->save_for_backward({probs});
    ctx->saved_data["main_grad"] = main_grad;
    ctx->saved_data["experts"] = experts;
    ctx->saved_data["bias_dtype"] = bias.scalar_type();
    return joined.to(out.scalar_type());  // the same tensor when the dtypes agree
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    StandInKernelScope kernels;
    const at::Tensor probs = ctx->get_saved_variables()[0];
    const at::Tensor& main_grad = ctx->saved_data["main_grad"].toTensor();
    const int64_t experts = ctx->saved_data["experts"].toInt();
    const at::ScalarType bias_dtype = ctx->saved_data["bias_dtype"].toScalarType();
    const int64_t rows = grads[0].size(0), H = grads[0].size(1);
    const at::ScalarType product = at::promote_types(bias_dtype, probs.scalar_type());
    const at::Tensor up = grads[0].to(at::promote_types(grads[0].scalar_type(), product));
    at::Tensor grad_out = at::empty_like(grads[0]);  // the rows' gradients, cast back, joined
    for (int64_t e = 0; e < experts; ++e) {
      const at::Tensor scaled = at::empty({ExpertRows(rows, experts, e), H}, Meta(product));
      const at::Tensor grad_bias = scaled.sum(0).to(bias_dtype);  // (grad * p) reduced to [H]
      if (main_grad.defined()) {
        AccumulateIntoMainGrad(main_grad.narrow(0, CheckedMul(e, H), H), grad_bias);
      }
    }
    return {grad_out, at::empty_like(probs), at::Tensor(), at::Tensor(), at::Tensor()};
  }

  static int64_t ExpertRows(int64_t rows, int64_t experts, int64_t e) {
    return rows / experts + (e == experts - 1 ? rows % experts : 0);
  }
};

// moe_utils.permute's index: which row of the input each output row copies. Unfused
// (dropless branch): routing_map.T.contiguous() [M, X] bool and its stable argsort int64
// [M*X], whose first `rows` entries modulo X are the index (int64 [rows]); the argsort
// buffer lives on while a view of it does (the alltoall probabilities keep one). Padded to
// capacity (drop_and_pad): the map as int8, its per-expert argsort int64 [M, X], of which
// the first capacity columns are copied out (int64 [rows]) and the argsort goes. Fused
// (TE's moe_permute): one int32 row_id_map [X, 2M + 1].
struct Permutation {
  at::Tensor index;  // saved by the tokens' permute
  at::Tensor order;  // unfused and not padded: the argsort buffer
  int64_t inputs;    // X
};

Permutation MakePermutation(int64_t inputs, int64_t map_columns, int64_t rows, bool fused,
                            bool padded) {
  StandInKernelScope kernels;
  Permutation p{at::Tensor(), at::Tensor(), inputs};
  if (fused) {
    p.index = at::empty({inputs, 2 * map_columns + 1}, Meta(at::kInt));
    return p;
  }
  at::Tensor map_t = at::empty({map_columns, inputs}, Meta(padded ? at::kChar : at::kBool));
  p.order = at::empty({map_columns * inputs}, Meta(at::kLong));
  map_t.reset();
  p.index = at::empty({rows}, Meta(at::kLong));
  if (padded) p.order.reset();
  return p;
}

// Note [Deterministic index_add_]
// Under torch.use_deterministic_algorithms(True) (Megatron-LM's --deterministic-mode),
// PyTorch's CUDA index_add_ (index_add_cuda_impl) runs as
// result.index_put_(indices, source * alpha, accumulate=true), and index_put_ on CUDA as
// index_put_with_sort_kernel (aten/src/ATen/native/cuda/Indexing.cu, PyTorch 2.x). For n
// indices into dimension 0 of a contiguous result it allocates, and frees on return:
//   source * alpha, a copy of the source [n, ...] in its dtype;
//   the range check's index.max() and index.min(), int64 scalars;
//   the linear index: index.remainder(rows), then that times the row stride (int64 [n]
//     each; the remainder goes once multiplied);
//   sorted_indices, orig_indices and arange(n), int64 [n] each, and cub's radix-sort
//     scratch, one allocation holding alternate key and value buffers (int64 [2n]; its
//     histograms, a few KiB, are not modelled).
// The unfused MoE permutation meets it twice (TE's fused kernels, --moe-permute-fusion,
// never): moe_utils.unpermute index_add_s the expert rows into its output, which it zeroes
// twice in deterministic mode (two [X, H] alive for a moment), and index_select's backward
// (the permute's) index_add_s the gradient into a zeroed [X, H].
void DeterministicIndexAdd(const at::Tensor& source) {
  const int64_t n = source.size(0);
  const at::TensorOptions index = Meta(at::kLong);
  std::optional<StandInKernelScope> kernels(std::in_place);  // each output below a kernel's
  const at::Tensor scaled = at::empty_like(source);          // source * alpha
  at::empty({}, index);                                      // index.max()
  at::empty({}, index);                                      // index.min()
  at::Tensor linear = at::empty({n}, index);                 // index.remainder(rows)
  linear = at::empty({n}, index);                            // ... * stride
  const at::Tensor range = at::empty({n}, index);
  const at::Tensor sorted = at::empty({n}, index);  // the sort's, with `original`
  kernels.reset();
  const at::Tensor original = at::empty({n}, index);
  const at::Tensor scratch = at::empty({CheckedMul(2, n)}, index);  // the sort's own buffer
}

// Whether the run's MoE permutation index_add_s through the sort of Note [Deterministic
// index_add_]: unfused, deterministic.
bool SortsIndexAdd(const TrainingConfig& t) {
  return t.deterministic_algorithms && !t.moe_permute_fusion;
}

// tokens [X, H] -> [rows, H] (index_select, or TE's kernel); backward scatters the
// gradient into a new zeroed [X, H] (Note [Deterministic index_add_] with
// `sorted_index_add`: unfused, deterministic).
struct PermuteFunction : public Function<PermuteFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& tokens, const at::Tensor& index,
                            int64_t rows, bool sorted_index_add) {
    ctx->save_for_backward({index});
    ctx->saved_data["inputs"] = tokens.size(0);
    ctx->saved_data["sorted_index_add"] = sorted_index_add;
    StandInKernelScope kernel;  // index_select
    return at::empty({rows, tokens.size(1)}, tokens.options());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    at::Tensor grad =
        at::zeros({ctx->saved_data["inputs"].toInt(), grads[0].size(1)}, grads[0].options());
    if (ctx->saved_data["sorted_index_add"].toBool()) DeterministicIndexAdd(grads[0]);
    return {grad, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// unpermute without probabilities: [rows, H] -> a new zeroed [X, H] scatter-added into;
// backward gathers [rows, H]. Its saved index is a stride-0 view of the permutation's.
// With `sorted_index_add` (unfused, deterministic) the output is zeroed twice and
// index_add_ sorts (Note [Deterministic index_add_]); autograd's IndexAddBackward0 then
// keeps the whole source (its formula expand_as(source)s the gathered gradient), where
// scatter_add_'s node keeps only the index: the experts' output [rows, H] lives until this
// layer's backward.
struct UnpermuteFunction : public Function<UnpermuteFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& rows_in, int64_t inputs,
                            bool sorted_index_add) {
    ctx->saved_data["rows"] = rows_in.size(0);
    at::Tensor out = at::zeros({inputs, rows_in.size(1)}, rows_in.options());
    if (sorted_index_add) {
      ctx->save_for_backward({rows_in});
      out = at::zeros(out.sizes(), out.options());  // replaces the first once allocated
      DeterministicIndexAdd(rows_in);
    }
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    StandInKernelScope kernel;  // the gather
    return {at::empty({ctx->saved_data["rows"].toInt(), grads[0].size(1)}, grads[0].options()),
            at::Tensor(), at::Tensor()};
  }
};

// The probabilities of the permuted rows, [rows] p, from [X, E] p.
//   alltoall: probs.T.contiguous() [E, X] (temporary) indexed with the argsort's view,
//     which autograd keeps (and so the whole argsort); backward: zeros [E*X] p. (`keep`
//     is what it keeps; the allgather path keeps its own.)
//   allgather: probs[:, local].contiguous() [X, E_local] (temporary), transposed and made
//     contiguous [E_local, X] and masked_select'ed with the transposed local map
//     [E_local, X] bool: both kept for backward; backward: zeros [E_local, X] p, then the
//     column slice's zeros [X, E] p.
struct PermuteProbsFunction : public Function<PermuteProbsFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& probs, const at::Tensor& keep,
                            int64_t columns, int64_t rows, bool masked_select) {
    StandInKernelScope kernels;
    const int64_t inputs = probs.size(0);
    at::Tensor out;
    if (masked_select) {
      at::Tensor local = at::empty({inputs, columns}, probs.options());
      at::Tensor local_t = at::empty({columns, inputs}, probs.options());
      local.reset();
      at::Tensor mask = at::empty({columns, inputs}, Meta(at::kBool));
      out = at::empty({rows}, probs.options());
      ctx->save_for_backward({local_t, mask});
    } else {
      at::Tensor probs_t = at::empty({probs.size(1), inputs}, probs.options());
      out = at::empty({rows}, probs.options());
      ctx->save_for_backward({keep});
    }
    ctx->saved_data["masked_select"] = masked_select;
    ctx->saved_data["input_sizes"] = probs.sizes().vec();
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::TensorOptions options = grads[0].options();
    at::Tensor grad;
    if (ctx->saved_data["masked_select"].toBool()) {
      at::Tensor grad_t = at::zeros(saved[0].sizes(), options);
      grad = at::zeros(ctx->saved_data["input_sizes"].toIntVector(), options);
    } else {
      // zeros [E*X] p, the transposed view of [E, X] that is the gradient of [X, E].
      const std::vector<int64_t> sizes = ctx->saved_data["input_sizes"].toIntVector();
      grad = at::zeros({sizes[1] * sizes[0]}, options).view({sizes[1], sizes[0]}).t();
    }
    return {grad, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// gather_from_sequence_parallel_region over `group`: a new [group * rows, ...] (or, with
// `buffer`, a view of Megatron's persistent global buffer); backward reduce-scatters.
struct AllGatherRowsFunction : public Function<AllGatherRowsFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, int64_t group,
                            c10::intrusive_ptr<GlobalMemoryBuffer> buffer) {
    ctx->saved_data["group"] = group;
    if (!buffer) return AllGather(input, group);
    std::vector<int64_t> sizes = input.sizes().vec();
    sizes[0] *= group;
    at::Tensor out = buffer->Get(sizes, input.scalar_type());
    ReceiveInto(out);
    ctx->saved_data["buffer"] = c10::IValue::make_capsule(std::move(buffer));
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const int64_t group = ctx->saved_data["group"].toInt();
    if (!ctx->saved_data.count("buffer")) {
      return {ReduceScatter(grads[0].contiguous(), group), at::Tensor(), at::Tensor()};
    }
    // Megatron reduce-scatters into the same global buffer: no new memory.
    const auto buffer = c10::static_intrusive_pointer_cast<GlobalMemoryBuffer>(
        ctx->saved_data["buffer"].toCapsule());
    std::vector<int64_t> sizes = grads[0].sizes().vec();
    sizes[0] /= group;
    at::Tensor out = buffer->Get(sizes, grads[0].scalar_type());
    ReceiveInto(out);
    return {out, at::Tensor(), at::Tensor()};
  }
};

at::Tensor AllGatherRows(const at::Tensor& input, int64_t group,
                         c10::intrusive_ptr<GlobalMemoryBuffer> buffer = {}) {
  if (group == 1) return input;
  return AllGatherRowsFunction::apply(input, group, std::move(buffer));
}

// Returns `x` and keeps `kept` alive until backward (an index a kernel saved).
struct KeepFunction : public Function<KeepFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& kept) {
    ctx->save_for_backward({kept});
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {grads[0], at::Tensor()};
  }
};

// What DeepEP's dispatch returns besides the tokens and keeps in its handle (Note [DeepEP
// dispatch]); the dispatch's and the combine's nodes share it.
// The dispatcher handle a Function's forward kept as ctx->saved_data["handle"].
template <typename Handle>
c10::intrusive_ptr<Handle> SavedHandle(AutogradContext* ctx) {
  return c10::static_intrusive_pointer_cast<Handle>(ctx->saved_data["handle"].toCapsule());
}

struct DeepEpHandle : public torch::CustomClassHolder {
  int64_t group = 1;     // G
  int64_t tokens = 0;    // T
  int64_t received = 0;  // N_r
  std::vector<at::Tensor> tensors;
};

// tokens [T, H] and token_probs fp32 [T, K] -> recv_x [N_r, H], recv_topk_weights fp32
// [N_r, K]; backward: DeepEP's combine of both gradients, [T, H] and fp32 [T, K].
struct DeepEpDispatchFunction : public Function<DeepEpDispatchFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& tokens,
                               const at::Tensor& token_probs,
                               c10::intrusive_ptr<DeepEpHandle> handle) {
    ctx->saved_data["handle"] = c10::IValue::make_capsule(handle);
    return {AllToAll(tokens, handle->group, handle->received),
            AllToAll(token_probs, handle->group, handle->received)};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto handle = SavedHandle<DeepEpHandle>(ctx);
    return {AllToAll(grads[0].contiguous(), handle->group, handle->tokens),
            AllToAll(grads[1].contiguous(), handle->group, handle->tokens), at::Tensor()};
  }
};

// [N_r, H] -> DeepEP's combine [T, H]; backward: the cached dispatch, [N_r, H].
struct DeepEpCombineFunction : public Function<DeepEpCombineFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& rows,
                            c10::intrusive_ptr<DeepEpHandle> handle) {
    ctx->saved_data["handle"] = c10::IValue::make_capsule(handle);
    return AllToAll(rows.contiguous(), handle->group, handle->tokens);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto handle = SavedHandle<DeepEpHandle>(ctx);
    return {AllToAll(grads[0].contiguous(), handle->group, handle->received), at::Tensor()};
  }
};

// HybridEP's handle (Note [HybridEP dispatch]): the tensors its autograd nodes keep.
struct HybridEpHandle : public torch::CustomClassHolder {
  int64_t tokens = 0;   // T
  int64_t rows = 0;     // N_p
  int64_t experts = 0;  // E
  std::vector<at::Tensor> tensors;
};

// dispatch_with_permute: tokens [T, H] and probabilities fp32 [T, E] -> the local experts'
// rows [N_p, H] and probabilities fp32 [N_p]; makes the handle over `group` ranks of
// `local` experts each. Backward: combine_with_unpermute, [T, H] and fp32 [T, E].
struct HybridEpDispatchFunction : public Function<HybridEpDispatchFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& tokens,
                               const at::Tensor& probs, c10::intrusive_ptr<HybridEpHandle> handle,
                               int64_t group, int64_t local, int64_t domain_gpus) {
    const int64_t T = tokens.size(0), E = probs.size(1);
    const int64_t domain = std::min(group, domain_gpus), nodes = (group + domain - 1) / domain;
    const int64_t gathered = CheckedMul(T, group);
    const at::Tensor gathered_map = at::empty({gathered, E}, Meta(at::kBool));
    handle->tensors = {at::empty({CheckedMul(T, nodes), domain}, Meta(at::kInt)),
                       at::empty({CheckedRoundUp(T, 16), nodes}, Meta(at::kBool)),
                       at::empty({T, nodes - 1}, Meta(at::kBool)),
                       at::empty({gathered, local}, Meta(at::kBool)),
                       at::empty({CheckedMul((T + 63) / 64, group)}, Meta(at::kInt)),
                       at::empty({gathered, local}, Meta(at::kInt)),
                       at::empty({local}, Meta(at::kInt)),
                       at::empty({1}, Meta(at::kInt))};
    ctx->saved_data["handle"] = c10::IValue::make_capsule(handle);
    return {at::empty({handle->rows, tokens.size(1)}, tokens.options()),
            at::empty({handle->rows}, Meta(at::kFloat))};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto handle = SavedHandle<HybridEpHandle>(ctx);
    return {at::empty({handle->tokens, grads[0].size(1)}, grads[0].options()),
            at::empty({handle->tokens, handle->experts}, Meta(at::kFloat)),
            at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor()};
  }
};

// combine_with_unpermute: [N_p, H] -> [T, H]; backward: dispatch_with_permute, [N_p, H].
struct HybridEpCombineFunction : public Function<HybridEpCombineFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& rows,
                            c10::intrusive_ptr<HybridEpHandle> handle) {
    ctx->saved_data["handle"] = c10::IValue::make_capsule(handle);
    return at::empty({handle->tokens, rows.size(1)}, rows.options());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto handle = SavedHandle<HybridEpHandle>(ctx);
    return {at::empty({handle->rows, grads[0].size(1)}, grads[0].options()), at::Tensor()};
  }
};

// _indices_to_multihot: received weights fp32 [N_r, K] -> probabilities fp32 [N_r, E_local];
// the routing map int64 [N_r, E_local] is made bool (`*map`). The index_put keeps the mask
// [N_r, K] bool and the row and column indices int64 [N] each; backward: fp32 [N_r, K].
struct MultihotFunction : public Function<MultihotFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& weights, int64_t local,
                            int64_t rows, at::Tensor* map) {
    StandInKernelScope kernels;
    const int64_t received = weights.size(0);
    // The int64 map lives until its .bool() copy is made (below), as in Megatron's code.
    at::Tensor map_long = at::zeros({received, local}, Meta(at::kLong));
    at::Tensor probs = at::zeros({received, local}, Meta(at::kFloat));
    at::Tensor mask = at::empty(weights.sizes(), Meta(at::kBool));
    ctx->save_for_backward(
        {mask, at::empty({rows}, Meta(at::kLong)), at::empty({rows}, Meta(at::kLong))});
    *map = at::empty({received, local}, Meta(at::kBool));  // .bool()
    return probs;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor mask = ctx->get_saved_variables()[0];
    return {at::zeros(mask.sizes(), Meta(at::kFloat)), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

struct Routing {
  at::Tensor probs;        // [T, E] p, zero but for the top-K
  at::Tensor routing_map;  // [T, E] bool
};

// The routing map of the top-K indices `top` [T, K]:
// zeros_like(logits).int().scatter(1, top, 1).bool(), [T, E] p, int32 twice, then bool.
at::Tensor MapOfTopK(const at::Tensor& logits, const at::Tensor& top) {
  return at::zeros_like(logits).to(at::kInt).scatter(1, top, 1).to(at::kBool);
}

// group_limited_topk (moe_utils.py) of `scores` [T, E]: each group's best K/group_topk
// scores summed ([T, groups]), the best groups' mask spread to a [T, E] copy, the scores
// outside them masked (masked_fill keeps the negated mask [T, E] bool), the top-K of the rest.
std::tuple<at::Tensor, at::Tensor> GroupLimitedTopK(const ModelConfig& m,
                                                    const at::Tensor& scores) {
  const int64_t T = scores.size(0), E = scores.size(1), K = m.moe_router_topk;
  const int64_t groups = m.moe_router_num_groups, chosen = m.moe_router_group_topk;
  at::Tensor group_scores;
  {
    at::NoGradGuard indices_only;  // only the groups' indices are used
    group_scores =
        std::get<0>(at::topk(scores.view({T, groups, E / groups}), K / chosen, -1)).sum(-1);
  }
  const at::Tensor group_index = std::get<1>(at::topk(group_scores, chosen, -1));
  const at::Tensor group_mask = at::zeros_like(group_scores).scatter(1, group_index, 1);
  const at::Tensor score_mask =
      group_mask.unsqueeze(-1).expand({T, groups, E / groups}).reshape({T, E});
  const at::Tensor outside = at::logical_not(score_mask.to(at::kBool));
  return at::topk(scores.masked_fill(outside, -std::numeric_limits<double>::infinity()), K, -1);
}

// The top-K of `scores` [T, E]: group-limited with --moe-router-num-groups.
std::tuple<at::Tensor, at::Tensor> TopK(const ModelConfig& m, const at::Tensor& scores) {
  if (m.moe_router_group_topk > 0) return GroupLimitedTopK(m, scores);
  return at::topk(scores, m.moe_router_topk, -1);
}

// The sigmoid or sqrt(softplus) scores of every expert, float32 [T, E]: the logits' float32
// copy goes once the sigmoid has read it; softplus keeps it for backward.
at::Tensor SigmoidOrSqrtSoftplus(const ModelConfig& m, const at::Tensor& logits) {
  if (m.moe_router_score_function == MoeScoreFunction::kSigmoid) {
    return at::sigmoid(logits.to(at::kFloat));
  }
  return at::sqrt(at::softplus(logits.to(at::kFloat)));
}

// topk_routing_with_score_function (moe_utils.py), unfused, in training: Note [MoE routing].
Routing TopKRouting(const ModelConfig& m, const at::Tensor& logits, const at::Tensor& expert_bias) {
  const int64_t K = m.moe_router_topk;
  at::Tensor probs, top;
  if (m.moe_router_score_function == MoeScoreFunction::kSoftmax) {
    if (m.moe_router_pre_softmax) {
      std::tie(probs, top) = TopK(m, at::softmax(logits, -1, at::kFloat));
    } else {
      at::Tensor scores;
      std::tie(scores, top) = TopK(m, logits);
      probs = at::softmax(scores, -1, at::kFloat);
    }
  } else {
    at::Tensor scores = SigmoidOrSqrtSoftplus(m, logits);
    if (expert_bias.defined()) {
      {
        at::NoGradGuard indices_only;  // the biased scores only choose
        top = std::get<1>(TopK(m, scores + expert_bias));
      }
      scores = at::gather(scores, 1, top);
    } else {
      std::tie(scores, top) = TopK(m, scores);
    }
    probs = K > 1 ? scores / (scores.sum(-1, /*keepdim=*/true) + 1e-20) : scores;
  }
  if (m.moe_router_topk_scaling_factor > 0) probs = probs * m.moe_router_topk_scaling_factor;
  probs = probs.to(logits.scalar_type());
  return {at::zeros_like(logits).scatter(1, top, probs), MapOfTopK(logits, top)};
}

// sinkhorn_load_balancing (router.py) in training: Note [MoE routing].
Routing SinkhornRouting(const ModelConfig& m, const at::Tensor& logits) {
  const int64_t K = m.moe_router_topk;
  at::Tensor balanced, top;  // norm_logits, alive until the routing returns
  {
    at::NoGradGuard no_grad;
    // sinkhorn() on the logits' float32 copy (alive until it returns): cost = exp [T, E];
    // an iteration's d1 * cost and d0.unsqueeze(1) * cost, one at a time; the result
    // d1 * cost * d0.unsqueeze(1).
    const at::Tensor logits32 = logits.to(at::kFloat);
    const at::Tensor cost = at::exp(logits32);
    const at::Tensor d0 = (cost * at::ones({cost.size(1)}, cost.options())).sum(1);
    const at::Tensor d1 = (d0.unsqueeze(1) * cost).sum(0);
    balanced = d1 * cost * d0.unsqueeze(1);
    top = std::get<1>(at::topk(balanced, K, 1));
  }
  const at::Tensor activation =
      K == 1 ? at::sigmoid(logits) : at::softmax(logits, -1, at::kFloat).to(logits.scalar_type());
  at::Tensor map = MapOfTopK(logits, top);
  return {activation * map, map};
}

// Transformer Engine's fused_topk_with_score_function (FusedTopkScoreFunction, TE's
// router.py): probabilities [T, E] p and the map [T, E] bool; it keeps the map and a float32
// [T, E] of the scores; backward writes the logits' gradient [T, E] p.
struct FusedTopKFunction : public Function<FusedTopKFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& logits) {
    const at::Tensor probs = at::empty_like(logits);
    const at::Tensor map = at::empty(logits.sizes(), Meta(at::kBool));
    ctx->save_for_backward({map, at::empty(logits.sizes(), Meta(at::kFloat))});
    ctx->mark_non_differentiable({map});
    return {probs, map};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {at::empty_like(grads[0])};
  }
};

// fused_compute_score_for_moe_aux_loss: the scores [T, E] float32 and a map [T, E] bool
// out, a float32 [T, E] kept; backward writes [T, E] in the logits' dtype.
struct FusedAuxScoresFunction : public Function<FusedAuxScoresFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& logits) {
    const at::Tensor scores = at::empty(logits.sizes(), Meta(at::kFloat));
    const at::Tensor map = at::empty(logits.sizes(), Meta(at::kBool));
    ctx->save_for_backward({at::empty(logits.sizes(), Meta(at::kFloat))});
    ctx->saved_data["dtype"] = logits.scalar_type();
    ctx->mark_non_differentiable({map});
    return {scores, map};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {at::empty(grads[0].sizes(), Meta(ctx->saved_data["dtype"].toScalarType()))};
  }
};

// fused_moe_aux_loss: the loss, a scalar in the scores' dtype; it keeps a float32 [2] and
// the tokens per expert; backward writes the scores' gradient [T, E].
struct FusedAuxLossFunction : public Function<FusedAuxLossFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& scores,
                            const at::Tensor& tokens_per_expert) {
    ctx->save_for_backward({at::empty({2}, Meta(at::kFloat)), tokens_per_expert});
    ctx->saved_data["sizes"] = scores.sizes().vec();
    return at::empty({}, scores.options());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {at::empty(ctx->saved_data["sizes"].toIntVector(), grads[0].options()), at::Tensor()};
  }
};

// The load-balancing loss's scores and their top-K map (compute_routing_scores_for_aux_loss),
// then the loss (switch_load_balancing_loss_func) attached to `probs`: Note [MoE routing].
at::Tensor AttachAuxLoss(const ModelConfig& m, const TrainingConfig& t, const at::Tensor& logits,
                         const at::Tensor& probs) {
  at::Tensor scores, map;
  if (t.moe_router_fusion) {
    const auto outputs = FusedAuxScoresFunction::apply(logits);
    scores = outputs[0];
    map = outputs[1];
  } else {
    if (m.moe_router_score_function == MoeScoreFunction::kSoftmax) {
      scores = at::softmax(logits, -1, at::kFloat);
    } else {
      scores = SigmoidOrSqrtSoftplus(m, logits);
      scores = scores / (scores.sum(-1, /*keepdim=*/true) + 1e-20);
    }
    at::Tensor top;
    {
      at::NoGradGuard indices_only;
      top = std::get<1>(at::topk(scores, m.moe_router_topk, 1));
    }
    map = MapOfTopK(logits, top);
  }
  const at::Tensor tokens_per_expert = map.sum(0);  // int64 [E], all-reduced in place
  map.reset();
  const at::Tensor loss = t.moe_router_fusion
                              ? FusedAuxLossFunction::apply(scores, tokens_per_expert)
                              : (scores.sum(0) * tokens_per_expert).sum();
  return AttachLoss(probs, loss);
}

// TopKRouter (router.py) in training: gating, z-loss, routing, token dropping, aux loss.
Routing Route(const ModelConfig& m, const TrainingConfig& t, MoeParameters& params,
              const at::Tensor& tokens) {
  ModuleScope s("router");
  at::Tensor input = tokens;
  if (m.moe_input_jitter_eps) {
    // apply_input_jitter: Uniform(...).rsample(shape) is low + rand * (high - low) in the
    // input's dtype; the product keeps the noise for backward.
    const at::Tensor noise =
        at::empty_like(tokens) * (2 * *m.moe_input_jitter_eps) + (1 - *m.moe_input_jitter_eps);
    input = tokens * noise;
  }
  // The gating GEMM writes the router dtype directly (TE's GEMM; a bf16 [T, E] here then
  // its fp32 copy).
  at::Tensor logits;
  {
    DelayedWgradScope no_delay({});  // the router's is never delayed (a torch linear)
    logits = Linear(input, *params.router, nullptr);  // [T, E]
  }
  if (m.moe_router_fp32) logits = logits.to(at::kFloat);
  // RandomSTE (apply_random_logits, which apply_biased_logits calls too): normal_() in a
  // clone; saves nothing.
  if (m.moe_router_force_load_balancing) logits = logits.clone();
  if (m.moe_router_force_biased) {
    logits = logits.clone();
    // RandomSTEShared: logits + a random bias [E] (saves nothing); a negative STD makes
    // each layer's bias once and keeps it in a class-level cache.
    at::Tensor bias = params.forced_router_bias;
    if (!bias.defined()) {
      std::optional<PersistentScope> cached;
      if (*m.moe_router_force_biased < 0) cached.emplace();
      bias = at::empty({m.num_experts}, logits.options());
      if (cached) params.forced_router_bias = bias;
    }
    logits = logits + bias;
  }
  if (m.moe_z_loss_coeff > 0) {
    logits = AttachLoss(logits, at::logsumexp(logits, {-1}).square().mean());
  }
  Routing routing;
  if (m.moe_router_sinkhorn) {
    routing = SinkhornRouting(m, logits);
  } else if (t.moe_router_fusion) {
    const auto outputs = FusedTopKFunction::apply(logits);
    routing = {outputs[0], outputs[1]};
  } else {
    routing = TopKRouting(m, logits, params.expert_bias);
  }
  at::Tensor& probs = routing.probs;
  at::Tensor& routing_map = routing.routing_map;
  if (m.moe_capacity_factor > 0) {
    // apply_router_token_dropping (moe_utils.py): each expert's capacity highest tokens
    // (by probability, or by position: the map as int32) make a [T, E] mask; the map becomes
    // the mask (padded) or the map and the mask, and the probabilities are multiplied by it
    // (the product keeps it for backward).
    const int64_t capacity = ExpertCapacity(m, logits.size(0));
    at::Tensor mask;
    if (capacity > logits.size(0)) {
      mask = at::ones_like(probs).to(at::kBool);
    } else {
      const at::Tensor scored = m.moe_drop_by_position ? routing_map.to(at::kInt) : probs;
      const at::Tensor kept = std::get<1>(at::topk(scored, capacity, 0));  // [capacity, E]
      mask = at::zeros_like(probs).scatter(0, kept, 1).to(at::kBool);
    }
    routing_map = m.moe_pad_to_capacity ? mask : at::logical_and(routing_map, mask);
    mask.reset();
    probs = probs * routing_map;
  }
  if (m.moe_aux_loss_coeff > 0) {
    probs = AttachAuxLoss(m, t, logits, probs);
    Charge(kAuxLossUnmodelledOps);
  }
  return routing;
}

// The routed experts on N (token, expert) rows and their probabilities [N] p (experts.py):
// fc1, activation, the activation times the probabilities (in p, then the training
// dtype), fc2. SequentialMLP runs the local experts one by one and concatenates their
// outputs (a second [N, H] while the pieces are alive). With Transformer Engine's op fuser
// the weighted activation is TE's ScaledSwiGLU, which saves its input and the
// probabilities only. The op fuser also pads each expert's rows to a multiple of 256
// (TEGroupedMLP's Fp8Padding, copies of the rows and probabilities, unpadded after fc2)
// whenever routing leaves a count off the multiple: not modelled yet (memsim routes evenly,
// and the padding of uneven routing is not known in advance).
//
// Megatron-Core's own fused path (--bias-activation-fusion with SwiGLU or quick-GeGLU:
// bias_act_func in TEGroupedMLP, MLP.forward's per_token_scale in SequentialMLP) is
// weighted_bias_swiglu_impl / weighted_bias_quick_geglu_impl, which save the fc1 output and
// the probabilities only and return the weighted activation in the fc1 output's dtype; the
// backward recomputes the activation. A real run showed it (validation/fake_pg,
// llama_1b_moe8_local_ep1_dp8: its allocator history has one fused_bias_swiglu.py output
// per expert and no unweighted activation). Otherwise the activation is made, multiplied
// by the probabilities (a product that keeps both factors) and cast back.
at::Tensor Experts(const ModelConfig& m, const TrainingConfig& t, const MoeParallelism& p,
                   MoeParameters& params, const at::Tensor& unpadded_x,
                   const at::Tensor& unpadded_probs, ActivationOffloader* offloader) {
  ModuleScope e("experts");
  const int64_t fe = m.moe_ffn_hidden_size / p.etp;
  const int64_t local = m.num_experts / p.ep;
  const Fp8Recipe recipe = params.experts_fc1->fp8.recipe;
  // Fp8Padding, unless the router's padding (Note [Router padding]) or HybridEP's dispatch
  // has aligned each expert's rows already (moe_utils.skip_routed_expert_padding).
  const bool fp8 = recipe != Fp8Recipe::kNone && t.moe_dispatcher != MoeDispatcher::kHybridEp &&
                   !t.moe_router_padding;
  // The experts' delayed weight gradients run once their backward is done, before the
  // dispatch's (Note [Delayed weight gradients] in delayed_wgrad.h).
  const c10::intrusive_ptr<WeightGradStore> wgrad = NewWgradStore(t.delay_wgrad_compute);
  DelayedWgradScope delay(wgrad);
  const at::Tensor input = wgrad ? RunOnBackward(unpadded_x, wgrad) : unpadded_x;
  auto [x, probs] = fp8 ? PadForFp8(input, unpadded_probs, local, recipe)
                        : std::pair<at::Tensor, at::Tensor>{input, unpadded_probs};
  // --moe-apply-probs-on-input (experts.py): the rows times their probabilities (a product
  // that keeps both factors, in the promoted dtype, then cast back), and ones for the
  // activation's weights. TE's fused path refuses it: the op fuser does not run.
  const bool op_fuser = t.te_op_fuser && !m.moe_apply_probs_on_input;
  if (m.moe_apply_probs_on_input) {
    const at::ScalarType rows_dtype = x.scalar_type();
    x = (probs.unsqueeze(-1) * x).to(rows_dtype);
    probs = at::ones_like(probs);
  }
  // TEGroupedMLP calls two GroupedLinears (the op fuser one fused MLP), SequentialMLP two
  // linears per local expert.
  ChargeTeModuleCalls(t, op_fuser ? 1 : t.moe_grouped_gemm ? 2 : CheckedMul(2, local));
  if ((!t.moe_grouped_gemm || t.profile == ProfileKind::kMegatronLocal) && local > 1) {
    Charge(SequentialMlpUnmodelledOps(local));
  }
  at::Tensor h;
  {
    ModuleScope f("linear_fc1");
    Fp8LinearOptions fc1_fp8;
    fc1_fp8.row_groups = local;
    // experts.py: fc1 saves its whole input (set_save_original_input), offloaded as that.
    OffloadRegion offload(offloader, OffloadModule::kExpertFc1, &x);
    h = GroupedLinear(x, *params.experts_fc1, m.Fc1Width(fe), /*rows=*/true, fc1_fp8);
    offload.EndSaving({h});
    offload.Commit(&h, {{x}});
  }
  x.reset();
  const at::ScalarType dtype = unpadded_x.scalar_type();
  // TEGroupedMLP's bias_act_func: Megatron's weighted GLU kernels (under the bias-activation
  // fusion) or its weighted squared ReLU (TE's activation ops take no squared ReLU).
  const bool te_grouped_mlp = t.moe_grouped_gemm && t.profile == ProfileKind::kTransformerEngine;
  auto weighted_activation =
      [&m, dtype, op_fuser, fused = t.bias_activation_fusion,
       weighted_srelu = te_grouped_mlp && m.activation == ActivationKind::kSquaredRelu &&
                        t.fused_weighted_squared_relu,
       one_kernel = t.OneKernelActivation()](const std::vector<at::Tensor>& in) {
        const bool gated =
            m.activation == ActivationKind::kSwiglu || m.activation == ActivationKind::kQuickGeglu;
        if (op_fuser || (fused && gated) || weighted_srelu) {
          // TE's ScaledSwiGLU and ScaledSReLU take the scales in the activation dtype,
          // Megatron's kernels as they are.
          const at::Tensor scales = in[1].unsqueeze(-1);
          return std::vector<at::Tensor>{
              WeightedActivation(in[0], op_fuser ? scales.to(dtype) : scales, gated)};
        }
        // Transformer Engine's op, or the eager activation, then the probabilities' product.
        return std::vector<at::Tensor>{
            (Activation(m, one_kernel, in[0]) * in[1].unsqueeze(-1)).to(dtype)};
      };
  // moe_act: the weighted activation goes once fc2 has saved it. Offloading's moe_act
  // region covers the activation alone; it commits after fc2 (experts.py).
  at::Tensor fc1_output = std::move(h);
  OffloadRegion offload(offloader, OffloadModule::kMoeAct, &fc1_output);
  std::optional<CheckpointWithoutOutput> activation_checkpoint;
  if (t.Recomputes(RecomputeModule::kMoeAct)) {
    activation_checkpoint.emplace();
    h = activation_checkpoint->Run(weighted_activation, {fc1_output, probs})[0];
  } else {
    h = weighted_activation({fc1_output, probs})[0];
  }
  offload.EndSaving({h});
  if (!offload.active()) fc1_output.reset();  // the activation keeps what it saved
  // TEGroupedMLP adds fc2's bias after the GEMM (Note [MoE biases]); with TE's op fuser
  // GroupedLinear scales it inside, and SequentialMLP's per-expert MLPs add theirs in place:
  // neither is modelled.
  const Parameter* fc2_bias = t.moe_grouped_gemm && !op_fuser ? params.experts_fc2_bias : nullptr;
  if (fc2_bias == nullptr) probs.reset();
  {
    ModuleScope f("linear_fc2");
    // Under moe_act recomputation fc2 keeps its 16-bit input, which the recomputation
    // restores (experts.py: set_save_original_input).
    Fp8LinearOptions fc2_fp8;
    fc2_fp8.save_original_input = activation_checkpoint.has_value();
    fc2_fp8.row_groups = local;
    h = GroupedLinear(h, *params.experts_fc2, fe, /*rows=*/false, fc2_fp8);  // [N, H]
  }
  if (activation_checkpoint) activation_checkpoint->DiscardOutputAndRegisterRecompute(h);
  offload.Commit(&h, {{fc1_output}});
  fc1_output.reset();
  if (fc2_bias != nullptr) {
    h = ExpertBiasFunction::apply(h, probs.unsqueeze(-1), fc2_bias->data, fc2_bias->main_grad,
                                  local);
    probs.reset();
  }
  if (fp8) h = UnpadForFp8(h, local, unpadded_x.size(0));
  if (!t.moe_grouped_gemm && m.num_experts / p.ep > 1) h = h.clone();  // torch.cat
  return h;
}

// The flex dispatcher with DeepEP around the experts (Note [DeepEP dispatch]): tokens
// [T, H] -> [T, H].
at::Tensor DeepEpDispatchAndCombine(const ModelConfig& m, const TrainingConfig& t,
                                    const MoeParallelism& p, MoeParameters& params,
                                    const at::Tensor& tokens, const Routing& routing,
                                    ActivationOffloader* offloader) {
  // The dispatcher's work, then the experts and the combine beside it (MoELayer's children).
  std::optional<ModuleScope> dispatcher(std::in_place, "token_dispatcher");
  const int64_t T = tokens.size(0), K = m.moe_router_topk, local = m.num_experts / p.ep;
  const int64_t N = ReceivedTokens(m, T) * p.etp;
  const bool sorted_index_add = SortsIndexAdd(t);
  auto handle = c10::make_intrusive<DeepEpHandle>();
  handle->group = p.etp * p.ep;
  handle->tokens = T;
  handle->received = DeepEpReceivedRows(m, p, T);
  const int64_t G = handle->group, R = handle->received;
  // setup_metadata, kept by the dispatcher until the layer's next forward.
  auto [token_probs, token_indices] = at::topk(routing.probs, K, -1);
  token_probs = token_probs.to(at::kFloat);
  params.kept[0] = token_indices;
  params.kept[1] = token_probs;
  at::Tensor received, weights, indices;
  {
    // get_dispatch_layout, then the dispatch and its handle.
    const int64_t channels = t.deepep_num_sms / 2;
    const at::Tensor per_rank = at::empty({G}, Meta(at::kInt));
    const at::Tensor per_expert = at::empty({m.num_experts}, Meta(at::kInt));
    const at::Tensor in_rank = at::empty({T, G}, Meta(at::kBool));
    auto outputs = DeepEpDispatchFunction::apply(tokens, token_probs, handle);
    received = outputs[0];  // [N_r, H]
    weights = outputs[1];   // [N_r, K] fp32
    indices = at::empty({R, K}, Meta(at::kLong));
    handle->tensors = {at::empty({G, G}, Meta(at::kInt)),
                       at::empty({G, channels}, Meta(at::kInt)),
                       at::empty({G, channels}, Meta(at::kInt)),
                       at::empty({R}, Meta(at::kInt)),
                       in_rank,
                       at::empty({T, G}, Meta(at::kInt))};
  }
  at::Tensor map;
  const at::Tensor dispatched_probs = MultihotFunction::apply(weights, local, N, &map);
  weights.reset();
  // Note [Router padding]: each local expert's received rows rounded up, unless one of them
  // would take more rows than were received (_pad_routing_map).
  int64_t rows = N;
  if (t.moe_router_padding) {
    const int64_t align = QuantizationAlignment(t);
    const int64_t largest = CheckedRoundUp(N / local + (N % local > 0 ? 1 : 0), align);
    if (largest <= R) rows = PaddedShares(N, local, align, std::numeric_limits<int64_t>::max());
    if (rows > N) PadRoutingMap(t, rows - N, &map);
  }
  const Permutation perm = MakePermutation(R, local, rows, t.moe_permute_fusion, /*padded=*/false);
  at::Tensor x = PermuteFunction::apply(received, perm.index, rows, sorted_index_add);  // [N, H]
  const at::Tensor probs_index = t.moe_permute_fusion ? perm.index : perm.order;
  at::Tensor probs = PermuteProbsFunction::apply(dispatched_probs, probs_index, local, rows,
                                                 /*masked_select=*/false);  // [N] fp32
  dispatcher.reset();
  x = Experts(m, t, p, params, x, probs, offloader);
  received.reset();  // moe_layer.py's dispatched_input, alive while the experts ran
  ModuleScope c("token_combine");
  x = UnpermuteFunction::apply(x, R, sorted_index_add);  // [N_r, H]
  indices.reset();                                 // released by the combine, as the handle is
  params.kept[2] = std::move(map);                 // dispatched_routing_map
  return DeepEpCombineFunction::apply(x, handle);  // [T, H]
}

// The rows HybridEP hands the local experts (N_p of Note [HybridEP dispatch]): the N the
// rank's experts take, evenly over them, each expert's rounded up to the quantization
// alignment (get_align_size_for_quantization).
int64_t HybridEpRows(const ModelConfig& m, const TrainingConfig& t, const MoeParallelism& p,
                     int64_t tokens) {
  const int64_t rows = ReceivedTokens(m, tokens) * p.etp, local = m.num_experts / p.ep;
  return PaddedShares(rows, local, QuantizationAlignment(t), std::numeric_limits<int64_t>::max());
}

// The flex dispatcher with HybridEP around the experts (Note [HybridEP dispatch]): tokens
// [T, H] -> [T, H].
at::Tensor HybridEpDispatchAndCombine(const ModelConfig& m, const TrainingConfig& t,
                                      const MoeParallelism& p, MoeParameters& params,
                                      const at::Tensor& tokens, const Routing& routing,
                                      ActivationOffloader* offloader) {
  std::optional<ModuleScope> dispatcher(std::in_place, "token_dispatcher");
  const int64_t T = tokens.size(0), local = m.num_experts / p.ep;
  params.kept[0] = routing.routing_map;
  params.kept[1] = routing.probs.to(at::kFloat);  // setup_metadata's token_probs
  auto handle = c10::make_intrusive<HybridEpHandle>();
  handle->tokens = T;
  handle->rows = HybridEpRows(m, t, p, T);
  handle->experts = m.num_experts;
  const auto outputs = HybridEpDispatchFunction::apply(tokens, params.kept[1], handle, p.etp * p.ep,
                                                       local, t.gpus_per_nvlink_domain);
  dispatcher.reset();
  const at::Tensor x = Experts(m, t, p, params, outputs[0], outputs[1], offloader);
  ModuleScope c("token_combine");
  return HybridEpCombineFunction::apply(x, handle);  // [T, H]
}

}  // namespace

at::Tensor MoeForward(const ModelConfig& m, const TrainingConfig& t, const MoeParallelism& p,
                      MoeParameters& params,
                      const c10::intrusive_ptr<GlobalMemoryBuffer>& global_buffer,
                      const at::Tensor& hidden, const LinearParallelism& shared_fc1,
                      ActivationOffloader* offloader) {
  const int64_t H = m.hidden_size, E = m.num_experts, local = E / p.ep;
  const at::Tensor tokens = hidden.reshape({-1, H});  // [T, H]
  const int64_t T = tokens.size(0);
  // CUDA graphs' moe_router module captures the shared experts and the router (Note [CUDA
  // graphs] in parallel/cuda_graphs.h); overlapped shared experts stay outside it
  // (TransformerLayer's graphed submodules).
  std::optional<GraphedScope> router_graph;
  router_graph.emplace(t.Graphs(CudaGraphModule::kMoeRouter) && !t.SharedExpertsOverlap(m));
  at::Tensor shared;
  if (params.shared_fc1 != nullptr) {
    // Shared experts run first, on the same input: SharedExpertMLP is an MLP over the
    // attention tp group (shared_experts.py), so with sequence parallelism fc1 (a TE
    // column-parallel linear) gathers the sequence and keeps only its shard, and fc2's
    // output is reduce-scattered; fc1's output and the activation are the whole sequence's.
    ModuleScope s("shared_experts");
    // Captures what outlives the forward: the recomputation runs in backward.
    // In FP8 fc1 keeps its 16-bit input, the norm's output the router holds anyway, unless
    // the shared experts are recomputed (shared_experts.py).
    Fp8LinearOptions fc1_fp8;
    fc1_fp8.save_original_input = !t.Recomputes(RecomputeModule::kSharedExperts);
    const bool sp = shared_fc1.gather_input_group > 1;
    Fp8LinearOptions fc2_fp8;
    if (sp) fc2_fp8.reduce_scatter_output_group = p.tp;
    auto shared_experts = [&m, &params, tp = p.tp, sp, fc1_parallelism = shared_fc1, fc1_fp8,
                           fc2_fp8, fused = t.OneKernelActivation(),
                           &t](const std::vector<at::Tensor>& in) {
      ChargeTeModuleCalls(t, 2);
      at::Tensor h;
      {
        ModuleScope f("linear_fc1");
        h = Linear(in[0], *params.shared_fc1, nullptr, fc1_parallelism, fc1_fp8);
      }
      h = Activation(m, fused, h);
      at::Tensor out;
      {
        ModuleScope f("linear_fc2");
        out = Linear(h, *params.shared_fc2, nullptr, {}, fc2_fp8);
        // An FP8 linear reduce-scatters inside (fc2_fp8); a 16-bit one leaves it to Megatron.
        if (params.shared_fc2->fp8.recipe == Fp8Recipe::kNone || !sp) {
          out = sp ? ReduceScatterToSequenceParallelRegion(out, tp, /*into_userbuffer=*/false)
                   : ReduceFromTensorParallelRegion(out, tp);
        }
      }
      if (params.shared_gate != nullptr) {
        // A torch linear (never delayed) on this rank's tokens, its sigmoid, the product.
        DelayedWgradScope no_delay({});
        out = out * at::sigmoid(Linear(in[0], *params.shared_gate, nullptr));  // [T, 1]
      }
      return out;
    };
    shared = t.Recomputes(RecomputeModule::kSharedExperts) ? Checkpoint(shared_experts, {tokens})
                                                           : shared_experts({tokens});
  }
  if (t.SharedExpertsOverlap(m)) router_graph.emplace(t.Graphs(CudaGraphModule::kMoeRouter));
  Routing routing = Route(m, t, params, tokens);
  router_graph.reset();
  const bool fp32_probs = routing.probs.scalar_type() == at::kFloat;
  const int64_t R = ReceivedTokens(m, T);
  const bool sorted_index_add = SortsIndexAdd(t);
  at::Tensor out;
  if (t.moe_dispatcher == MoeDispatcher::kAllGather) {
    std::optional<ModuleScope> dispatcher(std::in_place, "token_dispatcher");
    const int64_t group = p.ep * p.etp, gathered = T * group, N = R * p.etp;
    at::Tensor map = AllGather(routing.routing_map, group);                   // [T_g, E] bool
    const at::Tensor probs = AllGatherRows(routing.probs, group);             // [T_g, E] p
    const at::Tensor hidden_g = AllGatherRows(tokens, group, global_buffer);  // [T_g, H]
    {
      StandInKernelScope kernel;
      params.kept[0] = at::empty({gathered, local}, Meta(at::kBool));  // local_map
    }
    map.reset();
    Charge(AllGatherUnmodelledOps(t));
    const Permutation perm =
        MakePermutation(gathered, local, N, t.moe_permute_fusion, /*padded=*/false);
    const at::Tensor local_probs = PermuteProbsFunction::apply(probs, /*keep=*/probs, local, N,
                                                               /*masked_select=*/true);
    at::Tensor x = PermuteFunction::apply(hidden_g, perm.index, N, sorted_index_add);
    dispatcher.reset();
    x = Experts(m, t, p, params, x, local_probs, offloader);
    ModuleScope c("token_combine");
    x = UnpermuteFunction::apply(x, gathered, sorted_index_add);  // [T_g, H]
    if (fp32_probs) x = x.to(at::kFloat);
    out = ReduceScatterToSequenceParallelRegion(x, group).to(tokens.scalar_type());  // [T, H]
  } else if (t.moe_dispatcher == MoeDispatcher::kDeepEp) {
    out = DeepEpDispatchAndCombine(m, t, p, params, tokens, routing, offloader);
  } else if (t.moe_dispatcher == MoeDispatcher::kHybridEp) {
    out = HybridEpDispatchAndCombine(m, t, p, params, tokens, routing, offloader);
  } else {
    std::optional<ModuleScope> dispatcher(std::in_place, "token_dispatcher");
    // Note [Router padding]: each expert's share of the rank's map rounded up (at most every
    // token); each of the ep * E_local shares a rank receives is padded as its sender's was.
    const int64_t unpadded = DispatchedTokens(m, T);
    const int64_t padding = t.moe_router_padding
                                ? PaddedShares(unpadded, E, QuantizationAlignment(t), T) - unpadded
                                : 0;
    if (padding > 0) PadRoutingMap(t, padding, &routing.routing_map);
    const int64_t D = unpadded + padding, received = R + padding, N = received * p.etp;
    params.kept[1] = routing.probs;
    params.kept[0] = routing.routing_map;
    Charge(AllToAllUnmodelledOps(m, t, p, local));
    const bool padded = m.moe_pad_to_capacity && !t.moe_permute_fusion;
    const Permutation perm = MakePermutation(T, E, D, t.moe_permute_fusion, padded);
    at::Tensor x = PermuteFunction::apply(tokens, perm.index, D, sorted_index_add);  // [D, H]
    // The probabilities' gather index: TE's map, the argsort, or padded its own int64 [D].
    const at::Tensor probs_index = t.moe_permute_fusion ? perm.index
                                   : padded             ? at::empty({D}, Meta(at::kLong))
                                                        : perm.order;
    at::Tensor probs = PermuteProbsFunction::apply(routing.probs, probs_index, E, D,
                                                   /*masked_select=*/false);  // [D] p
    x = AllToAllTokens(x, p.ep, received);                                    // [R, H]
    probs = AllToAllTokens(probs.unsqueeze(-1), p.ep, received).squeeze(-1);  // [R] p
    x = AllGatherRows(x, p.etp);                                              // [N, H]
    probs = AllGatherRows(probs, p.etp);                                      // [N] p
    // With more than one local expert the received rows are regrouped by expert:
    // sort_chunks_by_idxs, split + cat (new buffers) or TE's chunk sort with an int32 [N]
    // map it keeps; padded to capacity, a view of [ep, E_local, capacity] rows transposed
    // into a new buffer.
    const bool chunk_sort_map = t.moe_permute_fusion && !m.moe_pad_to_capacity;
    if (local > 1) {
      x = x.clone();
      probs = probs.clone();
      if (chunk_sort_map) x = KeepFunction::apply(x, at::empty({N}, Meta(at::kInt)));
    }
    dispatcher.reset();
    x = Experts(m, t, p, params, x, probs, offloader);
    ModuleScope c("token_combine");
    if (local > 1) {
      x = x.clone();
      if (chunk_sort_map) x = KeepFunction::apply(x, at::empty({N}, Meta(at::kInt)));
    }
    if (p.etp > 1) {
      if (fp32_probs) x = x.to(at::kFloat);
      x = ReduceScatterToSequenceParallelRegion(x, p.etp).to(tokens.scalar_type());  // [R, H]
    }
    x = AllToAllTokens(x, p.ep, D);                          // [D, H]
    out = UnpermuteFunction::apply(x, T, sorted_index_add);  // [T, H]
  }
  if (shared.defined()) out = out + shared;
  return out.view(hidden.sizes());
}

}  // namespace memsim
