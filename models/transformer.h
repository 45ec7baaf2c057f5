// The decoder-only transformer that GPT and the Llama family share, as Megatron-Core's
// GPTModel builds it (megatron/core/models/gpt/gpt_model.py), for one model-parallel
// shard: tensor parallelism shards the weights, pipeline parallelism gives each stage a
// range of layers (in virtual chunks), context parallelism splits the sequence.
//
// Parameters of a shard (legend in model_config.h; tp = tensor-parallel size):
//   embedding.word_embeddings.weight        (V/tp, H)            first stage (and the
//                                                                 MTP stage)
//   embedding.position_embeddings.weight    (S_max, H)           first stage, GPT only
//   per layer l held by the stage, prefix decoder.layers.l:
//     input_layernorm.weight                 (H)
//     input_layernorm.bias                   (H)                  LayerNorm only
//     self_attention.linear_qkv.weight       ((A + 2G) * D / tp, H); ((2A + 2G) * D / tp, H)
//                                                                 with attention_output_gate
//     self_attention.linear_qkv.bias         (the weight's rows)  if add_qkv_bias
//     self_attention.q_layernorm.weight/.bias (D)                 if qk_layernorm (bias:
//     self_attention.k_layernorm.weight/.bias (D)                  LayerNorm only), unless
//                                                                  qk_l2_norm applies (no
//                                                                  parameters)
//     multi-latent attention (kv_lora_rank = R > 0, q/k width Dq = qk + rope, v width Dv)
//     instead of linear_qkv, q_layernorm and k_layernorm:
//       self_attention.linear_q_down_proj.weight (Q, H)             if q_lora_rank = Q > 0
//       self_attention.q_layernorm.weight/.bias (Q)                  (not split over tp)
//       self_attention.linear_q_up_proj.weight (A * Dq / tp, Q)
//       self_attention.linear_q_proj.weight    (A * Dq / tp, H)      if q_lora_rank = 0
//       self_attention.linear_kv_down_proj.weight (R + rope, H)      (not split over tp)
//       self_attention.kv_layernorm.weight/.bias (R)
//       self_attention.linear_kv_up_proj.weight (A * (qk + Dv) / tp, R)
//     self_attention.core_attention.softmax_offset (A/tp)        learnable softmax (sinks)
//     self_attention.linear_proj.weight      (H, A * D / tp; A * Dv / tp with MLA)
//     self_attention.linear_proj.bias        (H)                  if add_bias_linear
//     self_attention.linear_proj.post_layernorm.weight/.bias (H)  post_projection_norms
//     pre_mlp_layernorm.weight / .bias       (H)
//     mlp.linear_fc1.weight                  (F/tp, H); (2F/tp, H) gated (SwiGLU, GeGLUs)
//     mlp.linear_fc1.bias                    (F/tp or 2F/tp)      if add_bias_linear
//     mlp.linear_fc2.weight                  (H, F/tp)
//     mlp.linear_fc2.bias                    (H)                  if add_bias_linear
//     mlp.linear_fc2.post_layernorm.weight/.bias (H)              post_projection_norms
//     MoE layers (num_experts > 0, from layer moe_first_k_dense_layers on) replace
//     mlp.linear_fc1/fc2 with a router and experts: see moe.h
//   decoder.final_layernorm.weight / .bias   (H)                  last stage
//   mtp.layers.j.*  (j < mtp_num_layers; j = 0 only with          last stage: Note [Multi-
//                    mtp_use_repeated_layer)                      token prediction]
//   output_layer.weight                      (V/tp, H)            last stage; with tied
//                                                                 embeddings and pp > 1 a
//                                                                 copy of the embedding
//
// Parameter count (GPT, tied, unsharded): V*H + S*H + L*(12*H^2 + 13*H) + 2*H.
//
// Activations a layer saves for backward, 16-bit, eager attention, dropout on, no
// recomputation (Korthikanti et al. 2022, Table 2), in bytes, t = tp:
//   input_layernorm input 2SBH + ln output 2SBH + QKV 6SBH/t + softmax 2AS^2B/t +
//   dropout mask AS^2B/t + dropout output 2AS^2B/t + projection input 2SBH/t + mask SBH +
//   pre_mlp_layernorm input 2SBH + ln output 2SBH + fc1 output 8SBH/t + GeLU output
//   8SBH/t + mask SBH = SBH(10 + 24/t + 5AS/(Ht)); with sequence parallelism the 10SBH
//   of LayerNorms and masks is sharded too: SBH(34/t + 5AS/(Ht)). The real kernels also
//   keep each LayerNorm's float32 mean and rstd (2 * 2 * 4SB, /t with SP). With
//   qk_layernorm the q and k norms keep their contiguous inputs and outputs, 2SB(A+G)D/t
//   each, and float32 statistics per head row (the local spec's RMSNorm keeps the key as
//   the view of linear_qkv's output it is, so that output whole, as qk_l2_norm does).
//   With qk_l2_norm the weightless L2Norm keeps its inputs as they come (the reshaped
//   query, 2SBAD/t when G < A; the key, a view of linear_qkv's output, which it keeps
//   whole) and float32 rsqrt 4SB(A+G)/t.
//
// The same for the Llama family (RMSNorm, SwiGLU, RoPE, no biases), flash attention, no
// dropout, no recomputation, B > 1, in bytes, t = tp, without sequence parallelism:
//   input_layernorm input 2SBH + float32 invvar 4SB      linear_qkv input 2SBH
//   contiguous q, k, v for FlashAttention-2 2SB(A + 2G)D/t (RoPE saves nothing)
//   flash output 2SBAD/t + float32 log-sum-exp 4SBA/t + int64[2] RNG state 16
//   linear_proj input (the output rearranged to [S, B, A*D]) 2SBAD/t
//   pre_mlp_layernorm input 2SBH + invvar 4SB            linear_fc1 input 2SBH
//   SwiGLU input 4SBF/t                                  linear_fc2 input 2SBF/t
//   = SB(8H + 8 + (6H + 4GD + 4A + 6F)/t) + 16, with AD = H (Activations.
//   LlamaFlashAttentionTable measures it). With B = 1 the rearranged output is the
//   kernel's own (2SBAD/t less); with sequence parallelism the 8SBH + 8SB of norms and
//   linear inputs is sharded over t too.
//
// Note [Multi-token prediction]
// Megatron-Core's MultiTokenPredictionBlock (megatron/core/transformer/
// multi_token_prediction.py, 0.20). With --mtp-num-layers k (and a pipeline layout, if
// any, placing them with the loss), the last virtual chunk of the last pipeline stage builds k MTP
// layers after the decoder, and its own word embedding (V/tp, H) (GPTModel's mtp_process; with pp >
// 1 a copy of the first stage's, all-reduced with it; with tied embeddings the output layer then
// reads it, and its own output_layer.weight stays unused but allocated). MTP layer j, prefix
// mtp.layers.j:
//   enorm.weight / .bias          (H)         norm of the embedding of the tokens j+1 ahead
//   hnorm.weight / .bias          (H)         norm of the previous depth's hidden state
//   eh_proj.weight                (H/tp, 2H)  column-parallel, over both concatenated
//   mtp_model_layer.*                         a decoder layer of the last decoder layer's
//                                             kind (dense or MoE)
//   final_layernorm.weight / .bias (H)
// Per microbatch, on top of the decoder: get_batch also puts the tokens and positions on
// the stage; each depth rolls them left (a copy each), embeds them again ([S', B, H]),
// normalizes both inputs, concatenates them ([S', B, 2H]), projects, all-gathers over tp
// along the hidden dim (re-split along the sequence with SP), runs its layer and norm. The
// decoder's output and the k depths' are concatenated ([(1+k)S', B, H], one new tensor);
// each depth's slice gets its own output-layer logits and cross-entropy (as large as the
// main loss's: [S, B, V/tp]), its masked loss attached to the main slice (AttachLoss);
// the main loss reads the first slice, a view that keeps the whole concatenation alive
// until its backward. With uniform full recomputation each depth's norms, concatenation,
// projection, layer and final norm are checkpointed (MultiTokenPredictionLayer.
// _checkpointed_forward).
// With cp > 1 roll_tensor also exchanges each chunk's boundary tokens: those [B, S/cp]
// temporaries are not modelled (the roll is cp = 1's). With --mtp-use-repeated-layer the
// block builds one layer, mtp.layers.0, and runs it at every depth (forward(): layer_idx 0):
// its parameters, gradients, optimizer states and FP8 caches once, its activations per
// depth as before. With --mtp-detach-heads (multi_token_prediction.py) the block's input
// and each depth's embedding are detached (the embedding keeps nothing for backward then),
// the first depth's input is made a leaf that requires grad (its gradient stays in its
// .grad until the microbatch's graph goes), and the depths' output layer reads the weight
// detached: LinearWithFrozenWeight keeps only the weight, not its (with SP gathered) input,
// and computes no weight gradient. With --mtp-hsm each depth but the first takes, for every
// token, one of the earlier depths' states (rolled a token left per depth) or the newest,
// drawn at random (MixHiddenStates in transformer.cc): the rolled states stay for backward
// (gather keeps them), 2nSBH at the nth mixing, with the draw's int64 indices and bool mask
// per token. Refused: MTP layers outside the loss's chunk (Note [Pipeline layout] in
// parallel/layout.h), CUDA graphs of a repeated layer, detached heads with deferred
// embedding gradients (Megatron asserts).
//
// Note [Gemma-2]
// Megatron-Core 0.20 has no Gemma-2; Megatron-Bridge builds it on Megatron-Core's GPTModel
// with a layer spec of its own (NVIDIA-NeMo/Megatron-Bridge 067f987d: models/gemma/
// gemma2_provider.py, gemma2_bridge.py, modules.py, models/common/te_layers.py), and memsim
// models that (ModelConfig's Gemma fields; Hugging Face's gemma2 configs map onto them):
//   * Transformer Engine layers: linear_qkv and linear_fc1 fuse the input and pre-FFN
//     RMSNorms as usual; linear_proj and linear_fc2 are TERowParallelLinearLayerNorm: the
//     row-parallel linear, then TENorm on its reduced (with SP reduce-scattered) output
//     before the residual add. Each post norm keeps the linear's output, which was freed
//     after the add before, and its float32 rsigma: 2 * (2SBH + 4SB) more a layer (/tp with
//     SP), and makes one more [S, B, H] on the way (post_projection_norms).
//   * Core attention is Gemma2FlexDotProductAttention whatever the attention backend and
//     the soft cap (flex_attention): PyTorch's FlexAttention (torch.compile'd; PyTorch 2.5
//     or later), the scores soft-capped inside the kernel and a sliding window on
//     odd-numbered layers. It keeps q, k and v as they come (the value a view that keeps
//     linear_qkv's whole output, where cuDNN's fused attention keeps a copy: Note
//     [Transformer Engine's qkv layout] in layers.cc), the output and the float32
//     log-sum-exp (FlexAttention in layers.h). It takes the unfused path instead when
//     given an attention mask or dropout: Megatron-Bridge's data path passes no mask by
//     default (skip_getting_attention_mask_from_dataset; megatron_bridge: get_batch makes
//     none, Note [The batch on the GPU]), and memsim refuses attention dropout. Context
//     parallelism raises. Selective recomputation of core_attn checkpoints it in Megatron;
//     memsim, as for the other flash-style kernels, leaves it as it is (the float32
//     log-sum-exp's difference).
//   * The MLP is GeGLU with fast_gelu (eager glu(); no fused kernel exists, and Bridge's
//     TransformerConfig leaves the bias-activation fusion off).
//   * The embedding's output is multiplied by sqrt(H) (EmbeddingScalingMixin), after the
//     sequence-parallel scatter and dropout: one more transient [S, B, H].
//   * The output layer soft-caps its logits, c * tanh(logits / c) (Gemma2OutputLayer;
//     final_logit_softcap, none when the config's cap is null): while it runs three
//     [S, B, V/tp] 16-bit tensors live where there was one, and tanh's output stays for
//     backward: 2SBV/tp more until the loss's backward.
// Not modelled: FlexAttention's block masks, which each layer makes at its first forward and
// caches (eight int32 tensors of at most (S/128)^2 elements, about 66 KiB a layer at
// S = 8192); making one evaluates the mask function over the whole [S, S] grid (an int64
// difference and two or three bools: about 10 S^2 bytes, 640 MiB at S = 8192, transient, at
// each layer's first forward of the run); and the compiled kernel's float32 [B, A, S]
// max_scores.
// Gemma-3's text model (gemma3_provider.py, gemma3_bridge.py) is the same layer with q/k
// RMSNorms (TENorm) and Transformer Engine's own attention (its flash backend), sliding on
// five layers of six (sliding_window: context parallelism only over a2a or all-gather), with
// no soft-capping; of its two RoPE tables memsim keeps the global one (Note [RoPE
// frequencies]), not the local one.
//
// Note [The batch on the GPU]
// Megatron-LM 0.20's get_batch (pretrain_gpt.py over megatron/core/utils.py) on a stage
// that holds the embedding or the loss: tokens, labels, position_ids (int64 [B, S]), the
// float32 loss mask and, unless --no-create-attention-mask-in-dataloader, a bool
// [B, 1, S, S] attention mask, for the whole sequence, on the GPU (copied from the data
// loader on tensor-parallel rank 0, received by broadcast on the others, in different
// orders: GetBatch); a first stage lets labels and loss mask go, a last stage (without
// multi-token prediction) tokens and positions. With context parallelism
// get_batch_on_this_cp_rank replaces each by this rank's two of 2cp sequence chunks, a new
// tensor made by index_select ([B, S/cp]; the mask's queries only: [B, 1, S/cp, S]), the
// whole one going as it is replaced. The batch lives until the microbatch's forward ends,
// the mask longer where activation recomputation checkpoints save it with their inputs
// (full recomputation's layer units, selective core attention: WithBatchMask). Megatron-Bridge's
// data path (skip_getting_attention_mask_from_dataset, its default) puts no mask on the GPU; its
// own get_batch (gpt_step.py) also copies only the keys a stage needs, without the broadcast's
// extra [B, S] tensors, which memsim does not distinguish (a few [B, S] tensors).
//
// Note [FP32 residual stream]
// --fp32-residual-connection (Megatron-Core 0.20, Transformer Engine 2.18), in 16-bit training
// with Transformer Engine's layers:
//   * LanguageModelEmbedding makes its output float32 (embeddings.float(), before dropout;
//     under sequence parallelism after the reduce-scatter of a model without a position
//     table, before the scatter of one with): a float32 copy; the 16-bit one goes.
//   * TransformerLayer's residuals are .float()'d (a copy only where the input is 16-bit: a
//     multi-token prediction layer's projected input), and the bias-dropout-add
//     (_bias_dropout_add_func, fused_bias_dropout.py) first upcasts the attention's or the
//     MLP's 16-bit output to float32 (a transient [S, B, H] float32); its float32 output is
//     the next residual and the layer's output.
//   * The norms take the float32 stream as a 16-bit copy: TELayerNormColumnParallelLinear.
//     forward casts before Transformer Engine runs (x.to(layer_norm_weight.dtype)), and TE's
//     own RMSNorm and LayerNorm ops cast to their weight's dtype (maybe_dequantize). The copy
//     is what the norm saves for backward, so no one saves the float32 stream itself: a
//     layer saves what it saves in 16-bit training, while the hidden state in flight between
//     layers is float32 (4SBH, /tp with sequence parallelism).
//   * Full recomputation's checkpoints keep their float32 inputs (4SBH a layer, not 2SBH);
//     pipeline sends and receives are float32 (TransformerConfig.__post_init__ overrides
//     pipeline_dtype), so the schedule keeps each in-flight microbatch's float32 input
//     (hidden_dtype()).
//   * Backward: autograd turns each 16-bit input gradient back into float32 where the
//     forward cast, so the residual stream's gradients are float32 too.
// Not modelled: the bias's float32 copy in the bias-dropout-add ([H]); torch.compile fusing
// its upcast into the kernel (memsim runs its eager ops, as in 16-bit training). Refused:
// Megatron-Core's local layers, whose norms take the float32 input as it is (Apex's
// mixed-dtype kernels or torch's), which memsim has not read.
//
// Note [RoPE frequencies]
// Every model chunk's GPTModel with RoPE owns a RotaryEmbedding whose forward is an
// lru_cache (rotary_pos_embedding.py): the chunk's first forward moves inv_freq [rot/2]
// float32 to the GPU and makes the frequencies arange(S) [S], outer [S, rot/2] and
// cat((freqs, freqs)) [S, 1, 1, rot] float32 (rot = RotaryDim(), S the whole sequence),
// with context parallelism replaced by this rank's two of 2cp chunks (index_select:
// [S/cp, 1, 1, rot]); the cache keeps them for the run. Both RoPE paths read them; the
// unfused one (--no-rope-fusion) also keeps a cos and a sin per call, two calls (q and k)
// per layer (UnfusedRotaryEmbedding in layers.h), which a real run's allocator history
// shows (validation/fake_pg: rope_utils.py's cos_ and sin_ alive at the peak, 4 per layer).
// Multi-latent attention's YaRN embedding keeps its own tables: not modelled.
//
// Note [Max attention logit]
// --log-max-attention-logit (Megatron-Core 0.20's TEDotProductAttention, TE 2.18): TE's
// DotProductAttention runs with return_max_logit, which drops FlashAttention from its
// backends (get_attention_backend); each call returns [A/tp] maxima (CoreAttention's
// `max_logit` in layers.h), which Megatron detaches and folds into the layer's
// current_max_attn_logits with torch.max, a new [A/tp] tensor in the attention's dtype.
// clip_qk (optimizer/qk_clip.py), right after optimizer.step(), all-reduces each decoder
// layer's in place and resets it to None; MTP layers are not in decoder.layers, so theirs
// stays for the run. memsim keeps one [A/tp] per decoder layer from the step's start to the
// reset (Megatron's first is made at the layer's first forward of the step, at most 512
// bytes a layer earlier here), one per MTP layer from the first step on, and per forward
// the call's maxima and torch.max's result as transients (the result takes the place of
// the kept one, which it equals in size; Megatron's first forward of a step keeps the
// call's maxima instead, making no torch.max). Refused: context parallelism (TE folds the
// maxima over the ring's steps), CUDA graphs, the local spec (no maxima; clip_qk fails).
// --qk-clip (MuonClip) makes the maxima too, and clip_qk then clips each decoder layer
// whose maximum passed the threshold, which depends on the data: memsim clips every layer,
// every step (the most memory it can take). Per layer, under no_grad (attention.py,
// multi_latent_attention.py): the per-group maxima and their argmax indices ([G/tp]), the
// threshold's quotient and the clamped eta, kept as qk_clip_balancing_eta [G/tp, 1, 1];
// then for the float32 main parameter (bf16 and fp16 training: the optimizer's copy) and
// the weight itself, each in turn: eta repeated per query row (kept as
// qk_clip_balancing_eta_extended [G/tp, A*D/(G/tp), 1], the next replacing it: clip_qk
// divides the whole model's query rows by this rank's groups, so with tp > 1 its views
// mix rows, a numerical matter that leaves the sizes as modelled), the two powers,
// and torch.cat of the scaled query, key and value rows, a new tensor the size of the
// weight that copy_ writes back and drops. Multi-latent attention clips linear_q_(up_)proj
// and linear_kv_up_proj the same way per head ([A/tp, 1, 1] eta, no extended copy).
// Refused with it: an attention output gate (linear_qkv's gate rows break clip_qk's view),
// FP8 parameters, and any optimizer but plain DDP's (run_spec.cc).
//
// Note [Recompute modules]
// Selective recomputation recomputes the modules of --recompute-modules (Megatron-Core 0.20:
// TransformerLayer, SelfAttention/MLASelfAttention, MoELayer and TEGroupedMLP read
// config.recompute_modules only when recompute_granularity is selective; default core_attn).
// Two mechanisms (tensor_parallel/random.py):
//   checkpointed (Checkpoint in layers.h): runs without saving anything but its inputs,
//     reruns in backward:
//       core_attn       core attention (eager only: FlashAttention and cuDNN keep no S^2
//                       tensor, so memsim leaves them as they are)
//       mlp             a dense layer's MLP from the pre-MLP norm's output; with Transformer
//                       Engine the norm is linear_fc1's (pre_mlp_layernorm is IdentityOp), so
//                       from the residual
//       moe             an MoE layer's routing, dispatch, experts and combine. The recomputed
//                       probabilities the alltoall dispatcher keeps until the layer's next
//                       forward hold the recomputed graph, whose leaf is the checkpoint's
//                       detached input: that input and its gradient stay until then too
//       shared_experts  the shared experts
//   output-discarding (CheckpointWithoutOutput in layers.h, Note [Output-discarding
//   recomputation]): the output goes once its consumers saved it, and is recomputed into
//   the same storage when backward reaches them:
//       layernorm       input_layernorm and pre_mlp_layernorm where they are modules of their
//                       own: always with local layers; with Transformer Engine only where no
//                       linear fuses them (MLA's input norm, an MoE layer's pre-MLP norm)
//       moe_act         the routed experts' probability-weighted activation (grouped GEMM
//                       experts only, as Megatron requires), until fc2 has run
//       mla_up_proj     MLA's up projections and RoPE (query, key, value), until core
//                       attention has run; the inputs kept include the key's positional part,
//                       a view holding the whole down projection output
// MTP depths' decoder layers follow the same rules. Not modelled (refused):
// gdn_norm_out, gdp_in_proj, gdp_qkv, mhc.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "models/activation_offload.h"
#include "models/layers.h"
#include "models/model_config.h"
#include "models/moe.h"
#include "models/parameters.h"

