#include "parallel/theoretical_memory.h"

#include <algorithm>

namespace memsim {
namespace {

constexpr double kBytesPerMegabyte = 1024.0 * 1024.0;  // NUM_BYTES_IN_MEGABYTE

// The Python mixes integers and floats; this port computes in double throughout, which
// agrees with it to rounding.

// compute_weight_and_optimizer_memory, without multi-latent attention and MTP (memsim
// has neither). Sets the parameter counts of `out`; returns bytes.
double WeightAndOptimizerBytes(const ModelConfig& m, const ParallelLayout& l,
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
  out->num_parameters_on_most_loaded_shard = shard;

  const double bytes_per_parameter =
      l.data_parallel == DataParallelKind::kDdp ? 18.0 : 6.0 + 12.0 / static_cast<double>(l.dp);
  return shard * bytes_per_parameter;
}

// The part both activation formulas share: embedding input and dropout (pp microbatches
// in flight), then the pipeline schedule's factor.
double WithEmbeddingAndSchedule(double layers_bytes, const TrainingConfig& t, const ModelConfig& m,
                                const ParallelLayout& l, int64_t num_microbatches) {
  const double S = static_cast<double>(t.seq_length);
  const double B = static_cast<double>(t.micro_batch_size);
  const double H = static_cast<double>(m.hidden_size);
  const double pp = static_cast<double>(l.pp);
  double bytes = layers_bytes;
  bytes += 8 * S * B * pp;  // input to the embedding
  bytes += S * B * H * pp;  // dropout in the embedding
  if (l.vpp > 1) {
    // Megatron-LM's virtual_pipeline_model_parallel_size is None unless interleaved.
    bytes *= 1 + (pp - 1) / (pp * static_cast<double>(l.vpp));
  } else if (l.pp > 1) {
    bytes *= std::min(1.0, static_cast<double>(num_microbatches) / pp);
  }
  return bytes;
}

}  // namespace

TheoreticalMemory ComputeTheoreticalMemory(const ModelConfig& m, const TrainingConfig& t,
                                           const ParallelLayout& l, int64_t num_microbatches) {
  TheoreticalMemory r;
  r.weight_and_optimizer_mb = WeightAndOptimizerBytes(m, l, &r) / kBytesPerMegabyte;

  const double S = static_cast<double>(t.seq_length);
  const double B = static_cast<double>(t.micro_batch_size);
  const double H = static_cast<double>(m.hidden_size);
  const double L = static_cast<double>(m.num_layers);
  const double V = static_cast<double>(m.padded_vocab_size);
  const double tp = static_cast<double>(l.tp);
  double activation_bytes;
  // report_theoretical_memory's choice; FinalizeLayout clears sequence_parallel at TP 1
  // as Megatron-LM does.
  if (l.sequence_parallel && t.recompute == RecomputeKind::kSelective) {
    r.activation_formula = TheoreticalActivationFormula::kSequenceParallelSelective;
    // Table 2 of Korthikanti et al. 2022 with the FFN width: per layer
    // s*b*h*(18 + 4F/h), for pp microbatches of L/pp layers on the first stage.
    const double layers = S * B * H * (18 + 4 * (m.ffn_hidden_size / H)) * L;
    activation_bytes = WithEmbeddingAndSchedule(layers, t, m, l, num_microbatches);
    if (l.pp == 1) activation_bytes += S * B * H * 4 * (1 + V / H);  // output layer and loss
    activation_bytes /= tp;  // TP and sequence parallelism split all of it
  } else {
    r.activation_formula = TheoreticalActivationFormula::kWithoutSequenceParallel;
    const double layers = S * B * H * (10 + 24 / tp) * L;
    activation_bytes = WithEmbeddingAndSchedule(layers, t, m, l, num_microbatches);
    if (l.pp == 1) {
      // Logits (split over TP) and the final norm's output, 2 bytes each.
      activation_bytes += (S * B * V / tp + S * B * H) * 2;
    }
    activation_bytes *= 1.05;  // the source's allowance for temporaries
  }
  r.activation_mb = activation_bytes / kBytesPerMegabyte;
  r.total_mb = r.weight_and_optimizer_mb + r.activation_mb;
  return r;
}

const char* TheoreticalActivationFormulaName(TheoreticalActivationFormula formula) {
  switch (formula) {
    case TheoreticalActivationFormula::kSequenceParallelSelective:
      return "sequence parallel + selective recomputation";
    case TheoreticalActivationFormula::kWithoutSequenceParallel:
      return "without sequence parallelism";
  }
  return "?";
}

}  // namespace memsim
