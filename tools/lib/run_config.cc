#include "tools/lib/run_config.h"

#include "tools/lib/yaml_reader.h"

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>

namespace memsim {
namespace {
namespace fs = std::filesystem;

template <typename E>
Status ReadEnum(const YAML::Node& node, const std::string& source, const std::string& key,
                Status (*parse)(const std::string&, E*), E* out) {
  std::string text;
  MEMSIM_RETURN_IF_ERROR(Read(node, source, key, &text));
  Status s = parse(text, out);
  return s.ok() ? s : Status::Error(Where(source, node) + ": " + key + ": " + s.message());
}

Status ApplyArchitecture(const YAML::Node& v, const std::string& source, ModelConfig* m) {
  std::string arch;
  MEMSIM_RETURN_IF_ERROR(Read(v, source, "architecture", &arch));
  if (arch == "gpt") {  // Megatron-LM's GPT: LayerNorm, GeLU, learned positions, tied, biases
    m->norm = NormKind::kLayerNorm;
    m->activation = ActivationKind::kGelu;
    m->position = PositionKind::kLearned;
    m->tie_embeddings = true;
    m->add_bias_linear = m->add_qkv_bias = true;
  } else if (arch == "llama") {  // RMSNorm, SwiGLU, RoPE, untied, no biases
    m->norm = NormKind::kRmsNorm;
    m->activation = ActivationKind::kSwiglu;
    m->position = PositionKind::kRope;
    m->tie_embeddings = false;
    m->add_bias_linear = m->add_qkv_bias = false;
  } else {
    return Status::Error(Where(source, v) + ": unknown architecture '" + arch +
                         "' (use gpt or llama)");
  }
  return Status::OK();
}

}  // namespace

std::string ConfigDir() {
  if (const char* dir = std::getenv("MEMSIM_CONFIG_DIR")) return dir;
  return std::string(MEMSIM_SOURCE_DIR) + "/configs";
}

std::vector<std::string> ModelPresetNames() {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(ConfigDir() + "/models", ec)) {
    if (entry.path().extension() == ".yaml") names.push_back(entry.path().stem().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

Status ParsePrecision(const std::string& text, Precision* out) {
  return ParseEnum(kPrecisionNames, text, "precision", out);
}
Status ParseActivation(const std::string& text, ActivationKind* out) {
  return ParseEnum(kActivationNames, text, "activation", out);
}
Status ParseSoftmax(const std::string& text, SoftmaxKind* out) {
  return ParseEnum(kSoftmaxNames, text, "softmax", out);
}
Status ParseMoeScoreFunction(const std::string& text, MoeScoreFunction* out) {
  return ParseEnum(kMoeScoreFunctionNames, text, "moe_router_score_function", out);
}
Status ParseAttention(const std::string& text, AttentionKind* out) {
  return ParseEnum(kAttentionNames, text, "attention", out);
}
Status ParseRecompute(const std::string& text, RecomputeKind* out) {
  return ParseEnum(kRecomputeNames, text, "recompute", out);
}
Status ParseFp8Recipe(const std::string& text, Fp8Recipe* out) {
  return ParseEnum(kFp8RecipeNames, text, "fp8 recipe", out);
}
namespace {

// Names of `table` into a bitmask of 1 << value, as Megatron's list arguments give them.
template <typename E, size_t N>
Status ParseEnumBits(const EnumName<E> (&table)[N], const std::vector<std::string>& names,
                     const char* what, uint32_t* out) {
  uint32_t bits = 0;
  for (const std::string& name : names) {
    E value;
    MEMSIM_RETURN_IF_ERROR(ParseEnum(table, name, what, &value));
    bits |= 1u << static_cast<uint32_t>(value);
  }
  *out = bits;
  return Status::OK();
}

}  // namespace

Status ParseRecomputeModules(const std::vector<std::string>& names, uint32_t* out) {
  return ParseEnumBits(kRecomputeModuleNames, names, "recompute module", out);
}
Status ParseOffloadModules(const std::vector<std::string>& names, uint32_t* out) {
  return ParseEnumBits(kOffloadModuleNames, names, "offload module", out);
}
Status ParseCudaGraphModules(const std::vector<std::string>& names, uint32_t* out) {
  return ParseEnumBits(kCudaGraphModuleNames, names, "CUDA graph module", out);
}
Status ParseRecomputeMethod(const std::string& text, RecomputeMethod* out) {
  return ParseEnum(kRecomputeMethodNames, text, "recompute method", out);
}
Status ParseProfile(const std::string& text, ProfileKind* out) {
  return ParseEnum(kProfileNames, text, "profile", out);
}
Status ParseOptimizer(const std::string& text, OptimizerKind* out) {
  return ParseEnum(kOptimizerNames, text, "optimizer", out);
}
Status ParseGpu(const std::string& text, const GpuSpec** out) {
  *out = FindGpu(text);
  if (*out == nullptr) {
    return Status::Error("unknown GPU '" + text + "' (use one of: " + GpuPresetNames() + ")");
  }
  return Status::OK();
}

Status ParseDataParallel(const std::string& text, DataParallelKind* out) {
  return ParseEnum(kDataParallelNames, text, "data parallelism", out);
}

Status ApplyLayoutYaml(const YAML::Node& node, const std::string& source, ParallelLayout* l) {
  auto i64 = [&](const char* key, int64_t* field) -> std::pair<std::string, YamlKeyHandler> {
    return {key, [&, key, field](const YAML::Node& v) { return Read(v, source, key, field); }};
  };
  std::map<std::string, YamlKeyHandler> handlers = {
      i64("world_size", &l->world_size),
      i64("tp", &l->tp),
      i64("pp", &l->pp),
      i64("vpp", &l->vpp),
      i64("cp", &l->cp),
      i64("ep", &l->ep),
      i64("etp", &l->etp),
      i64("first_stage_layers", &l->first_stage_layers),
      i64("last_stage_layers", &l->last_stage_layers),
      {"sequence_parallel",
       [&](const YAML::Node& v) {
         return Read(v, source, "sequence_parallel", &l->sequence_parallel);
       }},
      {"deallocate_pipeline_outputs",
       [&](const YAML::Node& v) {
         return Read(v, source, "deallocate_pipeline_outputs", &l->deallocate_pipeline_outputs);
       }},
      {"embedding_in_pipeline_split",
       [&](const YAML::Node& v) {
         return Read(v, source, "embedding_in_pipeline_split", &l->embedding_in_split);
       }},
      {"loss_in_pipeline_split",
       [&](const YAML::Node& v) {
         return Read(v, source, "loss_in_pipeline_split", &l->loss_in_split);
       }},
      {"pipeline_layout",
       [&](const YAML::Node& v) {
         return Read(v, source, "pipeline_layout", &l->pipeline_layout);
       }},
      {"combined_1f1b",
       [&](const YAML::Node& v) { return Read(v, source, "combined_1f1b", &l->combined_1f1b); }},
      {"overlap_p2p_comm",
       [&](const YAML::Node& v) {
         return Read(v, source, "overlap_p2p_comm", &l->overlap_p2p_comm);
       }},
      // Megatron's --overlap-grad-reduce and --ddp-bucket-size: how the distributed
      // optimizer's buckets cut its shards (Note [Distributed optimizer buffers]).
      {"overlap_grad_reduce",
       [&](const YAML::Node& v) {
         return Read(v, source, "overlap_grad_reduce", &l->ddp_buckets.overlap_grad_reduce);
       }},
      {"ddp_bucket_size",
       [&](const YAML::Node& v) {
         int64_t elements = 0;
         MEMSIM_RETURN_IF_ERROR(Read(v, source, "ddp_bucket_size", &elements));
         if (elements <= 0) {
           return Status::Error(Where(source, v) + ": 'ddp_bucket_size' must be a positive " +
                                "number of elements, got " + std::to_string(elements));
         }
         l->ddp_buckets.bucket_size = elements;
         return Status::OK();
       }},
      {"data_parallel",
       [&](const YAML::Node& v) {
         return ReadEnum(v, source, "data_parallel", &ParseDataParallel, &l->data_parallel);
       }},
  };
  return ApplyKeys(node, source, "layout", handlers);
}

Status ApplyModelYaml(const YAML::Node& node, const std::string& source, ModelConfig* m) {
  if (!node.IsMap()) {
    return Status::Error(Where(source, node) + ": a model must be a mapping of keys to values");
  }
  if (node["base"]) {
    std::string base;
    MEMSIM_RETURN_IF_ERROR(Read(node["base"], source, "base", &base));
    MEMSIM_RETURN_IF_ERROR(LoadModelPreset(base, m));
  }
  auto i64 = [&](const char* key, int64_t* field) -> std::pair<std::string, YamlKeyHandler> {
    return {key, [&, key, field](const YAML::Node& v) { return Read(v, source, key, field); }};
  };
  auto f64 = [&](const char* key, double* field) -> std::pair<std::string, YamlKeyHandler> {
    return {key, [&, key, field](const YAML::Node& v) { return Read(v, source, key, field); }};
  };
  auto flag = [&](const char* key, bool* field) -> std::pair<std::string, YamlKeyHandler> {
    return {key, [&, key, field](const YAML::Node& v) { return Read(v, source, key, field); }};
  };
  // A number whose absence means "off" (std::nullopt).
  auto optional_f64 = [&](const char* key,
                          std::optional<double>* field) -> std::pair<std::string, YamlKeyHandler> {
    return {key, [&, key, field](const YAML::Node& v) {
              double value = 0;
              MEMSIM_RETURN_IF_ERROR(Read(v, source, key, &value));
              *field = value;
              return Status::OK();
            }};
  };
  std::map<std::string, YamlKeyHandler> handlers = {
      {"base", [](const YAML::Node&) { return Status::OK(); }},
      {"name", [&](const YAML::Node& v) { return Read(v, source, "name", &m->name); }},
      {"architecture", [](const YAML::Node&) { return Status::OK(); }},  // applied first
      {"activation",
       [&](const YAML::Node& v) {
         return ReadEnum(v, source, "activation", &ParseActivation, &m->activation);
       }},
      i64("num_layers", &m->num_layers),
      i64("hidden_size", &m->hidden_size),
      i64("num_attention_heads", &m->num_attention_heads),
      i64("num_query_groups", &m->num_query_groups),
      i64("kv_channels", &m->kv_channels),
      i64("ffn_hidden_size", &m->ffn_hidden_size),
      i64("vocab_size", &m->vocab_size),
      i64("make_vocab_size_divisible_by", &m->make_vocab_size_divisible_by),
      i64("max_position_embeddings", &m->max_position_embeddings),
      flag("tie_embeddings", &m->tie_embeddings),
      flag("add_bias_linear", &m->add_bias_linear),
      flag("add_qkv_bias", &m->add_qkv_bias),
      flag("qk_layernorm", &m->qk_layernorm),
      flag("qk_l2_norm", &m->qk_l2_norm),
      flag("attention_output_gate", &m->attention_output_gate),
      flag("use_mup", &m->use_mup),
      i64("no_rope_freq", &m->no_rope_freq),
      {"no_rope_layers",
       [&](const YAML::Node& v) { return Read(v, source, "no_rope_layers", &m->no_rope_layers); }},
      i64("mup_base_hidden_size", &m->mup_base_hidden_size),
      f64("mup_embedding_mult", &m->mup_embedding_mult),
      f64("mup_output_mult", &m->mup_output_mult),
      i64("q_lora_rank", &m->q_lora_rank),
      i64("kv_lora_rank", &m->kv_lora_rank),
      i64("qk_head_dim", &m->qk_head_dim),
      i64("qk_pos_emb_head_dim", &m->qk_pos_emb_head_dim),
      i64("v_head_dim", &m->v_head_dim),
      f64("activation_clamp_value", &m->activation_clamp_value),
      f64("rotary_percent", &m->rotary_percent),
      flag("megatron_bridge", &m->megatron_bridge),
      flag("post_projection_norms", &m->post_projection_norms),
      flag("flex_attention", &m->flex_attention),
      f64("final_logit_softcap", &m->final_logit_softcap),
      flag("scale_embeddings", &m->scale_embeddings),
      flag("sliding_window", &m->sliding_window),
      {"softmax",
       [&](const YAML::Node& v) {
         return ReadEnum(v, source, "softmax", &ParseSoftmax, &m->softmax);
       }},
      f64("hidden_dropout", &m->hidden_dropout),
      f64("attention_dropout", &m->attention_dropout),
      i64("num_experts", &m->num_experts),
      i64("moe_router_topk", &m->moe_router_topk),
      i64("moe_ffn_hidden_size", &m->moe_ffn_hidden_size),
      i64("moe_shared_expert_size", &m->moe_shared_expert_size),
      i64("moe_first_k_dense_layers", &m->moe_first_k_dense_layers),
      f64("moe_capacity_factor", &m->moe_capacity_factor),
      flag("moe_pad_to_capacity", &m->moe_pad_to_capacity),
      flag("moe_drop_by_position", &m->moe_drop_by_position),
      f64("moe_imbalance_factor", &m->moe_imbalance_factor),
      flag("moe_router_fp32", &m->moe_router_fp32),
      flag("moe_apply_probs_on_input", &m->moe_apply_probs_on_input),
      flag("moe_shared_expert_gate", &m->moe_shared_expert_gate),
      f64("moe_aux_loss_coeff", &m->moe_aux_loss_coeff),
      f64("moe_z_loss_coeff", &m->moe_z_loss_coeff),
      i64("moe_router_num_groups", &m->moe_router_num_groups),
      i64("moe_router_group_topk", &m->moe_router_group_topk),
      {"moe_router_score_function",
       [&](const YAML::Node& v) {
         return ReadEnum(v, source, "moe_router_score_function", &ParseMoeScoreFunction,
                         &m->moe_router_score_function);
       }},
      flag("moe_router_pre_softmax", &m->moe_router_pre_softmax),
      flag("moe_router_expert_bias", &m->moe_router_expert_bias),
      f64("moe_router_topk_scaling_factor", &m->moe_router_topk_scaling_factor),
      flag("moe_router_sinkhorn", &m->moe_router_sinkhorn),
      flag("moe_router_force_load_balancing", &m->moe_router_force_load_balancing),
      optional_f64("moe_router_force_biased", &m->moe_router_force_biased),
      optional_f64("moe_input_jitter_eps", &m->moe_input_jitter_eps),
      i64("mtp_num_layers", &m->mtp_num_layers),
      flag("mtp_use_repeated_layer", &m->mtp_use_repeated_layer),
      flag("mtp_detach_heads", &m->mtp_detach_heads),
      flag("mtp_hsm", &m->mtp_hsm),
  };
  // architecture sets defaults that the explicit keys then override, wherever it stands.
  if (node.IsMap() && node["architecture"]) {
    MEMSIM_RETURN_IF_ERROR(ApplyArchitecture(node["architecture"], source, m));
  }
  return ApplyKeys(node, source, "model", handlers);
}

Status ApplyTrainingYaml(const YAML::Node& node, const std::string& source, TrainingConfig* t,
                         int64_t* global_batch_size) {
  int64_t iterations = t->iterations;
  std::map<std::string, YamlKeyHandler> handlers = {
      {"seq_length",
       [&](const YAML::Node& v) { return Read(v, source, "seq_length", &t->seq_length); }},
      {"micro_batch_size",
       [&](const YAML::Node& v) {
         return Read(v, source, "micro_batch_size", &t->micro_batch_size);
       }},
      {"num_microbatches",
       [&](const YAML::Node& v) {
         return Read(v, source, "num_microbatches", &t->num_microbatches);
       }},
      {"iterations",
       [&](const YAML::Node& v) { return Read(v, source, "iterations", &iterations); }},
      {"precision",
       [&](const YAML::Node& v) {
         return ReadEnum(v, source, "precision", &ParsePrecision, &t->precision);
       }},
      {"output_logit_dtype",
       [&](const YAML::Node& v) {
         Precision dtype;
         MEMSIM_RETURN_IF_ERROR(ReadEnum(v, source, "output_logit_dtype", &ParsePrecision, &dtype));
         t->output_logit_dtype = dtype;
         return Status::OK();
       }},
      {"attention",
       [&](const YAML::Node& v) {
         return ReadEnum(v, source, "attention", &ParseAttention, &t->attention);
       }},
      {"recompute",
       [&](const YAML::Node& v) {
         return ReadEnum(v, source, "recompute", &ParseRecompute, &t->recompute);
       }},
      {"recompute_method",
       [&](const YAML::Node& v) {
         return ReadEnum(v, source, "recompute_method", &ParseRecomputeMethod,
                         &t->recompute_method);
       }},
      {"recompute_num_layers",
       [&](const YAML::Node& v) {
         return Read(v, source, "recompute_num_layers", &t->recompute_num_layers);
       }},
      {"fp8",
       [&](const YAML::Node& v) { return ReadEnum(v, source, "fp8", &ParseFp8Recipe, &t->fp8); }},
      {"fp8_param_gather",
       [&](const YAML::Node& v) {
         return Read(v, source, "fp8_param_gather", &t->fp8_param_gather);
       }},
      {"fp8_amax_history_len",
       [&](const YAML::Node& v) {
         return Read(v, source, "fp8_amax_history_len", &t->fp8_amax_history_len);
       }},
      {"fp8_bf16_layers_at_start",
       [&](const YAML::Node& v) {
         return Read(v, source, "fp8_bf16_layers_at_start", &t->fp8_bf16_layers_at_start);
       }},
      {"fp8_bf16_layers_at_end",
       [&](const YAML::Node& v) {
         return Read(v, source, "fp8_bf16_layers_at_end", &t->fp8_bf16_layers_at_end);
       }},
      {"tp_comm_overlap",
       [&](const YAML::Node& v) {
         return Read(v, source, "tp_comm_overlap", &t->tp_comm_overlap);
       }},
      {"tp_comm_overlap_ag",
       [&](const YAML::Node& v) {
         return Read(v, source, "tp_comm_overlap_ag", &t->tp_comm_overlap_ag);
       }},
      {"tp_comm_bulk_dgrad",
       [&](const YAML::Node& v) {
         return Read(v, source, "tp_comm_bulk_dgrad", &t->tp_comm_bulk_dgrad);
       }},
      {"tp_comm_bulk_wgrad",
       [&](const YAML::Node& v) {
         return Read(v, source, "tp_comm_bulk_wgrad", &t->tp_comm_bulk_wgrad);
       }},
      {"precision_aware_optimizer",
       [&](const YAML::Node& v) {
         return Read(v, source, "precision_aware_optimizer", &t->precision_aware_optimizer);
       }},
      {"main_grads_dtype",
       [&](const YAML::Node& v) {
         return ReadEnum(v, source, "main_grads_dtype", &ParsePrecision, &t->main_grads_dtype);
       }},
      {"exp_avg_dtype",
       [&](const YAML::Node& v) {
         return ReadEnum(v, source, "exp_avg_dtype", &ParsePrecision, &t->exp_avg_dtype);
       }},
      {"exp_avg_sq_dtype",
       [&](const YAML::Node& v) {
         return ReadEnum(v, source, "exp_avg_sq_dtype", &ParsePrecision, &t->exp_avg_sq_dtype);
       }},
      {"store_param_remainders",
       [&](const YAML::Node& v) {
         return Read(v, source, "store_param_remainders", &t->store_param_remainders);
       }},
      {"moe_router_fusion",
       [&](const YAML::Node& v) {
         return Read(v, source, "moe_router_fusion", &t->moe_router_fusion);
       }},
      {"moe_router_padding",
       [&](const YAML::Node& v) {
         return Read(v, source, "moe_router_padding", &t->moe_router_padding);
       }},
      {"experimental",
       [&](const YAML::Node& v) { return Read(v, source, "experimental", &t->experimental); }},
      {"te_op_fuser",
       [&](const YAML::Node& v) { return Read(v, source, "te_op_fuser", &t->te_op_fuser); }},
      {"grad_reduce_in_bf16",
       [&](const YAML::Node& v) {
         return Read(v, source, "grad_reduce_in_bf16", &t->grad_reduce_in_bf16);
       }},
      {"distribute_saved_activations",
       [&](const YAML::Node& v) {
         return Read(v, source, "distribute_saved_activations", &t->distribute_saved_activations);
       }},
      {"recompute_modules",
       [&](const YAML::Node& v) {
         // A list of names, as Megatron's --recompute-modules takes them.
         std::vector<std::string> names;
         MEMSIM_RETURN_IF_ERROR(Read(v, source, "recompute_modules", &names));
         Status s = ParseRecomputeModules(names, &t->recompute_modules);
         return s.ok() ? s
                       : Status::Error(Where(source, v) + ": recompute_modules: " + s.message());
       }},
      {"offload_modules",
       [&](const YAML::Node& v) {
         // Fine-grained activation offloading, as Megatron's --offload-modules names them.
         std::vector<std::string> names;
         MEMSIM_RETURN_IF_ERROR(Read(v, source, "offload_modules", &names));
         Status s = ParseOffloadModules(names, &t->offload_modules);
         return s.ok() ? s : Status::Error(Where(source, v) + ": offload_modules: " + s.message());
       }},
      {"cuda_graph_modules",
       [&](const YAML::Node& v) {
         // Transformer Engine's CUDA graphs of these modules; an empty list: whole layers.
         std::vector<std::string> names;
         MEMSIM_RETURN_IF_ERROR(Read(v, source, "cuda_graph_modules", &names));
         Status s = ParseCudaGraphModules(names, &t->cuda_graph_modules);
         if (!s.ok())
           return Status::Error(Where(source, v) + ": cuda_graph_modules: " + s.message());
         t->cuda_graphs = true;
         return Status::OK();
       }},
      {"cpu_offloading_num_layers",
       [&](const YAML::Node& v) {
         return Read(v, source, "cpu_offloading_num_layers", &t->cpu_offloading_num_layers);
       }},
      {"cuda_graph_warmup_steps",
       [&](const YAML::Node& v) {
         return Read(v, source, "cuda_graph_warmup_steps", &t->cuda_graph_warmup_steps);
       }},
      {"min_offloaded_tensor_size",
       [&](const YAML::Node& v) {
         return Read(v, source, "min_offloaded_tensor_size", &t->min_offloaded_tensor_elements);
       }},
      {"fine_grained_offloading_max_inflight_offloads",
       [&](const YAML::Node& v) {
         return Read(v, source, "fine_grained_offloading_max_inflight_offloads",
                     &t->max_inflight_offloads);
       }},
      {"empty_unused_memory_level",
       [&](const YAML::Node& v) {
         return Read(v, source, "empty_unused_memory_level", &t->empty_unused_memory_level);
       }},
      {"optimizer",
       [&](const YAML::Node& v) {
         return ReadEnum(v, source, "optimizer", &ParseOptimizer, &t->optimizer);
       }},
      {"dropout", [&](const YAML::Node& v) { return Read(v, source, "dropout", &t->dropout); }},
      {"fp32_residual_connection",
       [&](const YAML::Node& v) {
         return Read(v, source, "fp32_residual_connection", &t->fp32_residual_connection);
       }},
      {"clone_scatter_output_in_embedding",
       [&](const YAML::Node& v) {
         return Read(v, source, "clone_scatter_output_in_embedding",
                     &t->clone_scatter_output_in_embedding);
       }},
      {"bias_activation_fusion",
       [&](const YAML::Node& v) {
         return Read(v, source, "bias_activation_fusion", &t->bias_activation_fusion);
       }},
      {"te_activation_func",
       [&](const YAML::Node& v) {
         return Read(v, source, "te_activation_func", &t->te_activation_func);
       }},
      {"fused_weighted_squared_relu",
       [&](const YAML::Node& v) {
         return Read(v, source, "fused_weighted_squared_relu", &t->fused_weighted_squared_relu);
       }},
      {"log_max_attention_logit",
       [&](const YAML::Node& v) {
         return Read(v, source, "log_max_attention_logit", &t->log_max_attention_logit);
       }},
      {"qk_clip", [&](const YAML::Node& v) { return Read(v, source, "qk_clip", &t->qk_clip); }},
      {"moe_shared_expert_overlap",
       [&](const YAML::Node& v) {
         return Read(v, source, "moe_shared_expert_overlap", &t->moe_shared_expert_overlap);
       }},
      {"log_num_zeros_in_grad",
       [&](const YAML::Node& v) {
         return Read(v, source, "log_num_zeros_in_grad", &t->log_num_zeros_in_grad);
       }},
      {"mlp_chunks_for_training",
       [&](const YAML::Node& v) {
         return Read(v, source, "mlp_chunks_for_training", &t->mlp_chunks_for_training);
       }},
      {"create_attention_mask",
       [&](const YAML::Node& v) {
         return Read(v, source, "create_attention_mask", &t->create_attention_mask);
       }},
      {"rope_fusion",
       [&](const YAML::Node& v) { return Read(v, source, "rope_fusion", &t->rope_fusion); }},
      {"deterministic_algorithms",
       [&](const YAML::Node& v) {
         return Read(v, source, "deterministic_algorithms", &t->deterministic_algorithms);
       }},
      {"profile",
       [&](const YAML::Node& v) {
         return ReadEnum(v, source, "profile", &ParseProfile, &t->profile);
       }},
      {"global_batch_size",
       [&](const YAML::Node& v) {
         return Read(v, source, "global_batch_size", global_batch_size);
       }},
  };
  MEMSIM_RETURN_IF_ERROR(ApplyKeys(node, source, "training", handlers));
  // Modules count only under selective recomputation; a file naming them means that (a
  // sweep or plan may vary the recomputation afterwards).
  if (node["recompute_modules"] && t->recompute != RecomputeKind::kSelective) {
    return Status::Error(Where(source, node["recompute_modules"]) +
                         ": recompute_modules needs recompute: selective");
  }
  if (iterations <= 0 || iterations > 1000) {
    return Status::Error(source + ": iterations must be in [1, 1000], got " +
                         std::to_string(iterations));
  }
  t->iterations = static_cast<int32_t>(iterations);
  return Status::OK();
}

Status LoadModelPreset(const std::string& name, ModelConfig* model) {
  // The presets being loaded on this thread, outermost first: a `base:` chain that comes
  // back to one of them is a cycle.
  thread_local std::vector<std::string> chain;
  if (std::find(chain.begin(), chain.end(), name) != chain.end()) {
    std::string cycle;
    for (const std::string& n : chain) cycle += n + " -> ";
    return Status::Error("model preset '" + chain.front() + "': its base chain is a cycle (" +
                         cycle + name + ")");
  }
  chain.push_back(name);
  struct Pop {
    ~Pop() { chain.pop_back(); }
  } pop;
  const std::string path = ConfigDir() + "/models/" + name + ".yaml";
  std::error_code ec;  // a name too long for the OS is unknown, not an exception
  if (name.empty() || name.find('/') != std::string::npos || !fs::is_regular_file(path, ec)) {
    std::string known;
    for (const std::string& n : ModelPresetNames()) known += (known.empty() ? "" : ", ") + n;
    return Status::Error("unknown model preset '" + name + "' (known: " + known + ")");
  }
  YAML::Node node;
  MEMSIM_RETURN_IF_ERROR(LoadYamlFile(path, &node));
  *model = ModelConfig();
  model->name = name;
  return ApplyModelYaml(node, path, model);
}

Status LoadRunFile(const std::string& path, RunSpec* spec) {
  YAML::Node node;
  MEMSIM_RETURN_IF_ERROR(LoadYamlFile(path, &node));
  std::map<std::string, YamlKeyHandler> handlers = {
      {"model",
       [&](const YAML::Node& v) {
         if (v.IsScalar()) {
           spec->model_source = v.as<std::string>();
           Status s = LoadModelPreset(spec->model_source, &spec->model);
           return s.ok() ? s : Status::Error(Where(path, v) + ": " + s.message());
         }
         spec->model_source = path;
         return ApplyModelYaml(v, path, &spec->model);
       }},
      {"training",
       [&](const YAML::Node& v) {
         return ApplyTrainingYaml(v, path, &spec->training, &spec->global_batch_size);
       }},
      {"layout", [&](const YAML::Node& v) { return ApplyLayoutYaml(v, path, &spec->layout); }},
      {"gpu",
       [&](const YAML::Node& v) {
         std::string name;
         MEMSIM_RETURN_IF_ERROR(Read(v, path, "gpu", &name));
         Status s = ParseGpu(name, &spec->gpu);
         return s.ok() ? s : Status::Error(Where(path, v) + ": " + s.message());
       }},
  };
  return ApplyKeys(node, path, "run file", handlers);
}

Status LoadDefaultRun(RunSpec* spec) {
  return LoadRunFile(ConfigDir() + "/runs/default.yaml", spec);
}

}  // namespace memsim
