// ModelConfig and TrainingConfig: plain structs with the real defaults, and one function
// that derives dependent fields and checks every rule before anything runs.
//
// Dimension legend used across models/ and parallel/:
//   B  micro-batch size            S  sequence length          H  hidden size
//   A  attention heads             G  query groups (kv heads)  D  head dim (H / A)
//   F  FFN hidden size             L  transformer layers       V  padded vocabulary
//   E  routed experts              K  experts per token (top-k)
//   tp/pp/dp/ep/cp: tensor-, pipeline-, data-, expert-, context-parallel sizes.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "simulator/caching_allocator_model.h"
#include "simulator/enum_names.h"
#include "simulator/status.h"

namespace memsim {

// Note [Limits]
// The largest sizes memsim simulates. Beyond them it says no at once, naming the limit,
// instead of running for hours, exhausting memory or wrapping a 64-bit count. They are far
// above any real run: 10,000 layers (the largest published models have under 200), 2^32
// for any one dimension, 2^32 GPUs (nothing memsim keeps grows with them: Note [Rank
// classes]), 10,000 microbatches per iteration (cost grows with them: GPT-3 1.3B on two
// stages, 10,000 microbatches, 2 iterations, files included, took 14 s, 3.1 GB of memory
// and 2.6 GB of files on 2026-11-28), and 2^50 bytes (1 PiB, far beyond any GPU) for the largest
// tensor a layer makes.
inline constexpr int64_t kMaxLayers = 10000;
inline constexpr int64_t kMaxDimension = int64_t{1} << 32;
inline constexpr int64_t kMaxWorldSize = int64_t{1} << 32;
inline constexpr int64_t kMaxMicrobatches = 10000;
inline constexpr int64_t kMaxTensorBytes = int64_t{1} << 50;

enum class NormKind { kLayerNorm, kRmsNorm };
// The MLP's activation: GeLU, SwiGLU (gated: fc1 is 2F wide), squared ReLU (Megatron's
// --squared-relu: relu(x)^2, Nemotron), quick-GeGLU (--quick-geglu, gated: quick_gelu of
// the first half, x * sigmoid(1.702 x), times the second half plus --glu-linear-offset;
// gpt-oss) or GeGLU (gated like quick-GeGLU, with Megatron-Core's fast_gelu, the tanh
// approximation of GeLU; Gemma-2 as Megatron-Bridge builds it, which no Megatron-LM argument
// selects).
enum class ActivationKind { kGelu, kSwiglu, kSquaredRelu, kQuickGeglu, kGeglu };
inline constexpr EnumName<ActivationKind> kActivationNames[] = {
    {ActivationKind::kGelu, "gelu"},
    {ActivationKind::kSwiglu, "swiglu"},
    {ActivationKind::kSquaredRelu, "squared_relu"},
    {ActivationKind::kQuickGeglu, "quick_geglu"},
    {ActivationKind::kGeglu, "geglu"}};
// Core attention's softmax (Megatron-Core's --softmax-type, TransformerConfig.softmax_type):
// vanilla, or with a sink logit per head added to every row's denominator: zero
// (off-by-one) or a learned parameter (learnable: gpt-oss's attention sinks).
enum class SoftmaxKind { kVanilla, kOffByOne, kLearnable };
inline constexpr EnumName<SoftmaxKind> kSoftmaxNames[] = {{SoftmaxKind::kVanilla, "vanilla"},
                                                          {SoftmaxKind::kOffByOne, "off-by-one"},
                                                          {SoftmaxKind::kLearnable, "learnable"}};
enum class PositionKind { kLearned, kRope };
// The MoE router's score function (--moe-router-score-function): softmax, sigmoid
// (DeepSeek-V3), or sqrt(softplus).
enum class MoeScoreFunction { kSoftmax, kSigmoid, kSqrtSoftplus };
inline constexpr EnumName<MoeScoreFunction> kMoeScoreFunctionNames[] = {
    {MoeScoreFunction::kSoftmax, "softmax"},
    {MoeScoreFunction::kSigmoid, "sigmoid"},
    {MoeScoreFunction::kSqrtSoftplus, "sqrtsoftplus"}};

struct ModelConfig {
  std::string name = "gpt";
  int64_t num_layers = 2;                      // L
  int64_t hidden_size = 1024;                  // H
  int64_t num_attention_heads = 16;            // A
  int64_t num_query_groups = 0;                // G; 0: = A (multi-head attention)
  int64_t kv_channels = 0;                     // D; 0: H / A
  int64_t ffn_hidden_size = 0;                 // F; 0: 4H (GeLU) or Megatron's SwiGLU default
  int64_t vocab_size = 51200;                  // before padding
  int64_t make_vocab_size_divisible_by = 128;  // Megatron pads V to a multiple of this * tp
  int64_t max_position_embeddings = 0;         // learned positions; 0: the sequence length
  NormKind norm = NormKind::kLayerNorm;
  ActivationKind activation = ActivationKind::kGelu;
  PositionKind position = PositionKind::kLearned;
  // --no-rope-freq (Llama 4's NoPE layers; Attention.forward passes no rotary embedding to
  // them): every no_rope_freq-th layer skips RoPE (N, 2N, ... from 1), or per layer 0/1 in
  // no_rope_layers (non-zero: skips). FinalizeModelConfig turns the first into the second.
  // Nothing without RoPE or with multi-latent attention. MTP layer j reads entry j (its
  // attention's layer number is j + 1: TransformerLayer adds no decoder offset to MTP
  // layers, and memsim's MTP layers all sit in the last chunk, after no other MTP layer).
  int64_t no_rope_freq = 0;
  std::vector<int64_t> no_rope_layers;
  // Whether decoder layer `layer` (from 0) runs without RoPE (never with multi-latent
  // attention, whose forward does not read the pattern).
  bool SkipsRope(int64_t layer) const {
    return !no_rope_layers.empty() && !multi_latent_attention() &&
           no_rope_layers[static_cast<size_t>(layer)] != 0;
  }
  // --rotary-percent: the share of each head's width RoPE rotates (RotaryEmbedding's dim,
  // int(kv_channels * rotary_percent)).
  double rotary_percent = 1.0;
  // --activation-func-clamp-value (0: none): a gated activation clamps its gate half from
  // above and its linear half to [-c, c] first (SwiGLU: MoE only, as Megatron-Core asserts).
  double activation_clamp_value = 0.0;
  SoftmaxKind softmax = SoftmaxKind::kVanilla;
  bool tie_embeddings = true;  // output layer reuses the input embedding
  bool add_bias_linear = true;
  bool add_qkv_bias = true;
  // --qk-layernorm: a norm (of the model's kind) over each head's query and key, D wide,
  // before the rotary embedding (SelfAttention.get_query_key_value_tensors).
  bool qk_layernorm = false;
  // --qk-l2-norm: a weightless RMS norm (Megatron-Core's L2Norm, torch_norm.py) over each
  // head's query and key instead, in Transformer Engine layers and in MoE models (Megatron-
  // Core's local dense layer spec leaves it out: QkL2NormApplies).
  bool qk_l2_norm = false;
  // --attention-output-gate (Qwen3-Next's gated attention): linear_qkv also projects a
  // gate per query head, A*D more columns, and core attention's output is scaled by its
  // sigmoid before linear_proj (Attention._apply_output_gate). Not with multi-latent
  // attention (Megatron-Core raises).
  bool attention_output_gate = false;
  // Multi-latent attention (--multi-latent-attention; DeepSeek-V2/V3), on when
  // kv_lora_rank > 0 (Megatron-Core's MLASelfAttention): queries from the hidden state, or
  // through a q_lora_rank-wide projection and norm; keys and values from a kv_lora_rank-wide
  // latent and norm; q and k heads qk_head_dim + qk_pos_emb_head_dim wide (the rotary part
  // of k shared by every head), v heads v_head_dim wide. head_dim is then the q/k width.
  int64_t q_lora_rank = 0;  // 0: linear_q_proj straight from the hidden state
  int64_t kv_lora_rank = 0;
  int64_t qk_head_dim = 0;
  int64_t qk_pos_emb_head_dim = 0;
  int64_t v_head_dim = 0;
  bool multi_latent_attention() const { return kv_lora_rank > 0; }
  // Gemma-2 and Gemma-3 as Megatron-Bridge builds them (Note [Gemma-2] in transformer.h):
  //   megatron_bridge: built and trained by Megatron-Bridge, whose data path puts no
  //     attention mask on the GPU and whose TransformerConfig leaves the bias-activation
  //     fusion off;
  //   post_projection_norms: a norm of the model's kind on linear_proj's and linear_fc2's
  //     outputs (TERowParallelLinearLayerNorm), before the residual add;
  //   flex_attention: core attention is Gemma2FlexDotProductAttention (PyTorch's
  //     FlexAttention; the soft cap on its scores changes no tensor) instead of Transformer
  //     Engine's;
  //   final_logit_softcap > 0: the output layer's logits become c * tanh(logits / c);
  //   scale_embeddings: the embedding is multiplied by sqrt(H) (EmbeddingScalingMixin);
  //   sliding_window: some layers attend within a window (Gemma-3's five of six; Megatron's
  //     --window-size): Transformer Engine's context parallelism then needs a2a or
  //     all-gather.
  bool megatron_bridge = false;
  bool post_projection_norms = false;
  bool flex_attention = false;
  double final_logit_softcap = 0.0;
  bool scale_embeddings = false;
  bool sliding_window = false;
  // MuP (--use-mup; TransformerConfig's MuP fields, Megatron-Core 0.20): the embedding's
  // output times mup_embedding_mult and the logits times mup_output_mult, each a new tensor
  // where the multiplier is not 1 (LanguageModelEmbedding.forward, GPTModel._scale_logits).
  // An output multiplier of 1 becomes 1/width, width = H / mup_base_hidden_size (0: H).
  // MuP's other changes (initialization, learning rates, the attention's softmax scale)
  // change no memory.
  bool use_mup = false;
  int64_t mup_base_hidden_size = 0;
  double mup_embedding_mult = 1.0;
  double mup_output_mult = 1.0;
  double hidden_dropout = 0.1;
  double attention_dropout = 0.1;

