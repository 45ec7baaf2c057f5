// A mixture-of-experts MLP as Megatron-Core 0.20's MoELayer runs it (megatron/core/
// transformer/moe/: TopKRouter, MoEAllGatherTokenDispatcher or MoEAlltoAllTokenDispatcher,
// TEGroupedMLP or SequentialMLP, shared experts).
//
// Parameters of one MoE layer on a rank (legend in model_config.h; E_local = E/ep,
// F_e = moe_ffn_hidden_size, etp = expert tensor parallelism, F_s = shared expert size):
//   mlp.router.weight                 (E, H)
//   mlp.experts.linear_fc1.weight     (E_local * 2F_e/etp, H)   SwiGLU; F_e/etp otherwise
//   mlp.experts.linear_fc2.weight     (H, E_local * F_e/etp)
//   mlp.shared_experts.linear_fc1     (2F_s/tp, H), linear_fc2 (H, F_s/tp)   if F_s > 0
//
// Tokens: T = S*B/(tp*cp) on the rank (Megatron trains MoE with tp > 1 only under
// sequence parallelism); top-K routing; p = the probabilities' dtype (fp32 with
// --moe-router-dtype fp32, else the training dtype). Per rank, the experts process
// N = etp * R (token, expert) pairs, R = T*K; with capacity factor cf each expert takes at
// most c = ceil(cf * T*K / E) of a rank's tokens, R = min(T*K, E*c), exactly E*c when its
// input is padded to capacity; a run whose busiest rank takes f times the mean
// (moe_imbalance_factor) has R = ceil(f * T*K), at most E*c (not padded).
//
// Kept for backward, per layer (Note: what autograd saves, as Megatron's code does):
//   router: its input [T, H]; top-K indices int64 [T, K] and softmax fp32 [T, K];
//     with an aux loss the full softmax fp32 [T, E]; with a z-loss the logits [T, E] p;
//   allgather dispatcher (gathers over etp*ep, T_g = T*etp*ep): the gathered hidden states
//     in Megatron's persistent global buffer ([T_g, H], shared by every layer); the local
//     probabilities transposed [E_local, T_g] p and their mask [E_local, T_g] bool (masked
//     select); the local routing map [T_g, E_local] bool (kept until the layer's next
//     forward); the permutation index (int64 [N], or TE's int32 map [T_g, 2 E_local + 1]);
//   alltoall dispatcher: probabilities [T, E] p and routing map [T, E] bool (kept until the
//     layer's next forward); the permutation (int64 [D], D = R before the all-to-all, and
//     through the permuted probabilities the whole int64 argsort [E*T], or when padded to
//     capacity their own int64 [D]; or TE's int32 map [T, 2E + 1]);
//   experts: their input [N, H], fc1 output, activation, probability-weighted activation
//     [N, F_e/etp] each, and the probabilities [N] p (TEGroupedMLP and SequentialMLP alike;
//     with Transformer Engine's op fuser no activation: Experts in moe.cc says why).
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>

#include "models/activation_offload.h"
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
  // What the dispatcher keeps as attributes until this layer's next forward (the routing
  // map, and for alltoall the probabilities).
  at::Tensor kept_map;
  at::Tensor kept_probs;
};

// Creates the MoE layer's parameters under the current module ("mlp").
// `gemm_weight`, when set, is called on each GEMM weight of the experts and shared experts
// (not the router) right after it is made, in its module's scope (FP8 modules: Note [FP8
// training] in fp8.h).
MoeParameters CreateMoeParameters(const ModelConfig& model, const MoeParallelism& parallel,
                                  ParameterStore* store,
                                  const std::function<void(Parameter*)>& gemm_weight = {});

// Tokens dispatched and received by one rank, as above; an expert's capacity c.
int64_t ExpertCapacity(const ModelConfig& model, int64_t tokens);
int64_t DispatchedTokens(const ModelConfig& model, int64_t tokens);
int64_t ReceivedTokens(const ModelConfig& model, int64_t tokens);

// hidden [S', B, H] -> [S', B, H]. `global_buffer` is Megatron's persistent "mpu" buffer,
// into which the allgather dispatcher gathers the hidden states. `offloader` (may be null)
// offloads the experts' expert_fc1 and moe_act regions.
at::Tensor MoeForward(const ModelConfig& model, const TrainingConfig& training,
                      const MoeParallelism& parallel, MoeParameters& params,
                      const c10::intrusive_ptr<GlobalMemoryBuffer>& global_buffer,
                      const at::Tensor& hidden, ActivationOffloader* offloader = nullptr);

}  // namespace memsim
