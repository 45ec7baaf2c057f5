#include "parallel/theoretical_memory.h"
#include "simulator/check.h"

#include <algorithm>

namespace memsim {
namespace {

constexpr double kBytesPerMegabyte = 1024.0 * 1024.0;  // NUM_BYTES_IN_MEGABYTE

// The Python mixes integers and floats; this port computes in double throughout, which
// agrees with it to rounding.

// compute_weight_and_optimizer_memory, without multi-latent attention (counted as
// multi-head attention, a caveat says so) and MTP, for pipeline stage `stage` (Note [Theoretical
// memory per stage]). Sets the parameter counts of `out`; returns bytes.
double WeightAndOptimizerBytes(const ModelConfig& m, const ParallelLayout& l, int64_t stage,
                               TheoreticalMemory* out) {
  const double H = static_cast<double>(m.hidden_size);
  const double A = static_cast<double>(m.num_attention_heads);
  const double G = static_cast<double>(m.num_query_groups);  // = A without GQA
  const double query_projection_to_hidden_size_ratio = m.head_dim * A / H;
  const bool moe = m.num_experts > 0;
  const double num_experts = moe ? static_cast<double>(m.num_experts) : 1.0;
  const double gated_linear_multiplier = m.activation == ActivationKind::kSwiglu ? 1.5 : 1.0;
  const double shared_expert_ffn_hidden_size = static_cast<double>(m.moe_shared_expert_size);
  // --moe-layer-freq as memsim models it: dense first layers, then MoE layers.
  const double num_dense_layers =
      moe ? static_cast<double>(m.moe_first_k_dense_layers) : static_cast<double>(m.num_layers);
  const double num_moe_layers = static_cast<double>(m.num_layers) - num_dense_layers;
  const double moe_ffn_hidden_size = moe ? static_cast<double>(m.moe_ffn_hidden_size) : 0.0;
  // RMSNorm has no bias; LayerNorm has.
  const double norm_size = m.norm == NormKind::kRmsNorm ? 1.0 : 2.0;

  const double self_attn_term = 2 * H * H * ((1 + G / A) * query_projection_to_hidden_size_ratio);
  const double layer_dense =
      2 * H * (m.ffn_hidden_size * gated_linear_multiplier + norm_size) + self_attn_term;
  const double layer_moe =
      2 * H *
          (moe_ffn_hidden_size * num_experts * gated_linear_multiplier +
           shared_expert_ffn_hidden_size * gated_linear_multiplier + norm_size) +
      self_attn_term;
  const double embedding_size = H * static_cast<double>(m.padded_vocab_size);
  const double final_layernorm = norm_size * H;
  const double embedding_layers = m.tie_embeddings ? embedding_size : 2 * embedding_size;
  const double transformer_block =
      layer_dense * num_dense_layers + layer_moe * num_moe_layers + final_layernorm;
  out->num_parameters = transformer_block + embedding_layers;

  // The most loaded shard holds 1/pp of the block and one embedding, over TP.
  const double pp = static_cast<double>(l.pp), tp = static_cast<double>(l.tp);
  double shard = (transformer_block / pp + embedding_size) / tp;
  if (!m.tie_embeddings && l.pp == 1) shard += embedding_size / tp;
  if (stage > 0) {
    // Its layers, and on the last stage the final norm and the output layer (a copy of the
    // embedding when tied).
    double dense = 0, moe_layers = 0;
    for (int64_t chunk = 0; chunk < l.vpp; ++chunk) {
      const int64_t first = FirstLayerOfStage(l, m, stage, chunk);
      const int64_t count = LayersOnStage(l, m, stage, chunk);
      const int64_t dense_count =
          moe ? std::clamp<int64_t>(m.moe_first_k_dense_layers - first, 0, count) : count;
      dense += static_cast<double>(dense_count);
      moe_layers += static_cast<double>(count - dense_count);
    }
    shard = layer_dense * dense + layer_moe * moe_layers;
    if (stage == l.pp - 1) shard += final_layernorm + embedding_size;
    shard /= tp;
  }
  out->num_parameters_on_most_loaded_shard = shard;

  const double bytes_per_parameter =
      l.data_parallel == DataParallelKind::kDdp ? 18.0 : 6.0 + 12.0 / static_cast<double>(l.dp);
  return shard * bytes_per_parameter;
}

// The part both activation formulas share, for one layer's bytes per microbatch: the
// layers and (first stage) the embedding's input and dropout, times the microbatches in
// flight (Note [Theoretical memory per stage]).
double WithEmbeddingAndSchedule(double layer_bytes, const TrainingConfig& t, const ModelConfig& m,
                                const ParallelLayout& l, int64_t num_microbatches, int64_t stage) {
  const double S = static_cast<double>(t.seq_length);
  const double B = static_cast<double>(t.micro_batch_size);
  const double H = static_cast<double>(m.hidden_size);
  const double L = static_cast<double>(m.num_layers);
  const double pp = static_cast<double>(l.pp), vpp = static_cast<double>(l.vpp);
  const double m_count = static_cast<double>(num_microbatches);
  if (stage == 0) {
    // Megatron-LM: pp microbatches of L/pp layers, then the schedule's factor.
    double bytes = layer_bytes * L;
    bytes += 8 * S * B * pp;  // input to the embedding
    bytes += S * B * H * pp;  // dropout in the embedding
    if (l.vpp > 1) {
      // Megatron-LM's virtual_pipeline_model_parallel_size is None unless interleaved.
      bytes *= 1 + (pp - 1) / (pp * vpp);
    } else if (l.pp > 1) {
      bytes *= std::min(1.0, m_count / pp);
    }
    return bytes;
  }
  double layers = 0;
  for (int64_t chunk = 0; chunk < l.vpp; ++chunk) {
    layers += static_cast<double>(LayersOnStage(l, m, stage, chunk));
  }
  // Microbatches in flight: 1F1B's warmup plus one, or the interleaved schedule's warmup
  // (2 per later stage, pp per extra chunk) plus one, in chunks, over vpp chunks.
  const double later = pp - static_cast<double>(stage) - 1;
  const double in_flight = l.vpp > 1 ? (2 * later + (vpp - 1) * pp + 1) / vpp : later + 1;
  return layer_bytes * layers * std::min(m_count, in_flight);
}

}  // namespace

TheoreticalMemory ComputeTheoreticalMemory(const ValidatedRun& run, int64_t pp_rank) {
  const ModelConfig& m = run.spec().model;
  const TrainingConfig& t = run.spec().training;
  const ParallelLayout& l = run.spec().layout;
  const int64_t num_microbatches = t.num_microbatches;
  MEMSIM_DCHECK(0 <= pp_rank && pp_rank < l.pp);
  TheoreticalMemory r;
  r.weight_and_optimizer_mb = WeightAndOptimizerBytes(m, l, pp_rank, &r) / kBytesPerMegabyte;
  // The output layer and loss: Megatron-LM counts them when pp == 1; per stage, on the last.
  const bool output_layer = pp_rank == l.pp - 1;

  const double S = static_cast<double>(t.seq_length);
  const double B = static_cast<double>(t.micro_batch_size);
  const double H = static_cast<double>(m.hidden_size);
  const double V = static_cast<double>(m.padded_vocab_size);
  const double tp = static_cast<double>(l.tp);
  double activation_bytes;
  // report_theoretical_memory's choice; FinalizeLayout clears sequence_parallel at TP 1
  // as Megatron-LM does.
  if (l.sequence_parallel && t.recompute == RecomputeKind::kSelective) {
    r.activation_formula = TheoreticalActivationFormula::kSequenceParallelSelective;
    // Table 2 of Korthikanti et al. 2022 with the FFN width: per layer
    // s*b*h*(18 + 4F/h), for pp microbatches of L/pp layers on the first stage.
    const double layer = S * B * H * (18 + 4 * (m.ffn_hidden_size / H));
    activation_bytes = WithEmbeddingAndSchedule(layer, t, m, l, num_microbatches, pp_rank);
    if (output_layer) activation_bytes += S * B * H * 4 * (1 + V / H);
    activation_bytes /= tp;  // TP and sequence parallelism split all of it
  } else {
    r.activation_formula = TheoreticalActivationFormula::kWithoutSequenceParallel;
    const double layer = S * B * H * (10 + 24 / tp);
    activation_bytes = WithEmbeddingAndSchedule(layer, t, m, l, num_microbatches, pp_rank);
    if (output_layer) {
      // Logits (split over TP) and the final norm's output, 2 bytes each.
      activation_bytes += (S * B * V / tp + S * B * H) * 2;
    }
    activation_bytes *= 1.05;  // the source's allowance for temporaries
  }
  r.activation_mb = activation_bytes / kBytesPerMegabyte;
  r.total_mb = r.weight_and_optimizer_mb + r.activation_mb;
  return r;
}

std::vector<std::string> TheoreticalMemoryCaveats(const ValidatedRun& run, int64_t pp_rank) {
  const ModelConfig& m = run.spec().model;
  const TrainingConfig& t = run.spec().training;
  const ParallelLayout& l = run.spec().layout;
  std::vector<std::string> caveats;
  if (pp_rank > 0) caveats.push_back("a later stage: memsim's extension of the formula");
  if (m.num_experts > 0) {
    caveats.push_back("MoE: experts divided by TP only (EP, ETP ignored), no routing activations");
  }
  if (l.cp > 1) caveats.push_back("context parallelism ignored");
  if (m.qk_layernorm || m.qk_l2_norm) caveats.push_back("q/k norms ignored");
  if (m.attention_output_gate) caveats.push_back("attention output gate ignored");
  if (m.multi_latent_attention()) {
    caveats.push_back("multi-latent attention counted as multi-head attention");
  }
  if (m.mtp_num_layers > 0) caveats.push_back("multi-token prediction layers ignored");
  if (t.recompute == RecomputeKind::kFull) caveats.push_back("full recomputation ignored");
  if (t.recompute == RecomputeKind::kSelective && !l.sequence_parallel) {
    caveats.push_back("selective recomputation ignored without sequence parallelism");
  }
  if (t.precision_aware_optimizer) caveats.push_back("precision-aware optimizer states ignored");
  if (l.data_parallel == DataParallelKind::kFsdp ||
      l.data_parallel == DataParallelKind::kMegatronFsdp) {
    caveats.push_back("FSDP: sharded parameters and gradients counted as whole");
  }
  if (t.grad_reduce_in_bf16 && t.precision == Precision::kBf16) {
    caveats.push_back("bf16 gradient buffers counted as fp32");
  }
  if (t.recompute == RecomputeKind::kSelective &&
      t.recompute_modules != RecomputeModuleBit(RecomputeModule::kCoreAttn)) {
    caveats.push_back("recompute modules counted as core_attn");
  }
  if (m.num_query_groups != m.num_attention_heads) caveats.push_back("activations ignore GQA");
  if (m.activation == ActivationKind::kSwiglu &&
      !(l.sequence_parallel && t.recompute == RecomputeKind::kSelective)) {
    caveats.push_back("activations ignore SwiGLU's width");
  }
  if (m.activation == ActivationKind::kQuickGeglu || m.activation == ActivationKind::kGeglu) {
    caveats.push_back(
        std::string(m.activation == ActivationKind::kGeglu ? "GeGLU" : "quick-GeGLU") +
        " counted as an ungated MLP (the formula reads --swiglu only)");
  }
  if (m.post_projection_norms || m.final_logit_softcap > 0 || m.scale_embeddings) {
    caveats.push_back(
        "Gemma's norms after the projections, logit soft-capping and embedding scaling "
        "ignored");
  }
  if (l.first_stage_layers > 0 || l.last_stage_layers > 0 || !l.pipeline_layout.empty()) {
    caveats.push_back("uneven pipeline stages ignored on the first stage");
  }
  return caveats;
}

}  // namespace memsim
