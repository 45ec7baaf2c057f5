#include "tools/lib/hf_config.h"

#include "tools/lib/json_reader.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "simulator/checked_math.h"

namespace memsim {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

enum class Family {
  kLlama,
  kMistral,
  kQwen2,
  kQwen3,
  kQwen3Moe,
  kMixtral,
  kDeepseekV3,
  kGlm4Moe,
  kPhi3,
  kGptOss,
  kGemma2,
  kGemma3Text
};

struct FamilyInfo {
  const char* model_type;
  const char* architecture;  // the causal-LM class memsim's decoder mirrors
  Family family;
};

constexpr FamilyInfo kFamilies[] = {
    {"llama", "LlamaForCausalLM", Family::kLlama},
    {"mistral", "MistralForCausalLM", Family::kMistral},
    {"qwen2", "Qwen2ForCausalLM", Family::kQwen2},
    {"qwen3", "Qwen3ForCausalLM", Family::kQwen3},
    {"qwen3_moe", "Qwen3MoeForCausalLM", Family::kQwen3Moe},
    {"mixtral", "MixtralForCausalLM", Family::kMixtral},
    {"deepseek_v3", "DeepseekV3ForCausalLM", Family::kDeepseekV3},
    {"glm4_moe", "Glm4MoeForCausalLM", Family::kGlm4Moe},
    {"phi3", "Phi3ForCausalLM", Family::kPhi3},
    {"gpt_oss", "GptOssForCausalLM", Family::kGptOss},
    {"gemma2", "Gemma2ForCausalLM", Family::kGemma2},
    {"gemma3_text", "Gemma3ForCausalLM", Family::kGemma3Text},
};

// Keys that do not change training memory, accepted and ignored in every family:
// PretrainedConfig's bookkeeping, token ids and generation defaults; initialisation and
// norm epsilon; RoPE's base and scaling (they change the rotation, not any tensor's
// size); torch_dtype/dtype (the run's precision decides the dtypes).
const std::set<std::string> kNeutralKeys = {
    "_attn_implementation_autoset",
    "_name_or_path",
    "add_cross_attention",
    "auto_map",
    "bad_words_ids",
    "begin_suppress_tokens",
    "bos_token_id",
    "chunk_size_feed_forward",
    "cross_attention_hidden_size",
    "decoder_start_token_id",
    "diversity_penalty",
    "do_sample",
    "dtype",
    "early_stopping",
    "encoder_no_repeat_ngram_size",
    "eos_token_id",
    "exponential_decay_length_penalty",
    "finetuning_task",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "id2label",
    "initializer_range",
    "is_decoder",
    "is_encoder_decoder",
    "label2id",
    "length_penalty",
    "max_length",
    "min_length",
    "no_repeat_ngram_size",
    "num_beam_groups",
    "num_beams",
    "num_return_sequences",
    "output_attentions",
    "output_hidden_states",
    "output_scores",
    "pad_token_id",
    "prefix",
    "problem_type",
    "pruned_heads",
    "remove_invalid_values",
    "repetition_penalty",
    "return_dict",
    "return_dict_in_generate",
    "rms_norm_eps",
    "rope_parameters",
    "rope_scaling",
    "rope_theta",
    "sep_token_id",
    "suppress_tokens",
    "task_specific_params",
    "temperature",
    "tf_legacy_loss",
    "tie_encoder_decoder",
    "tokenizer_class",
    "top_k",
    "top_p",
    "torch_dtype",
    "torchscript",
    "transformers_version",
    "typical_p",
    "use_bfloat16",
    "use_cache",
};

// Memory-neutral keys of one family:
//   pretraining_tp: how HF splits the matmuls at inference, not the weights' shapes;
//   sliding_window (and Qwen2's use_sliding_window, max_window_layers, layer_types): a
//     window mask changes which scores count, not the size of what attention saves
//     (flash keeps O and the log-sum-exp; eager masks a full S x S score matrix). Where
//     Megatron-Bridge builds the window (Mistral, gpt-oss, Gemma-3) it is read instead: it
//     decides which context parallelism Transformer Engine allows;
//   Mixtral's and Qwen3-MoE's router_aux_loss_coef, router_jitter_noise,
//     output_router_logits (and DeepSeek's norm_topk_prob, a rescaling of the sigmoid
//     router's top-k, which Megatron's router does for K > 1 anyway), DeepSeek's aux_loss_alpha
//     and seq_aux (how the original run weighted its aux loss, a training choice: memsim's
//     is --moe-aux-loss-coeff);
//   ep_size: DeepSeek's inference-time expert split;
//   gpt-oss's initial_context_length (YaRN's original length);
//   Phi-3's original_max_position_embeddings (LongRoPE's scaling base),
//     partial_rotary_factor (RoPE rotates part of each head; the rotated query and key are
//     as large either way; GLM-4.5's too) and attention_bias (Phi3Attention's projections
//     never have one).
std::set<std::string> FamilyNeutralKeys(Family family) {
  switch (family) {
    case Family::kLlama:
      return {"pretraining_tp"};
    case Family::kMistral:
      return {};
    case Family::kQwen2:
    case Family::kQwen3:
      return {"sliding_window", "use_sliding_window", "max_window_layers", "layer_types"};
    case Family::kQwen3Moe:
      return {"sliding_window", "use_sliding_window",   "max_window_layers",
              "layer_types",    "router_aux_loss_coef", "output_router_logits"};
    case Family::kMixtral:
      return {"sliding_window", "router_aux_loss_coef", "router_jitter_noise",
              "output_router_logits"};
    case Family::kPhi3:
      return {"sliding_window", "original_max_position_embeddings", "partial_rotary_factor",
              "attention_bias"};
    case Family::kGptOss:
      return {"layer_types", "initial_context_length", "router_aux_loss_coef",
              "output_router_logits"};
    case Family::kDeepseekV3:
      return {"pretraining_tp", "ep_size", "norm_topk_prob",
              "aux_loss_alpha", "seq_aux", "rope_interleave"};
    case Family::kGlm4Moe:
      return {"norm_topk_prob", "partial_rotary_factor"};
    case Family::kGemma2:
      // query_pre_attn_scalar: the scores' scale; attn_logit_softcapping: their cap, inside
      // FlexAttention's kernel; cache_implementation: inference only.
      return {"sliding_window", "query_pre_attn_scalar", "attn_logit_softcapping",
              "cache_implementation"};
    case Family::kGemma3Text:
      // Also which layers slide and the local layers' RoPE base; Megatron-Bridge's Gemma-3
      // reads neither soft cap (Transformer Engine's attention and a plain output layer).
      return {"sliding_window",         "sliding_window_pattern",  "layer_types",
              "query_pre_attn_scalar",  "cache_implementation",    "rope_local_base_freq",
              "attn_logit_softcapping", "final_logit_softcapping", "use_bidirectional_attention"};
  }
  return {};
}

std::string Shown(const json& value) {
  std::string text = value.dump();
  return text.size() > 40 ? text.substr(0, 37) + "..." : text;
}

// Reads keys of one config.json, remembering which it has read so that the rest can
// be checked against the neutral lists.
class Reader {
 public:
  Reader(const json& root, const std::string& path) : root_(root), path_(path) {}