namespace memsim {

// Which part of the model a rank holds, and how it is split.
struct ModelShard {
  int64_t tp = 1;
  bool sequence_parallel = false;
  int64_t cp = 1;
  int64_t ep = 1;   // expert parallel
  int64_t etp = 1;  // expert tensor parallel
  // Per virtual pipeline chunk: [first layer, first layer + count). Chunk 0 of the first
  // stage holds the embedding; the last chunk of the last stage the output layer.
  std::vector<std::pair<int64_t, int64_t>> chunks;
  bool first_stage = true;
  bool last_stage = true;
  // Runs layer `index`'s forward (`run`) on `input`; set by data parallelism that works
  // per layer (FSDP gathers the layer's parameters around it). Empty: run it directly. It
  // also runs the output layer, as index kOutputLayerUnit (whose parameters belong to no
  // layer: Megatron-FSDP allocates their gradient bucket when its backward starts), and
  // each multi-token prediction layer's inner transformer layer as the unit after the
  // decoder's (num_layers + its depth: a TransformerLayer, so an FSDP unit in Megatron-FSDP;
  // its norms and projection belong to no layer).
  using LayerFn = std::function<at::Tensor(const at::Tensor&)>;
  std::function<at::Tensor(int64_t index, const at::Tensor& input, const LayerFn& run)> wrap_layer;
  static constexpr int64_t kOutputLayerUnit = -2;
  // Called before the final norm's forward (Megatron-FSDP's pre-forward hook of a module
  // outside every layer); empty: nothing.
  std::function<void()> before_final_norm;
  // Copy the events of identical layers instead of running them all (Note [Layer
  // replication] in layer_replication.h); ignored with wrap_layer.
  bool replicate_layers = false;

