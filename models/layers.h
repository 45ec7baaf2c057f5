// The layer pieces every architecture is built from. Each mirrors one real kernel or
// Megatron-LM autograd Function and saves for backward exactly what it saves; the
// comment at each names it. Activations are sequence-first, [S, B, H], as in Megatron.
//
// Parameters never receive param.grad: weight gradients go into Parameter::main_grad
// inside backward (Note [Mixed precision state] in parameters.h).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/custom_class_detail.h>

#include <functional>
#include <map>
#include <vector>

#include "models/delayed_wgrad.h"
#include "models/model_config.h"
#include "models/parameters.h"

namespace memsim {

// Where the eager attention's baddbmm input and sequence parallelism's all-gather output
// live. This is where the two profiles differ in memory:
//   Megatron-Core local layers: Megatron's global memory buffer (parallel_state.
//     get_global_memory_buffer(), "mpu"), one workspace per dtype allocated on first use,
//     replaced by a larger one when a larger view is asked, and kept: part of static
//     memory from the second iteration on;
//   Transformer Engine layers: TE's Linear/LayerNormLinear all-gather into a fresh
//     tensor, and its UnfusedDotProductAttention hands baddbmm a fresh torch.empty: each
//     use allocates and frees.
// (TE's LayerNormLinear/LayerNormMLP save the same tensors as LayerNorm followed by
// Megatron's linears at 16 bits: LayerNorm input, its output, mu/rsigma, fc1 and
// activation outputs; they differ with FP8: Note [FP8 training] in fp8.h.)
class GlobalMemoryBuffer : public torch::CustomClassHolder {
 public:
  explicit GlobalMemoryBuffer(bool persistent = true) : persistent_(persistent) {}
  // The buffer named `slot` for `dtype` ("mpu" is 0; the wgrad drain's "mpu_0" and "mpu_1"
  // are 1 and 2), grown to `shape`.
  at::Tensor Get(at::IntArrayRef shape, at::ScalarType dtype, int slot = 0);

 private:
  bool persistent_;
  std::map<std::pair<at::ScalarType, int>, at::Tensor> buffers_;
};

// --defer-embedding-wgrad-compute on the output layer (Megatron-Core's ColumnParallelLinear
// with its embedding_activation_buffer and grad_output_buffer): the inputs of the first
// `limit` microbatches of a step (0: every one) are kept from forward and their output
// gradients from backward, whose weight-gradient GEMMs are skipped; DrainDeferredWgrad
// runs them at the pipeline flush (drain_embedding_wgrad_compute) and lets both go.
struct DeferredWgrad : public torch::CustomClassHolder {
  explicit DeferredWgrad(int64_t limit) : limit(limit) {}
  bool Accepts(const std::vector<at::Tensor>& buffer) const {
    return limit == 0 || static_cast<int64_t>(buffer.size()) < limit;
  }
  int64_t limit;
  std::vector<at::Tensor> inputs, grad_outputs;
};

// How a linear layer talks to its tensor-parallel group.
struct LinearParallelism {
  // Column-parallel with sequence parallelism: all-gather the [S/tp, B, in] input along
  // the sequence into the workspace in forward (and again in backward), save only the
  // shard, and reduce-scatter the input gradient. 1: no gathering.
  int64_t gather_input_group = 1;
  // Column-parallel without sequence parallelism: all-reduce the input gradient in place.
  int64_t all_reduce_input_grad_group = 1;
  c10::intrusive_ptr<GlobalMemoryBuffer> workspace;  // required when gathering
  c10::intrusive_ptr<DeferredWgrad> deferred;        // the output layer, when deferring
  // Transformer Engine's userbuffers (Note [Userbuffers] in ops/collectives.h), with
  // sequence parallelism: all-gathers into them (a column-parallel forward's input, a
  // row-parallel backward's output gradient); a column-parallel backward's input gather
  // (bulk dgrad) and input gradient (bulk wgrad).
  bool userbuffer_gather = false;
  bool userbuffer_bulk_dgrad = false;
  bool userbuffer_bulk_wgrad = false;
  // Megatron's output_dtype (the output layer's, --output-logit-dtype): a GEMM output of
  // another dtype than the input's, through Transformer Engine's general_gemm; backward casts
  // the output gradient to the input's dtype first (a new tensor while backward runs).
  // Undefined, or the input's dtype: torch.matmul.
  at::ScalarType output_dtype = at::ScalarType::Undefined;
};

// How a Transformer Engine linear module running in FP8 is used, beyond its tensor-parallel
// group (Note [FP8 training] in fp8.h); ignored by 16-bit linears.
struct Fp8LinearOptions {
  // LayerNormLinear: the input is the fused norm's output, which lives only until it is
  // quantized. REQUIRES: the input owns its whole storage, which nothing else reads.
  bool input_is_fused_norm_output = false;
  // Megatron's save_original_input (linear_proj, the experts' fc2 under moe_act
  // recomputation, the shared experts' fc1, MLA's down projections under layernorm
  // recomputation): the 16-bit input is kept instead of an FP8 copy; ignored with the
  // delayed recipe. REQUIRES: the linear gathers nothing (gather_input_group == 1).
  bool save_original_input = false;
  // Row-parallel with sequence parallelism: TE reduce-scatters the output over this group
  // (1: the caller reduces it).
  int64_t reduce_scatter_output_group = 1;
  // GroupedLinear: the rows are this many experts' (equal counts), each quantized alone;
  // MXFP8 pads each expert's scales (1: one tensor).
  int64_t row_groups = 1;

