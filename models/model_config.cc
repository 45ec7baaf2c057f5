#include "models/model_config.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <string>
#include <utility>

#include "simulator/checked_math.h"
#include "simulator/format.h"

namespace memsim {
namespace {

std::string Str(int64_t v) { return std::to_string(v); }

// The largest MoE capacity or imbalance factor memsim takes: far above any real run, and
// the expert capacities derived from it stay within an int64.
constexpr double kMaxFactor = 1e6;

Status Positive(int64_t value, const char* name) {
  if (value <= 0) return Status::Error(std::string(name) + " must be positive, got " + Str(value));
  return Status::OK();
}

// Note [Limits].
Status AtMost(int64_t value, int64_t limit, const char* name) {
  if (value > limit) {
    return Status::Error(std::string(name) + " " + Str(value) + " is above memsim's limit of " +
                         Str(limit));
  }
  return Status::OK();
}

}  // namespace

Status FinalizeModelConfig(ModelConfig* m, int64_t tp) {
  MEMSIM_RETURN_IF_ERROR(Positive(m->num_layers, "num_layers"));
  MEMSIM_RETURN_IF_ERROR(Positive(m->hidden_size, "hidden_size"));
  MEMSIM_RETURN_IF_ERROR(Positive(m->num_attention_heads, "num_attention_heads"));
  MEMSIM_RETURN_IF_ERROR(Positive(m->vocab_size, "vocab_size"));
  MEMSIM_RETURN_IF_ERROR(Positive(m->make_vocab_size_divisible_by, "make_vocab_size_divisible_by"));
  MEMSIM_RETURN_IF_ERROR(Positive(tp, "tensor parallel size"));
  MEMSIM_RETURN_IF_ERROR(AtMost(m->num_layers, kMaxLayers, "num_layers"));
  MEMSIM_RETURN_IF_ERROR(AtMost(m->mtp_num_layers, kMaxLayers, "mtp_num_layers"));
  for (auto [value, name] : {std::pair{m->hidden_size, "hidden_size"},
                             {m->num_attention_heads, "num_attention_heads"},
                             {m->vocab_size, "vocab_size"},
                             {m->num_query_groups, "num_query_groups"},
                             {m->kv_channels, "kv_channels"},
                             {m->ffn_hidden_size, "ffn_hidden_size"},
                             {m->num_experts, "num_experts"},
                             {m->moe_ffn_hidden_size, "moe_ffn_hidden_size"},
                             {m->moe_shared_expert_size, "moe_shared_expert_size"},
                             {m->max_position_embeddings, "max_position_embeddings"},
                             {m->make_vocab_size_divisible_by, "make_vocab_size_divisible_by"},
                             {tp, "tensor parallel size"}}) {
    MEMSIM_RETURN_IF_ERROR(AtMost(value, kMaxDimension, name));
  }
  if (m->num_query_groups < 0 || m->kv_channels < 0 || m->ffn_hidden_size < 0 ||
      m->num_experts < 0 || m->moe_ffn_hidden_size < 0 || m->moe_shared_expert_size < 0 ||
      m->max_position_embeddings < 0 || m->moe_first_k_dense_layers < 0 || m->mtp_num_layers < 0) {
    return Status::Error(
        "sizes must not be negative (query groups, kv channels, ffn, experts, MTP layers)");
  }
  // TransformerConfig.__post_init__: N becomes [0]*(N-1)+[1] repeated over the layers.
  if (m->no_rope_freq < 0) {
    return Status::Error("no_rope_freq must not be negative, got " + Str(m->no_rope_freq));
  }
  if (m->no_rope_freq > 0) {
    if (!m->no_rope_layers.empty()) {
      return Status::Error("give no_rope_freq or no_rope_layers, not both");
    }
    if (m->num_layers % m->no_rope_freq != 0) {
      return Status::Error("no_rope_freq " + Str(m->no_rope_freq) + " does not divide the " +
                           Str(m->num_layers) + " layers (Megatron-Core asserts it)");
    }
    for (int64_t l = 0; l < m->num_layers; ++l) {
      m->no_rope_layers.push_back((l + 1) % m->no_rope_freq == 0 ? 1 : 0);
    }
    m->no_rope_freq = 0;
  }
  if (!m->no_rope_layers.empty()) {
    const int64_t mtp_built = m->mtp_use_repeated_layer ? 1 : m->mtp_num_layers;
    if (mtp_built > m->num_layers && !m->multi_latent_attention()) {
      return Status::Error("no-RoPE layers with " + Str(mtp_built) + " MTP layers over " +
                           Str(m->num_layers) +
                           " decoder layers: Megatron-Core reads MTP layer j's entry at j, past "
                           "the pattern's end");
    }
    if (static_cast<int64_t>(m->no_rope_layers.size()) != m->num_layers) {
      return Status::Error("the no-RoPE pattern has " +
                           Str(static_cast<int64_t>(m->no_rope_layers.size())) + " entries for " +
                           Str(m->num_layers) + " layers (Megatron-Core asserts one per layer)");
    }
  }
  if (m->mtp_hsm && m->mtp_num_layers < 2) {
    return Status::Error("MTP hidden-state mixing needs mtp_num_layers >= 2, got " +
                         Str(m->mtp_num_layers) + " (Megatron-Core raises ValueError)");
  }
  if (m->mtp_num_layers > 0 && m->position == PositionKind::kLearned) {
    return Status::Error(
        "multi-token prediction needs RoPE position embeddings (Megatron-LM asserts it); use "
        "--position-embedding-type rope or drop --mtp-num-layers");
  }
  if (m->kv_channels == 0) {
    if (m->hidden_size % m->num_attention_heads != 0) {
      return Status::Error(Str(m->num_attention_heads) +
                           " attention heads do not divide hidden size " + Str(m->hidden_size) +
                           "; change one or set kv_channels");
    }
    m->kv_channels = m->hidden_size / m->num_attention_heads;
  }
  m->head_dim = m->kv_channels;
  for (auto [value, name] : {std::pair{m->q_lora_rank, "q_lora_rank"},
                             {m->kv_lora_rank, "kv_lora_rank"},
                             {m->qk_head_dim, "qk_head_dim"},
                             {m->qk_pos_emb_head_dim, "qk_pos_emb_head_dim"},
                             {m->v_head_dim, "v_head_dim"}}) {
    if (value < 0) return Status::Error(std::string(name) + " must not be negative");
    MEMSIM_RETURN_IF_ERROR(AtMost(value, kMaxDimension, name));
  }
  if (m->multi_latent_attention()) {
    if (m->qk_head_dim <= 0 || m->qk_pos_emb_head_dim <= 0 || m->v_head_dim <= 0) {
      return Status::Error(
          "multi-latent attention needs qk_head_dim, qk_pos_emb_head_dim and v_head_dim");
    }
    if (m->num_query_groups != 0 && m->num_query_groups != m->num_attention_heads) {
      return Status::Error("multi-latent attention has no grouped-query attention");
    }
    m->head_dim = m->qk_head_dim + m->qk_pos_emb_head_dim;
  } else if (m->q_lora_rank > 0) {
    return Status::Error("q_lora_rank needs multi-latent attention (kv_lora_rank > 0)");
  }
  if (m->attention_output_gate && m->multi_latent_attention()) {
    return Status::Error(
        "attention_output_gate is not supported with multi-latent attention (Megatron-Core "
        "refuses it)");
  }
  if (m->qk_l2_norm && m->multi_latent_attention()) {
    return Status::Error(
        "qk_l2_norm is not supported with multi-latent attention (Megatron-Core "
        "refuses it)");
  }
  if (m->num_query_groups == 0) m->num_query_groups = m->num_attention_heads;
  if (m->num_attention_heads % m->num_query_groups != 0) {
    return Status::Error(Str(m->num_query_groups) + " query groups (kv heads) do not divide " +
                         Str(m->num_attention_heads) + " attention heads");
  }
  if (m->ffn_hidden_size == 0) {
    // Megatron-LM (arguments.py): 4H; for SwiGLU int((4H * 2/3) / 64) * 64.
    m->ffn_hidden_size = m->activation != ActivationKind::kSwiglu
                             ? CheckedMul(4, m->hidden_size)
                             : CheckedMul(8, m->hidden_size) / 3 / 64 * 64;
  }
  if (!(m->rotary_percent > 0 && m->rotary_percent <= 1)) {
    return Status::Error("rotary percent " + FormatNumber(m->rotary_percent) +
                         " is outside (0, 1]: RoPE rotates that share of each head");
  }
  if (!(m->activation_clamp_value >= 0 && m->activation_clamp_value < kMaxFactor)) {
    return Status::Error("the activation clamp value must be positive and finite (0: none), got " +
                         FormatNumber(m->activation_clamp_value));
  }
  if (m->activation_clamp_value > 0 && m->activation == ActivationKind::kSwiglu &&
      m->num_experts == 0) {
    return Status::Error(
        "a clamped SwiGLU needs MoE layers (Megatron-Core: activation_func_clamp_value for "
        "SwiGLU is only supported with MoE)");
  }
  if (m->use_mup) {
    // TransformerConfig.__post_init__: the base defaults to the model's width.
    if (m->mup_base_hidden_size < 0) {
      return Status::Error("mup_base_hidden_size must be positive (0: the hidden size), got " +
                           Str(m->mup_base_hidden_size));
    }
    MEMSIM_RETURN_IF_ERROR(AtMost(m->mup_base_hidden_size, kMaxDimension, "mup_base_hidden_size"));
    if (m->mup_base_hidden_size == 0) m->mup_base_hidden_size = m->hidden_size;
    const double width = static_cast<double>(m->hidden_size) / m->mup_base_hidden_size;
    if (m->mup_output_mult == 1.0 && width != 1.0) m->mup_output_mult = 1.0 / width;
  } else if (m->mup_base_hidden_size != 0 || m->mup_embedding_mult != 1.0 ||
             m->mup_output_mult != 1.0) {
    return Status::Error("the mup_* settings need use_mup (without it Megatron-Core ignores them)");
  }
  for (const auto& [value, name] : {std::pair{m->mup_embedding_mult, "mup_embedding_mult"},
                                    std::pair{m->mup_output_mult, "mup_output_mult"}}) {
    if (!std::isfinite(value)) {
      return Status::Error(std::string(name) + " must be a finite number, got " +
                           FormatNumber(value));
    }
  }
  if (!(m->final_logit_softcap >= 0 && m->final_logit_softcap < kMaxFactor)) {
    return Status::Error("final_logit_softcap must be positive and finite (0: none), got " +
                         FormatNumber(m->final_logit_softcap));
  }
  if (m->flex_attention && (m->multi_latent_attention() || m->softmax != SoftmaxKind::kVanilla)) {
    return Status::Error(
        "FlexAttention is Megatron-Bridge's Gemma-2 attention, which has no multi-latent "
        "attention and no attention sinks");
  }
  if (m->activation == ActivationKind::kGeglu && m->num_experts > 0) {
    return Status::Error(
        "GeGLU (fast_gelu) is modelled in dense MLPs only (Gemma-2); Megatron-Core's experts "
        "fuse SwiGLU and quick-GeGLU");
  }
  if (m->hidden_dropout < 0 || m->hidden_dropout >= 1 || m->attention_dropout < 0 ||
      m->attention_dropout >= 1) {
    return Status::Error("dropout probabilities must be in [0, 1)");
  }
  if (m->num_experts > 0) {
    MEMSIM_RETURN_IF_ERROR(Positive(m->moe_router_topk, "moe_router_topk"));
    if (m->moe_router_topk > m->num_experts) {
      return Status::Error("top-k " + Str(m->moe_router_topk) + " is larger than the " +
                           Str(m->num_experts) + " experts");
    }
    if (m->moe_apply_probs_on_input && m->moe_router_topk != 1) {
      return Status::Error(
          "applying the router's probabilities to the experts' input works "
          "with top-1 routing only (as Megatron-Core asserts), got top-" +
          Str(m->moe_router_topk));
    }
    if (m->moe_ffn_hidden_size == 0) m->moe_ffn_hidden_size = m->ffn_hidden_size;
    if (!(m->moe_capacity_factor >= 0 && m->moe_capacity_factor <= kMaxFactor)) {
      return Status::Error("moe_capacity_factor must be in [0, 1e6] (0: dropless), got " +
                           FormatNumber(m->moe_capacity_factor));
    }
    if (m->moe_pad_to_capacity && m->moe_capacity_factor == 0) {
      return Status::Error(
          "padding expert inputs to capacity needs a capacity factor (Megatron-LM: "
          "--moe-pad-expert-input-to-capacity requires --moe-expert-capacity-factor)");
    }
    if (!(m->moe_imbalance_factor >= 1 && m->moe_imbalance_factor <= kMaxFactor)) {
      return Status::Error(
          "moe_imbalance_factor is the busiest expert's load over the mean: in [1, 1e6], got " +
          FormatNumber(m->moe_imbalance_factor));
    }
    if (m->moe_first_k_dense_layers > m->num_layers) {
      return Status::Error("moe_first_k_dense_layers exceeds num_layers");
    }
    // Megatron-Core's TransformerConfig and TopKRouter checks.
    if (m->moe_router_expert_bias && m->moe_router_score_function == MoeScoreFunction::kSoftmax) {
      return Status::Error(
          "the router's expert bias (aux-loss-free routing) needs the sigmoid or sqrtsoftplus "
          "score function (Megatron-LM: --moe-router-score-function sigmoid)");
    }
    if (m->moe_router_sinkhorn && m->moe_aux_loss_coeff > 0) {
      return Status::Error(
          "Sinkhorn routing has no auxiliary loss: set the aux loss coefficient to 0 "
          "(Megatron-Core asserts the same)");
    }
    if (m->moe_router_topk == 1 && !m->moe_router_sinkhorn && !m->moe_router_pre_softmax &&
        m->moe_router_score_function == MoeScoreFunction::kSoftmax) {
      return Status::Error(
          "top-1 softmax routing needs the softmax before the top-k (Megatron-LM: "
          "--moe-router-pre-softmax; a softmax over one expert has no gradient)");
    }
    if (m->moe_router_group_topk > 0) {
      if (m->moe_router_num_groups <= 0 || m->num_experts % m->moe_router_num_groups != 0 ||
          m->moe_router_group_topk > m->moe_router_num_groups) {
        return Status::Error(
            "group-limited routing needs a number of groups that divides the " +
            Str(m->num_experts) + " experts and is at least the groups each token picks (" +
            Str(m->moe_router_group_topk) + "), got " + Str(m->moe_router_num_groups) +
            " (Megatron-LM: --moe-router-num-groups with --moe-router-group-topk)");
      }
    }
    if (!(m->moe_router_topk_scaling_factor >= 0 &&
          m->moe_router_topk_scaling_factor <= kMaxFactor)) {
      return Status::Error("the router's top-k scaling factor must be in [0, 1e6] (0: none)");
    }
  }
  // Megatron-LM's _vocab_size_with_padding: a multiple of divisible_by * tp.
  const int64_t multiple = CheckedMul(m->make_vocab_size_divisible_by, tp);
  m->padded_vocab_size = CheckedMul(CheckedAdd(m->vocab_size, multiple - 1) / multiple, multiple);
  return Status::OK();
}

bool PreMlpNormRecomputable(const ModelConfig& m, const TrainingConfig& t, bool moe_layer) {
  if (!moe_layer || !t.Graphs(CudaGraphModule::kMoeRouter)) return true;
  if (t.SharedExpertsOverlap(m)) return false;
  return t.Graphs(CudaGraphModule::kMoePreprocess) && t.moe_dispatcher == MoeDispatcher::kAllToAll;
}

Status ValidateTrainingConfig(const TrainingConfig& t, const ModelConfig& m) {
  MEMSIM_RETURN_IF_ERROR(Positive(t.seq_length, "seq_length"));
  MEMSIM_RETURN_IF_ERROR(Positive(t.micro_batch_size, "micro_batch_size"));
  MEMSIM_RETURN_IF_ERROR(Positive(t.num_microbatches, "num_microbatches"));
  MEMSIM_RETURN_IF_ERROR(Positive(t.iterations, "iterations"));
  MEMSIM_RETURN_IF_ERROR(AtMost(t.seq_length, kMaxDimension, "seq_length"));
  MEMSIM_RETURN_IF_ERROR(AtMost(t.micro_batch_size, kMaxDimension, "micro_batch_size"));
  MEMSIM_RETURN_IF_ERROR(AtMost(t.num_microbatches, kMaxMicrobatches, "num_microbatches"));
  // The largest tensors a layer makes must have a 64-bit byte count (fp32, [S, B, X] for
  // the widest X; the [B*A, S, S] scores of eager attention): overflow_error otherwise,
  // which the callers turn into a one-line error.
  const int64_t widest = std::max({m.hidden_size, m.ffn_hidden_size, m.padded_vocab_size,
                                   CheckedMul(m.num_attention_heads, m.head_dim)});
  int64_t largest = CheckedMul(CheckedMul(CheckedMul(t.seq_length, t.micro_batch_size), widest), 8);
  // Multi-token prediction concatenates the decoder's and every depth's hidden states.
  largest =
      std::max(largest, CheckedMul(CheckedMul(CheckedMul(t.seq_length, t.micro_batch_size),
                                              CheckedMul(m.hidden_size, 1 + m.mtp_num_layers)),
                                   8));
  if (t.attention == AttentionKind::kEager) {
    largest =
        std::max(largest, CheckedMul(CheckedMul(CheckedMul(CheckedMul(t.seq_length, t.seq_length),
                                                           t.micro_batch_size),
                                                m.num_attention_heads),
                                     8));
  }
  if (largest > kMaxTensorBytes) {
    return Status::Error("a layer's largest tensor would take " + Str(largest) +
                         " bytes, above memsim's limit of " + Str(kMaxTensorBytes) +
                         " (1 PiB): reduce the sequence length or the micro-batch size");
  }
  if (m.position == PositionKind::kLearned && m.max_position_embeddings > 0 &&
      t.seq_length > m.max_position_embeddings) {
    return Status::Error("seq_length " + Str(t.seq_length) + " exceeds max_position_embeddings " +
                         Str(m.max_position_embeddings));
  }
  if (t.output_logit_dtype == Precision::kFp16) {
    return Status::Error("output_logit_dtype must be bf16 or fp32 (Megatron-LM's choices)");
  }
  if (t.fp32_residual_connection && t.precision == Precision::kFp32) {
    return Status::Error(
        "an fp32 residual stream needs 16-bit training (Megatron-LM asserts --fp16 or --bf16 "
        "with --fp32-residual-connection)");
  }
  if (t.fp32_residual_connection && t.profile != ProfileKind::kTransformerEngine) {
    // Megatron-Core's local norms (Apex or torch) take the float32 stream as it is, in ways
    // memsim has not read; Transformer Engine's layers cast it (Note [FP32 residual stream]).
    return Status::Error(
        "an fp32 residual stream is modelled with Transformer Engine's layers only; use "
        "profile transformer_engine (Megatron-LM: --transformer-impl transformer_engine)");
  }
  if (t.defer_embedding_wgrad && !t.gradient_accumulation_fusion) {
    return Status::Error(
        "deferring the embedding weight gradients needs gradient accumulation fusion (as "
        "Megatron-LM asserts)");
  }
  if (t.wgrad_deferral_limit < 0) {
    return Status::Error("wgrad_deferral_limit must not be negative, got " +
                         Str(t.wgrad_deferral_limit));
  }
  if (t.recompute == RecomputeKind::kFull &&
      (t.recompute_num_layers <= 0 || t.recompute_num_layers > m.num_layers)) {
    return Status::Error("recompute_num_layers must be in [1, num_layers=" + Str(m.num_layers) +
                         "], got " + Str(t.recompute_num_layers));
  }
  if (m.activation == ActivationKind::kQuickGeglu && t.bias_activation_fusion &&
      (m.num_experts == 0 || m.moe_first_k_dense_layers > 0 || m.moe_shared_expert_size > 0)) {
    // mlp.py fuses only GeLU and SwiGLU without per-token scales; experts.py fuses quick-GeGLU.
    return Status::Error(
        "a fused quick-GeGLU runs in MoE experts only: Megatron-Core's dense MLP raises "
        "ValueError (\"Only support fusion of gelu and swiglu\"); turn the fusion off "
        "(Megatron-LM: --no-bias-gelu-fusion)");
  }
  if (m.activation == ActivationKind::kGeglu && t.bias_activation_fusion && !m.megatron_bridge) {
    // TransformerConfig.__post_init__ raises for fast_gelu with the fusion on (it fuses GeLU,
    // SwiGLU and quick-GeGLU only). Megatron-Bridge's models leave the fusion off (its
    // default), whatever Megatron-LM's setting says.
    return Status::Error(
        "a fused GeGLU (fast_gelu) does not exist: Megatron-Core's TransformerConfig raises "
        "ValueError; turn the bias-activation fusion off");
  }
  if ((m.post_projection_norms || m.flex_attention) &&
      t.profile != ProfileKind::kTransformerEngine) {
    return Status::Error(
        "Gemma's norms after the projections and Gemma-2's FlexAttention are "
        "Megatron-Bridge's Transformer Engine layer specs: use profile transformer_engine "
        "(memsim simulate: --profile transformer_engine)");
  }
  if (m.flex_attention && t.dropout && m.attention_dropout > 0) {
    return Status::Error(
        "attention dropout with FlexAttention is not modelled (Megatron-Bridge's Gemma-2 "
        "attention then leaves FlexAttention for its unfused path); set attention_dropout to 0 "
        "as Gemma-2 does");
  }
  if (m.post_projection_norms && t.offload_modules != 0) {
    return Status::Error(
        "fine-grained activation offloading with norms after the projections (Gemma) is not "
        "modelled");
  }
  if (m.softmax == SoftmaxKind::kOffByOne) {
    return Status::Error(
        "the off-by-one softmax is not modelled (Transformer Engine's zero offsets, a float32 "
        "tensor outside the parameters); the learnable one is");
  }
  if (m.softmax != SoftmaxKind::kVanilla) {
    if (t.profile != ProfileKind::kTransformerEngine || t.attention != AttentionKind::kFused) {
      return Status::Error(
          std::string("the ") + NameOf(kSoftmaxNames, m.softmax).data() +
          " softmax (attention sinks) is modelled with Transformer Engine's cuDNN fused "
          "attention only: FlashAttention has no sinks, and the unfused and local paths' "
          "extra softmax tensors are not modelled");
    }
  }
  if (t.te_activation_func) {
    // TransformerConfig.__post_init__, and TEActivationOp (extensions/transformer_engine.py).
    // The local spec has no TE op: MLP applies config.activation_func itself, which is
    // GeLU as before, but for SwiGLU silu over fc1's whole output, which fc2 cannot take.
    if (t.profile != ProfileKind::kTransformerEngine && m.activation == ActivationKind::kSwiglu) {
      return Status::Error(
          "Transformer Engine's activation ops with the local spec: Megatron-Core applies silu to "
          "fc1's whole [.., 2F] output, which linear_fc2 cannot take; use Transformer Engine's "
          "layers");
    }
    if (t.bias_activation_fusion) {
      return Status::Error(
          "Transformer Engine's activation ops and the bias-activation fusion cannot both be on "
          "(Megatron-Core raises); turn the fusion off (Megatron-LM: --no-bias-swiglu-fusion or "
          "--no-bias-gelu-fusion)");
    }
    if (m.activation != ActivationKind::kGelu && m.activation != ActivationKind::kSwiglu) {
      // geglu is fast_gelu's (Megatron-Bridge's Gemma), not F.gelu's.
      return Status::Error(std::string("Transformer Engine's activation ops cover F.gelu and "
                                       "SwiGLU, not ") +
                           NameOf(kActivationNames, m.activation).data() +
                           " (Megatron-Core raises)");
    }
    if (m.activation_clamp_value > 0) {
      return Status::Error(
          "Transformer Engine's activation ops take no clamp (Megatron-Core raises with "
          "activation_func_clamp_value)");
    }
  }
  if (t.ReturnsMaxAttentionLogit()) {
    if (t.profile != ProfileKind::kTransformerEngine) {
      return Status::Error(
          "the max attention logit comes from Transformer Engine's attention (return_max_logit); "
          "Megatron-Core's local DotProductAttention has none and clip_qk fails on it: use "
          "Transformer Engine's layers");
    }
    if (m.flex_attention) {
      // Megatron-Bridge's Gemma2DotProductAttention returns no maxima; clip_qk fails on it.
      return Status::Error(
          "the max attention logit comes from Transformer Engine's attention, and Gemma-2's "
          "own core attention has none (clip_qk fails on it); drop --log-max-attention-logit "
          "and --qk-clip");
    }
    if (t.attention == AttentionKind::kFlash && !t.te_attention) {
      return Status::Error(
          "Transformer Engine drops FlashAttention when it returns the max attention logit "
          "(get_attention_backend); choose fused or eager attention");
    }
    if (t.cuda_graphs) {
      return Status::Error(
          "the max attention logit under CUDA graphs is not modelled (each layer's kept maximum "
          "would be a graph output); drop one of the two");
    }
  }
  if (t.SharedExpertsOverlap(m)) {
    // TransformerConfig.__post_init__, in its order (without shared experts it checks
    // neither, and the switch does nothing).
    if (t.moe_dispatcher == MoeDispatcher::kAllGather) {
      return Status::Error(
          "moe_shared_expert_overlap (--moe-shared-expert-overlap) only works with the alltoall "
          "or flex token dispatcher, as Megatron-Core asserts");
    }
    if (t.Recomputes(RecomputeModule::kSharedExperts)) {
      return Status::Error(
          "the shared_experts recompute module cannot be used with moe_shared_expert_overlap "
          "(--moe-shared-expert-overlap), as Megatron-Core asserts");
    }
  }
  if (t.mlp_chunks_for_training > 1) {
    const char* with = m.num_experts > 0           ? "MoE layers (per-chunk routing)"
                       : t.fp8 != Fp8Recipe::kNone ? "FP8"
                       : t.delay_wgrad_compute     ? "delayed weight gradients"
                       : t.tp_comm_overlap         ? "TP communication overlap"
                       : t.cuda_graphs             ? "CUDA graphs"
                       : t.offload_modules != 0    ? "activation offloading"
                                                   : nullptr;
    if (with != nullptr) {
      return Status::Error(std::string("the MLP in sequence chunks (mlp_chunks_for_training ") +
                           Str(t.mlp_chunks_for_training) + ") is not modelled with " + with +
                           "; use 1 chunk or drop the other");
    }
  }
  if (t.qk_clip) {
    if (m.attention_output_gate) {
      return Status::Error(
          "QK-clip with an attention output gate: clip_qk views linear_qkv as [groups, query + "
          "2 key-value rows, -1], which the gate's rows break (Megatron-Core 0.20); drop one");
    }
    if (t.fp8_param_gather) {
      return Status::Error(
          "QK-clip on FP8 parameters is not modelled (clip_qk scales weight.data in place); drop "
          "fp8_param_gather or qk_clip");
    }
  }
  if (t.te_op_fuser) {
    // MoEGroupedMLP._is_fused_impl_supported: SwiGLU, or squared ReLU with the weighted
    // kernel (TE's ScaledSReLU).
    const bool fused_activation =
        m.activation == ActivationKind::kSwiglu ||
        (m.activation == ActivationKind::kSquaredRelu && t.fused_weighted_squared_relu);
    if (m.num_experts == 0 || m.moe_first_k_dense_layers > 0 || !t.moe_grouped_gemm ||
        !fused_activation || t.profile != ProfileKind::kTransformerEngine) {
      return Status::Error(
          "Transformer Engine's op fuser is modelled for MoE layers only, every layer, with "
          "grouped SwiGLU experts, or squared ReLU with the fused weighted kernel "
          "(--moe-grouped-gemm --swiglu or --squared-relu --use-fused-weighted-squared-relu, "
          "Transformer Engine layers); its fused dense MLP is not");
    }
    if (t.Recomputes(RecomputeModule::kMoeAct)) {
      // _ScaledGLU and _ScaledUnary raise on activation_recompute_in_mlp (TE 2.18).
      return Status::Error(
          "moe_act recomputation does not work with Transformer Engine's op fuser (its "
          "ScaledSwiGLU and ScaledSReLU refuse activation recomputation)");
    }
  }
  if (t.precision_aware_optimizer) {
    if (t.optimizer != OptimizerKind::kAdam) {
      return Status::Error("the precision-aware optimizer is Adam only (as Megatron-Core asserts)");
    }
    for (Precision p : {t.main_grads_dtype, t.exp_avg_dtype, t.exp_avg_sq_dtype}) {
      if (p == Precision::kFp16) {
        return Status::Error(
            "fp16 gradients or Adam states in the precision-aware optimizer are not modelled "
            "(FusedAdam's scaled fp32 copies in the step); use fp32 or bf16");
      }
    }
    if (t.exp_avg_dtype != t.exp_avg_sq_dtype) {
      // FusedAdam fuses the unscaling only when both are bf16; else each bf16 state gets an
      // fp32 copy for the step.
      return Status::Error(
          "the precision-aware optimizer is modelled with exp_avg and exp_avg_sq of one dtype "
          "(fp32 or bf16 both)");
    }
  } else if (t.main_grads_dtype != Precision::kFp32 || t.exp_avg_dtype != Precision::kFp32 ||
             t.exp_avg_sq_dtype != Precision::kFp32) {
    return Status::Error(
        "main_grads_dtype, exp_avg_dtype and exp_avg_sq_dtype other than fp32 need the "
        "precision-aware optimizer (as Megatron-Core asserts)");
  }
  if (t.fp8 != Fp8Recipe::kNone) {
    if (t.profile != ProfileKind::kTransformerEngine) {
      return Status::Error(
          "FP8 training needs Transformer Engine layers (profile transformer_engine; "
          "Megatron-LM: --transformer-impl transformer_engine)");
    }
    if (t.te_op_fuser) {
      return Status::Error(
          "FP8 with Transformer Engine's op fuser is not modelled (its fused grouped MLP pads "
          "to 256 rows); drop one of the two");
    }
    if (t.fp8 == Fp8Recipe::kDelayed && t.Recomputes(RecomputeModule::kMoeAct)) {
      return Status::Error(
          "moe_act recomputation does not work with the delayed FP8 recipe (as Megatron-Core "
          "asserts)");
    }
    if (t.fp8 == Fp8Recipe::kMxfp8 && t.fp8_param_gather) {
      return Status::Error(
          "MXFP8 parameters (fp8_param_gather with the mxfp8 recipe) are not modelled "
          "(Megatron-Core gathers them in bf16 through the gradient buffer, "
          "--reuse-grad-buf-for-mxfp8-param-ag); drop fp8_param_gather to simulate TE's "
          "cached MXFP8 weights instead");
    }
    if (t.fp8_param_gather && t.precision_aware_optimizer) {
      return Status::Error(
          "FP8 parameters with the precision-aware optimizer are not modelled (Transformer "
          "Engine's FusedAdam casting into them); drop one of the two");
    }
    // Transformer Engine's own default is 1024; a history is [L, slots] fp32 per module.
    constexpr int64_t kMaxAmaxHistory = int64_t{1} << 20;
    if (t.fp8_amax_history_len < 1 || t.fp8_amax_history_len > kMaxAmaxHistory) {
      return Status::Error("fp8_amax_history_len must be between 1 and " + Str(kMaxAmaxHistory) +
                           ", got " + Str(t.fp8_amax_history_len));
    }
    const int64_t start = t.fp8_bf16_layers_at_start, end = t.fp8_bf16_layers_at_end;
    if (start < 0 || end < 0 || start > m.num_layers || end > m.num_layers - start) {
      return Status::Error("the bf16 layers at the start (" + Str(start) + ") and end (" +
                           Str(end) + ") must be >= 0 and together at most the model's " +
                           Str(m.num_layers) + " layers");
    }
    if (t.fp8 == Fp8Recipe::kDelayed && (start != 0 || end != 0)) {
      return Status::Error(
          "first and last layers in bf16 do not work with the delayed FP8 recipe (as "
          "Megatron-Core asserts)");
    }
  } else if (t.fp8_param_gather) {
    return Status::Error("FP8 parameters (fp8_param_gather) need FP8 training (fp8)");
  } else if (t.fp8_bf16_layers_at_start != 0 || t.fp8_bf16_layers_at_end != 0) {
    return Status::Error("bf16 first and last layers need FP8 training (fp8)");
  }
  if (t.tp_comm_overlap) {
    if (t.profile != ProfileKind::kTransformerEngine) {
      return Status::Error(
          "TP communication overlap needs Transformer Engine layers (profile "
          "transformer_engine; Megatron-LM: --transformer-impl transformer_engine)");
    }
    if (t.fp8 == Fp8Recipe::kBlockwise) {
      return Status::Error(
          "TP communication overlap does not work with blockwise FP8 (Transformer Engine's "
          "userbuffers raise on block scaling)");
    }
    if (t.fp8 == Fp8Recipe::kMxfp8) {
      return Status::Error(
          "TP communication overlap with MXFP8 is not modelled (its userbuffer gathers of "
          "scales); drop one of the two");
    }
  }
  if (t.grad_reduce_in_bf16 && t.precision != Precision::kBf16) {
    return Status::Error("bf16 gradient buffers (grad_reduce_in_bf16) need bf16 training");
  }
  if (t.distribute_saved_activations && t.recompute != RecomputeKind::kFull) {
    return Status::Error(
        "distributing saved activations needs full recomputation (as Megatron-LM asserts)");
  }
  if (t.empty_unused_memory_level < 0 || t.empty_unused_memory_level > 2) {
    return Status::Error("empty_unused_memory_level must be 0, 1 or 2, got " +
                         Str(t.empty_unused_memory_level));
  }
  if (t.recompute_modules >> std::size(kRecomputeModuleNames) != 0) {
    return Status::Error("recompute_modules has bits of no module: " +
                         Str(static_cast<int64_t>(t.recompute_modules)));
  }
  if (t.offload_modules >> std::size(kOffloadModuleNames) != 0) {
    return Status::Error("offload_modules has bits of no module: " +
                         Str(static_cast<int64_t>(t.offload_modules)));
  }
  if (t.min_offloaded_tensor_elements < 0) {
    return Status::Error("min_offloaded_tensor_size must be >= 0, got " +
                         Str(t.min_offloaded_tensor_elements));
  }
  if (t.max_inflight_offloads < -1) {
    return Status::Error(
        "fine_grained_offloading_max_inflight_offloads must be >= 0 (or -1: no limit), got " +
        Str(t.max_inflight_offloads));
  }
  if (t.offload_modules != 0) {
    // TransformerConfig.__post_init__ and arguments.py (Megatron-Core 0.20).
    if (t.profile != ProfileKind::kTransformerEngine) {
      return Status::Error(
          "fine-grained activation offloading needs Transformer Engine layers "
          "(--transformer-impl transformer_engine), as Megatron-LM requires");
    }
    if (t.Offloads(OffloadModule::kAttnProj) && !t.Offloads(OffloadModule::kCoreAttn)) {
      return Status::Error("offload module attn_proj needs core_attn, as Megatron-Core requires");
    }
    if (t.Recomputes(RecomputeModule::kMoe) &&
        (t.offload_modules & (OffloadModuleBit(OffloadModule::kExpertFc1) |
                              OffloadModuleBit(OffloadModule::kMoeAct))) != 0) {
      return Status::Error(
          "offload modules expert_fc1 and moe_act cannot be used with the moe recompute module "
          "(Megatron-Core rejects it)");
    }
    if (t.recompute == RecomputeKind::kFull) {
      return Status::Error(
          "fine-grained activation offloading with full recomputation is not modelled; use "
          "selective recomputation");
    }
    if (t.Offloads(OffloadModule::kQkvLinear) && !m.multi_latent_attention()) {
      return Status::Error(
          "offload module qkv_linear is modelled for multi-latent attention only (Megatron-Core "
          "0.20's self-attention has no such region)");
    }
  }
  if (t.cuda_graphs) {
    if (t.cuda_graph_modules >> std::size(kCudaGraphModuleNames) != 0) {
      return Status::Error("cuda_graph_modules has bits of no module: " +
                           Str(static_cast<int64_t>(t.cuda_graph_modules)));
    }
    if (t.profile != ProfileKind::kTransformerEngine) {
      return Status::Error(
          "CUDA graphs (--cuda-graph-impl transformer_engine) need Transformer Engine layers");
    }
    if (t.cuda_graph_warmup_steps < 0) {
      return Status::Error("cuda_graph_warmup_steps must be >= 0, got " +
                           Str(t.cuda_graph_warmup_steps));
    }
    if (t.cuda_graph_modules == 0 && m.num_experts > 0) {
      return Status::Error(
          "whole-layer CUDA graphs of MoE layers are not modelled; name the modules "
          "(--cuda-graph-modules attn moe_router)");
    }
    if (t.offload_modules != 0) {
      return Status::Error(
          "fine-grained activation offloading with CUDA graphs is not modelled; drop one");
    }
    if (t.recompute == RecomputeKind::kFull) {
      return Status::Error("CUDA graphs with full recomputation are not modelled");
    }
  }
  if (!(t.optimizer_offload_fraction >= 0 && t.optimizer_offload_fraction <= 1)) {
    return Status::Error("the optimizer offload fraction must be in [0, 1], got " +
                         std::to_string(t.optimizer_offload_fraction));
  }
  if (t.optimizer_offload_fraction > 0 && t.optimizer != OptimizerKind::kAdam) {
    return Status::Error("optimizer CPU offload is modelled for Adam only");
  }
  if (t.optimizer_offload_fraction > 0 && !t.precision_aware_optimizer) {
    return Status::Error(
        "optimizer CPU offload needs the precision-aware optimizer "
        "(--use-precision-aware-optimizer), as Megatron-LM asserts");
  }
  if (t.cpu_offloading_num_layers != 0) {
    // TransformerConfig.__post_init__ (Megatron-Core 0.20); pipelines are checked with the
    // layout (FinalizeRunSpec).
    if (t.cpu_offloading_num_layers < 0 || t.cpu_offloading_num_layers >= m.num_layers) {
      return Status::Error("cpu_offloading_num_layers must be in [0, num_layers), got " +
                           Str(t.cpu_offloading_num_layers));
    }
    if (t.recompute != RecomputeKind::kNone) {
      return Status::Error(
          "CPU offloading of layers cannot be used with activation recomputation (Megatron-Core "
          "rejects it)");
    }
    if (t.offload_modules != 0 || t.cuda_graphs) {
      return Status::Error(
          "CPU offloading of layers cannot be used with fine-grained offloading or CUDA graphs "
          "(Megatron-Core rejects it)");
    }
  }
  // TransformerConfig.__post_init__'s rules.
  if (t.Recomputes(RecomputeModule::kMoeAct) && !t.moe_grouped_gemm) {
    return Status::Error(
        "recompute module moe_act needs the grouped GEMM experts (--moe-grouped-gemm), as "
        "Megatron-Core requires");
  }
  if (t.Recomputes(RecomputeModule::kMlaUpProj) && !m.multi_latent_attention()) {
    return Status::Error(
        "recompute module mla_up_proj needs multi-latent attention (kv_lora_rank > 0)");
  }
  if (m.mtp_detach_heads && m.mtp_num_layers > 0 && t.defer_embedding_wgrad) {
    return Status::Error(
        "detached MTP heads exclude deferring the embedding weight gradients: Megatron-Core's "
        "linear_with_frozen_weight asserts it gets no gradient buffer (drop "
        "--defer-embedding-wgrad-compute or --mtp-detach-heads)");
  }
  if (m.mtp_use_repeated_layer && m.mtp_num_layers > 1 && t.cuda_graphs) {
    return Status::Error(
        "CUDA graphs of a repeated MTP layer (one module run at every depth) are not modelled; "
        "graph no modules of it or drop mtp_use_repeated_layer");
  }
  if (m.mtp_num_layers > 0 && t.recompute == RecomputeKind::kFull &&
      t.recompute_method == RecomputeMethod::kUniform && t.recompute_num_layers != 1) {
    // MultiTokenPredictionLayer._checkpointed_forward asserts it.
    return Status::Error(
        "multi-token prediction with uniform full recomputation needs "
        "recompute_num_layers 1, got " +
        Str(t.recompute_num_layers));
  }
  return Status::OK();
}

Status SelectTeAttention(const TeAttentionChoice& choice, const TrainingConfig& training,
                         const ModelConfig& model, int compute_capability, AttentionKind* out) {
  const bool fp32 = training.precision == Precision::kFp32;
  const bool sink = model.softmax != SoftmaxKind::kVanilla;
  // cuDNN on Blackwell (10.x) trains deterministically only without dropout
  // (nvte_get_fused_attn_backend in fused_attn.cpp, cuDNN 9.18.1 and later).
  const bool blackwell_dropout = compute_capability >= 100 && model.attention_dropout > 0;
  const bool fused =
      choice.fused && !fp32 &&
      !((compute_capability < 90 || sink || blackwell_dropout) && choice.deterministic);
  // A pinned FlashAttention 3 runs on 9.0 only, 4 on 9.0 and later (get_attention_backend).
  const bool flash_generation_runs = choice.flash_version == 3   ? compute_capability == 90
                                     : choice.flash_version == 4 ? compute_capability >= 90
                                                                 : true;
  // return_max_logit drops FlashAttention (get_attention_backend's max_logit filter).
  const bool flash = choice.flash && flash_generation_runs && !fp32 && !sink &&
                     !training.ReturnsMaxAttentionLogit();
  if (compute_capability >= 90 && fused) {
    *out = AttentionKind::kFused;
  } else if (flash) {
    if (choice.flash_version > 2) {
      return Status::Error("FlashAttention " + Str(choice.flash_version) +
                           " (--flash-attention-version) keeps what it saves inside its own "
                           "package, which memsim has not read; pin 2, or allow fused attention");
    }
    *out = AttentionKind::kFlash;
  } else if (fused) {
    *out = AttentionKind::kFused;
  } else if (choice.unfused) {
    *out = AttentionKind::kEager;
  } else {
    return Status::Error(
        "Transformer Engine has no attention backend for this run: flash and fused attention "
        "are disabled or do not support it, and so is unfused attention (NVTE_UNFUSED_ATTN=0)");
  }
  return Status::OK();
}

int64_t ParamBytesPerElement(Precision precision) { return precision == Precision::kFp32 ? 4 : 2; }

}  // namespace memsim