  // The whole model on one rank.
  static ModelShard Whole(const ModelConfig& model) {
    ModelShard shard;
    shard.chunks = {{0, model.num_layers}};
    return shard;
  }
};

// Whether `shard`'s linear_qkv, linear_proj, linear_fc1 and linear_fc2 communicate through
// Transformer Engine's userbuffers (Note [Userbuffers] in ops/collectives.h).
inline bool UsesUserbuffers(const TrainingConfig& training, const ModelShard& shard) {
  return training.tp_comm_overlap && shard.sequence_parallel && shard.tp > 1;
}

class TransformerModel {
 public:
  // Creates every parameter of the shard in `store`, recorded under its module path.
  // REQUIRES: `model` passed FinalizeModelConfig (with shard.tp) and `training`
  // ValidateTrainingConfig; the shard's sizes divide the model's (FinalizeLayout).
  TransformerModel(const ModelConfig& model, const TrainingConfig& training,
                   const ModelShard& shard, ParameterStore* store);

  int64_t num_chunks() const { return static_cast<int64_t>(chunks_.size()); }
  // The transformer layers chunk `chunk` runs: its decoder layers, and on the last stage's
  // last chunk the multi-token prediction depths (a repeated MTP layer counts at each).
  int64_t LayersInChunk(int64_t chunk) const {
    return static_cast<int64_t>(chunks_[static_cast<size_t>(chunk)].size()) +
           (ChunkHasLoss(chunk) && !mtp_layers_.empty() ? model_.mtp_num_layers : 0);
  }
  // Fine-grained activation offloading (null when off), driven by the pipeline schedule.
  ActivationOffloader* offloader() { return offloader_.get(); }
  bool ChunkHasEmbedding(int64_t chunk) const { return shard_.first_stage && chunk == 0; }
  bool ChunkHasLoss(int64_t chunk) const { return shard_.last_stage && chunk == num_chunks() - 1; }
  // Shape of the hidden state between layers and pipeline stages: [S/cp (/tp with SP), B, H].
  std::vector<int64_t> HiddenShape() const;
  // The hidden state's dtype between layers and pipeline stages: the parameters' 16 bits, or
  // float32 with an fp32 residual stream (Note [FP32 residual stream]).
  at::ScalarType hidden_dtype() const { return hidden_dtype_; }