  static Fp8LinearOptions LayerNormLinear() {
    Fp8LinearOptions options;
    options.input_is_fused_norm_output = true;
    return options;
  }
};

// `calls` calls of modules that are Transformer Engine's under `t`'s spec (its linears,
// norms, attention, grouped linears): ChargeModuleCalls (simulator/session.h), or nothing
// under the local spec, whose modules are Megatron's own.
void ChargeTeModuleCalls(const TrainingConfig& t, int64_t calls = 1);

// Megatron's LinearWithGradAccumulationAndAsyncCommunication with
// gradient_accumulation_fusion: y = x W^T (+ b). Saves x (and W, a parameter). Backward
// allocates dx, accumulates dW into main_grad in place (wgrad_gemm_accum) and db through
// a [out] temporary. `bias` may be null. A weight of an FP8 module (Parameter::fp8) runs
// Fp8Linear (fp8.h) instead.
at::Tensor Linear(const at::Tensor& input, Parameter& weight, Parameter* bias,
                  const LinearParallelism& parallelism = {}, const Fp8LinearOptions& fp8 = {});

// Megatron's linear_with_frozen_weight, for a weight that does not require a gradient
// (--mtp-detach-heads' output layer): with sequence parallelism the input is all-gathered
// into a new tensor (gather_from_sequence_parallel_region), which nothing saves;
// LinearWithFrozenWeight keeps only the weight. Backward: dx = dy W, reduce-scattered with
// sequence parallelism, all-reduced in place otherwise; no weight gradient.
// REQUIRES: a 16-bit weight, no deferred gradient (Megatron asserts it), no userbuffers.
at::Tensor FrozenLinear(const at::Tensor& input, const Parameter& weight,
                        const LinearParallelism& parallelism);

// Adds a parameter gradient computed in backward to its main_grad, then drops it, as
// Megatron's DDP grad hook does (param.main_grad.add_(param.grad); param.grad = None).
// Either may be undefined (nothing happens).
void AccumulateIntoMainGrad(const at::Tensor& main_grad, const at::Tensor& grad);

// Frees a storage's bytes, keeping the storage and its tensors (FSDP's
// storage.resize_(0)); later reads of them see no bytes.
void FreeStorage(const c10::Storage& storage);
// t.narrow(dim, 0, length), also when t's storage has no bytes now (a Megatron-FSDP
// main_grad, whose gradient bucket is allocated only in backward): the view is made
// without checking it against the storage.
at::Tensor LeadingSlice(const at::Tensor& t, int64_t dim, int64_t length);
// Gives a tensor whose storage FreeStorage emptied the bytes of its elements back
// (storage.resize_(numel)), allocated as a new storage allocation of the same storage.
void AllocateStorage(const at::Tensor& t);
// Gives it the bytes back without allocating them: they belong to memory counted where it
// was allocated (a persistent buffer the storage is laid over); FreeStorage drops them.
void MapStorage(const at::Tensor& t);
// A contiguous tensor of `shape` whose storage has no bytes yet (nothing allocated or
// counted): AllocateStorage or MapStorage gives them.
at::Tensor EmptyWithoutBytes(at::IntArrayRef shape, const at::TensorOptions& options);

// The deferred weight-gradient GEMMs of `weight` (DeferredWgrad), as
// drain_embedding_wgrad_compute runs them: with sequence parallelism each input is
// all-gathered into one of two alternating buffers while the previous GEMM runs.
void DrainDeferredWgrad(DeferredWgrad& deferred, Parameter& weight,
                        const LinearParallelism& parallelism);

// Apex FusedLayerNormAffineFunction (== native_layer_norm on CUDA): saves the input,
// and float32 mean and rstd of shape [S, B, 1].
at::Tensor LayerNorm(const at::Tensor& input, Parameter& weight, Parameter* bias);
// Apex FusedRMSNormAffineFunction: saves the input and float32 invvar [S*B].
at::Tensor RmsNorm(const at::Tensor& input, Parameter& weight);

// F.embedding over a (vocabulary shard of a) table: output [B, S, H] in the weight's
// dtype. Saves the indices; backward runs embedding_dense_backward (a dense gradient of
// the table's shape and two int64 sort buffers) and adds it to main_grad.
at::Tensor Embedding(const at::Tensor& indices, Parameter& weight);

// torch.nn.functional.dropout on CUDA (native_dropout): a 1-byte mask is saved. p == 0
// returns the input itself, allocating nothing, as PyTorch does.
at::Tensor Dropout(const at::Tensor& input, double p);

// x + bias as a new tensor (Megatron's out-of-place bias add inside fused bias-GeLU and
// bias-dropout-add); the bias gradient (a [out] reduction) goes to main_grad.
at::Tensor AddBias(const at::Tensor& x, Parameter& bias);

// Megatron's bias_dropout_add_fused_train: residual + dropout(x + bias). Saves the mask.
at::Tensor BiasDropoutAdd(const at::Tensor& x, Parameter* bias, const at::Tensor& residual,
                          double p);

// The MLP's activation on fc1's output [.., Fc1Width] -> [.., F], as Megatron-Core's
// mlp.py, experts.py and shared_experts.py run it:
//   GeLU: torch's gelu, or Transformer Engine's GELU op (saves its input);
//   squared ReLU: a torch.compile'd function (a new output; saves its input);
//   gated (SwiGLU, quick-GeGLU), fused (`fused`: bias_swiglu_impl, weighted_bias_quick_
//     geglu_impl, or Transformer Engine's SwiGLU op): one kernel that saves its input only;
//   gated, unfused: the eager glu(): chunk into gate and linear halves (views), clamp both
//     when model.activation_clamp_value is set (each clamp saves its input, a view that
//     keeps fc1's output, and makes an [.., F] copy), the gate's activation (SwiGLU: torch's
//     silu, which saves its input; quick-GeGLU and GeGLU: the compiled quick_gelu or
//     fast_gelu, which saves its input), the linear half plus the offset (a new [.., F]),
//     and their product, which saves both factors. GeGLU is never fused (Megatron-Core has
//     no fused fast_gelu): `fused` is ignored for it.
at::Tensor Activation(const ModelConfig& model, bool fused, const at::Tensor& input);
// An activation times per-row `weights` [.., 1] as one kernel that saves its input and the
// weights only and returns a new tensor in the input's dtype; the backward recomputes the
// activation. `gated`: SwiGLU of `input` [.., 2F] -> [.., F] (Megatron-Core's
// WeightedSwiGLUFunction, Transformer Engine's ScaledSwiGLU op in
// transformer_engine/pytorch/ops/basic/swiglu.py, TE 2.18); else squared ReLU of `input`
// [.., F] -> [.., F] (Megatron-Core's WeightedSquaredReLUFunction in
// fusions/fused_weighted_squared_relu.py, TE's ScaledSReLU in ops/basic/activation.py).
at::Tensor WeightedActivation(const at::Tensor& input, const at::Tensor& weights, bool gated);

// Megatron-Core's L2Norm (transformer/torch_norm.py, torch.compile'd): x * rsqrt(mean(x^2) +
// eps) over the last dimension, computed in float32 and cast back: a new contiguous output
// like `input`; saves `input` as it is (a view keeps its whole storage) and the float32
// rsqrt [..., 1].
at::Tensor L2Norm(const at::Tensor& input);

// Megatron-Core's attention output gate (--attention-output-gate; Attention.
// _apply_output_gate, a torch.compile'd x * sigmoid(gate.float()) cast back to x's dtype):
// `x` the core attention's output [S, B, A*D], `gate` [S, B, A, D] as
// get_query_key_value_tensors reshaped it (a view of linear_qkv's output when a rank has one
// query group or one per head, a copy otherwise). One kernel: a new output like `x`; its backward
// recomputes the sigmoid, so it saves its two inputs as they are (a view keeps its whole storage);
// backward: the gradients of both.
at::Tensor AttentionOutputGate(const at::Tensor& x, const at::Tensor& gate);

// Transformer Engine's fused RoPE (FusedRoPEFunc, Megatron's default apply_rope_fusion):
// a new output like the input; saves nothing but the (persistent) frequencies.
at::Tensor RotaryEmbedding(const at::Tensor& input);

// Megatron-Core's unfused RoPE (_apply_rotary_pos_emb_bshd, --no-rope-fusion) of `input`
// [S, B, heads, D] with `freqs` [S, 1, 1, rot] float32: cos_ and sin_ of the frequencies
// (float32 cos, times mscale, cast to the input's dtype), the rotated part
// t * cos_ + rotate_half(t) * sin_, then a new output cat((rotated, rest)). The products
// save cos_ and sin_ (the input's gradient needs them; the frequencies need none).
at::Tensor UnfusedRotaryEmbedding(const at::Tensor& input, const at::Tensor& freqs);

// Core attention over q [S, B, A, D], k and v [S, B, G, D]; returns [S, B, A*D] (the
// tensor the output projection saves). Causal.
//   eager: Megatron's DotProductAttention: baddbmm into a persistent global buffer,
//     FusedScaleMaskSoftmax (scaled_upper_triang_masked_softmax: saves its output,
//     backward in place; torch softmax for fp32 or unsupported shapes), dropout, bmm.
//     Saves q and k (for QK^T), softmax output, dropout mask and output, v.
//   flash: FlashAttention-2 after Megatron's rearrange to [B, S, heads, D]: saves the
//     contiguous q, k, v, the output and a float32 log-sum-exp [B, A, S].
// `cp` > 1: the sequence is split over cp ranks and flash attention runs as ring
// attention (parallel/regions/context_parallel.h); with `cp_all_to_all` > 1 it first
// exchanges heads over that many of them (Note [All-to-all context parallelism]), and the
// ring runs over the rest; with `cp_all_gather` the keys and values are all-gathered
// instead (Note [All-gather context parallelism]). REQUIRES: cp_all_to_all divides cp and
// q's and k's heads; not both cp_all_to_all > 1 and cp_all_gather.
// `max_logit` not null: set to each head's largest logit [A], detached, as Transformer
// Engine returns it (return_max_logit, Note [Max attention logit] in transformer.h): the
// fused backend's cuDNN call also makes a float32 Max [B, A, S, 1] that goes once its
// float32 amax [A] is cast to q's dtype; the eager one takes the amax of its masked scores
// in their dtype. REQUIRES with it: cp == 1, kind != kFlash.
at::Tensor CoreAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         AttentionKind kind, double dropout_p, GlobalMemoryBuffer& workspace,
                         int64_t cp = 1, int64_t cp_all_to_all = 1, bool cp_all_gather = false,
                         at::Tensor* max_logit = nullptr);