  // An absent key, or one set to null, leaves `*out` unchanged; a required one is an
  // error.
  Status Int(const char* key, bool required, int64_t* out) {
    const json* v = Find(key);
    if (v == nullptr) return required ? Missing(key) : Status::OK();
    if (v->is_number_unsigned() && v->get<uint64_t>() > std::numeric_limits<int64_t>::max()) {
      return Status::Error(path_ + ": '" + key + "' is " + Shown(*v) + ", out of range");
    }
    if (!v->is_number_integer()) return WrongType(key, "an integer", *v);
    *out = v->get<int64_t>();
    return Status::OK();
  }
  Status Bool(const char* key, bool* out) {
    const json* v = Find(key);
    if (v == nullptr) return Status::OK();
    if (!v->is_boolean()) return WrongType(key, "true or false", *v);
    *out = v->get<bool>();
    return Status::OK();
  }
  Status Number(const char* key, double* out) {
    const json* v = Find(key);
    if (v == nullptr) return Status::OK();
    if (!v->is_number()) return WrongType(key, "a number", *v);
    *out = v->get<double>();
    return Status::OK();
  }
  Status String(const char* key, bool required, std::string* out) {
    const json* v = Find(key);
    if (v == nullptr) return required ? Missing(key) : Status::OK();
    if (!v->is_string()) return WrongType(key, "a string", *v);
    *out = v->get<std::string>();
    return Status::OK();
  }
  // The length of the list `key` (0 when absent).
  Status ListSize(const char* key, size_t* size) {
    const json* v = Find(key);
    *size = 0;
    if (v == nullptr) return Status::OK();
    if (!v->is_array()) return WrongType(key, "a list", *v);
    *size = v->size();
    return Status::OK();
  }
  // Marks `key` as read without looking at it; true when it is present and not null.
  bool Take(const char* key) { return Find(key) != nullptr; }