  // Mixture of experts (num_experts == 0: dense).
  int64_t num_experts = 0;      // E
  int64_t moe_router_topk = 2;  // K
  // Group-limited routing (--moe-router-num-groups, --moe-router-group-topk; 0: none): the
  // experts form this many equal groups, and a token's K experts come from that many of them.
  int64_t moe_router_num_groups = 0;
  int64_t moe_router_group_topk = 0;
  int64_t moe_ffn_hidden_size = 0;     // per routed expert; 0: F
  int64_t moe_shared_expert_size = 0;  // FFN size of the shared experts; 0: none
  // --moe-shared-expert-gate: the shared experts' output scaled by sigmoid(x g^T), g a
  // (1, H) parameter (SharedExpertMLP); nothing without shared experts.
  bool moe_shared_expert_gate = false;
  int64_t moe_first_k_dense_layers = 0;  // DeepSeek: the first layers are dense
  // Token dropping (--moe-expert-capacity-factor; 0: dropless): each expert takes at most
  // its capacity ceil(cf * T*K / E) of a rank's T tokens, dropping the lowest-probability
  // ones (or, with moe_drop_by_position, the last); with moe_pad_to_capacity
  // (--moe-pad-expert-input-to-capacity) every expert's input is filled up to it.
  double moe_capacity_factor = 0.0;
  bool moe_pad_to_capacity = false;
  bool moe_drop_by_position = false;  // --moe-token-drop-policy position (default probs)
  double moe_imbalance_factor = 1.0;  // busiest expert's load over the mean (not padded)
  bool moe_router_fp32 = false;       // --moe-router-dtype fp32: logits and probs in fp32
  double moe_aux_loss_coeff = 0.0;    // > 0: the load-balancing loss keeps [T, E] fp32 scores
  double moe_z_loss_coeff = 0.0;      // > 0: the z-loss keeps the router logits
  // How the router turns logits into the top-K (Note [MoE routing] in models/moe.h):
  // --moe-router-score-function, --moe-router-pre-softmax (softmax over every expert before
  // the top-K), --moe-router-enable-expert-bias (a float32 [E] bias added to the scores
  // that choose; sigmoid and sqrtsoftplus only), --moe-router-topk-scaling-factor (0: none)
  // and --moe-router-load-balancing-type sinkhorn (Sinkhorn-balanced choice, no aux loss).
  MoeScoreFunction moe_router_score_function = MoeScoreFunction::kSoftmax;
  bool moe_router_pre_softmax = false;
  bool moe_router_expert_bias = false;
  double moe_router_topk_scaling_factor = 0.0;
  bool moe_router_sinkhorn = false;
  // Benchmarking knobs of TopKRouter.forward (moe_utils.py), each cloning the logits
  // (RandomSTE: random ones in a clone, both clones when both are set):
  // --moe-router-force-load-balancing, and --moe-router-force-biased STD, after whose clone
  // RandomSTEShared adds a random bias [E] shared by every rank (logits + bias, a new
  // [T, E]; a negative STD makes each layer's bias once and keeps it). Unset: no bias.
  bool moe_router_force_load_balancing = false;
  std::optional<double> moe_router_force_biased;
  // --moe-input-jitter-eps (TopKRouter.apply_input_jitter, router.py): the router's input
  // times Uniform(1 - eps, 1 + eps) noise in its dtype (rsample: low + rand * (high - low)),
  // so each MoE layer keeps the noise (the product's backward) and the jittered input (the
  // gating GEMM's), [T, H] each, where it kept the router's input. Unset: no jitter (any
  // value, 0 too, jitters).
  std::optional<double> moe_input_jitter_eps;
  // --moe-apply-probs-on-input (Llama 4's top-1 routing): the experts' input rows are
  // scaled by their probabilities before fc1 and the activation is weighted by ones
  // (Experts in models/moe.cc). REQUIRES: top-1.
  bool moe_apply_probs_on_input = false;
  // --mtp-num-layers: multi-token prediction depth, built after the decoder on the last
  // pipeline stage (Note [Multi-token prediction] in transformer.h); 0: none.
  int64_t mtp_num_layers = 0;
  // --mtp-use-repeated-layer: one MTP layer, applied at every depth (its parameters once).
  bool mtp_use_repeated_layer = false;
  // --mtp-detach-heads: no MTP gradient reaches the decoder, the embedding or the output
  // layer's weight (Note [Multi-token prediction] in transformer.h).
  bool mtp_detach_heads = false;
  // --mtp-hsm: hidden-state mixing before every depth but the first (Note [Multi-token
  // prediction] in transformer.h). REQUIRES: mtp_num_layers >= 2.
  bool mtp_hsm = false;
  // Whether the activation is a gated linear unit (fc1 computes gate and linear halves).
  bool gated() const {
    return activation == ActivationKind::kSwiglu || activation == ActivationKind::kQuickGeglu ||
           activation == ActivationKind::kGeglu;
  }
  // fc1's output width for an FFN of `ffn`: twice it for a gated activation.
  int64_t Fc1Width(int64_t ffn) const { return gated() ? 2 * ffn : ffn; }
  // Whether decoder layer `index` (0-based) is a mixture of experts.
  bool moe_layer(int64_t index) const {
    return num_experts > 0 && index >= moe_first_k_dense_layers;
  }