// Note [Transformer Engine's unfused mask]
// Transformer Engine's UnfusedDotProductAttention (backends.py, TE 2.20.0.dev0) calls
// dpa_utils.get_full_mask (utils.py) on every forward, before the scores exist: for a causal
// mask over q's S_q and k's S_kv rows it takes two int32 aranges, their difference int32
// [1, 1, S_q, S_kv] and the window's left and right bounds (two more int32 [1, 1, S_q,
// S_kv]), all locals until it returns, and makes the sliding-window mask with bool
// temporaries: (left <= 0), (right < 0) and its negation, their conjunction, then the mask
// (logical_not) [1, 1, S_q, S_kv] bool. With Megatron-LM's batch mask [B, 1, S_q, S_kv] (a
// chunk with the embedding or the loss, when the data loader makes it) the result is their
// logical_or, [B, 1, S_q, S_kv] bool, and the window mask goes. The scaled masked softmax reads
// the result and saves nothing of it; it lives until the attention's forward returns.
// TeUnfusedAttentionMask makes these allocations and returns the mask, [B, 1, S_q, S_kv]
// with a batch mask of B = `batch_mask_rows` rows, [1, 1, S_q, S_kv] without (0).
at::Tensor TeUnfusedAttentionMask(int64_t seq_q, int64_t seq_kv, int64_t batch_mask_rows);