  // One microbatch's forward through chunk `chunk`. `input` is the hidden state received
  // from the previous stage, undefined for the chunk holding the embedding. Allocates
  // the microbatch's data as Megatron's get_batch puts it on the GPU (tokens and
  // positions on the first stage, labels and loss mask on the last, the attention mask
  // on both). Returns the hidden state to send on, or the scalar loss on the last chunk.
  at::Tensor ForwardChunk(int64_t chunk, const at::Tensor& input);

  // The pipeline flush's deferred output-layer weight gradients (DeferredWgrad); nothing
  // unless the shard holds the loss and training defers them.
  void FinishDeferredWgrad();

  // The step's batches kept under TrainingConfig::keeps_microbatch_batches go (the next
  // train_step's RerunStateMachine advance).
  void ReleaseKeptBatches() { kept_batches_.clear(); }

  // The whole model on one rank: ForwardChunk(0, {}).
  at::Tensor Forward() { return ForwardChunk(0, at::Tensor()); }

  // Note [Max attention logit]: the step's kept maxima, one per decoder layer (and, from the
  // first step on, per MTP layer), at the step's start; nothing unless
  // training.ReturnsMaxAttentionLogit().
  void KeepMaxAttentionLogits();
  // clip_qk after the optimizer step (Note [Max attention logit]): with
  // training.qk_clip each decoder layer's query and key weights are clipped, as if every
  // layer's maximum passed the threshold; then the decoder layers' maxima go.
  void ClipQk();