  // Derived by FinalizeModelConfig.
  int64_t padded_vocab_size = 0;  // V
  int64_t head_dim = 0;           // D
  // The width RoPE rotates and its frequencies span: int(D * rotary_percent).
  int64_t RotaryDim() const { return static_cast<int64_t>(head_dim * rotary_percent); }
};

enum class Precision { kFp32, kBf16, kFp16 };
inline constexpr EnumName<Precision> kPrecisionNames[] = {
    {Precision::kFp32, "fp32"}, {Precision::kBf16, "bf16"}, {Precision::kFp16, "fp16"}};
// Megatron-Core's MoE token dispatchers (--moe-token-dispatcher-type; allgather is its
// default); kDeepEp: flex with the DeepEP backend (Note [DeepEP dispatch] in moe.h);
// kHybridEp: flex with DeepEP's HybridEP backend (Note [HybridEP dispatch] in moe.h).
enum class MoeDispatcher { kAllGather, kAllToAll, kDeepEp, kHybridEp };
// Which attention kernel runs (and so what it keeps for backward):
//   kFlash  FlashAttention-2: contiguous [B, S, A, D] copies of q, k, v, out, and the
//           float32 log-sum-exp [B, A, S];
//   kFused  cuDNN fused attention (Transformer Engine's FusedAttention): q, k, v and out
//           in place ([S, B, A, D] views, no copies) and float32 statistics [B, A, S, 1];
//   kEager  unfused: the [B*A, S, S] scores and probabilities are materialised.
enum class AttentionKind { kFlash, kFused, kEager };
inline constexpr EnumName<AttentionKind> kAttentionNames[] = {{AttentionKind::kFlash, "flash"},
                                                              {AttentionKind::kFused, "fused"},
                                                              {AttentionKind::kEager, "eager"}};

// Transformer Engine's choice of attention backend (get_attention_backend in
// transformer_engine/pytorch/attention/dot_product_attention/utils.py, TE 2.18): the
// backends the launch allows (NVTE_FLASH_ATTN, NVTE_FUSED_ATTN, NVTE_UNFUSED_ATTN, or
// Megatron's --attention-backend) and whether non-deterministic kernels are allowed
// (NVTE_ALLOW_NONDETERMINISTIC_ALGO, --deterministic-mode).
struct TeAttentionChoice {
  bool flash = true, fused = true, unfused = true;
  bool deterministic = false;
  // --flash-attention-version: 2, 3 or 4 pins FlashAttention's generation (Megatron-Core
  // sets NVTE_FLASH_ATTN_V* of the others to 0); 0: unpinned. memsim models FlashAttention-2.
  int flash_version = 0;
};
enum class RecomputeKind { kNone, kSelective, kFull };
inline constexpr EnumName<RecomputeKind> kRecomputeNames[] = {
    {RecomputeKind::kNone, "none"},
    {RecomputeKind::kSelective, "selective"},
    {RecomputeKind::kFull, "full"}};
// What selective recomputation recomputes (Megatron-Core's --recompute-modules, read in
// transformer_layer.py, attention.py, multi_latent_attention.py and moe/; Note [Recompute
// modules] in models/transformer.h says what each one keeps). Bits of
// TrainingConfig::recompute_modules; only kSelective reads them.
enum class RecomputeModule : uint32_t {
  kCoreAttn,       // core attention, checkpointed (the default)
  kLayerNorm,      // input_layernorm and pre_mlp_layernorm, output discarded
  kMlp,            // a dense layer's MLP, checkpointed
  kMoe,            // an MoE layer's whole MLP, checkpointed
  kMoeAct,         // the routed experts' weighted activation, output discarded
  kSharedExperts,  // the shared experts, checkpointed
  kMlaUpProj,      // multi-latent attention's up projections and RoPE, outputs discarded
};
inline constexpr EnumName<RecomputeModule> kRecomputeModuleNames[] = {
    {RecomputeModule::kCoreAttn, "core_attn"},
    {RecomputeModule::kLayerNorm, "layernorm"},
    {RecomputeModule::kMlp, "mlp"},
    {RecomputeModule::kMoe, "moe"},
    {RecomputeModule::kMoeAct, "moe_act"},
    {RecomputeModule::kSharedExperts, "shared_experts"},
    {RecomputeModule::kMlaUpProj, "mla_up_proj"}};
constexpr uint32_t RecomputeModuleBit(RecomputeModule module) {
  return 1u << static_cast<uint32_t>(module);
}
// What fine-grained activation offloading copies to the host (Megatron-Core's
// --offload-modules; Note [Fine-grained activation offloading] in
// models/activation_offload.h says what each region saves). Bits of
// TrainingConfig::offload_modules.
enum class OffloadModule : uint32_t {
  kAttnNorm,   // the input norm's input (the layer's input)
  kQkvLinear,  // the query/key/value projections' saved tensors (multi-latent attention)
  kCoreAttn,   // core attention's saved tensors and its query, key and value
  kAttnProj,   // the output projection's input
  kMlpNorm,    // the pre-MLP norm's input (MoE layers)
  kExpertFc1,  // the routed experts' fc1 input
  kMoeAct,     // the routed experts' activation input
};
inline constexpr EnumName<OffloadModule> kOffloadModuleNames[] = {
    {OffloadModule::kAttnNorm, "attn_norm"}, {OffloadModule::kQkvLinear, "qkv_linear"},
    {OffloadModule::kCoreAttn, "core_attn"}, {OffloadModule::kAttnProj, "attn_proj"},
    {OffloadModule::kMlpNorm, "mlp_norm"},   {OffloadModule::kExpertFc1, "expert_fc1"},
    {OffloadModule::kMoeAct, "moe_act"}};
constexpr uint32_t OffloadModuleBit(OffloadModule module) {
  return 1u << static_cast<uint32_t>(module);
}
// What Transformer Engine's CUDA graphs capture of each layer (Megatron-Core's
// --cuda-graph-modules; Note [CUDA graphs] in parallel/cuda_graphs.h). Bits of
// TrainingConfig::cuda_graph_modules.
enum class CudaGraphModule : uint32_t {
  kAttn,           // input norm, self-attention, bias-dropout-add
  kMlp,            // a dense layer's pre-MLP norm, MLP, bias-dropout-add
  kMoeRouter,      // an MoE layer's pre-MLP norm, router and shared experts
  kMoePreprocess,  // the dispatcher's preprocessing too (counted as eager: index work)
};
inline constexpr EnumName<CudaGraphModule> kCudaGraphModuleNames[] = {
    {CudaGraphModule::kAttn, "attn"},
    {CudaGraphModule::kMlp, "mlp"},
    {CudaGraphModule::kMoeRouter, "moe_router"},
    {CudaGraphModule::kMoePreprocess, "moe_preprocess"}};
constexpr uint32_t CudaGraphModuleBit(CudaGraphModule module) {
  return 1u << static_cast<uint32_t>(module);
}
enum class RecomputeMethod { kUniform, kBlock };
inline constexpr EnumName<RecomputeMethod> kRecomputeMethodNames[] = {
    {RecomputeMethod::kUniform, "uniform"}, {RecomputeMethod::kBlock, "block"}};
// Muon: Megatron-Core's emerging optimizer (Note [Muon] in models/optimizer.h).
enum class OptimizerKind { kAdam, kSgd, kMuon };
inline constexpr EnumName<OptimizerKind> kOptimizerNames[] = {
    {OptimizerKind::kAdam, "adam"}, {OptimizerKind::kSgd, "sgd"}, {OptimizerKind::kMuon, "muon"}};
// Transformer Engine's FP8 recipe (--fp8-recipe with --fp8-format; Note [FP8 training] in
// models/fp8.h says what each keeps). kNone: no FP8.
// kMxfp8 (Blackwell's MX format) needs compute capability 10.x.
enum class Fp8Recipe { kNone, kDelayed, kTensorwise, kBlockwise, kMxfp8 };
inline constexpr EnumName<Fp8Recipe> kFp8RecipeNames[] = {{Fp8Recipe::kNone, "none"},
                                                          {Fp8Recipe::kDelayed, "delayed"},
                                                          {Fp8Recipe::kTensorwise, "tensorwise"},
                                                          {Fp8Recipe::kBlockwise, "blockwise"},
                                                          {Fp8Recipe::kMxfp8, "mxfp8"}};
// Which real implementation's kernels the layers mirror (GlobalMemoryBuffer in layers.h
// says where they differ).
enum class ProfileKind { kMegatronLocal, kTransformerEngine };
inline constexpr EnumName<ProfileKind> kProfileNames[] = {
    {ProfileKind::kMegatronLocal, "local"},
    {ProfileKind::kTransformerEngine, "transformer_engine"}};

struct TrainingConfig {
  int64_t seq_length = 2048;     // S
  int64_t micro_batch_size = 1;  // B
  int64_t num_microbatches = 1;  // per iteration, per pipeline
  int32_t iterations = 2;        // the real tracer records two
  Precision precision = Precision::kBf16;
  // --output-logit-dtype (bf16 or fp32; unset: the output layer's input dtype): the output
  // layer's GEMM writes the logits in this dtype, through Transformer Engine's general_gemm
  // when it differs from the input's (LinearParallelism::output_dtype in layers.h).
  std::optional<Precision> output_logit_dtype;
  // --fp32-residual-connection: the hidden state between layers and pipeline stages is
  // float32 (Note [FP32 residual stream] in models/transformer.h). REQUIRES: 16-bit
  // training, Transformer Engine's layers.
  bool fp32_residual_connection = false;
  // Megatron's clone_scatter_output_in_embedding (--no-clone-scatter-output-in-embedding
  // clears it): under sequence parallelism the embedding's output is a copy of this rank's
  // part, not a view keeping the whole sequence (TransformerModel::Embed).
  bool clone_scatter_output_in_embedding = true;
  AttentionKind attention = AttentionKind::kFlash;
  // Set: `attention` is chosen as Transformer Engine chooses it, for the GPU
  // (SelectTeAttention), when the run is finalized.
  std::optional<TeAttentionChoice> te_attention;
  ProfileKind profile = ProfileKind::kMegatronLocal;
  RecomputeKind recompute = RecomputeKind::kNone;
  RecomputeMethod recompute_method = RecomputeMethod::kUniform;
  int64_t recompute_num_layers = 1;
  // --distribute-saved-activations: under full recomputation each checkpoint keeps 1/tp of
  // its input hidden state (Checkpoint's distribute_over in layers.h). Megatron-LM requires
  // TP > 1 and no sequence parallelism.
  bool distribute_saved_activations = false;
  // RecomputeModuleBit()s of what kSelective recomputes; Megatron's default is core_attn.
  uint32_t recompute_modules = RecomputeModuleBit(RecomputeModule::kCoreAttn);
  // Whether selective recomputation covers `module`.
  bool Recomputes(RecomputeModule module) const {
    return recompute == RecomputeKind::kSelective &&
           (recompute_modules & RecomputeModuleBit(module)) != 0;
  }
  // --fine-grained-activation-offloading with --offload-modules: OffloadModuleBit()s of the
  // regions whose saved tensors go to the host between forward and backward (0: none), of
  // at least `min_offloaded_tensor_elements` elements (--min-offloaded-tensor-size).
  uint32_t offload_modules = 0;
  int64_t min_offloaded_tensor_elements = 1024 * 1024;
  // --fine-grained-offloading-max-inflight-offloads: the compute stream waits for a name's
  // older offloads beyond this many (Note [Offload copies on the clock]); -1: no limit.
  int64_t max_inflight_offloads = -1;
  // --cpu-offloading-num-layers: the first this many decoder layers' activations go to the
  // host (Note [Layer CPU offloading] in models/activation_offload.h); 0: none.
  int64_t cpu_offloading_num_layers = 0;
  bool Offloads(OffloadModule module) const {
    return (offload_modules & OffloadModuleBit(module)) != 0;
  }
  // --cuda-graph-impl transformer_engine: Transformer Engine's per-layer CUDA graphs of
  // `cuda_graph_modules` (0: the whole layer), captured after `cuda_graph_warmup_steps`
  // eager iterations (Note [CUDA graphs] in parallel/cuda_graphs.h).
  bool cuda_graphs = false;
  uint32_t cuda_graph_modules = 0;
  int64_t cuda_graph_warmup_steps = 3;
  bool Graphs(CudaGraphModule module) const {
    if (!cuda_graphs) return false;
    if (cuda_graph_modules == 0) {
      return module == CudaGraphModule::kAttn || module == CudaGraphModule::kMlp;
    }
    return (cuda_graph_modules & CudaGraphModuleBit(module)) != 0;
  }
  // The simulated iteration before which the graphs are captured: the eager ones before it
  // stand for the warm-up steps (the first, then the steady state); -1 without graphs.
  int32_t CudaGraphCaptureIteration() const {
    if (!cuda_graphs) return -1;
    return static_cast<int32_t>(std::min<int64_t>(cuda_graph_warmup_steps, 2));
  }
  OptimizerKind optimizer = OptimizerKind::kAdam;
  int64_t muon_ns_steps = 5;   // Newton-Schulz iterations of each Muon update
  bool muon_split_qkv = true;  // Muon orthogonalizes q, k and v apart (Note [Muon])
  // Megatron-Core's layer-wise optimizer (Muon with --use-distributed-optimizer and
  // --no-use-layer-wise-param-layout, over plain DDP): each data-parallel rank owns whole
  // parameters and their optimizer state (Note [Layer-wise optimizer] in models/optimizer.h).
  bool layer_wise_optimizer = false;
  // The global rank whose data-parallel share the simulated stages hold where data-parallel
  // ranks differ: the layer-wise optimizer's owners (unset: the rank holding the most
  // optimizer state, what decides whether a layout fits) and the distributed optimizer's
  // bucket slices (unset: the rank whose slices hold the most, in each of the dense and
  // expert groups). `memsim validate` sets the rank a measurement logged.
  std::optional<int64_t> simulated_rank;
  bool dropout = true;  // false: every dropout probability is treated as 0
  // Megatron-Core's bias_activation_fusion: the activation (with fc1's bias) runs as one
  // fused kernel that saves only its input. Megatron-LM sets it from --bias-swiglu-fusion
  // for SwiGLU, else from --bias-gelu-fusion and the biases. Off: the activation's eager ops
  // save what autograd saves (Activation in layers.h).
  bool bias_activation_fusion = true;
  // --use-te-activation-func: the MLPs', shared experts' and experts' activation is a
  // Transformer Engine op (te.pytorch.ops GELU or SwiGLU; TEActivationOp), run after an
  // out-of-place bias add: like the fused kernels it saves only its input, but the experts'
  // probabilities are applied after it by an eager product (moe.h). With the local spec
  // there is no TE op and GeLU runs as without the switch. REQUIRES: the bias-activation
  // fusion off (Megatron-Core raises otherwise); GeLU, or SwiGLU with Transformer Engine's
  // layers, without a clamp.
  bool te_activation_func = false;
  // --use-fused-weighted-squared-relu: TEGroupedMLP's experts (grouped GEMMs, Transformer
  // Engine's layers) run squared ReLU times the probabilities as Megatron-Core's
  // WeightedSquaredReLUFunction, or TE's ScaledSReLU under the op fuser (WeightedActivation
  // in layers.h): fc1's output and the probabilities are saved, not the unweighted
  // activation, and no product in the probabilities' dtype is made. Other activations,
  // SequentialMLP and the dense MLPs ignore it, as Megatron-Core does (TEGroupedMLP adds
  // fc1's bias in its GEMM, so experts.py's bias_parallel assert never fires).
  bool fused_weighted_squared_relu = false;
  // --log-max-attention-logit (Note [Max attention logit] in models/transformer.h):
  // Transformer Engine's attention returns each head's largest logit
  // (return_max_logit), which drops FlashAttention from its backends; each layer keeps
  // the maximum over the step's microbatches until clip_qk resets it after the optimizer
  // step. REQUIRES: Transformer Engine's layers, no context parallelism, no CUDA graphs.
  bool log_max_attention_logit = false;
  // --qk-clip (MuonClip): the maxima as above, and after the optimizer step clip_qk scales
  // each layer's query and key weights (TransformerModel::ClipQk), as if every layer's
  // maximum passed the threshold. REQUIRES as above, and plain DDP without the layer-wise
  // optimizer (checked with the layout in run_spec.cc).
  bool qk_clip = false;
  // --mlp-chunks-for-training (TransformerLayer._forward_mlp, Megatron-Core 0.20): a dense
  // layer's MLP runs on this many chunks of its input along the sequence (torch.chunk of the
  // local sequence, at most one row a chunk), one MLP call each, and torch.cat joins their
  // outputs; with Transformer Engine's layers each chunk's linear_fc1 normalizes its own rows.
  // Whole-MLP recomputation takes precedence (no chunks); 1 or less: no chunks, as in
  // Megatron-Core. REQUIRES: > 1 only for dense models, without FP8, delayed weight
  // gradients, TP communication overlap, CUDA graphs or activation offloading (not modelled
  // with chunks).
  int64_t mlp_chunks_for_training = 1;
  // Whether Transformer Engine's attention returns the max logit (return_max_logit).
  bool ReturnsMaxAttentionLogit() const { return log_max_attention_logit || qk_clip; }
  // Whether the activation runs as one kernel that saves only its input (Activation's
  // `fused` in layers.h).
  bool OneKernelActivation() const { return bias_activation_fusion || te_activation_func; }
  // Megatron-Core's apply_rope_fusion (Transformer Engine's fused RoPE, the default; off with
  // --no-rope-fusion): the unfused path keeps a cos and a sin per call (Note [RoPE
  // frequencies] in models/transformer.h).
  bool rope_fusion = true;
  // Megatron-LM's get_batch puts a [B, 1, S, S] bool attention mask on the first and last
  // stages for each microbatch unless --no-create-attention-mask-in-dataloader.
  bool create_attention_mask = true;
  // torch.use_deterministic_algorithms(True), which Megatron-LM's --deterministic-mode sets:
  // index_add_ and index_put_ run PyTorch's sort-based kernels, with their temporaries
  // (Note [Deterministic index_add_] in models/moe.cc).
  bool deterministic_algorithms = false;
  // --use-precision-aware-optimizer (Note [Precision-aware optimizer] in models/optimizer.h):
  // Transformer Engine's FusedAdam holds the master weights and Adam's states, in these
  // dtypes (fp32 or bf16), and reads the gradient buffer (main_grads_dtype) as it is.
  bool precision_aware_optimizer = false;
  Precision main_grads_dtype = Precision::kFp32;
  Precision exp_avg_dtype = Precision::kFp32;
  Precision exp_avg_sq_dtype = Precision::kFp32;
  bool store_param_remainders = true;  // bf16 parameters' fp32 masters keep 16 bits
  // --optimizer-cpu-offload with --optimizer-offload-fraction (Note [Optimizer CPU offload]
  // in models/optimizer.h): the share of the optimizer's parameter shards whose masters and
  // states live on the host; 0: none. REQUIRES: the precision-aware optimizer.
  double optimizer_offload_fraction = 0.0;
  // --log-num-zeros-in-grad: each optimizer step counts the zeros of every main gradient
  // (Note [Counting zeros in gradients] in models/optimizer.h), a bool and an int64 copy of
  // each gradient alive one gradient at a time.
  bool log_num_zeros_in_grad = false;
  // --moe-shared-expert-overlap: the shared experts run on a CUDA stream of their own
  // (SharedExpertMLP.stream), whose GEMMs get cuBLAS workspaces of their own (Note [Library
  // workspaces] in ops/library_workspaces.h); nothing without shared experts.
  bool moe_shared_expert_overlap = false;
  // Whether the shared experts run overlapped: the switch, with shared experts.
  bool SharedExpertsOverlap(const ModelConfig& m) const {
    return moe_shared_expert_overlap && m.moe_shared_expert_size > 0;
  }
  // Megatron-FSDP's gradient dtypes (Note [Megatron-FSDP] in parallel/megatron_fsdp.h): the
  // shards' (--megatron-fsdp-main-grads-dtype) and the full buckets' (--megatron-fsdp-grad-
  // comm-dtype). Unset: auto, the parameters' dtype, then the main gradients'.
  std::optional<Precision> fsdp_main_grads_dtype;
  std::optional<Precision> fsdp_grad_comm_dtype;
  // Megatron-FSDP around the step (Note [Megatron-FSDP]): the optimizer's states made before
  // training (--load with --ckpt-format fsdp_dtensor); --log-params-norm, whose norm
  // resets the buckets start_param_sync gathered.
  bool fsdp_states_before_training = false;
  bool log_params_norm = false;
  // Megatron-FSDP before two changes, for validation cases recorded then (Note [Software of a
  // measurement] in tools/lib/validate.h): before 41f3b6f308 (2026-04-02) the final norm's
  // pre-forward hook gathered with prefetch on every forward, not only the first; before
  // 378d81fbd3 (#4717, 2026-05-30) reset() released the non-unit buckets too.
  bool fsdp_final_norm_gathers_every_forward = false;
  bool fsdp_reset_releases_non_unit = false;
  // --fsdp-double-buffer, and --fsdp-db-use-persist-buf-on-alloc-fail (Note [Megatron-FSDP
  // double buffers] in parallel/megatron_fsdp.h).
  bool fsdp_double_buffer = false;
  bool fsdp_double_buffer_persistent_fallback = false;
  // --init-model-with-meta-device under Megatron-FSDP: the model is never whole on the GPU
  // (Note [Megatron-FSDP]); elsewhere Megatron-LM materializes it (to_empty) as usual.
  bool fsdp_meta_init = false;
  // --grad-reduce-in-bf16 (bf16 training): the gradient buffer is bf16, not fp32; the
  // optimizer then takes fp32 copies of its gradients as fp16 training does (Note [Mixed
  // precision state] in models/parameters.h).
  bool grad_reduce_in_bf16 = false;
  // Megatron's gradient accumulation fusion (off: --no-gradient-accumulation-fusion);
  // Note [Weight gradients] in models/parameters.h.
  bool gradient_accumulation_fusion = true;
  // --moe-grouped-gemm: Transformer Engine's GroupedLinear runs the local experts (with its
  // multi-stream GEMM workspaces, Note [Library workspaces]).
  bool moe_grouped_gemm = false;
  // --use-transformer-engine-op-fuser: the grouped experts run as Transformer Engine ops
  // (GroupedLinear, ScaledSwiGLU, GroupedLinear; TEGroupedMLP._fused_forward), whose
  // weighted activation saves only its input and the probabilities (moe.h). Modelled for
  // models whose every layer is an MoE layer with SwiGLU grouped experts.
  bool te_op_fuser = false;
  MoeDispatcher moe_dispatcher = MoeDispatcher::kAllGather;
  bool moe_permute_fusion = false;  // --moe-permute-fusion: TE's permute kernels
  // --moe-router-fusion: TE's fused top-k and aux-loss score kernels (Note [MoE routing]).
  bool moe_router_fusion = false;
  // --moe-router-padding-for-quantization (alias --moe-router-padding-for-fp8): the
  // dispatcher pads each expert's share of the routing map to the FP8 row alignment, and the
  // experts skip their Fp8Padding (Note [Router padding] in models/moe.h). REQUIRES: FP8, the
  // alltoall or flex dispatcher.
  bool moe_router_padding = false;
  // Megatron-LM from 5e4fc931ba (2026-05-21) to bf32f4415e (2026-07-06), which a validation
  // case's values may have been recorded on (Note [Software of a measurement] in
  // tools/lib/validate.h): RerunDataIterator kept each microbatch's batch dict, into which
  // get_batch wrote its GPU copies (and context parallelism its slices), until the next
  // train_step; on tensor-parallel rank 0, which reads the data, every batch of a step stays
  // allocated through the optimizer step. Only validation sets it.
  bool keeps_microbatch_batches = false;
  // --enable-experimental: Megatron-Core's experimental kernels where memsim models them
  // (the router padding's fused kernel); others run as the default path.
  bool experimental = false;
  int64_t deepep_num_sms = 20;  // --moe-flex-dispatcher-num-sms: DeepEP's handle widths
  // The all-to-all level of context parallelism (Note [All-to-all context parallelism] in
  // parallel/regions/context_parallel.h): 1 with --cp-comm-type p2p (a ring over all cp
  // ranks), cp with a2a, the first of --hierarchical-context-parallel-sizes with a2a+p2p
  // (heads exchanged over it, then a ring over the rest).
  int64_t cp_all_to_all = 1;
  // --cp-comm-type allgather: keys and values all-gathered instead of passed around a ring
  // (Note [All-gather context parallelism] in parallel/regions/context_parallel.h).
  bool cp_all_gather = false;
  // --cross-entropy-loss-fusion with the native implementation (VocabCrossEntropy), or
  // with Transformer Engine's kernel (--cross-entropy-fusion-impl te:
  // TeParallelCrossEntropy), both in layers.h.
  bool cross_entropy_fusion = false;
  bool te_cross_entropy = false;
  // --defer-embedding-wgrad-compute / --wgrad-deferral-limit: the output layer's weight
  // gradients of the first `wgrad_deferral_limit` microbatches (0: all) wait for the
  // pipeline flush, their inputs and output gradients kept until then (DeferredWgrad in
  // layers.h). Megatron-LM requires PP > 1 and gradient accumulation fusion.
  bool defer_embedding_wgrad = false;
  int64_t wgrad_deferral_limit = 0;
  // --delay-wgrad-compute: a decoder layer's Transformer Engine linears run their weight-
  // gradient GEMMs in the combined 1F1B schedule's backward_dw, keeping the operands until
  // then (Note [Delayed weight gradients] in delayed_wgrad.h).
  bool delay_wgrad_compute = false;
  // --empty-unused-memory-level: Megatron-LM's train_step empties the CUDA cache after
  // forward-backward (1) and after the optimizer step too (2); reserved memory only.
  int32_t empty_unused_memory_level = 0;
  // FP8 training (Note [FP8 training] in models/fp8.h): Transformer Engine's GEMM layers of
  // the decoder run in FP8 under `fp8`, except the first `fp8_bf16_layers_at_start` and the
  // last `fp8_bf16_layers_at_end` layers (--first-last-layers-bf16).
  Fp8Recipe fp8 = Fp8Recipe::kNone;
  // --fp8-param-gather: those layers' weights are FP8 themselves (no 16-bit copy).
  bool fp8_param_gather = false;
  int64_t fp8_amax_history_len = 1;  // the delayed recipe's history (Megatron's default)
  int64_t fp8_bf16_layers_at_start = 0;
  int64_t fp8_bf16_layers_at_end = 0;
  // Derived by FinalizeRunSpec from the GPU (TE's nvte_is_non_tn_fp8_gemm_supported:
  // compute capability 10.x, 11.x, 13 and later): its FP8 GEMMs read operands in any
  // layout, so the per-tensor recipes keep no transposes (Note [FP8 training]).
  bool fp8_gemm_any_layout = false;
  // Derived by FinalizeRunSpec from the GPU: the ranks one NVLink domain joins (a node; a
  // GB200 NVL72 rack), which HybridEP's handle and buffers are laid out by.
  int64_t gpus_per_nvlink_domain = 8;
  // Whether decoder layer `index` (of `num_layers`) runs its GEMMs in FP8.
  bool Fp8Layer(int64_t index, int64_t num_layers) const {
    return fp8 != Fp8Recipe::kNone && index >= fp8_bf16_layers_at_start &&
           index < num_layers - fp8_bf16_layers_at_end;
  }
  // --tp-comm-overlap: Transformer Engine's userbuffers (Note [Userbuffers] in
  // ops/collectives.h), with the all-gather overlap (off: --no-tp-comm-overlap-ag) and the
  // column-parallel backward's bulk overlaps (off: --no-tp-comm-bulk-dgrad and
  // --no-tp-comm-bulk-wgrad, or --tp-comm-overlap-rs-dgrad for both).
  bool tp_comm_overlap = false;
  bool tp_comm_overlap_ag = true;
  bool tp_comm_bulk_dgrad = true;
  bool tp_comm_bulk_wgrad = true;
  // PyTorch's cuBLAS workspace per (handle, stream), from CUBLAS_WORKSPACE_CONFIG;
  // -1: the GPU's default (Note [Library workspaces] in ops/library_workspaces.h).
  int64_t cublas_workspace_bytes = -1;
  // PYTORCH_CUDA_ALLOC_CONF as the caching allocator's model takes it (its settings only:
  // no capacity, default placement).
  CachingAllocatorConfig allocator_settings;
};

// Fills derived fields (head_dim, num_query_groups, ffn_hidden_size, padded vocabulary
// for `tp`) and checks every shape rule; the error names the rule and the numbers.
Status FinalizeModelConfig(ModelConfig* model, int64_t tp = 1);
Status ValidateTrainingConfig(const TrainingConfig& training, const ModelConfig& model);

// Whether the layernorm recompute module recomputes a layer's pre-MLP norm under CUDA
// graphs (transformer_layer.py's can_recompute_pre_mlp_layernorm_for_cudagraph, Megatron-Core
// 0.20): under a moe_router graph an MoE layer's norm output leaves the graph in a static
// buffer, unless the alltoall dispatcher's preprocessing is captured too; and overlapped
// shared experts read it outside the graph.
bool PreMlpNormRecomputable(const ModelConfig& model, const TrainingConfig& training,
                            bool moe_layer);

// The names of Note [Enum names]; string literals, so data() is null-terminated.
inline const char* PrecisionName(Precision precision) {
  return NameOf(kPrecisionNames, precision).data();
}
inline const char* AttentionName(AttentionKind attention) {
  return NameOf(kAttentionNames, attention).data();
}
inline std::string RecomputeName(RecomputeKind kind) {
  return std::string(NameOf(kRecomputeNames, kind));
}

// Transformer Engine's backend for `training` of `model` on a GPU of `compute_capability`
// (80: A100, 90: H100): unfused for float32; else on 9.x and later cuDNN fused attention
// before FlashAttention (TE drops flash where fused is available), and on 8.x
// FlashAttention-2 before fused (and fused not at all when deterministic). A sink softmax
// (off-by-one, learnable) has no FlashAttention, and no fused attention when deterministic
// (get_attention_backend's softmax filter); neither has the max attention logit. A pinned
// FlashAttention 3 runs on 9.0 only and 4 on 9.0 and later (elsewhere TE has no
// FlashAttention); where a pinned 3 or 4 would run, an error: memsim models FlashAttention-2. An
// error when the allowed backends leave none.
Status SelectTeAttention(const TeAttentionChoice& choice, const TrainingConfig& training,
                         const ModelConfig& model, int compute_capability, AttentionKind* out);
// Parameter dtype in forward/backward.
int64_t ParamBytesPerElement(Precision precision);

}  // namespace memsim