// PyTorch's FlexAttention as Megatron-Bridge's Gemma2FlexDotProductAttention calls it
// (torch.compile'd flex_attention, soft-capped scores, causal or sliding-window block mask;
// Note [Gemma-2] in transformer.h) on q [S, B, A, D], k and v [S, B, G, D] seen as
// [B, heads, S, D]: the output takes the query's memory layout (the compiled kernel matches
// its strides), so the rearrangement back to [S, B, A*D] copies nothing. Saves q, k, v as
// they are, the output and a float32 log-sum-exp [B, A, S]; backward makes a float32
// [B, A, S] delta and dq, dk, dv like q, k, v (the kernel sums GQA's shared heads itself).
at::Tensor FlexAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);

// Transformer Engine's fused attention with a learnable softmax offset (attention sinks):
// `out` (core attention's output) passes through; what the kernel keeps of `offset` for
// backward, and its gradient, are AttentionSinkFunction's in layers.cc.
at::Tensor AttentionSink(const at::Tensor& out, Parameter& offset);

// Megatron's vocab_parallel_cross_entropy on logits [S, B, V/tp] in the training dtype:
// upcasts to a float32 copy, turns it into softmax in place (all-reducing the max, the
// target logits and the sum over the tensor-parallel group) and saves it; backward
// writes the gradient into that buffer in place. Returns the float32 loss [S, B].
// `fused`: Megatron's --cross-entropy-loss-fusion (native), whose compiled steps hold a
// second float32 buffer while they run (layers.cc).
at::Tensor VocabCrossEntropy(const at::Tensor& logits, const at::Tensor& labels,
                             int64_t tp_group = 1, bool fused = false);

