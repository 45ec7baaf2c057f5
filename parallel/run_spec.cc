#include "parallel/run_spec.h"

#include <algorithm>
#include <stdexcept>

#include "models/moe.h"
#include "ops/collectives.h"
#include "parallel/pipeline_schedule.h"
#include "simulator/checked_math.h"

namespace memsim {
namespace {

// Transformer Engine's assert_dim_for_fp8_exec: an FP8 GEMM's operands have rows a multiple
// of 8 and an inner dimension a multiple of 16. MXFP8's quantizer asserts more: both
// dimensions of every tensor it quantizes (the local rows under sequence parallelism, and
// the output gradients' widths too) a multiple of its 32-value block.
Status CheckFp8GemmShapes(const ModelConfig& m, const ParallelLayout& l, const TrainingConfig& t) {
  const bool mxfp8 = t.fp8 == Fp8Recipe::kMxfp8;
  const char* asserts = mxfp8 ? " (as Transformer Engine's MXFP8 quantizer asserts)"
                              : " (as Transformer Engine asserts)";
  const int64_t row_multiple = mxfp8 ? 32 : 8, width_multiple = mxfp8 ? 32 : 16;
  const int64_t rows = CheckedMul(t.seq_length / l.cp, t.micro_batch_size);
  const int64_t local_rows = mxfp8 && l.sequence_parallel ? rows / l.tp : rows;
  if (local_rows % row_multiple != 0) {
    return Status::Error(
        std::string("FP8 GEMMs need the tokens per rank (sequence / CP * micro batch") +
        (local_rows != rows ? " / TP" : "") + " = " + std::to_string(local_rows) +
        ") to be a multiple of " + std::to_string(row_multiple) + asserts);
  }
  const int64_t attention_out =
      m.num_attention_heads * (m.multi_latent_attention() ? m.v_head_dim : m.head_dim) / l.tp;
  std::vector<std::pair<const char*, int64_t>> widths = {
      {"hidden size", m.hidden_size}, {"attention width per TP rank", attention_out}};
  const bool dense_layers = m.num_experts == 0 || m.moe_first_k_dense_layers > 0;
  if (dense_layers) widths.emplace_back("FFN size per TP rank", m.ffn_hidden_size / l.tp);
  if (m.num_experts > 0) {
    widths.emplace_back("expert FFN size per expert-TP rank", m.moe_ffn_hidden_size / l.etp);
  }
  if (mxfp8) {  // the other widths MXFP8 quantizes: weights' rows, output gradients' widths
    const int64_t A = m.num_attention_heads;
    if (m.multi_latent_attention()) {
      if (m.q_lora_rank > 0) widths.emplace_back("q_lora_rank", m.q_lora_rank);
      widths.emplace_back("kv_lora_rank", m.kv_lora_rank);
      widths.emplace_back("kv_lora_rank + qk_pos_emb_head_dim",
                          m.kv_lora_rank + m.qk_pos_emb_head_dim);
      widths.emplace_back("query width per TP rank", A * m.head_dim / l.tp);
      widths.emplace_back("key-value width per TP rank", A * (m.qk_head_dim + m.v_head_dim) / l.tp);
    } else {
      const int64_t gate_heads = m.attention_output_gate ? A : 0;
      widths.emplace_back("QKV width per TP rank",
                          (A + gate_heads + 2 * m.num_query_groups) * m.head_dim / l.tp);
    }
    if (m.moe_shared_expert_size > 0) {
      widths.emplace_back("shared-expert FFN size per TP rank", m.moe_shared_expert_size / l.tp);
    }
  }
  for (const auto& [what, value] : widths) {
    if (value % width_multiple != 0) {
      return Status::Error(std::string("FP8 GEMMs need the ") + what + " (" +
                           std::to_string(value) + ") to be a multiple of " +
                           std::to_string(width_multiple) + asserts);
    }
  }
  return Status::OK();
}

Status FinalizeUnchecked(RunSpec* spec) {
  MEMSIM_RETURN_IF_ERROR(FinalizeModelConfig(&spec->model, spec->layout.tp));
  if (spec->training.te_attention && spec->gpu != nullptr) {
    MEMSIM_RETURN_IF_ERROR(SelectTeAttention(*spec->training.te_attention, spec->training,
                                             spec->model, spec->gpu->compute_capability,
                                             &spec->training.attention));
  }
  if (spec->gpu != nullptr) {
    const int capability = spec->gpu->compute_capability;
    spec->training.fp8_gemm_any_layout =
        (capability >= 100 && capability < 120) || capability >= 130;
    spec->training.gpus_per_nvlink_domain = spec->gpu->gpus_per_node;
  }
  MEMSIM_RETURN_IF_ERROR(FinalizeLayout(&spec->layout, spec->model));
  const ParallelLayout& l = spec->layout;
  TrainingConfig& t = spec->training;
  if (t.cpu_offloading_num_layers > 0 && l.pp > 1) {
    return Status::Error(
        "CPU offloading of layers (--cpu-offloading-num-layers) needs PP=1 (Megatron-Core "
        "rejects pipelines)");
  }
  if (t.cpu_offloading_num_layers > 0 && (l.data_parallel == DataParallelKind::kFsdp ||
                                          l.data_parallel == DataParallelKind::kMegatronFsdp)) {
    return Status::Error("CPU offloading of layers with FSDP is not modelled");
  }
  // With CUDA graphs the run goes on to a replayed iteration (Note [CUDA graphs]).
  if (t.cuda_graphs) t.iterations = std::max(t.iterations, t.CudaGraphCaptureIteration() + 1);
  if (spec->global_batch_size > 0) {
    const int64_t per_step = CheckedMul(t.micro_batch_size, l.dp);
    const std::string global = "global batch size " + std::to_string(spec->global_batch_size);
    const std::string step = "micro batch size " + std::to_string(t.micro_batch_size) +
                             " x data-parallel size " + std::to_string(l.dp) + " = " +
                             std::to_string(per_step);
    if (per_step <= 0 ||
        (!spec->round_global_batch_down && spec->global_batch_size % per_step != 0)) {
      return Status::Error(global + " is not a multiple of " + step);
    }
    t.num_microbatches = spec->global_batch_size / per_step;
    if (t.num_microbatches == 0) {  // only when rounding down
      return Status::Error(global + " rounds down to no microbatch of " + step +
                           "; raise the global batch");
    }
  }
  MEMSIM_RETURN_IF_ERROR(
      CheckMicrobatchGroup(l.pp, l.vpp, t.num_microbatches,
                           l.microbatch_group_size == 0 ? l.pp : l.microbatch_group_size));
  const int64_t seq_divisor = l.cp * (l.sequence_parallel ? l.tp : 1);
  if (t.seq_length % seq_divisor != 0) {
    return Status::Error("sequence length " + std::to_string(t.seq_length) +
                         " is not divisible by CP" + (l.sequence_parallel ? "*TP" : "") + " = " +
                         std::to_string(seq_divisor));
  }
  if (l.combined_1f1b) {
    // TransformerConfig.__post_init__'s rules for overlap_moe_expert_parallel_comm.
    const ModelConfig& m = spec->model;
    const char* broken =
        m.num_experts == 0 || l.ep == 1 ? "it needs expert parallelism (EP > 1)"
        : t.moe_dispatcher == MoeDispatcher::kAllGather
            ? "it needs the alltoall or flex token dispatcher"
        : t.precision == Precision::kFp32     ? "it needs bf16 or fp16"
        : l.pp > 1 && l.vpp == 1              ? "with PP > 1 it needs virtual pipeline stages"
        : t.recompute == RecomputeKind::kFull ? "it excludes full recomputation"
        : t.Recomputes(RecomputeModule::kMoe) ? "it excludes the moe recompute module"
        : m.mtp_num_layers > 1                ? "it allows at most one MTP layer"
        : t.moe_shared_expert_overlap
            ? "it excludes overlapping the shared experts (--moe-shared-expert-overlap)"
            : nullptr;
    if (broken != nullptr) {
      return Status::Error(std::string("overlapping expert-parallel communication (the combined "
                                       "1F1B schedule): ") +
                           broken + ", as Megatron-Core asserts");
    }
  }
  if (t.moe_router_padding && spec->model.num_experts > 0) {
    // Note [Router padding] in models/moe.h; TransformerConfig.__post_init__ asserts the
    // first two.
    const char* broken =
        t.fp8 == Fp8Recipe::kNone ? "it needs FP8 training (--fp8-format), as Megatron-Core asserts"
        : t.moe_dispatcher == MoeDispatcher::kAllGather
            ? "the allgather dispatcher does not support it (Megatron-Core asserts it); use "
              "alltoall or flex"
        : spec->model.moe_pad_to_capacity
            ? "with --moe-pad-expert-input-to-capacity it is not modelled; drop one of the two"
            : nullptr;
    if (broken != nullptr) {
      return Status::Error(std::string("padding the routing map for quantization: ") + broken);
    }
  }
  if (t.moe_dispatcher == MoeDispatcher::kDeepEp && spec->model.num_experts > 0) {
    // Note [DeepEP dispatch] in models/moe.h; MoEFlexTokenDispatcher, TransformerConfig and
    // DeepEP's Buffer assert the first three.
    const int64_t group = l.etp * l.ep;
    const std::vector<int64_t> sizes = {2, 4, 8, 16, 24, 32, 64, 128, 144, 160};
    const std::string broken =
        group == 1 ? "it needs expert or expert-tensor parallelism (EP*ETP > 1)"
        : std::find(sizes.begin(), sizes.end(), group) == sizes.end()
            ? "DeepEP runs on 2, 4, 8, 16, 24, 32, 64, 128, 144 or 160 ranks, not EP*ETP = " +
                  std::to_string(group)
        : spec->model.moe_pad_to_capacity ? "it excludes --moe-pad-expert-input-to-capacity"
        : spec->model.moe_capacity_factor > 0
            ? "with a capacity factor it is not modelled; drop it to simulate a dropless run"
            : "";
    if (!broken.empty()) return Status::Error("the flex dispatcher with DeepEP: " + broken);
  }
  if (spec->model.num_experts > 0 && spec->model.add_bias_linear && l.etp > 1) {
    return Status::Error(
        "MoE layers with biases need expert tensor parallelism 1 (Megatron-Core asserts it); "
        "--disable-bias-linear, or YAML add_bias_linear: false, removes the biases");
  }
  if (t.moe_dispatcher == MoeDispatcher::kHybridEp && spec->model.num_experts > 0) {
    // Note [HybridEP dispatch] in models/moe.h.
    const char* broken =
        l.etp > 1 ? "with expert tensor parallelism it is not modelled (its group then spans "
                    "ETP*EP ranks of ETP*E experts)"
        : spec->model.moe_capacity_factor > 0
            ? "with a capacity factor it is not modelled; drop it to simulate a dropless run"
            : nullptr;
    if (broken != nullptr)
      return Status::Error(std::string("the flex dispatcher with HybridEP: ") + broken);
  }
  if (t.delay_wgrad_compute) {
    // Note [Delayed weight gradients] in models/delayed_wgrad.h; TransformerConfig.__post_init__
    // and arguments.py assert the first two.
    const char* broken =
        !l.combined_1f1b ? "it needs --overlap-moe-expert-parallel-comm, as Megatron-Core asserts"
        : t.profile != ProfileKind::kTransformerEngine
            ? "it needs --transformer-impl transformer_engine, as Megatron-LM asserts"
        : t.fp8 != Fp8Recipe::kNone ? "with FP8 training it is not modelled; drop it to simulate "
                                      "the run without it"
                                    : nullptr;
    if (broken != nullptr) return Status::Error(std::string("--delay-wgrad-compute: ") + broken);
  }
  if (spec->model.moe_pad_to_capacity && spec->model.num_experts > 0) {
    // permute's drop_and_pad keeps each expert's first `capacity` of the rank's tokens: more
    // than it has fails (moe_utils.permute's view), so Megatron-LM cannot run it.
    const int64_t tokens = TokensPerRank(*spec);
    const int64_t capacity = ExpertCapacityPerRank(*spec);
    if (capacity > tokens) {
      return Status::Error("padding expert inputs to capacity needs a capacity of at most the " +
                           std::to_string(tokens) + " tokens a rank routes, got " +
                           std::to_string(capacity) +
                           " (top-k x capacity factor above the experts): Megatron-LM fails on "
                           "it; lower the capacity factor");
    }
  }
  if (t.ReturnsMaxAttentionLogit() && l.cp > 1) {
    return Status::Error(
        "the max attention logit with context parallelism is not modelled (Transformer Engine's "
        "context-parallel attention reduces it over the ring's steps); use context parallelism "
        "1 or drop --log-max-attention-logit and --qk-clip");
  }
  if (t.qk_clip && (l.data_parallel != DataParallelKind::kDdp || t.layer_wise_optimizer)) {
    // Attention.clip_qk clips linear_qkv.weight.main_param viewed as [groups, rows, -1]:
    // a whole float32 copy only under the plain mixed-precision optimizer.
    return Status::Error(
        "QK-clip is modelled with plain DDP only: under the distributed optimizer clip_qk views "
        "the main parameter, a flat shard of the weight, as [groups, rows, -1], which Megatron-"
        "Core 0.20 cannot do in general, and the layer-wise optimizer keeps main parameters "
        "for the weights a rank owns only");
  }
  if (t.te_op_fuser && l.etp > 1) {
    // TEGroupedMLP._is_fused_impl_supported: the experts' tensor-parallel group is 1.
    return Status::Error("Transformer Engine's op fuser needs expert tensor parallelism 1, got " +
                         std::to_string(l.etp) + " (as Megatron-Core asserts)");
  }
  if (t.fp8 != Fp8Recipe::kNone && spec->gpu != nullptr) {
    const int capability = spec->gpu->compute_capability;
    const std::string has = spec->gpu->name + " has " + std::to_string(capability / 10) + "." +
                            std::to_string(capability % 10);
    if (capability < 89) {
      return Status::Error("FP8 training needs a GPU of compute capability 8.9 or later; " + has);
    }
    // Transformer Engine's check_mxfp8_support.
    if (t.fp8 == Fp8Recipe::kMxfp8 && (capability < 100 || capability >= 120)) {
      return Status::Error(
          "MXFP8 needs a Blackwell GPU of compute capability 10.0 to 11.x (B200, "
          "GB200); " +
          has + ": choose another --fp8-recipe or --gpu");
    }
  }
  if (t.tp_comm_overlap && !l.sequence_parallel) {
    return Status::Error(
        "TP communication overlap needs sequence parallelism (as Megatron-LM asserts)");
  }
  if (t.fp8 != Fp8Recipe::kNone) MEMSIM_RETURN_IF_ERROR(CheckFp8GemmShapes(spec->model, l, t));
  if (t.fp8_param_gather && l.data_parallel != DataParallelKind::kDistributedOptimizer &&
      l.data_parallel != DataParallelKind::kMegatronFsdp) {
    return Status::Error(
        "FP8 parameters (--fp8-param-gather) need the distributed optimizer (as Megatron-LM "
        "asserts)");
  }
  if (t.precision_aware_optimizer && l.data_parallel != DataParallelKind::kDistributedOptimizer &&
      l.data_parallel != DataParallelKind::kMegatronFsdp) {
    return Status::Error(
        "the precision-aware optimizer needs the distributed optimizer (as Megatron-Core "
        "asserts)");
  }
  if (t.distribute_saved_activations && (l.tp == 1 || l.sequence_parallel)) {
    return Status::Error(
        "distributing saved activations needs TP > 1 without sequence parallelism (as "
        "Megatron-LM asserts)");
  }
  if (t.distribute_saved_activations && spec->model.mtp_num_layers > 0) {
    // MultiTokenPredictionLayer would overwrite the depth's input, which the concatenation
    // of the depths' outputs still reads.
    return Status::Error(
        "distributing saved activations with multi-token prediction is not modelled");
  }
  if (t.defer_embedding_wgrad && l.pp == 1) {
    return Status::Error(
        "deferring the embedding weight gradients needs pipeline parallelism (PP > 1), as "
        "Megatron-LM asserts");
  }
  if (l.data_parallel == DataParallelKind::kFsdp && (l.pp > 1 || l.tp > 1 || l.ep > 1)) {
    return Status::Error(
        "FSDP is modelled on its own (TP=PP=EP=1); combine TP/PP with "
        "distributed-optimizer instead");
  }
  if (l.data_parallel == DataParallelKind::kFsdp && spec->model.mtp_num_layers > 0) {
    // memsim's FSDP wraps decoder layers; an MTP depth's layer would stay whole.
    return Status::Error(
        "multi-token prediction with FSDP is not modelled; use distributed-optimizer");
  }
  if (l.data_parallel == DataParallelKind::kMegatronFsdp) {
    // Note [Megatron-FSDP] in parallel/megatron_fsdp.h: what memsim models of it.
    std::string unmodelled;
    if (l.pp > 1) unmodelled = "pipeline parallelism";
    if (t.recompute == RecomputeKind::kFull) unmodelled = "full recomputation";
    if (t.fp8_param_gather && !t.fp8_gemm_any_layout) {
      unmodelled = "FP8 parameters on a GPU whose FP8 GEMMs need transposes (before Blackwell)";
    }
    if (t.precision_aware_optimizer) unmodelled = "the precision-aware optimizer";
    if (t.optimizer == OptimizerKind::kMuon) unmodelled = "Muon";
    if (t.fsdp_meta_init && t.fp8_param_gather) {
      unmodelled = "meta-device initialization of FP8 parameters";
    }
    if (!unmodelled.empty()) {
      return Status::Error("Megatron-FSDP with " + unmodelled +
                           " is not modelled; use the distributed optimizer instead");
    }
  }
  if (t.cp_all_to_all < 1 || l.cp % t.cp_all_to_all != 0) {
    return Status::Error("the all-to-all level of context parallelism (" +
                         std::to_string(t.cp_all_to_all) +
                         ") must divide CP = " + std::to_string(l.cp));
  }
  if (t.cp_all_to_all > 1) {
    // Note [All-to-all context parallelism]: each rank of the all-to-all group takes its share
    // of the tensor-parallel rank's heads.
    const ModelConfig& m = spec->model;
    const int64_t a2a = t.cp_all_to_all;
    const int64_t heads = m.num_attention_heads / l.tp;
    const int64_t kv_heads =
        (m.multi_latent_attention() ? m.num_attention_heads : m.num_query_groups) / l.tp;
    if (heads % a2a != 0 || kv_heads % a2a != 0) {
      return Status::Error("all-to-all context parallelism needs the attention heads (" +
                           std::to_string(heads) + ") and key-value heads (" +
                           std::to_string(kv_heads) + ") of a tensor-parallel rank divisible by " +
                           "its group size " + std::to_string(a2a) +
                           " (Transformer Engine asserts it)");
    }
  }
  if (t.cp_all_gather && (t.cp_all_to_all > 1 || t.profile != ProfileKind::kTransformerEngine)) {
    return Status::Error(
        "all-gather context parallelism is Transformer Engine's (profile transformer_engine), "
        "alone for every layer");
  }
  if (l.cp > 1 && spec->model.flex_attention) {
    return Status::Error(
        "context parallelism with FlexAttention (Gemma-2) does not exist: Megatron-Bridge's "
        "Gemma2DotProductAttention raises ValueError for CP > 1");
  }
  if (l.cp > 1 && spec->model.softmax != SoftmaxKind::kVanilla &&
      (t.cp_all_gather || t.cp_all_to_all != l.cp)) {
    return Status::Error(
        "context parallelism with attention sinks (a softmax other than vanilla) needs the a2a "
        "communication alone (Transformer Engine asserts it; Megatron-LM: --cp-comm-type a2a)");
  }
  if (l.cp > 1 && spec->model.sliding_window && !t.cp_all_gather && t.cp_all_to_all != l.cp) {
    return Status::Error(
        "context parallelism over sliding-window attention needs the a2a or allgather "
        "communication (Transformer Engine asserts it; Megatron-LM: --cp-comm-type a2a or "
        "allgather)");
  }
  if (l.cp > 1 && t.attention == AttentionKind::kEager) {
    return Status::Error(
        "context parallelism needs flash or fused attention (as Megatron-LM's CP does)");
  }
  if (l.cp > 1 && t.seq_length % (2 * l.cp) != 0) {
    return Status::Error("sequence length " + std::to_string(t.seq_length) +
                         " must be divisible by 2*CP = " + std::to_string(2 * l.cp) +
                         " (causal load balancing splits it into 2*CP chunks)");
  }
  if (t.optimizer == OptimizerKind::kMuon) {
    if (t.precision == Precision::kFp16) {
      return Status::Error(
          "the Muon optimizer does not support fp16 (Megatron-LM rejects it); "
          "use bf16");
    }
    if (l.data_parallel != DataParallelKind::kDdp) {
      return Status::Error(
          "memsim models the Muon optimizer over plain data parallelism (data_parallel: ddp), "
          "with Megatron-LM's layer-wise optimizer or without; a distributed optimizer's "
          "shards of Muon's matrices do not exist in Megatron-LM");
    }
  }
  if (t.layer_wise_optimizer && t.optimizer != OptimizerKind::kMuon) {
    return Status::Error(
        "Megatron-LM's layer-wise optimizer is the distributed Muon's; "
        "use it with the Muon optimizer");
  }
  if (t.simulated_rank && (*t.simulated_rank < 0 || *t.simulated_rank >= l.world_size)) {
    return Status::Error("the simulated rank " + std::to_string(*t.simulated_rank) +
                         " is not a rank of the " + std::to_string(l.world_size) + " GPUs");
  }
  return ValidateTrainingConfig(t, spec->model);
}

}  // namespace

int64_t TokensPerRank(const RunSpec& spec) {
  const ParallelLayout& l = spec.layout;
  return spec.training.seq_length / (l.cp * (l.sequence_parallel ? l.tp : 1)) *
         spec.training.micro_batch_size;
}

int64_t ExpertCapacityPerRank(const RunSpec& spec) {
  return spec.model.moe_capacity_factor > 0 ? ExpertCapacity(spec.model, TokensPerRank(spec)) : 0;
}

int64_t UserbufferBytes(const RunSpec& spec) {
  const TrainingConfig& t = spec.training;
  const ParallelLayout& l = spec.layout;
  if (!t.tp_comm_overlap || !l.sequence_parallel || l.tp <= 1) return 0;
  const bool fp8 = t.fp8 != Fp8Recipe::kNone;
  const bool bf16_layers = t.fp8_bf16_layers_at_start != 0 || t.fp8_bf16_layers_at_end != 0;
  return UserbufferBytes(CheckedMul(t.seq_length / l.cp, t.micro_batch_size),
                         spec.model.hidden_size, fp8, !fp8 || bf16_layers);
}

int64_t DeepEpBufferBytes(const RunSpec& spec) {
  const TrainingConfig& t = spec.training;
  const ParallelLayout& l = spec.layout;
  if (spec.model.num_experts == 0) return 0;
  const int64_t group = l.etp * l.ep;
  if (t.moe_dispatcher == MoeDispatcher::kHybridEp) {
    // The tokens of the first dispatch, which sizes the buffer (the same on every layer).
    const int64_t tokens = CheckedMul(t.seq_length / (l.cp * l.tp), t.micro_batch_size);
    return HybridEpBufferBytes(tokens, spec.model.hidden_size, spec.model.num_experts, group,
                               t.gpus_per_nvlink_domain);
  }
  if (t.moe_dispatcher != MoeDispatcher::kDeepEp) return 0;
  const int64_t element_bytes = t.precision == Precision::kFp32 ? 4 : 2;
  return DeepEpBufferBytes(spec.model.hidden_size, element_bytes, group, t.deepep_num_sms);
}

int64_t AllocatorCapacityBytes(const RunSpec& spec) {
  MEMSIM_DCHECK(spec.gpu != nullptr);
  return spec.gpu->usable_bytes() - UserbufferBytes(spec) - DeepEpBufferBytes(spec);
}

Status FinalizeRunSpec(const RunSpec& spec, std::optional<ValidatedRun>* run) {
  run->reset();
  RunSpec finalized = spec;
  Status status;
  try {
    status = FinalizeUnchecked(&finalized);
  } catch (const std::overflow_error&) {
    status = Status::Error(
        "the configuration's sizes overflow 64 bits (world size, layout "
        "sizes, batch or sequence length too large)");
  }
  if (status.ok()) run->emplace(ValidatedRun(std::move(finalized)));
  return status;
}

}  // namespace memsim