 private:
  struct Layer {
    int64_t index;
    // --no-rope-freq: the attention runs without RoPE (its layer number's pattern entry).
    bool skips_rope;
    Parameter* input_norm_weight;
    Parameter* input_norm_bias;  // null for RMSNorm
    Parameter* qkv_weight;
    Parameter* qkv_bias;
    Parameter* q_norm_weight;  // qk_layernorm, or MLA's q_layernorm
    Parameter* q_norm_bias;
    Parameter* q_down_weight;  // multi-latent attention only
    Parameter* q_up_weight;    // (linear_q_proj when there is no q down projection)
    Parameter* kv_down_weight;
    Parameter* kv_up_weight;
    Parameter* kv_norm_weight;
    Parameter* kv_norm_bias;
    Parameter* k_norm_weight;
    Parameter* k_norm_bias;
    Parameter* softmax_offset;  // the learnable softmax's attention sinks; null otherwise
    Parameter* proj_weight;
    Parameter* proj_bias;
    Parameter* proj_post_norm_weight;  // post_projection_norms only (Note [Gemma-2])
    Parameter* proj_post_norm_bias;
    Parameter* mlp_norm_weight;
    Parameter* mlp_norm_bias;
    Parameter* fc1_weight;
    Parameter* fc1_bias;
    Parameter* fc2_weight;
    Parameter* fc2_bias;
    Parameter* fc2_post_norm_weight;  // post_projection_norms only
    Parameter* fc2_post_norm_bias;
    bool moe;  // the MLP is a mixture of experts (moe.h) instead of fc1/fc2
    MoeParameters experts;
  };

