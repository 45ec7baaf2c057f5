// A mixture-of-experts MLP as Megatron-Core's MoELayer runs it (megatron/core/transformer/
// moe/: TopKRouter, MoEAlltoAllTokenDispatcher, GroupedMLP, shared experts).
//
// Parameters of one MoE layer on a rank (legend in model_config.h; E_local = E/ep,
// F_e = moe_ffn_hidden_size, etp = expert tensor parallelism, F_s = shared expert size):
//   mlp.router.weight                 (E, H)
//   mlp.experts.linear_fc1.weight     (E_local * 2F_e/etp, H)   SwiGLU; F_e/etp for GeLU
//   mlp.experts.linear_fc2.weight     (H, E_local * F_e/etp)
//   mlp.shared_experts.linear_fc1     (2F_s/tp, H), linear_fc2 (H, F_s/tp)   if F_s > 0
//
// Tokens, for T tokens on the rank and top-K routing:
//   dispatched D = T*K (dropless) or E * ceil(cf * T*K / E) (capacity factor cf: each
//     expert takes at most that many of a rank's tokens, and is padded to it);
//   received R = D on balanced routing; dropless with imbalance factor f, the busiest
//     rank receives ceil(f * D).
// Saved for backward: router softmax [T, E] float32 and top-K indices; the permuted
// tokens [D, H] (dispatch) and the received tokens [R, H] (fc1 input), fc1 output
// [R, 2F_e/etp], activation [R, F_e/etp]; the returned expert outputs [D, H] and probs
// (combine).
#pragma once

#include <ATen/core/Tensor.h>

#include "models/layers.h"
#include "models/model_config.h"
#include "models/parameters.h"

namespace memsim {

struct MoeParallelism {
  int64_t ep = 1;
  int64_t etp = 1;
  int64_t tp = 1;
};

struct MoeParameters {
  Parameter* router = nullptr;
  Parameter* experts_fc1 = nullptr;
  Parameter* experts_fc2 = nullptr;
  Parameter* shared_fc1 = nullptr;  // null without shared experts
  Parameter* shared_fc2 = nullptr;
};

// Creates the MoE layer's parameters under the current module ("mlp").
MoeParameters CreateMoeParameters(const ModelConfig& model, const MoeParallelism& parallel,
                                  ParameterStore* store);

// Tokens dispatched and received by one rank, as above.
int64_t DispatchedTokens(const ModelConfig& model, int64_t tokens);
int64_t ReceivedTokens(const ModelConfig& model, int64_t tokens);

// hidden [S', B, H] -> [S', B, H].
at::Tensor MoeForward(const ModelConfig& model, const MoeParallelism& parallel,
                      MoeParameters& params, const at::Tensor& hidden);

}  // namespace memsim