  // Every key not read must be memory-neutral; those are appended to `*ignored`.
  Status CheckRest(const std::set<std::string>& family_neutral, const std::string& model_type,
                   std::vector<std::string>* ignored) {
    for (const auto& [key, _] : root_.items()) {
      if (read_.count(key)) continue;
      if (kNeutralKeys.count(key) || family_neutral.count(key)) {
        ignored->push_back(key);
        continue;
      }
      return Status::Error(path_ + ": unknown key '" + key + "' for model_type " + model_type +
                           "; memsim does not know whether it changes memory (if it does " +
                           "not, remove it from a copy of the file)");
    }
    return Status::OK();
  }

 private:
  const json* Find(const char* key) {
    read_.insert(key);
    auto it = root_.find(key);
    return it == root_.end() || it->is_null() ? nullptr : &*it;
  }
  Status Missing(const char* key) const {
    return Status::Error(path_ + ": missing required key '" + key + "'");
  }
  Status WrongType(const char* key, const char* expected, const json& v) const {
    return Status::Error(path_ + ": '" + key + "' must be " + expected + ", got " + Shown(v));
  }

  const json& root_;
  const std::string& path_;
  std::set<std::string> read_;
};

Status ParseFile(const std::string& path, json* out) {
  MEMSIM_RETURN_IF_ERROR(ParseJsonFile(path, out));
  if (!out->is_object()) return Status::Error(path + ": the top level must be a JSON object");
  return Status::OK();
}

// The model's name: the folder holding config.json, which for the Hugging Face cache
// (models--ORG--NAME/snapshots/HASH/config.json) is the repository's NAME.
std::string ModelName(const std::string& path, const std::string& model_type) {
  const fs::path folder = fs::path(path).parent_path();
  if (folder.filename().empty()) return model_type;
  if (folder.parent_path().filename() == "snapshots") {
    const std::string repo = folder.parent_path().parent_path().filename().string();
    const size_t sep = repo.rfind("--");
    if (repo.rfind("models--", 0) == 0 && sep != std::string::npos) return repo.substr(sep + 2);
  }
  return folder.filename().string();
}

// The mixture of experts DeepSeek-V3 and GLM-4.5 share (Glm4Moe reuses DeepseekV3's decoder
// layer and router): first_k_dense_replace dense layers, then routed experts beside
// n_shared_experts shared ones on every layer; Hugging Face's DeepseekV3TopkRouter scores
// with a sigmoid and chooses with e_score_correction_bias (the original configs' scoring_func
// sigmoid and topk_method noaux_tc, read where given), scales by routed_scaling_factor and
// limits the choice to topk_group of n_group groups, mapped as Megatron-Bridge maps them.
// Neither Hugging Face class trains the multi-token-prediction layers.
// Defaults of the routing keys a config may leave out: its class's.
struct RouterDefaults {
  double routed_scaling_factor;
  int64_t n_group, topk_group;
};
constexpr RouterDefaults kDeepseekV3Router = {2.5, 8, 4};  // DeepseekV3Config
constexpr RouterDefaults kGlm4MoeRouter = {1.0, 1, 1};     // Glm4MoeConfig

Status ReadDeepseekMoe(Reader& r, const std::string& path, const RouterDefaults& defaults,
                       const std::function<void(const std::string&)>& note, ModelConfig* model) {
  ModelConfig& m = *model;
  MEMSIM_RETURN_IF_ERROR(r.Int("n_routed_experts", true, &m.num_experts));
  MEMSIM_RETURN_IF_ERROR(r.Int("num_experts_per_tok", true, &m.moe_router_topk));
  MEMSIM_RETURN_IF_ERROR(r.Int("moe_intermediate_size", true, &m.moe_ffn_hidden_size));
  MEMSIM_RETURN_IF_ERROR(r.Int("first_k_dense_replace", true, &m.moe_first_k_dense_layers));
  int64_t shared = 0;
  MEMSIM_RETURN_IF_ERROR(r.Int("n_shared_experts", false, &shared));
  if (shared < 0) return Status::Error(path + ": 'n_shared_experts' must not be negative");
  m.moe_shared_expert_size = CheckedMul(shared, m.moe_ffn_hidden_size);
  int64_t freq = 1;
  MEMSIM_RETURN_IF_ERROR(r.Int("moe_layer_freq", false, &freq));
  if (freq != 1) {
    return Status::Error(path + ": moe_layer_freq " + std::to_string(freq) +
                         " is not modelled (memsim's MoE layers are every layer after " +
                         "first_k_dense_replace: moe_layer_freq 1)");
  }
  std::string scoring = "sigmoid", topk_method = "noaux_tc";
  MEMSIM_RETURN_IF_ERROR(r.String("scoring_func", false, &scoring));
  MEMSIM_RETURN_IF_ERROR(
      ParseEnum(kMoeScoreFunctionNames, scoring, "scoring_func", &m.moe_router_score_function));
  MEMSIM_RETURN_IF_ERROR(r.String("topk_method", false, &topk_method));
  if (topk_method != "greedy" && topk_method != "group_limited_greedy" &&
      topk_method != "noaux_tc") {
    return Status::Error(path + ": topk_method '" + topk_method +
                         "' is not modelled (greedy, group_limited_greedy, noaux_tc)");
  }
  m.moe_router_expert_bias = topk_method == "noaux_tc";
  m.moe_router_topk_scaling_factor = defaults.routed_scaling_factor;
  MEMSIM_RETURN_IF_ERROR(r.Number("routed_scaling_factor", &m.moe_router_topk_scaling_factor));
  m.moe_router_num_groups = defaults.n_group;
  m.moe_router_group_topk = defaults.topk_group;
  MEMSIM_RETURN_IF_ERROR(r.Int("n_group", false, &m.moe_router_num_groups));
  MEMSIM_RETURN_IF_ERROR(r.Int("topk_group", false, &m.moe_router_group_topk));
  if (topk_method == "greedy" || m.moe_router_num_groups <= 1) {
    m.moe_router_num_groups = m.moe_router_group_topk = 0;  // one group: no group limit
  }
  int64_t mtp = 0;
  MEMSIM_RETURN_IF_ERROR(r.Int("num_nextn_predict_layers", false, &mtp));
  if (mtp > 0) {
    note("num_nextn_predict_layers " + std::to_string(mtp) +
         " ignored: Hugging Face's model does not train the multi-token-prediction layers "
         "(Megatron-LM's do: mtp_num_layers in a model YAML, or --mtp-num-layers)");
  }
  return Status::OK();
}

// The decoder layer Megatron-Bridge builds for Gemma-2 and Gemma-3 (Note [Gemma-2] in
// models/transformer.h): GeGLU, norms after both projections, the embedding scaled by
// sqrt(H); head_dim, and attention_bias as CONFIG_MAPPING maps it (linear_qkv's bias).
Status ReadGemmaLayer(Reader& r, ModelConfig* model) {
  model->megatron_bridge = true;
  model->activation = ActivationKind::kGeglu;
  model->post_projection_norms = true;
  model->scale_embeddings = true;
  MEMSIM_RETURN_IF_ERROR(r.Int("head_dim", false, &model->kv_channels));
  return r.Bool("attention_bias", &model->add_qkv_bias);
}

}  // namespace

