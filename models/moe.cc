#include "models/moe.h"

#include <ATen/ATen.h>

#include <cmath>

#include "parallel/expert_parallel.h"
#include "parallel/tensor_parallel.h"
#include "simulator/session.h"

namespace memsim {
namespace {

int64_t Fc1Width(const ModelConfig& model, int64_t ffn) {
  return model.activation == ActivationKind::kSwiglu ? 2 * ffn : ffn;
}

at::Tensor Activation(const ModelConfig& model, const at::Tensor& x) {
  return model.activation == ActivationKind::kGelu ? at::gelu(x) : Swiglu(x);
}

// A grouped GEMM over the local experts' concatenated weights: memory and FLOPs equal one
// [tokens, in] x [in, out] GEMM against one expert's block (views of the parameter).
at::Tensor GroupedLinear(const at::Tensor& tokens, Parameter& weight, int64_t out, bool rows) {
  Parameter block{weight.name, rows ? weight.data.narrow(0, 0, out) : weight.data.narrow(1, 0, out),
                  rows ? weight.main_grad.narrow(0, 0, out) : weight.main_grad.narrow(1, 0, out),
                  true};
  block.store = weight.store;
  return Linear(tokens, block, nullptr);
}

}  // namespace

int64_t DispatchedTokens(const ModelConfig& m, int64_t tokens) {
  const int64_t routed = tokens * m.moe_router_topk;
  if (m.moe_capacity_factor <= 0) return routed;
  const auto capacity = static_cast<int64_t>(std::ceil(
      m.moe_capacity_factor * static_cast<double>(routed) / static_cast<double>(m.num_experts)));
  return capacity * m.num_experts;
}

int64_t ReceivedTokens(const ModelConfig& m, int64_t tokens) {
  const int64_t dispatched = DispatchedTokens(m, tokens);
  if (m.moe_capacity_factor > 0) return dispatched;
  return static_cast<int64_t>(std::ceil(m.moe_imbalance_factor * static_cast<double>(dispatched)));
}

MoeParameters CreateMoeParameters(const ModelConfig& m, const MoeParallelism& p,
                                  ParameterStore* store) {
  const int64_t H = m.hidden_size, local = m.num_experts / p.ep;
  const int64_t fe = m.moe_ffn_hidden_size / p.etp;
  MoeParameters params;
  {
    ModuleScope s("router");
    params.router = store->Add("weight", {m.num_experts, H});
  }
  {
    ModuleScope s("experts");
    {
      ModuleScope f("linear_fc1");
      params.experts_fc1 = store->Add("weight", {local * Fc1Width(m, fe), H}, /*expert=*/true);
    }
    ModuleScope f("linear_fc2");
    params.experts_fc2 = store->Add("weight", {H, local * fe}, /*expert=*/true);
  }
  if (m.moe_shared_expert_size > 0) {
    ModuleScope s("shared_experts");
    const int64_t fs = m.moe_shared_expert_size / p.tp;
    {
      ModuleScope f("linear_fc1");
      params.shared_fc1 = store->Add("weight", {Fc1Width(m, fs), H});
    }
    ModuleScope f("linear_fc2");
    params.shared_fc2 = store->Add("weight", {H, fs});
  }
  return params;
}

at::Tensor MoeForward(const ModelConfig& m, const MoeParallelism& p, MoeParameters& params,
                      const at::Tensor& hidden) {
  const int64_t H = m.hidden_size, K = m.moe_router_topk;
  const at::Tensor tokens = hidden.reshape({-1, H});  // [T, H]
  const int64_t T = tokens.size(0);
  at::Tensor probs, indices;
  {
    // TopKRouter: logits, softmax in float32, top-k.
    ModuleScope s("router");
    const at::Tensor logits = Linear(tokens, *params.router, nullptr);  // [T, E]
    const at::Tensor scores = at::softmax(logits.to(at::kFloat), -1);
    std::tie(probs, indices) = at::topk(scores, K, -1);  // [T, K] each
  }
  const int64_t D = DispatchedTokens(m, T), R = ReceivedTokens(m, T);
  at::Tensor expert_out;
  at::Tensor token_index;
  {
    ModuleScope s("token_dispatcher");
    // permute: the routed tokens sorted by expert (padded to capacity with a factor).
    token_index = at::empty({D}, tokens.options().dtype(at::kLong));
    const at::Tensor permuted = tokens.index_select(0, token_index);  // [D, H]
    at::Tensor received = AllToAllTokens(permuted, p.ep, R);          // [R, H]
    ModuleScope e("experts");
    const int64_t fe = m.moe_ffn_hidden_size / p.etp;
    at::Tensor h;
    {
      ModuleScope f("linear_fc1");
      h = GroupedLinear(received, *params.experts_fc1, Fc1Width(m, fe), /*rows=*/true);
    }
    received.reset();
    h = Activation(m, h);
    {
      ModuleScope f("linear_fc2");
      h = GroupedLinear(h, *params.experts_fc2, fe, /*rows=*/false);  // [R, H]
    }
    if (p.etp > 1) h = ReduceFromTensorParallelRegion(h, p.etp);
    expert_out = AllToAllTokens(h, p.ep, D);  // [D, H]
  }
  at::Tensor out;
  {
    // unpermute: weight each expert output by its routing probability, sum per token.
    ModuleScope s("token_combine");
    const at::Tensor weights =
        probs.reshape({-1}).narrow(0, 0, std::min<int64_t>(D, T * K)).to(expert_out.scalar_type());
    at::Tensor weighted = expert_out.narrow(0, 0, weights.size(0)) * weights.unsqueeze(-1);
    out = at::zeros({T, H}, tokens.options())
              .index_add(0, token_index.narrow(0, 0, weights.size(0)), weighted);
  }
  if (params.shared_fc1 != nullptr) {
    ModuleScope s("shared_experts");
    at::Tensor h;
    {
      ModuleScope f("linear_fc1");
      h = Linear(tokens, *params.shared_fc1, nullptr);
    }
    h = Activation(m, h);
    ModuleScope f("linear_fc2");
    h = ReduceFromTensorParallelRegion(Linear(h, *params.shared_fc2, nullptr), p.tp);
    out = out + h;
  }
  return out.view(hidden.sizes());
}

}  // namespace memsim