// Transformer Engine's parallel_cross_entropy (pytorch/cross_entropy.py and
// triton/cross_entropy.py, TE 2.18; Megatron's --cross-entropy-fusion-impl te): forward
// makes a float32 loss [S*B], statistics [3*S*B] (all-gathered over the tp group into a new
// [3*S*B*tp]), an int64 count (clamped into a new one) and the float32 gradient [S, B, V/tp],
// computed already and saved; the logits themselves are not kept. Backward scales the
// gradient in place and hands it back (autograd casts it to the logits' dtype). Returns the
// float32 loss [S, B].
at::Tensor TeParallelCrossEntropy(const at::Tensor& logits, const at::Tensor& labels,
                                  int64_t tp_group = 1);

// Megatron-Core's MTPLossAutoScaler (multi_token_prediction.py) and MoEAuxLossAutoScaler
// (moe/moe_utils.py), which are the same: returns `output` as it
// is (an alias) and saves `loss`, whose backward, reached through `output`'s, is a new
// gradient of ones like it, multiplied (another new tensor) by the main loss's scale.
at::Tensor AttachLoss(const at::Tensor& output, const at::Tensor& loss);

// Megatron's CheckpointFunction (activation recomputation): runs `fn` saving nothing but
// its inputs, and runs it again in backward, in the module that was current here.
// `distribute_over` > 1 (distribute_saved_activations): after `fn` the first input's data
// becomes a new buffer of its 1/distribute_over share (its full storage goes with its last
// holder), all-gathered into a new full buffer again before the recomputation.
using RecomputeFn = std::function<at::Tensor(const std::vector<at::Tensor>&)>;
at::Tensor Checkpoint(const RecomputeFn& fn, const std::vector<at::Tensor>& inputs,
                      int64_t distribute_over = 1);

// Note [Output-discarding recomputation]
// Megatron-Core's CheckpointWithoutOutput (tensor_parallel/random.py), for recompute modules
// whose outputs the next modules save anyway (a norm's output that linear layers keep, the
// experts' activation that fc2 keeps, MLA's query, key and value that attention keeps).
// Run() runs `fn` without autograd, so nothing inside it is saved for backward; keeps its
// inputs; and returns its outputs as the outputs of one autograd node.
// DiscardOutputAndRegisterRecompute(hook), called once the consumers have run, frees the
// outputs' storages: whoever saved them keeps their shapes over empty storages. When autograd
// computes `hook`'s gradient (before any consumer's backward, if `hook` is the consumers'
// output), `fn` runs again with autograd in the module that was current at Run(), and each
// emptied storage is pointed at the recomputed output's memory, shared and not copied (as
// Megatron's share_storage does). The node's backward goes through the recomputed graph and
// lets it go; the recomputed memory is freed with its last holder (the recomputed graph or
// a consumer's saved tensor). Without autograd (inside a Checkpoint's forward) the outputs
// are still freed, and nothing is registered.
class CheckpointWithoutOutput {
 public:
  using Fn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;
  struct State;

  CheckpointWithoutOutput();
  ~CheckpointWithoutOutput();  // where State is complete
  CheckpointWithoutOutput(const CheckpointWithoutOutput&) = delete;
  CheckpointWithoutOutput& operator=(const CheckpointWithoutOutput&) = delete;

  // REQUIRES: called once; `fn` returns new tensors (not views of its inputs).
  std::vector<at::Tensor> Run(Fn fn, const std::vector<at::Tensor>& inputs);
  // REQUIRES: Run() ran.
  void DiscardOutputAndRegisterRecompute(const at::Tensor& hook);

 private:
  c10::intrusive_ptr<State> state_;
};

}  // namespace memsim