Status LoadHfConfig(const std::string& path, ModelConfig* model,
                    std::vector<std::string>* approximations) {
  json root;
  MEMSIM_RETURN_IF_ERROR(ParseFile(path, &root));
  Reader r(root, path);
  auto note = [&](const std::string& line) {
    if (approximations != nullptr) approximations->push_back(path + ": " + line);
  };

  std::string model_type;
  MEMSIM_RETURN_IF_ERROR(r.String("model_type", /*required=*/true, &model_type));
  const FamilyInfo* info = nullptr;
  for (const FamilyInfo& f : kFamilies) {
    if (model_type == f.model_type) info = &f;
  }
  // Families Megatron-Core 0.20 does not build as Hugging Face defines them, or that memsim
  // does not model yet, with why.
  static constexpr std::pair<const char*, const char*> kRefused[] = {
      {"gemma3",
       "Gemma-3's vision tower is not modelled; its text model is (the file's text_config, "
       "model_type gemma3_text, as a config.json of its own)"},
      {"glm4",
       "GLM-4's norms after attention and the MLP: neither Megatron-Core 0.20 nor "
       "Megatron-Bridge (067f987d) builds the dense GLM-4"},
  };
  for (const auto& [type, why] : kRefused) {
    if (model_type == type) {
      return Status::Error(path + ": model_type '" + model_type + "' is not modelled: " + why);
    }
  }
  if (info == nullptr) {
    std::string supported;
    for (const FamilyInfo& f : kFamilies) {
      supported += std::string(supported.empty() ? "" : ", ") + f.model_type;
    }
    return Status::Error(path + ": unsupported model_type '" + model_type +
                         "' (supported: " + supported + ")");
  }
  const Family family = info->family;
  if (r.Take("architectures")) {
    const json& archs = root.at("architectures");
    if (!archs.is_array()) {
      return Status::Error(path + ": 'architectures' must be a list of strings, got " +
                           Shown(archs));
    }
    for (const json& a : archs) {
      if (!a.is_string() || a.get<std::string>() != info->architecture) {
        return Status::Error(path + ": unsupported architecture " + Shown(a) + " for model_type " +
                             model_type + " (memsim builds " + info->architecture + ")");
      }
    }
  }

  // The llama architecture of run_config.cc: RMSNorm, SwiGLU, RoPE, untied, no biases.
  // These decoders have no residual dropout; attention dropout is the file's (0 default).
  ModelConfig m;
  m.name = ModelName(path, model_type);
  m.norm = NormKind::kRmsNorm;
  m.activation = ActivationKind::kSwiglu;
  m.position = PositionKind::kRope;
  const bool gemma = family == Family::kGemma2 || family == Family::kGemma3Text;
  m.tie_embeddings = gemma;  // Gemma's configs tie them by default
  m.add_bias_linear = false;
  m.add_qkv_bias = family == Family::kQwen2;  // Qwen2's q/k/v projections always have biases
  m.hidden_dropout = 0.0;
  m.attention_dropout = 0.0;

  MEMSIM_RETURN_IF_ERROR(r.Int("hidden_size", true, &m.hidden_size));
  MEMSIM_RETURN_IF_ERROR(r.Int("num_hidden_layers", true, &m.num_layers));
  MEMSIM_RETURN_IF_ERROR(r.Int("num_attention_heads", true, &m.num_attention_heads));
  MEMSIM_RETURN_IF_ERROR(r.Int("intermediate_size", true, &m.ffn_hidden_size));
  // GptOssForCausalLM writes hidden_act silu for its own clamped GLU (below).
  MEMSIM_RETURN_IF_ERROR(r.Int("vocab_size", true, &m.vocab_size));
  // Llama's and Phi-3's num_key_value_heads default to the attention heads; the other
  // classes default to a fixed number, so an absent value would be a guess.
  MEMSIM_RETURN_IF_ERROR(r.Int("num_key_value_heads",
                               family != Family::kLlama && family != Family::kPhi3,
                               &m.num_query_groups));
  MEMSIM_RETURN_IF_ERROR(r.Bool("tie_word_embeddings", &m.tie_embeddings));
  MEMSIM_RETURN_IF_ERROR(r.Number("attention_dropout", &m.attention_dropout));
  // RoPE models have no position table: the length limit allocates nothing.
  int64_t max_positions = 0;
  MEMSIM_RETURN_IF_ERROR(r.Int("max_position_embeddings", false, &max_positions));
  std::string act = gemma ? "gelu_pytorch_tanh" : "silu";
  MEMSIM_RETURN_IF_ERROR(r.String("hidden_act", false, &act));
  if (gemma) {
    // Gemma's configs also write hidden_activation. Gemma2Bridge builds fast_gelu (the tanh
    // approximation) whatever they say; Gemma3ModelBridge maps hidden_act, and fast_gelu is
    // what gelu_pytorch_tanh maps to.
    std::string activation = "gelu_pytorch_tanh";
    MEMSIM_RETURN_IF_ERROR(r.String("hidden_activation", false, &activation));
    for (const std::string& name : {act, activation}) {
      if (name == "gelu_pytorch_tanh") continue;
      if (family == Family::kGemma3Text) {
        return Status::Error(
            path + ": activation '" + name + "' is not modelled for " + model_type +
            " (memsim's Gemma MLP is GeGLU with fast_gelu: " + "gelu_pytorch_tanh)");
      }
      note("activation '" + name + "' taken as fast_gelu, as Megatron-Bridge's Gemma2Bridge " +
           "builds it whatever the file says");
      break;
    }
  } else if (act != "silu") {
    return Status::Error(path + ": hidden_act '" + act +
                         "' is not modelled (memsim's gated MLP is SwiGLU: hidden_act silu)");
  }
  if (r.Take("quantization_config")) {
    note("quantization_config ignored: memsim simulates training in the run's precision");
  }

  switch (family) {
    case Family::kLlama: {
      MEMSIM_RETURN_IF_ERROR(r.Int("head_dim", false, &m.kv_channels));
      // HF's attention_bias covers q, k, v and o; mlp_bias the MLP. memsim's output
      // projection bias follows add_bias_linear (the MLP's), so it differs by H elements
      // per layer when exactly one is set.
      MEMSIM_RETURN_IF_ERROR(r.Bool("attention_bias", &m.add_qkv_bias));
      MEMSIM_RETURN_IF_ERROR(r.Bool("mlp_bias", &m.add_bias_linear));
      if (m.add_qkv_bias != m.add_bias_linear) {
        note(std::string("the attention output projection's bias follows mlp_bias, not ") +
             "attention_bias (" + std::to_string(m.hidden_size) + " elements per layer)");
      }
      break;
    }
    case Family::kMistral:
    case Family::kQwen2:
      MEMSIM_RETURN_IF_ERROR(r.Int("head_dim", false, &m.kv_channels));
      if (family == Family::kMistral) {
        // MistralBridge builds a window from a non-null sliding_window.
        int64_t window = 0;
        MEMSIM_RETURN_IF_ERROR(r.Int("sliding_window", false, &window));
        m.sliding_window = window > 0;
      }
      break;
    case Family::kQwen3:
    case Family::kQwen3Moe: {
      // Qwen3: an RMSNorm over each head's query and key (q_norm, k_norm), head_dim wide.
      m.qk_layernorm = true;
      MEMSIM_RETURN_IF_ERROR(r.Int("head_dim", false, &m.kv_channels));
      MEMSIM_RETURN_IF_ERROR(r.Bool("attention_bias", &m.add_qkv_bias));
      if (family == Family::kQwen3) break;
      // transformers 4 writes num_experts, 5 num_local_experts.
      MEMSIM_RETURN_IF_ERROR(r.Int("num_experts", false, &m.num_experts));
      MEMSIM_RETURN_IF_ERROR(r.Int("num_local_experts", m.num_experts == 0, &m.num_experts));
      MEMSIM_RETURN_IF_ERROR(r.Int("num_experts_per_tok", true, &m.moe_router_topk));
      MEMSIM_RETURN_IF_ERROR(r.Int("moe_intermediate_size", true, &m.moe_ffn_hidden_size));
      // Qwen3MoeBridge: moe_router_pre_softmax = not norm_topk_prob (Qwen3MoeConfig's default
      // False): the softmax over every expert, kept [T, E], or over the top-K, kept [T, K].
      bool norm_topk_prob = false;
      MEMSIM_RETURN_IF_ERROR(r.Bool("norm_topk_prob", &norm_topk_prob));
      m.moe_router_pre_softmax = !norm_topk_prob;
      int64_t sparse_step = 1;
      MEMSIM_RETURN_IF_ERROR(r.Int("decoder_sparse_step", false, &sparse_step));
      size_t dense_layers = 0;
      MEMSIM_RETURN_IF_ERROR(r.ListSize("mlp_only_layers", &dense_layers));
      if (sparse_step != 1 || dense_layers > 0) {
        return Status::Error(path + ": decoder_sparse_step " + std::to_string(sparse_step) +
                             " or a non-empty mlp_only_layers is not modelled (memsim's MoE " +
                             "layers are every layer)");
      }
      break;
    }
    case Family::kMixtral:
      MEMSIM_RETURN_IF_ERROR(r.Int("head_dim", false, &m.kv_channels));
      MEMSIM_RETURN_IF_ERROR(r.Int("num_local_experts", true, &m.num_experts));
      MEMSIM_RETURN_IF_ERROR(r.Int("num_experts_per_tok", true, &m.moe_router_topk));
      m.moe_ffn_hidden_size = m.ffn_hidden_size;  // every layer's MLP is the experts
      break;
    case Family::kPhi3: {
      // Phi3ForCausalLM: Llama's layer with q, k, v in one qkv_proj and gate and up in one
      // gate_up_proj (Megatron's fused layout already); dropout on the embedding
      // (embd_pdrop) and on each residual branch (resid_pdrop), which memsim's hidden
      // dropout applies to both.
      double resid = 0.0, embedding = 0.0;
      MEMSIM_RETURN_IF_ERROR(r.Number("resid_pdrop", &resid));
      MEMSIM_RETURN_IF_ERROR(r.Number("embd_pdrop", &embedding));
      m.hidden_dropout = resid;
      if (embedding != resid) {
        note("embd_pdrop " + std::to_string(embedding) + " taken as resid_pdrop " +
             std::to_string(resid) + ": memsim's hidden dropout is one probability");
      }
      break;
    }
    case Family::kGptOss: {
      // GptOssForCausalLM as Megatron-Core builds gpt-oss (its examples/gptoss launch line):
      // every layer's MLP is the experts; each expert's GLU is quick-GeGLU with offset 1,
      // both halves clamped at swiglu_limit (--quick-geglu --glu-linear-offset 1
      // --activation-func-clamp-value); the experts and router have biases; each head has a
      // learned attention sink (--softmax-type learnable); q, k, v, o biases follow
      // attention_bias.
      m.activation = ActivationKind::kQuickGeglu;
      m.softmax = SoftmaxKind::kLearnable;
      // GptOssBridge builds a window from sliding_window (on the sliding layer_types).
      int64_t window = 0;
      MEMSIM_RETURN_IF_ERROR(r.Int("sliding_window", false, &window));
      m.sliding_window = window > 0;
      m.add_bias_linear = true;
      m.add_qkv_bias = true;
      MEMSIM_RETURN_IF_ERROR(r.Int("head_dim", false, &m.kv_channels));
      MEMSIM_RETURN_IF_ERROR(r.Bool("attention_bias", &m.add_qkv_bias));
      if (!m.add_qkv_bias) {
        return Status::Error(path + ": attention_bias false is not modelled for gpt_oss " +
                             "(memsim's attention output bias follows the experts' biases)");
      }
      MEMSIM_RETURN_IF_ERROR(r.Int("num_local_experts", true, &m.num_experts));
      MEMSIM_RETURN_IF_ERROR(r.Int("num_experts_per_tok", true, &m.moe_router_topk));
      int64_t experts_per_token = m.moe_router_topk;
      MEMSIM_RETURN_IF_ERROR(r.Int("experts_per_token", false, &experts_per_token));
      if (experts_per_token != m.moe_router_topk) {
        return Status::Error(path + ": experts_per_token " + std::to_string(experts_per_token) +
                             " differs from num_experts_per_tok " +
                             std::to_string(m.moe_router_topk));
      }
      m.moe_ffn_hidden_size = m.ffn_hidden_size;
      m.activation_clamp_value = 7.0;  // GptOssConfig's default swiglu_limit
      MEMSIM_RETURN_IF_ERROR(r.Number("swiglu_limit", &m.activation_clamp_value));
      if (!(m.activation_clamp_value > 0)) {
        return Status::Error(path + ": 'swiglu_limit' must be positive");
      }
      note(
          "gpt-oss's attention sinks are modelled with Transformer Engine's fused attention "
          "(memsim simulate: --profile transformer_engine --attention fused)");
      break;
    }
    case Family::kDeepseekV3: {
      MEMSIM_RETURN_IF_ERROR(r.Bool("attention_bias", &m.add_qkv_bias));
      MEMSIM_RETURN_IF_ERROR(ReadDeepseekMoe(r, path, kDeepseekV3Router, note, &m));
      // Multi-head latent attention, as Megatron-Core's MLASelfAttention builds it.
      MEMSIM_RETURN_IF_ERROR(r.Int("q_lora_rank", false, &m.q_lora_rank));
      MEMSIM_RETURN_IF_ERROR(r.Int("kv_lora_rank", true, &m.kv_lora_rank));
      MEMSIM_RETURN_IF_ERROR(r.Int("qk_nope_head_dim", true, &m.qk_head_dim));
      MEMSIM_RETURN_IF_ERROR(r.Int("qk_rope_head_dim", true, &m.qk_pos_emb_head_dim));
      MEMSIM_RETURN_IF_ERROR(r.Int("v_head_dim", true, &m.v_head_dim));
      if (m.kv_lora_rank <= 0) {
        return Status::Error(path + ": 'kv_lora_rank' must be positive (multi-head latent " +
                             "attention)");
      }
      m.num_query_groups = 0;  // no grouped-query attention
      break;
    }
    case Family::kGemma2: {
      // Gemma2ForCausalLM as Megatron-Bridge's Gemma2Bridge and Gemma2ModelProvider build it
      // (Note [Gemma-2] in models/transformer.h): GeGLU, tied embeddings scaled by sqrt(H),
      // norms after the attention and MLP projections, FlexAttention with soft-capped scores,
      // soft-capped final logits, no dropout.
      MEMSIM_RETURN_IF_ERROR(ReadGemmaLayer(r, &m));
      m.flex_attention = true;
      m.attention_dropout = 0.0;  // the bridge sets it whatever the file says
      if (!m.tie_embeddings) {
        note(
            "tie_word_embeddings false ignored: Gemma2Bridge ties the output layer to the "
            "embedding whatever the file says");
        m.tie_embeddings = true;
      }
      // Gemma2Config's default cap; null (Python's None): no capping.
      m.final_logit_softcap = 30.0;
      MEMSIM_RETURN_IF_ERROR(r.Number("final_logit_softcapping", &m.final_logit_softcap));
      if (root.contains("final_logit_softcapping") && root["final_logit_softcapping"].is_null()) {
        m.final_logit_softcap = 0.0;
      }
      note(
          "Gemma-2 is modelled as Megatron-Bridge builds it, on Transformer Engine layers "
          "with FlexAttention (memsim simulate: --profile transformer_engine)");
      break;
    }
    case Family::kGemma3Text: {
      // Gemma3ForCausalLM as Megatron-Bridge's Gemma3ModelBridge and Gemma3ModelProvider
      // build it: Gemma-2's layer (norms after both projections, GeGLU, tied embeddings
      // scaled by sqrt(H)) with q/k RMSNorms and Transformer Engine's attention (sliding on
      // five layers of six), no soft-capping. Its two RoPE tables (local and global bases)
      // are not modelled, as no RoPE table is.
      MEMSIM_RETURN_IF_ERROR(ReadGemmaLayer(r, &m));
      m.qk_layernorm = true;
      m.sliding_window = true;
      note(
          "Gemma-3 is modelled as Megatron-Bridge builds it, on Transformer Engine layers "
          "with its FlashAttention backend (memsim simulate: --profile transformer_engine "
          "--attention flash)");
      break;
    }
    case Family::kGlm4Moe: {
      // Glm4MoeForCausalLM (GLM-4.5, GLM-4.5-Air): DeepSeek-V3's decoder layer with grouped-
      // query attention, head_dim wide; q, k, v biases follow attention_bias (o_proj has
      // none); use_qk_norm adds an RMSNorm over each head's query and key.
      MEMSIM_RETURN_IF_ERROR(r.Int("head_dim", false, &m.kv_channels));
      MEMSIM_RETURN_IF_ERROR(r.Bool("attention_bias", &m.add_qkv_bias));
      MEMSIM_RETURN_IF_ERROR(r.Bool("use_qk_norm", &m.qk_layernorm));
      MEMSIM_RETURN_IF_ERROR(ReadDeepseekMoe(r, path, kGlm4MoeRouter, note, &m));
      break;
    }
  }
  std::vector<std::string> ignored;
  MEMSIM_RETURN_IF_ERROR(r.CheckRest(FamilyNeutralKeys(family), model_type, &ignored));
  if (!ignored.empty()) {
    std::string keys;
    for (const std::string& key : ignored) keys += (keys.empty() ? "" : ", ") + key;
    note("ignored, as they do not change training memory: " + keys);
  }
  *model = m;
  return Status::OK();
}

}  // namespace memsim