  // A multi-token prediction depth (Note [Multi-token prediction]).
  struct MtpLayer {
    Parameter* enorm_weight;
    Parameter* enorm_bias;  // null for RMSNorm
    Parameter* hnorm_weight;
    Parameter* hnorm_bias;
    Parameter* eh_proj_weight;
    Layer layer;        // mtp_model_layer
    int64_t unit = -1;  // the layer's unit (ModelShard::wrap_layer): num_layers + depth
    Parameter* final_norm_weight;
    Parameter* final_norm_bias;
  };

  // Decoder layer `index`'s parameters (or a layer of its kind), in the current module scope.
  Layer CreateLayer(int64_t index, ParameterStore* store, bool fp8);
  // Makes `weight` an FP8 module's (Note [FP8 training] in fp8.h) when `fp8`.
  void MakeFp8(Parameter* weight, bool fp8) const;
  // MTP layer `depth` (from 0): its attention's layer number is depth + 1 (Megatron numbers
  // MTP layers apart from the decoder's), which picks its --no-rope-freq entry.
  MtpLayer CreateMtpLayer(int64_t depth, ParameterStore* store);
  // A norm of the model's kind, with its parameters, in a module named `name`.
  std::pair<Parameter*, Parameter*> AddNorm(const std::string& name, ParameterStore* store);
  at::Tensor Norm(const at::Tensor& x, Parameter* weight, Parameter* bias);
  // The norm, run in `checkpoint` when it is not null (the layernorm recompute module).
  at::Tensor RecomputableNorm(const at::Tensor& x, Parameter* weight, Parameter* bias,
                              CheckpointWithoutOutput* checkpoint);
  // Whether --qk-l2-norm puts an L2Norm on the query and key: Megatron-Core builds it into
  // Transformer Engine layer specs and MoE models' specs, not into the local dense spec
  // (gpt_builders.py passes qk_l2_norm only there).
  bool QkL2NormApplies() const;
  // The layer's pre_mlp_layernorm (in its module), recomputable.
  at::Tensor PreMlpNorm(Layer& layer, const at::Tensor& x, CheckpointWithoutOutput* checkpoint);
  at::Tensor LayerForward(Layer& layer, const at::Tensor& hidden);
  at::Tensor Attention(Layer& layer, const at::Tensor& ln_out);
  // SelfAttention's projections (with q/k norms and RoPE): query, key, value [S, B, heads, D],
  // and with attention_output_gate the gate [S, B, A, D] into `*gate`.
  std::vector<at::Tensor> QueryKeyValue(Layer& layer, const at::Tensor& ln_out, at::Tensor* gate);
  // A checkpoint's inputs as Megatron passes them: `inputs` and the batch's attention mask,
  // which CheckpointFunction saves with them (recompute.py's chunk_runner and attention.py's
  // _checkpointed_attention_forward pass it), so it lives until the recomputation.
  std::vector<at::Tensor> WithBatchMask(std::vector<at::Tensor> inputs) const;
  // `chunk`'s RoPE frequencies [S/cp, 1, 1, rot] float32, made at its first call and kept
  // (Note [RoPE frequencies]). REQUIRES: RoPE without multi-latent attention.
  const at::Tensor& RotaryFrequencies(int64_t chunk);
  // MLASelfAttention's projections: query, key, value [S, B, A/tp, Dq | Dq | Dv], then the
  // kv down projection's output [S', B, R + rope], which MLASelfAttention.forward keeps
  // until it returns (its kv_compressed local, a view of it under Transformer Engine's spec,
  // whose kv_layernorm is fused into linear_kv_up_proj). With `up_projection_checkpoint`,
  // the up projections and RoPE run in it (mla_up_proj).
  std::vector<at::Tensor> LatentQueryKeyValue(Layer& layer, const at::Tensor& ln_out,
                                              CheckpointWithoutOutput* up_projection_checkpoint);
  // qkv_up_proj_and_rope_apply on the compressed query and key-value and the key's
  // positional part. `norm_outputs_owned`: nothing else holds the compressed tensors (the
  // q and kv norms' outputs), so FP8 up projections may free them once quantized.
  std::vector<at::Tensor> LatentUpProjection(Layer& layer, at::Tensor q_compressed,
                                             at::Tensor kv_compressed, const at::Tensor& k_pos_emb,
                                             bool norm_outputs_owned);
  at::Tensor Mlp(Layer& layer, const at::Tensor& ln_out);
  // A dense layer's pre-MLP norm and MLP on training.mlp_chunks_for_training chunks of the
  // sequence, joined by torch.cat, as TransformerLayer._forward_mlp runs them; `residual` is
  // the layer's residual stream, `norm_checkpoint` the norm's (layernorm recomputation; the
  // local spec's whole-sequence norm only). REQUIRES: a dense layer, more than one chunk.
  at::Tensor ChunkedMlp(Layer& layer, const at::Tensor& residual,
                        CheckpointWithoutOutput* norm_checkpoint);
  // linear_proj or linear_fc2: a row-parallel linear, its output reduced over tp (with
  // sequence parallelism an FP8 linear reduce-scatters it itself), then normalized by
  // `post_norm_weight` when it is not null (Megatron-Bridge's TERowParallelLinearLayerNorm).
  at::Tensor RowParallelLinear(const at::Tensor& input, Parameter& weight, bool save_original_input,
                               Parameter* post_norm_weight = nullptr,
                               Parameter* post_norm_bias = nullptr);
  at::Tensor Layers(int64_t chunk, const at::Tensor& hidden);
  at::Tensor Embed(const at::Tensor& tokens, const at::Tensor& position_ids);
  // The k depths after the decoder's output: [(1+k)S', B, H] (Note [Multi-token prediction]).
  at::Tensor MultiTokenPrediction(const at::Tensor& decoder_output, at::Tensor tokens,
                                  at::Tensor position_ids);
  at::Tensor MtpDepth(MtpLayer& mtp, const at::Tensor& hidden, const at::Tensor& decoder_input);
  // process_mtp_loss: each depth's loss attached to the main slice, which it returns.
  at::Tensor MtpLosses(const at::Tensor& hidden, const at::Tensor& labels,
                       const at::Tensor& loss_mask);
  // [S, B, V/tp]; `frozen_weight`: the weight detached (FrozenLinear), as detached MTP heads'
  // losses read it.
  at::Tensor OutputLogits(const at::Tensor& hidden, bool frozen_weight = false);
  // GPTModel._scale_logits: MuP's output multiplier, a new tensor where it applies (the
  // caller's raw logits go once it has run); `logits` itself otherwise.
  at::Tensor ScaleLogits(at::Tensor logits) const;
  // What get_batch puts on the GPU for one microbatch (Note [The batch on the GPU]): each
  // undefined where this chunk does not need it.
  struct Batch {
    at::Tensor tokens, labels, loss_mask, position_ids, attention_mask;
  };
  // `inputs`: tokens and positions (the embedding, multi-token prediction); `targets`:
  // labels and loss mask (the loss).
  Batch GetBatch(bool inputs, bool targets) const;
  // The loss of logits [S, B, V/tp] against labels [S, B], as training picks it: [S, B].
  at::Tensor CrossEntropy(const at::Tensor& logits, const at::Tensor& labels);
  at::Tensor Loss(const at::Tensor& hidden, const at::Tensor& labels, const at::Tensor& loss_mask);
  LinearParallelism ColumnParallel() const;
  // ColumnParallel() for Megatron's own ColumnParallelLinear (the output layer under any
  // spec; only MXFP8's --fp8-output-proj, which memsim does not accept, makes it TE's): its
  // sequence-parallel gather lands in mpu_buffer_.
  LinearParallelism MegatronColumnParallel() const;
  // ColumnParallel() for linear_qkv and linear_fc1, with their userbuffer overlaps.
  LinearParallelism UserbufferColumnParallel() const;
  double hidden_dropout() const;

