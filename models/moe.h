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
//   mlp.shared_experts.gate_weight    (1, H)   with --moe-shared-expert-gate (not sharded)
//   with add_bias_linear, biases: router (E), experts' fc1 (E_local * 2F_e/etp) and fc2
//   (E_local * H), shared experts' fc1 (2F_s/tp) and fc2 (H) (Note [MoE biases])
//
// Note [MoE biases]
// With add_bias_linear Megatron-Core gives the router (router.py), each local expert's
// GroupedLinear fc1 and fc2 (experts.py) and the shared experts their biases, all held as
// parameters (with gradients and optimizer state). fc1's bias is added inside its GEMM.
// fc2's (skip_bias_add) is TEGroupedMLP._apply_bias, which with host token counts (no
// grouped tensors: --moe-single-grouped-bias off, the default) runs per expert t + b * p:
// the bias times the expert's probabilities in their promoted dtype, the sum with fc2's
// output rows promoted again, the pieces concatenated to [N, H] and cast back to the
// output's dtype; it saves the probabilities (a view) and the bias. Backward casts the
// gradient up, makes the rows' gradient in the output dtype and reduces each expert's bias
// gradient ([n_e, H] temporaries) into main_grad (ExpertBiasFunction in moe.cc). Not
// modelled (a few bytes a token): the router's bias gradient, the probabilities' gradient
// temporaries ([n_e, H] each, one at a time), the shared experts' bias additions, and
// SequentialMLP's (--moe-grouped-gemm off) per-expert bias additions, made in place.
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
//   router: its input [T, H] and what Note [MoE routing] lists;
//   allgather dispatcher (gathers over etp*ep, T_g = T*etp*ep): the gathered hidden states
//     in Megatron's persistent global buffer ([T_g, H], shared by every layer); the local
//     probabilities transposed [E_local, T_g] p and their mask [E_local, T_g] bool (masked
//     select); the local routing map [T_g, E_local] bool (kept until the layer's next
//     forward); the permutation index (int64 [N], or TE's int32 map [T_g, 2 E_local + 1]);
//   alltoall dispatcher: probabilities [T, E] p and routing map [T, E] bool (kept until the
//     layer's next forward); the permutation (int64 [D], D = R before the all-to-all, and
//     through the permuted probabilities the whole int64 argsort [E*T], or when padded to
//     capacity their own int64 [D]; or TE's int32 map [T, 2E + 1]);
//   flex dispatcher with DeepEP: Note [DeepEP dispatch];
//   experts: their input [N, H], fc1 output, activation, probability-weighted activation
//     [N, F_e/etp] each, and the probabilities [N] p (TEGroupedMLP and SequentialMLP alike;
//     with Transformer Engine's op fuser no activation: Experts in moe.cc says why);
//   shared experts' gate (--moe-shared-expert-gate; SharedExpertMLP.forward): the sigmoid
//     of its [T, 1] logits and the ungated output [T, H] it multiplies, which would
//     otherwise die at the sum with the routed experts' output.
//
// Note [MoE routing]
// TopKRouter (router.py, moe_utils.py) in training on T tokens, E experts, top-K, logits
// [T, E] p (the gating GEMM keeps its input [T, H]). What autograd keeps per layer:
//   softmax after the top-K (the default): the indices int64 [T, K] (the top-K's and the
//     probabilities' scatter) and the softmax of the K chosen logits, float32 [T, K];
//   softmax before (--moe-router-pre-softmax): the float32 softmax [T, E] and the indices;
//   sigmoid: the sigmoid of the float32 logits [T, E] and the indices (sqrtsoftplus keeps
//     the float32 logits and the square root instead); for K > 1 the renormalisation keeps
//     the chosen scores float32 [T, K] and their sum [T, 1]; with the expert bias (a
//     float32 [E] buffer beside a float32 [E] count) the biased scores only choose;
//   group-limited choice (--moe-router-num-groups, --moe-router-group-topk): also the
//     negated group mask bool [T, E] where the masked scores become the probabilities (no
//     expert bias);
//   Sinkhorn (--moe-router-load-balancing-type sinkhorn): its float32 balancing runs
//     without gradients (its balanced scores [T, E] live until the routing returns); the
//     activation (sigmoid for K = 1, else the float32 softmax, kept by the softmax, and its
//     copy in p) times the map (which the product keeps) is the probabilities;
//   Transformer Engine's fused kernel (--moe-router-fusion): the map and a float32 [T, E].
// The probabilities are scattered into [T, E] p, the map made as zeros [T, E] p, then int32
// twice, then bool (temporaries); --moe-router-topk-scaling-factor adds a [T, K] product.
// The load-balancing loss (an aux-loss kind with --moe-aux-loss-coeff > 0) scores every
// expert again and keeps the float32 softmax, or the float32 sigmoid (sqrtsoftplus: logits
// and root) with its [T, 1] normaliser; its top-K map counts tokens per expert (int64 [E],
// kept); fused, a float32 [T, E] and a float32 [2]. The z-loss keeps the logits and their
// logsumexp [T]. Not modelled: the deterministic routing path's index_put_ (int64 [T, K]
// buffers) and the global aux loss's [E] buffers.
//
// Note [DeepEP dispatch]
// --moe-token-dispatcher-type flex with DeepEP (--moe-flex-dispatcher-backend deepep, the
// default; --moe-enable-deepep): MoEFlexTokenDispatcher and _DeepepManager in
// token_dispatcher.py, fused_a2a.py, DeepEP's Buffer (read from Megatron-Core 0.20 and
// DeepEP's hybrid-ep branch). Over the etp*ep ranks of its group (G = etp*ep), per layer:
//   metadata: topk of the probabilities again, token_probs [T, K] fp32 (a copy when the
//     router's dtype is not fp32) and token_indices int64 [T, K] (TopkBackward keeps them);
//     the dispatcher keeps both, and the received rows' routing map below, until the
//     layer's next forward;
//   dispatch layout: int32 counts per rank [G] and expert [E] (temporary), is_token_in_rank
//     bool [T, G];
//   dispatch: each token goes once to each rank hosting one of its experts, not once per
//     expert: recv_x [N_r, H], recv_topk_weights fp32 [N_r, K], recv_topk_idx int64
//     [N_r, K] (kept until the combine), and the handle, which the dispatch's and the
//     combine's autograd nodes hold (ctx.handle) while autograd keeps them:
//     rank prefix int32 [G, G], two channel prefixes int32 [G, C] (C = SMs / 2, 10 by
//     default), recv_src_idx int32 [N_r], is_token_in_rank, send_head int32 [T, G];
//   multihot: the received indices as a routing map int64 [N_r, E_local] made bool, and
//     probabilities fp32 [N_r, E_local]; the index_put keeps its indices (mask [N_r, K] bool,
//     two int64 [N]);
//   permute: as alltoall's, from N_r rows to N (their expert input), probabilities fp32;
//     recv_x lives on while the experts run (moe_layer.py's dispatched_input);
//   combine: unpermute to [N_r, H], then DeepEP's combine to [T, H]; backward runs the
//     cached dispatch ([N_r, H]) and the combine ([T, H] and fp32 [T, K]).
// N_r: evenly routed, a token picks none of a rank's E/ep experts with probability
// C(E - E/ep, K) / C(E, K), so N_r = G * T * (1 - that), scaled by the imbalance factor and
// at most N; with group-limited routing (--moe-router-num-groups, --moe-router-group-topk)
// the chance counts the token's groups first (RankHitChance in moe.cc). DeepEP's communication
// buffers (NVLink and RDMA, a few hundred MiB, sized by the hidden size and group, not the tokens:
// DeepEpBufferBytes) are allocated outside PyTorch's caching allocator: not in memsim's figures,
// but the fit verdict leaves them room. Not modelled: the fused multihot kernel (experimental),
// capacity factors and NCCL-EP.
//
// Note [HybridEP dispatch]
// --moe-flex-dispatcher-backend hybridep: _HybridEPManager (token_dispatcher.py) and
// HybridEPDispatch/HybridEPCombine (fused_a2a.py) over DeepEP's HybridEPBuffer (its hybrid-ep
// branch, 94a9f8f6: deep_ep/hybrid_ep_buffer.py, csrc/hybrid_ep/). Over the G = etp*ep ranks
// of its group, per layer:
//   metadata: the router's map [T, E] bool and probabilities in float32 [T, E] (a copy unless
//     the router's dtype is fp32), kept until the layer's next forward; no top-K again;
//   dispatch_with_permute: the routing maps all-gathered into [T*G, E] bool (temporary); the
//     handle (kept by the dispatch's and the combine's autograd nodes): sparse_to_dense int32
//     [T*nodes, ranks per NVLink domain], rdma_to_attn bool [roundup(T, 16), nodes],
//     attn_to_rdma bool [T, nodes - 1], the local expert map bool and the dense-to-expert map
//     int32, both [T*G, E_local], the chunk layout int32 [ceil(T/64)*G], counts int32
//     [E_local] and a flag; out come the experts' rows already permuted, [N_p, H], and their
//     probabilities float32 [N_p] (N_p: each local expert's rows rounded up to the
//     quantization alignment: 256 with TE's op fuser, 32 MXFP8, 16 other FP8, else none);
//     nothing else is saved; backward combines into [T, H] and float32 [T, E];
//   combine_with_unpermute: [T, H], nothing saved; backward dispatches [N_p, H] again.
// Its buffers (HybridEpBufferBytes), shared by every layer, are outside PyTorch's allocator.
// memsim takes 8 ranks per NVLink domain for the handle's node-sized maps (a few KiB). Not
// modelled: --moe-hybridep-pad-uneven-dispatch-inputs, the rank capacity factor.
//
// Note [Router padding]
// --moe-router-padding-for-quantization (or its older name --moe-router-padding-for-fp8)
// with FP8 training (token_dispatcher.py, moe_utils.py pad_routing_map, fusions/
// fused_pad_routing_map.py; Megatron-Core d98e8a64): the dispatcher turns 0s of a routing
// map into 1s, the first zeros of each expert's column, until the expert's count is a multiple
// of a = get_align_size_for_quantization (32 MXFP8, 16 other FP8 recipes); the added rows are
// real tokens whose probability is 0. TEGroupedMLP then skips its Fp8Padding
// (skip_routed_expert_padding), so no padded copies of the experts' rows and probabilities.
//   alltoall: the rank's map [T, E] before the permutation, each expert's even share of the
//     D dispatched rows rounded up to a (a column has T tokens at most): D grows by the
//     padding, and a rank receives its R rows plus as much (each of the ep * E_local shares
//     it receives was padded by its sender);
//   flex with DeepEP: the received map [N_r, E_local] after the multihot, each local expert's
//     share of N rounded up to a, unless one would exceed the N_r received rows; then nothing
//     is padded, and the experts skip their padding all the same (_pad_routing_map);
//   flex with HybridEP: no effect, its dispatch pads already (N_p above);
//   allgather: Megatron-Core refuses it.
// pad_routing_map on a map [X, M], temporaries all: the map's counts and pads int64 [M] each,
// is_zero bool [M, X], is_zero.int() int32 [M, X] until its cumsum int64 [M, X] is made, the
// mask bool [M, X], and index_put_'s indices of the mask, int64 [n, 2] for the n added
// entries; the map itself is changed in place. With --enable-experimental and
// --moe-permute-fusion, fused_pad_routing_map: the map transposed into a bool [M, X] copy,
// that as int32 (the copy goes), and the kernel's int32 output [M, X], which replaces the map
// (transposed): the dispatcher then keeps int32 where it kept bool.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
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
  Parameter* experts_fc2_bias = nullptr;  // null without add_bias_linear
  Parameter* shared_fc1 = nullptr;        // null without shared experts
  Parameter* shared_fc2 = nullptr;
  Parameter* shared_gate = nullptr;  // null without --moe-shared-expert-gate
  // The router's buffers with --moe-router-enable-expert-bias (undefined without): the
  // float32 [E] bias added to the scores that choose, and the tokens counted per expert.
  at::Tensor expert_bias;
  at::Tensor local_tokens_per_expert;
  // --moe-router-force-biased with a negative STD: the layer's random bias [E] in the
  // logits' dtype, made at its first forward and kept (RandomSTEShared._cache).
  at::Tensor forced_router_bias;
  // What the dispatcher keeps as attributes until this layer's next forward: allgather,
  // {local map}; alltoall, {routing map, probabilities}; DeepEP, {token indices, token
  // probabilities, received routing map} (Note [DeepEP dispatch]).
  std::array<at::Tensor, 3> kept;
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
// DeepEP's communication buffers on each rank of a group of `group` ranks (Note [DeepEP
// dispatch]), outside PyTorch's caching allocator: fused_a2a.get_buffer sizes the NVLink
// buffer and, over more than 8 ranks, the RDMA buffer as the larger of the dispatch and
// combine configs' hints (DeepEP's Config::get_nvl_buffer_size_hint and
// get_rdma_buffer_size_hint, its recommended configs per group size, hidden bytes
// H * max(element size, 2)), plus the Buffer's 32 MiB workspace. NVSHMEM's own heap
// overhead is not included. REQUIRES: `group` one DeepEP supports (2, 4, 8, 16, 24, 32,
// 64, 128, 144, 160), num_sms even and >= 2.
int64_t DeepEpBufferBytes(int64_t hidden, int64_t element_bytes, int64_t group, int64_t num_sms);