  ModelConfig model_;
  TrainingConfig training_;
  ModelShard shard_;
  at::ScalarType hidden_dtype_;
  Parameter* word_embeddings_ = nullptr;
  Parameter* position_embeddings_ = nullptr;
  std::vector<std::vector<Layer>> chunks_;  // this stage's layers, per virtual chunk
  Parameter* final_norm_weight_ = nullptr;
  Parameter* final_norm_bias_ = nullptr;
  Parameter* output_weight_ = nullptr;  // == word_embeddings_ when tied and they share a stage
  std::vector<MtpLayer> mtp_layers_;    // last stage only
  c10::intrusive_ptr<GlobalMemoryBuffer> workspace_;
  std::vector<at::Tensor> kept_batches_;  // TrainingConfig::keeps_microbatch_batches
  // Note [Max attention logit]: the decoder layers' current_max_attn_logits, and the MTP
  // layers', which clip_qk never resets.
  std::vector<at::Tensor> max_attention_logits_;
  std::vector<at::Tensor> mtp_max_attention_logits_;
  // --qk-clip: what each decoder layer's attention keeps from its last clip, by layer index.
  struct QkClipEta {
    at::Tensor eta;       // qk_clip_balancing_eta [G/tp, 1, 1] ([A/tp, 1, 1] with MLA)
    at::Tensor extended;  // qk_clip_balancing_eta_extended [G/tp, A*D/(G/tp), 1]; not MLA
  };
  std::vector<QkClipEta> qk_clip_etas_;
  // The rows of the batch's attention mask the running chunk's layers get (0: none; the
  // chunk has neither the embedding nor the loss, or the data loader makes no mask).
  int64_t batch_mask_rows_ = 0;
  // The running chunk's batch attention mask while its layers run (undefined: none).
  at::Tensor batch_attention_mask_;
  // The running chunk's RoPE frequencies (Note [RoPE frequencies]); undefined without RoPE.
  at::Tensor rotary_freqs_;
  // Per virtual chunk: what RotaryEmbedding's cache keeps (inv_freq and the frequencies),
  // made at the chunk's first forward.
  std::vector<std::pair<at::Tensor, at::Tensor>> rotary_cache_;
  c10::intrusive_ptr<DeferredWgrad> deferred_wgrad_;  // output layer; null unless deferring
  // Megatron's global "mpu" buffer (get_global_memory_buffer), persistent: the sequence-
  // parallel gathers of Megatron's own ColumnParallelLinear (the output layer, whatever the
  // spec; every linear of the local spec, whose workspace_ it is) and the allgather MoE
  // dispatcher's.
  c10::intrusive_ptr<GlobalMemoryBuffer> mpu_buffer_;
  // Fine-grained activation offloading's state; null when nothing is offloaded.
  std::unique_ptr<ActivationOffloader> offloader_;
  // --cpu-offloading-num-layers' state; null when off.
  std::unique_ptr<LayerCpuOffloader> layer_offloader_;
};

// The parameters (elements) of `model` that `shard` holds under `training` (its TP, EP and
// pipeline share; ModelShard::Whole: the whole model, with Megatron's padded vocabulary).
// Builds the shard's parameters on meta in a session of its own.
// REQUIRES: `model` finalized for shard.tp.
int64_t ParameterCount(const ModelConfig& model, const TrainingConfig& training,
                       const ModelShard& shard);

}  // namespace memsim