// HybridEPBuffer's buffers on each rank (Note [HybridEP dispatch]), outside PyTorch's
// allocator (cuMem or cudaMalloc with IPC handles), for `tokens` T per rank, `experts` E over
// a group of `group` G ranks, `domain` ranks per NVLink domain: with T_m = roundup(max(T,
// 512), 64) and M = T_m * G rows, the combine tokens M*H 16-bit (shared with the dispatch's),
// its probabilities M * E/G * min(G, domain) float32, the dispatch's scaling factors
// M * H/128 float32 (made in 16-bit runs too), the chunk flags 2 * ceil(T_m/64) * G int32
// and the routing maps' all-gather E * T_m * G bytes. Its preprocessing scratch and, over
// more than one NVLink domain, the RDMA buffers are not included.
int64_t HybridEpBufferBytes(int64_t tokens, int64_t hidden, int64_t experts, int64_t group,
                            int64_t domain);

// N_r of Note [DeepEP dispatch]: rows DeepEP delivers to a rank from the G = etp*ep ranks'
// `tokens` each.
int64_t DeepEpReceivedRows(const ModelConfig& model, const MoeParallelism& parallel,
                           int64_t tokens);

// hidden [S', B, H] -> [S', B, H]. `global_buffer` is Megatron's persistent "mpu" buffer,
// into which the allgather dispatcher gathers the hidden states. `shared_fc1` is how the
// layer's column-parallel linears run over the attention tp group, which the shared experts
// (SharedExpertMLP, an MLP over that group) follow: with sequence parallelism fc1 gathers
// the sequence and fc2's output is reduce-scattered. `offloader` (may be null) offloads the
// experts' expert_fc1 and moe_act regions.
at::Tensor MoeForward(const ModelConfig& model, const TrainingConfig& training,
                      const MoeParallelism& parallel, MoeParameters& params,
                      const c10::intrusive_ptr<GlobalMemoryBuffer>& global_buffer,
                      const at::Tensor& hidden, const LinearParallelism& shared_fc1 = {},
                      ActivationOffloader* offloader = nullptr);

}  // namespace memsim
