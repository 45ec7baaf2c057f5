#include "tools/lib/megatron_args.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <stdexcept>
#include <utility>

#include "ops/library_workspaces.h"
#include "simulator/check.h"
#include "simulator/checked_math.h"
#include "tools/lib/layer_pattern.h"
#include "tools/lib/megatron_arg_table.h"

namespace memsim {
namespace {

std::string Str(int64_t v) { return std::to_string(v); }

// `text` as the integer value of argument `name`.
Status ParseInt(const std::string& name, const std::string& text, int64_t* out) {
  const char* begin = text.data() + (text.rfind('+', 0) == 0 ? 1 : 0);
  const char* end = text.data() + text.size();
  int64_t v;
  auto [ptr, ec] = std::from_chars(begin, end, v);
  if (ec != std::errc() || ptr != end || begin == end) {
    return Status::Error(name + " expects an integer, got '" + text + "'");
  }
  *out = v;
  return Status::OK();
}

// `text` as the number value of argument `name`.
Status ParseFloat(const std::string& name, const std::string& text, double* out) {
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (text.empty() || end != text.c_str() + text.size()) {
    return Status::Error(name + " expects a number, got '" + text + "'");
  }
  *out = v;
  return Status::OK();
}

Status NotModelled(const std::string& arg, const std::string& what) {
  return Status::Error(arg + " changes memory in a way memsim does not model (" + what +
                       "); drop it to simulate the run without it");
}

// The arguments as given: the last occurrence of each wins, as with argparse.
class Args {
 public:
  Status Parse(const std::vector<std::string>& args) {
    for (size_t i = 0; i < args.size(); ++i) {
      const std::string& token = args[i];
      if (token.rfind("--", 0) != 0 || token.size() == 2) {
        return Status::Error("unexpected argument '" + token +
                             "': Megatron-LM arguments start with --");
      }
      const size_t eq = token.find('=');
      const std::string spelled = token.substr(0, eq);
      const MegatronArg* arg = FindMegatronArg(spelled);
      if (arg == nullptr) {
        return Status::Error("unknown Megatron-LM argument '" + spelled +
                             "': Megatron-LM 0.20 has no such argument; check its spelling");
      }
      if (arg->use == ArgUse::kRefused) return NotModelled(spelled, arg->reason);
      if (arg->use == ArgUse::kRejected) {
        return Status::Error(spelled + " is " + arg->reason);
      }
      // Another spelling of an argument is read, and reported, as the table's.
      const std::string name = arg->name;
      if (arg->use == ArgUse::kNeutral) ignored_.insert(name);
      const Arity arity = arg->arity;
      std::vector<std::string> values;
      if (eq != std::string::npos) {
        if (arity == Arity::kFlag) {
          return Status::Error(spelled + " takes no value, got '" + token + "'");
        }
        values.push_back(token.substr(eq + 1));
      } else if (arity != Arity::kFlag) {
        while (i + 1 < args.size() && args[i + 1].rfind("--", 0) != 0) {
          values.push_back(args[++i]);
          if (arity == Arity::kValue) break;
        }
        if (arity == Arity::kValue && values.empty()) {
          return Status::Error(spelled + " needs a value");
        }
      }
      if (!values_.count(name)) order_.push_back(name);
      values_[name] = std::move(values);
    }
    return Status::OK();
  }

  bool Has(const std::string& name) const { return values_.count(name) > 0; }
  // The value of a one-value argument; `fallback` when absent.
  std::string Text(const std::string& name, const std::string& fallback) const {
    auto it = values_.find(name);
    return it == values_.end() ? fallback : it->second.front();
  }
  const std::vector<std::string>& Values(const std::string& name) const { return values_.at(name); }
  // Leaves `*out` unchanged when the argument is absent.
  Status Int(const std::string& name, int64_t* out) const {
    if (!Has(name)) return Status::OK();
    return ParseInt(name, Text(name, ""), out);
  }
  // Every value of a multi-valued argument; leaves `*out` unchanged when it is absent.
  Status Ints(const std::string& name, std::vector<int64_t>* out) const {
    if (!Has(name)) return Status::OK();
    out->clear();
    for (const std::string& text : Values(name)) {
      out->emplace_back();
      MEMSIM_RETURN_IF_ERROR(ParseInt(name, text, &out->back()));
    }
    return Status::OK();
  }
  Status Float(const std::string& name, double* out) const {
    if (!Has(name)) return Status::OK();
    return ParseFloat(name, Text(name, ""), out);
  }
  // Records a present argument as not changing memory.
  void Ignore(const std::string& name) {
    if (Has(name)) ignored_.insert(name);
  }
  std::vector<std::string> Ignored() const {
    std::vector<std::string> out;
    for (const std::string& name : order_) {
      if (ignored_.count(name)) out.push_back(name);
    }
    return out;
  }

 private:
  std::map<std::string, std::vector<std::string>> values_;
  std::vector<std::string> order_;  // first occurrence
  std::set<std::string> ignored_;
};

// A string argument (`fallback` when absent) that must be one of `choices`.
Status Choice(const Args& a, const std::string& name, const std::vector<std::string>& choices,
              const std::string& fallback, std::string* out) {
  *out = a.Text(name, fallback);
  if (std::find(choices.begin(), choices.end(), *out) != choices.end()) return Status::OK();
  std::string list;
  for (const std::string& c : choices) list += (list.empty() ? "" : ", ") + c;
  return Status::Error(name + " '" + *out + "' is not modelled (memsim supports " + list + ")");
}

// Megatron's --moe-layer-freq as memsim can model it: 1 (every layer has experts), or a
// list expression (moe_freq_type, evaluated by EvaluateLayerPattern) of dense layers then MoE
// layers, such as "([0]*3+[1]*12)". Sets the number of leading dense layers.
Status ParseMoeLayerFreq(const std::string& text, int64_t num_layers, int64_t* dense) {
  const Status unsupported =
      Status::Error("--moe-layer-freq '" + text +
                    "' is not modelled (memsim models dense layers followed by MoE layers, e.g. "
                    "'([0]*3+[1]*" +
                    Str(std::max<int64_t>(num_layers - 3, 1)) + ")', or 1)");
  if (text.find('[') == std::string::npos) {
    return text == "1" ? Status::OK() : unsupported;
  }
  std::vector<int64_t> pattern;
  const Status evaluated = EvaluateLayerPattern(text, &pattern);
  if (!evaluated.ok()) return Status::Error("--moe-layer-freq: " + evaluated.message());
  if (static_cast<int64_t>(pattern.size()) != num_layers) {
    return Status::Error("--moe-layer-freq '" + text + "' describes " +
                         Str(static_cast<int64_t>(pattern.size())) + " layers, not --num-layers " +
                         Str(num_layers));
  }
  const auto first_moe = std::find(pattern.begin(), pattern.end(), 1);
  const bool dense_then_moe =
      std::all_of(pattern.begin(), first_moe, [](int64_t v) { return v == 0; }) &&
      std::all_of(first_moe, pattern.end(), [](int64_t v) { return v == 1; });
  if (!dense_then_moe) return unsupported;
  *dense = first_moe - pattern.begin();
  return Status::OK();
}

// Megatron's --window-attn-skip-freq (moe_freq_type), which makes some layers attend to the
// whole sequence: N makes layer l (from 1) windowed when l % N != 0, a list expression when
// its l-th entry is not 0 (is_layer_window_attention in megatron/core/transformer/utils.py).
// Whether any layer keeps its window is what memsim needs (Transformer Engine's context
// parallelism refuses p2p for windowed layers); empty text: every layer does.
Status ParseWindowAttnSkipFreq(const std::string& text, bool* any_windowed) {
  *any_windowed = true;
  if (text.empty()) return Status::OK();
  if (text.find('[') == std::string::npos) {
    int64_t every = 0;
    if (!ParseInt("--window-attn-skip-freq", text, &every).ok()) {
      return Status::Error("--window-attn-skip-freq '" + text +
                           "' is neither N nor a list of 0/1 per layer (e.g. '([1]*3+[0]*1)*8')");
    }
    if (every == 0) {
      return Status::Error(
          "--window-attn-skip-freq 0 divides by zero in Megatron-LM; give N >= 1 (every N-th "
          "layer attends to the whole sequence) or a list");
    }
    // Python's l % N: layer 1 is windowed unless N is 1 or -1 (every layer full).
    *any_windowed = every > 1 || every < -1;
    return Status::OK();
  }
  std::vector<int64_t> pattern;
  const Status evaluated = EvaluateLayerPattern(text, &pattern);
  if (!evaluated.ok()) return Status::Error("--window-attn-skip-freq: " + evaluated.message());
  *any_windowed = std::any_of(pattern.begin(), pattern.end(), [](int64_t v) { return v != 0; });
  return Status::OK();
}

// The MLP's activation and the fusion of fc1's bias into it, as core_transformer_config_
// from_args and TransformerConfig.__post_init__ set and check them.
Status ReadActivation(Args& a, ModelConfig* model, TrainingConfig* training) {
  ModelConfig& m = *model;
  const bool swiglu = a.Has("--swiglu");
  m.activation = swiglu ? ActivationKind::kSwiglu : ActivationKind::kGelu;
  if (a.Has("--squared-relu") && a.Has("--quick-geglu")) {
    return Status::Error("--squared-relu and --quick-geglu exclude each other");
  }
  // argument_utils.py asserts both without --swiglu.
  for (const char* other : {"--squared-relu", "--quick-geglu"}) {
    if (swiglu && a.Has(other)) return Status::Error(std::string(other) + " excludes --swiglu");
  }
  if (a.Has("--squared-relu")) m.activation = ActivationKind::kSquaredRelu;
  if (a.Has("--quick-geglu")) m.activation = ActivationKind::kQuickGeglu;
  // SwiGLU follows --bias-swiglu-fusion; the others --bias-gelu-fusion, which arguments.py
  // turns off without biases.
  training->bias_activation_fusion =
      swiglu ? !a.Has("--no-bias-swiglu-fusion")
             : !a.Has("--no-bias-gelu-fusion") && !a.Has("--disable-bias-linear");
  if (!swiglu) a.Ignore("--no-bias-swiglu-fusion");
  training->te_activation_func = a.Has("--use-te-activation-func");
  // experts.py reads it for squared ReLU only.
  training->fused_weighted_squared_relu =
      a.Has("--use-fused-weighted-squared-relu") && m.activation == ActivationKind::kSquaredRelu;
  if (m.activation != ActivationKind::kSquaredRelu) a.Ignore("--use-fused-weighted-squared-relu");
  if (training->bias_activation_fusion && m.activation == ActivationKind::kSquaredRelu) {
    return Status::Error(
        "--squared-relu needs --no-bias-gelu-fusion or --disable-bias-linear: Megatron-LM "
        "fuses the bias into GeLU, SwiGLU and quick-GeGLU only and raises ValueError otherwise");
  }
  // The offset changes values only: the eager GLU adds it whatever it is (layers.h).
  double offset = 0.0;
  MEMSIM_RETURN_IF_ERROR(a.Float("--glu-linear-offset", &offset));
  if (offset != 0.0 && training->bias_activation_fusion &&
      m.activation != ActivationKind::kQuickGeglu) {
    return Status::Error(
        "--glu-linear-offset needs --quick-geglu when the bias-activation fusion is on "
        "(TransformerConfig raises ValueError)");
  }
  if (a.Has("--activation-func-clamp-value")) {
    MEMSIM_RETURN_IF_ERROR(a.Float("--activation-func-clamp-value", &m.activation_clamp_value));
    if (!(m.activation_clamp_value > 0)) {
      return Status::Error("--activation-func-clamp-value must be positive, got " +
                           a.Text("--activation-func-clamp-value", ""));
    }
    if (m.activation == ActivationKind::kSwiglu && offset != 0.0) {
      return Status::Error(
          "--glu-linear-offset must be 0 with --activation-func-clamp-value and --swiglu (as "
          "TransformerConfig requires)");
    }
  }
  std::string softmax;
  MEMSIM_RETURN_IF_ERROR(
      Choice(a, "--softmax-type", {"vanilla", "off-by-one", "learnable"}, "vanilla", &softmax));
  if (softmax == "off-by-one") {
    return NotModelled(
        "--softmax-type off-by-one",
        "Transformer Engine's zero offsets, a float32 tensor outside the parameters");
  }
  m.softmax = softmax == "learnable" ? SoftmaxKind::kLearnable : SoftmaxKind::kVanilla;
  return Status::OK();
}

// Model shape, with Megatron-LM's defaults.
Status ReadModelShape(Args& a, bool gpt2_vocabulary, ModelConfig* model, TrainingConfig* training,
                      int64_t* max_positions) {
  ModelConfig& m = *model;
  MEMSIM_RETURN_IF_ERROR(a.Int("--num-layers", &m.num_layers));
  MEMSIM_RETURN_IF_ERROR(a.Int("--hidden-size", &m.hidden_size));
  MEMSIM_RETURN_IF_ERROR(a.Int("--num-attention-heads", &m.num_attention_heads));
  MEMSIM_RETURN_IF_ERROR(ReadActivation(a, model, training));
  // Unset (0), FinalizeModelConfig gives Megatron-LM's default for the activation.
  MEMSIM_RETURN_IF_ERROR(a.Int("--ffn-hidden-size", &m.ffn_hidden_size));
  MEMSIM_RETURN_IF_ERROR(a.Int("--kv-channels", &m.kv_channels));
  // tuple_type: "W,0" or "(W,0)"; Transformer Engine's full windows are (-1, 0) and (-1, -1).
  std::string window = a.Text("--window-size", "");
  window.erase(std::remove_if(window.begin(), window.end(),
                              [](char c) { return c == '(' || c == ')' || c == ' '; }),
               window.end());
  if (!window.empty() && !std::regex_match(window, std::regex("-?[0-9]+(,-?[0-9]+)*"))) {
    return Status::Error("--window-size must be integers separated by commas (e.g. 4095,0), got " +
                         a.Text("--window-size", ""));
  }
  m.sliding_window = !window.empty() && window != "-1,0" && window != "-1,-1";
  bool any_windowed_layer = true;
  MEMSIM_RETURN_IF_ERROR(
      ParseWindowAttnSkipFreq(a.Text("--window-attn-skip-freq", ""), &any_windowed_layer));
  if (!m.sliding_window) a.Ignore("--window-attn-skip-freq");
  m.sliding_window = m.sliding_window && any_windowed_layer;
  if (a.Has("--group-query-attention")) {
    m.num_query_groups = 1;  // Megatron-LM's default
    MEMSIM_RETURN_IF_ERROR(a.Int("--num-query-groups", &m.num_query_groups));
  } else {
    a.Ignore("--num-query-groups");  // Megatron-LM reads it only with the flag
  }
  // build_tokenizer sets the padded size only with padding on: without it, a size must be
  // given (Megatron's model takes --padded-vocab-size as is).
  if (a.Has("--no-pad-vocab-size")) {
    if (!a.Has("--padded-vocab-size")) {
      return Status::Error(
          "--no-pad-vocab-size needs --padded-vocab-size (without padding Megatron-LM sets no "
          "vocabulary size of its own)");
    }
    a.Ignore("--no-pad-vocab-size");
  }
  if (a.Has("--padded-vocab-size")) {
    // Megatron-LM takes it as is; a divisor of 1 keeps it (rounded up to a multiple of TP).
    MEMSIM_RETURN_IF_ERROR(a.Int("--padded-vocab-size", &m.vocab_size));
    m.make_vocab_size_divisible_by = 1;
    a.Ignore("--vocab-size");
    a.Ignore("--make-vocab-size-divisible-by");
  } else {
    if (gpt2_vocabulary && !a.Has("--vocab-size")) m.vocab_size = 50257;
    MEMSIM_RETURN_IF_ERROR(a.Int("--vocab-size", &m.vocab_size));
    m.make_vocab_size_divisible_by = 128;
    MEMSIM_RETURN_IF_ERROR(
        a.Int("--make-vocab-size-divisible-by", &m.make_vocab_size_divisible_by));
  }
  std::string text;
  MEMSIM_RETURN_IF_ERROR(
      Choice(a, "--normalization", {"LayerNorm", "RMSNorm"}, "LayerNorm", &text));
  m.norm = text == "RMSNorm" ? NormKind::kRmsNorm : NormKind::kLayerNorm;
  // --fused-residual-rmsnorm (TENorm's TEFusedResidualRMSNorm for the norms followed by a
  // residual that no linear fuses: multi-latent attention's input norm, MoE layers' pre-MLP
  // norm; TE 2.18's ops MakeExtraOutput + RMSNorm): the same saves (input and rstdevs) and
  // the residual an alias of the input; its backward writes the norm's input gradient plus
  // the residual's in one kernel, where autograd adds the two in place. Memory-neutral.
  if (a.Has("--fused-residual-rmsnorm") && m.norm != NormKind::kRmsNorm) {
    return Status::Error(
        "--fused-residual-rmsnorm needs --normalization RMSNorm (TransformerConfig raises "
        "ValueError)");
  }
  a.Ignore("--fused-residual-rmsnorm");
  MEMSIM_RETURN_IF_ERROR(Choice(a, "--position-embedding-type", {"learned_absolute", "rope"},
                                "learned_absolute", &text));
  m.position = text == "rope" || a.Has("--use-rotary-position-embeddings") ? PositionKind::kRope
                                                                           : PositionKind::kLearned;
  // Deprecated: Megatron-LM raises unless RoPE, which has no position table anyway.
  if (a.Has("--no-position-embedding")) {
    if (m.position != PositionKind::kRope) {
      return Status::Error(
          "--no-position-embedding is deprecated and Megatron-LM raises without RoPE; use "
          "--position-embedding-type");
    }
    a.Ignore("--no-position-embedding");
  }
  MEMSIM_RETURN_IF_ERROR(a.Float("--rotary-percent", &m.rotary_percent));
  // no_rope_freq_type (arguments.py): a Python list expression per layer, or an integer N.
  if (a.Has("--no-rope-freq")) {
    const std::string text = a.Text("--no-rope-freq", "");
    if (text.find('[') != std::string::npos) {
      const Status pattern = EvaluateLayerPattern(text, &m.no_rope_layers);
      if (!pattern.ok()) return Status::Error("--no-rope-freq: " + pattern.message());
    } else {
      MEMSIM_RETURN_IF_ERROR(a.Int("--no-rope-freq", &m.no_rope_freq));
    }
  }
  MEMSIM_RETURN_IF_ERROR(a.Int("--max-position-embeddings", max_positions));
  if (m.position == PositionKind::kLearned) {
    m.max_position_embeddings = *max_positions;
  } else {
    a.Ignore("--max-position-embeddings");  // RoPE allocates no position table
  }
  m.tie_embeddings = !a.Has("--untie-embeddings-and-output-weights");
  m.add_bias_linear = !a.Has("--disable-bias-linear");
  m.add_qkv_bias = m.add_bias_linear || a.Has("--add-qkv-bias");  // as Megatron-LM syncs them
  m.qk_layernorm = a.Has("--qk-layernorm");
  m.qk_l2_norm = a.Has("--qk-l2-norm");
  m.attention_output_gate = a.Has("--attention-output-gate");
  // MuP's settings count only with --use-mup (TransformerConfig reads them then).
  m.use_mup = a.Has("--use-mup");
  for (const char* name : {"--mup-base-hidden-size", "--mup-embedding-mult", "--mup-output-mult"}) {
    if (!m.use_mup) a.Ignore(name);
  }
  if (m.use_mup) {
    MEMSIM_RETURN_IF_ERROR(a.Int("--mup-base-hidden-size", &m.mup_base_hidden_size));
    // Megatron-Core asserts a given base is positive; absent (None) it is the hidden size.
    if (a.Has("--mup-base-hidden-size") && m.mup_base_hidden_size <= 0) {
      return Status::Error("--mup-base-hidden-size must be positive, got " +
                           a.Text("--mup-base-hidden-size", ""));
    }
    MEMSIM_RETURN_IF_ERROR(a.Float("--mup-embedding-mult", &m.mup_embedding_mult));
    MEMSIM_RETURN_IF_ERROR(a.Float("--mup-output-mult", &m.mup_output_mult));
  }
  if (a.Has("--multi-latent-attention")) {
    // Megatron-LM's argument defaults (arguments.py): no q down projection (--q-lora-rank
    // None), kv_lora_rank 32, q/k heads 128 + 64 wide, v heads 128.
    m.kv_lora_rank = 32;
    m.qk_head_dim = 128;
    m.qk_pos_emb_head_dim = 64;
    m.v_head_dim = 128;
    MEMSIM_RETURN_IF_ERROR(a.Int("--q-lora-rank", &m.q_lora_rank));
    MEMSIM_RETURN_IF_ERROR(a.Int("--kv-lora-rank", &m.kv_lora_rank));
    MEMSIM_RETURN_IF_ERROR(a.Int("--qk-head-dim", &m.qk_head_dim));
    MEMSIM_RETURN_IF_ERROR(a.Int("--qk-pos-emb-head-dim", &m.qk_pos_emb_head_dim));
    MEMSIM_RETURN_IF_ERROR(a.Int("--v-head-dim", &m.v_head_dim));
    if (m.kv_lora_rank <= 0) return Status::Error("--kv-lora-rank must be positive");
  } else {
    for (const char* name : {"--q-lora-rank", "--kv-lora-rank", "--qk-head-dim",
                             "--qk-pos-emb-head-dim", "--v-head-dim"}) {
      a.Ignore(name);
    }
  }
  m.mtp_num_layers = 0;
  MEMSIM_RETURN_IF_ERROR(a.Int("--mtp-num-layers", &m.mtp_num_layers));
  m.mtp_use_repeated_layer = a.Has("--mtp-use-repeated-layer");
  m.mtp_detach_heads = a.Has("--mtp-detach-heads");
  m.mtp_hsm = a.Has("--mtp-hsm");  // FinalizeModelConfig checks the depths, as Megatron does
  if (m.mtp_num_layers == 0) {
    a.Ignore("--mtp-use-repeated-layer");
    a.Ignore("--mtp-detach-heads");
  }
  m.hidden_dropout = m.attention_dropout = 0.1;
  MEMSIM_RETURN_IF_ERROR(a.Float("--hidden-dropout", &m.hidden_dropout));
  MEMSIM_RETURN_IF_ERROR(a.Float("--attention-dropout", &m.attention_dropout));
  return Status::OK();
}

// Mixture of experts (--num-experts 0 is dense, as in Megatron-LM).
Status ReadMixtureOfExperts(Args& a, ModelConfig* model, TrainingConfig* training,
                            ParallelLayout* layout) {
  ModelConfig& m = *model;
  TrainingConfig& t = *training;
  ParallelLayout& l = *layout;
  std::string text;
  m.num_experts = 0;
  MEMSIM_RETURN_IF_ERROR(a.Int("--num-experts", &m.num_experts));
  const std::vector<std::string> moe_args = {"--moe-router-topk",
                                             "--moe-ffn-hidden-size",
                                             "--moe-layer-freq",
                                             "--moe-shared-expert-intermediate-size",
                                             "--moe-expert-capacity-factor",
                                             "--moe-pad-expert-input-to-capacity",
                                             "--moe-token-drop-policy",
                                             "--moe-token-dispatcher-type",
                                             "--moe-router-dtype",
                                             "--moe-aux-loss-coeff",
                                             "--moe-z-loss-coeff",
                                             "--moe-permute-fusion",
                                             "--moe-router-score-function",
                                             "--moe-router-pre-softmax",
                                             "--moe-router-enable-expert-bias",
                                             "--moe-router-topk-scaling-factor",
                                             "--moe-router-load-balancing-type",
                                             "--moe-router-fusion",
                                             "--moe-router-force-load-balancing",
                                             "--moe-router-force-biased",
                                             "--moe-router-padding-for-quantization",
                                             "--moe-router-padding-for-fp8",
                                             "--moe-apply-probs-on-input",
                                             "--moe-deepep-num-sms",
                                             "--moe-shared-expert-gate",
                                             "--moe-hybridep-num-sms",
                                             "--expert-tensor-parallel-size"};
  t.moe_grouped_gemm = m.num_experts > 0 && a.Has("--moe-grouped-gemm");
  // The combined 1F1B schedule (Note [Combined 1F1B]); FinalizeRunSpec checks its rules.
  l.combined_1f1b = a.Has("--overlap-moe-expert-parallel-comm");
  l.overlap_p2p_comm = !a.Has("--no-overlap-p2p-communication");
  t.moe_shared_expert_overlap = a.Has("--moe-shared-expert-overlap");
  t.te_op_fuser = a.Has("--use-transformer-engine-op-fuser");  // the rules: model_config.cc
  a.Ignore("--fake-process-group");  // unless with the flex dispatcher, below
  t.experimental = a.Has("--enable-experimental");
  if (m.num_experts == 0) {
    for (const std::string& name : moe_args) a.Ignore(name);
    a.Ignore("--moe-grouped-gemm");
  } else {
    m.moe_router_topk = 2;
    MEMSIM_RETURN_IF_ERROR(a.Int("--moe-router-topk", &m.moe_router_topk));
    MEMSIM_RETURN_IF_ERROR(a.Int("--moe-ffn-hidden-size", &m.moe_ffn_hidden_size));
    MEMSIM_RETURN_IF_ERROR(
        a.Int("--moe-shared-expert-intermediate-size", &m.moe_shared_expert_size));
    // Only with shared experts (SharedExpertMLP makes the gate).
    m.moe_shared_expert_gate = a.Has("--moe-shared-expert-gate");
    if (m.moe_shared_expert_size == 0) a.Ignore("--moe-shared-expert-gate");
    MEMSIM_RETURN_IF_ERROR(a.Float("--moe-expert-capacity-factor", &m.moe_capacity_factor));
    // A negative capacity factor is Megatron's None: dropless (TransformerConfig).
    if (m.moe_capacity_factor < 0) m.moe_capacity_factor = 0;
    m.moe_pad_to_capacity = a.Has("--moe-pad-expert-input-to-capacity");
    MEMSIM_RETURN_IF_ERROR(
        Choice(a, "--moe-token-drop-policy", {"probs", "position"}, "probs", &text));
    m.moe_drop_by_position = text == "position";
    // Without a capacity nothing is dropped: the policy changes nothing.
    if (m.moe_capacity_factor == 0) a.Ignore("--moe-token-drop-policy");
    if (a.Has("--moe-layer-freq")) {
      MEMSIM_RETURN_IF_ERROR(ParseMoeLayerFreq(a.Text("--moe-layer-freq", ""), m.num_layers,
                                               &m.moe_first_k_dense_layers));
    }
    MEMSIM_RETURN_IF_ERROR(a.Int("--moe-router-num-groups", &m.moe_router_num_groups));
    MEMSIM_RETURN_IF_ERROR(a.Int("--moe-router-group-topk", &m.moe_router_group_topk));
    MEMSIM_RETURN_IF_ERROR(Choice(a, "--moe-token-dispatcher-type",
                                  {"allgather", "alltoall", "flex"}, "allgather", &text));
    const bool flex = text == "flex";
    // The flex dispatcher's backend (Note [DeepEP dispatch], Note [HybridEP dispatch]);
    // --moe-enable-deepep is Megatron-Core's deprecated spelling of deepep.
    std::string backend;
    MEMSIM_RETURN_IF_ERROR(Choice(a, "--moe-flex-dispatcher-backend",
                                  {"deepep", "hybridep", "ncclep"}, "deepep", &backend));
    if (a.Has("--moe-enable-deepep") && (!flex || backend == "hybridep")) {
      return Status::Error(
          "--moe-enable-deepep needs --moe-token-dispatcher-type flex and no other backend "
          "(Megatron-Core raises it)");
    }
    if (flex && backend == "ncclep") {
      return Status::Error(
          "--moe-flex-dispatcher-backend ncclep is not modelled (memsim models DeepEP's and "
          "HybridEP's); use deepep or hybridep, or alltoall, to estimate the run");
    }
    const bool hybrid = flex && backend == "hybridep";
    t.moe_dispatcher = text == "alltoall" ? MoeDispatcher::kAllToAll
                       : hybrid           ? MoeDispatcher::kHybridEp
                       : flex             ? MoeDispatcher::kDeepEp
                                          : MoeDispatcher::kAllGather;
    // --moe-deepep-num-sms and --moe-hybridep-num-sms are deprecated spellings that
    // TransformerConfig routes here when --moe-flex-dispatcher-num-sms is not given.
    std::string num_sms_arg = "--moe-flex-dispatcher-num-sms";
    if (!a.Has(num_sms_arg)) {
      const std::string deepep = "--moe-deepep-num-sms", hybridep = "--moe-hybridep-num-sms";
      if (a.Has(deepep) && a.Has(hybridep) && a.Text(deepep, "") != a.Text(hybridep, "")) {
        return Status::Error(deepep + " and " + hybridep + " conflict; give one " + num_sms_arg +
                             " (Megatron-Core raises it)");
      }
      if (a.Has(deepep) || a.Has(hybridep)) num_sms_arg = a.Has(deepep) ? deepep : hybridep;
    }
    for (const char* deprecated : {"--moe-deepep-num-sms", "--moe-hybridep-num-sms"}) {
      if (deprecated != num_sms_arg) a.Ignore(deprecated);
    }
    MEMSIM_RETURN_IF_ERROR(a.Int(num_sms_arg, &t.deepep_num_sms));
    if (flex && !hybrid && (t.deepep_num_sms < 2 || t.deepep_num_sms % 2 != 0)) {
      return Status::Error(
          "--moe-flex-dispatcher-num-sms must be even and at least 2 (DeepEP "
          "asserts it: half of them are its channels)");
    }
    // The backend and its SMs change only what DeepEP delivers and holds; HybridEP's SMs
    // size nothing.
    if (!flex) a.Ignore("--moe-flex-dispatcher-backend");
    if (!flex || hybrid) a.Ignore(num_sms_arg);
    // The fake process group skips communication, not allocation (validation/fake_pg).
    if (flex && a.Has("--fake-process-group")) {
      return Status::Error(
          "--fake-process-group cannot be used with --moe-token-dispatcher-type flex "
          "(Megatron-LM asserts it)");
    }
    t.moe_permute_fusion = a.Has("--moe-permute-fusion");
    m.moe_apply_probs_on_input = a.Has("--moe-apply-probs-on-input");
    // Note [Router padding] in models/moe.h; --moe-router-padding-for-fp8 is its older name.
    t.moe_router_padding =
        a.Has("--moe-router-padding-for-quantization") || a.Has("--moe-router-padding-for-fp8");
    // The router's dtype: fp32 logits and probabilities, or (unset) the training dtype.
    MEMSIM_RETURN_IF_ERROR(Choice(a, "--moe-router-dtype", {"fp32", "none"}, "none", &text));
    m.moe_router_fp32 = text == "fp32";
    MEMSIM_RETURN_IF_ERROR(a.Float("--moe-z-loss-coeff", &m.moe_z_loss_coeff));
    // The router (Note [MoE routing] in models/moe.h). Load balancing: the aux-loss kinds
    // (aux_loss, the default, seq_aux_loss, global_aux_loss) keep the same scores; none and
    // sinkhorn compute no aux loss.
    std::vector<std::string> balancing = {"aux_loss"};
    if (a.Has("--moe-router-load-balancing-type")) {
      balancing = a.Values("--moe-router-load-balancing-type");
    }
    for (const std::string& kind : balancing) {
      if (kind != "aux_loss" && kind != "seq_aux_loss" && kind != "global_aux_loss" &&
          kind != "sinkhorn" && kind != "none") {
        return Status::Error("--moe-router-load-balancing-type '" + kind +
                             "' is not modelled (memsim supports aux_loss, seq_aux_loss, "
                             "global_aux_loss, sinkhorn, none)");
      }
    }
    // One coefficient per load-balancing type, as TransformerConfig pairs them.
    std::vector<double> coefficients;
    if (a.Has("--moe-aux-loss-coeff")) {
      for (const std::string& value : a.Values("--moe-aux-loss-coeff")) {
        MEMSIM_RETURN_IF_ERROR(
            ParseFloat("--moe-aux-loss-coeff", value, &coefficients.emplace_back()));
      }
    }
    if ((balancing.size() > 1 || coefficients.size() > 1) &&
        coefficients.size() != balancing.size()) {
      return Status::Error(
          "--moe-aux-loss-coeff needs one coefficient per "
          "--moe-router-load-balancing-type (" +
          Str(static_cast<int64_t>(coefficients.size())) + " for " +
          Str(static_cast<int64_t>(balancing.size())) + "; Megatron-Core asserts it)");
    }
    const auto positive =
        std::count_if(coefficients.begin(), coefficients.end(), [](double c) { return c > 0; });
    if (positive > 1) {
      return NotModelled("--moe-aux-loss-coeff", "several load-balancing losses at once");
    }
    if (!coefficients.empty()) {
      m.moe_aux_loss_coeff = *std::max_element(coefficients.begin(), coefficients.end());
    }
    m.moe_router_sinkhorn = balancing == std::vector<std::string>{"sinkhorn"};
    if (balancing == std::vector<std::string>{"none"}) {
      m.moe_aux_loss_coeff = 0;  // no load-balancing loss is computed
      a.Ignore("--moe-aux-loss-coeff");
    }
    MEMSIM_RETURN_IF_ERROR(ParseEnum(kMoeScoreFunctionNames,
                                     a.Text("--moe-router-score-function", "softmax"),
                                     "--moe-router-score-function", &m.moe_router_score_function));
    m.moe_router_pre_softmax = a.Has("--moe-router-pre-softmax");
    m.moe_router_expert_bias = a.Has("--moe-router-enable-expert-bias");
    MEMSIM_RETURN_IF_ERROR(
        a.Float("--moe-router-topk-scaling-factor", &m.moe_router_topk_scaling_factor));
    t.moe_router_fusion = a.Has("--moe-router-fusion");
    m.moe_router_force_load_balancing = a.Has("--moe-router-force-load-balancing");
    if (a.Has("--moe-router-force-biased")) {
      double std = 0;
      MEMSIM_RETURN_IF_ERROR(a.Float("--moe-router-force-biased", &std));
      m.moe_router_force_biased = std;
    }
    if (a.Has("--moe-input-jitter-eps")) {
      double eps = 0;
      MEMSIM_RETURN_IF_ERROR(a.Float("--moe-input-jitter-eps", &eps));
      m.moe_input_jitter_eps = eps;
    }
    MEMSIM_RETURN_IF_ERROR(a.Int("--expert-tensor-parallel-size", &l.etp));
  }
  return Status::OK();
}

// Batch, sequence and parallelism.
Status ReadBatchAndParallelism(Args& a, int64_t world_size, int64_t max_positions,
                               TrainingConfig* training, ParallelLayout* layout) {
  TrainingConfig& t = *training;
  ParallelLayout& l = *layout;
  MEMSIM_RETURN_IF_ERROR(a.Int("--seq-length", &t.seq_length));
  MEMSIM_RETURN_IF_ERROR(a.Int("--micro-batch-size", &t.micro_batch_size));
  // get_batch's attention mask (Note [The batch on the GPU] in models/transformer.h).
  t.create_attention_mask = !a.Has("--no-create-attention-mask-in-dataloader");
  t.rope_fusion = !a.Has("--no-rope-fusion");
  l.world_size = world_size;
  MEMSIM_RETURN_IF_ERROR(a.Int("--tensor-model-parallel-size", &l.tp));
  MEMSIM_RETURN_IF_ERROR(a.Int("--pipeline-model-parallel-size", &l.pp));
  MEMSIM_RETURN_IF_ERROR(a.Int("--context-parallel-size", &l.cp));
  MEMSIM_RETURN_IF_ERROR(a.Int("--expert-model-parallel-size", &l.ep));
  for (auto [value, name] : {std::pair{world_size, "world size"},
                             {t.seq_length, "--seq-length"},
                             {t.micro_batch_size, "--micro-batch-size"},
                             {l.tp, "--tensor-model-parallel-size"},
                             {l.pp, "--pipeline-model-parallel-size"},
                             {l.cp, "--context-parallel-size"},
                             {l.ep, "--expert-model-parallel-size"}}) {
    if (value <= 0) {
      return Status::Error(std::string(name) + " must be positive, got " + Str(value));
    }
  }
  if (max_positions > 0 && max_positions < t.seq_length) {
    return Status::Error("--max-position-embeddings " + Str(max_positions) +
                         " is smaller than --seq-length " + Str(t.seq_length) +
                         " (Megatron-LM rejects it)");
  }
  // One communication type for every layer (Megatron also takes one per layer): p2p, a2a,
  // allgather, or a2a+p2p over --hierarchical-context-parallel-sizes (Note [All-to-all
  // context parallelism], Note [All-gather context parallelism]).
  std::string cp_comm = "p2p";
  if (a.Has("--cp-comm-type")) {
    const std::vector<std::string> types = a.Values("--cp-comm-type");
    for (const std::string& type : types) {
      if ((type != "p2p" && type != "a2a" && type != "allgather" && type != "a2a+p2p") ||
          type != types.front()) {
        return NotModelled("--cp-comm-type " + type,
                           "context-parallel communication other than p2p, a2a, allgather or "
                           "a2a+p2p for every layer");
      }
    }
    cp_comm = types.front();
  }
  t.cp_all_gather = cp_comm == "allgather" && l.cp > 1;
  std::vector<int64_t> hierarchy;
  MEMSIM_RETURN_IF_ERROR(a.Ints("--hierarchical-context-parallel-sizes", &hierarchy));
  if (!hierarchy.empty()) {
    int64_t product = 1;
    for (int64_t size : hierarchy) {
      if (size < 1 || product > l.cp / size) {
        product = 0;  // not a factorization of cp
        break;
      }
      product *= size;
    }
    if (product != l.cp) {
      return Status::Error(
          "--hierarchical-context-parallel-sizes must multiply to --context-parallel-size " +
          Str(l.cp) + " (Megatron-LM asserts it)");
    }
  }
  if (cp_comm == "a2a+p2p") {
    if (hierarchy.size() != 2) {
      return Status::Error(
          "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes with the "
          "all-to-all and the ring group sizes (Megatron-LM asserts it)");
    }
    t.cp_all_to_all = hierarchy[0];
  } else {
    t.cp_all_to_all = cp_comm == "a2a" ? l.cp : 1;
    a.Ignore("--hierarchical-context-parallel-sizes");
  }
  if (l.cp == 1) a.Ignore("--cp-comm-type");
  l.sequence_parallel = a.Has("--sequence-parallel");
  // Without sequence parallelism the embedding scatters nothing and clones nothing.
  t.clone_scatter_output_in_embedding = !a.Has("--no-clone-scatter-output-in-embedding");
  if (!l.sequence_parallel) a.Ignore("--no-clone-scatter-output-in-embedding");
  return Status::OK();
}

// Pipeline stages: uneven first/last stages, or interleaved (virtual) stages.
Status ReadPipelineStages(Args& a, const ModelConfig& m, ParallelLayout* layout) {
  ParallelLayout& l = *layout;
  // An unnamed end (0) gets the other stages' even share in FinalizeLayout, as in Megatron-Core.
  for (const auto& [flag, layers] :
       {std::pair{"--decoder-first-pipeline-num-layers", &l.first_stage_layers},
        std::pair{"--decoder-last-pipeline-num-layers", &l.last_stage_layers}}) {
    MEMSIM_RETURN_IF_ERROR(a.Int(flag, layers));
    if (a.Has(flag) && *layers <= 0) {
      return Status::Error(std::string(flag) + " must be larger than 0, got " + Str(*layers) +
                           " (Megatron-Core raises it too)");
    }
  }
  const bool uneven =
      a.Has("--decoder-first-pipeline-num-layers") || a.Has("--decoder-last-pipeline-num-layers");
  l.embedding_in_split = a.Has("--account-for-embedding-in-pipeline-split");
  l.loss_in_split = a.Has("--account-for-loss-in-pipeline-split");
  const int virtual_stage_args = a.Has("--num-layers-per-virtual-pipeline-stage") +
                                 a.Has("--num-virtual-stages-per-pipeline-rank") +
                                 a.Has("--pipeline-model-parallel-layout");
  if (virtual_stage_args > 1) {
    return Status::Error(
        "give one of --num-layers-per-virtual-pipeline-stage, "
        "--num-virtual-stages-per-pipeline-rank and --pipeline-model-parallel-layout "
        "(Megatron-LM rejects more)");
  }
  // FinalizeLayout parses it (Note [Pipeline layout] in parallel/layout.h) and sets vpp.
  l.pipeline_layout = a.Text("--pipeline-model-parallel-layout", "");
  if (a.Has("--num-layers-per-virtual-pipeline-stage")) {
    int64_t per_chunk = 0;
    MEMSIM_RETURN_IF_ERROR(a.Int("--num-layers-per-virtual-pipeline-stage", &per_chunk));
    if (uneven) {
      return Status::Error(
          "--num-layers-per-virtual-pipeline-stage cannot be combined with uneven first/last "
          "pipeline stages (Megatron-LM asks for --num-virtual-stages-per-pipeline-rank)");
    }
    // The embedding and the loss count as layers when the split accounts for them.
    const int64_t split_layers =
        m.num_layers + (l.embedding_in_split ? 1 : 0) + (l.loss_in_split ? 1 : 0);
    if (per_chunk <= 0 || split_layers % l.pp != 0 || (split_layers / l.pp) % per_chunk != 0) {
      return Status::Error("--num-layers-per-virtual-pipeline-stage " + Str(per_chunk) +
                           " does not split the " + Str(split_layers) + " layers over " +
                           Str(l.pp) + " pipeline stages evenly (Megatron-LM asserts it)");
    }
    l.vpp = split_layers / l.pp / per_chunk;
  }
  MEMSIM_RETURN_IF_ERROR(a.Int("--num-virtual-stages-per-pipeline-rank", &l.vpp));
  MEMSIM_RETURN_IF_ERROR(
      a.Int("--microbatch-group-size-per-virtual-pipeline-stage", &l.microbatch_group_size));
  if (l.vpp == 1 && l.pipeline_layout.empty()) {
    a.Ignore("--microbatch-group-size-per-virtual-pipeline-stage");
  }
  return Status::OK();
}

// Megatron-FSDP (Note [Megatron-FSDP] in parallel/megatron_fsdp.h): --use-megatron-fsdp
// with its default sharding strategy, optim_grads_params.
Status ReadMegatronFsdp(Args& a, RunSpec* spec) {
  if (!a.Has("--use-megatron-fsdp")) {
    if (a.Text("--data-parallel-sharding-strategy", "no_shard") != "no_shard") {
      return NotModelled("--data-parallel-sharding-strategy", "FSDP");
    }
    for (const char* name :
         {"--data-parallel-sharding-strategy", "--megatron-fsdp-version",
          "--megatron-fsdp-main-params-dtype", "--megatron-fsdp-main-grads-dtype",
          "--megatron-fsdp-grad-comm-dtype", "--outer-dp-sharding-strategy", "--ckpt-format",
          "--load", "--log-params-norm", "--fsdp-double-buffer",
          "--fsdp-db-use-persist-buf-on-alloc-fail", "--init-model-with-meta-device"}) {
      a.Ignore(name);
    }
    return Status::OK();
  }
  std::string text;
  MEMSIM_RETURN_IF_ERROR(Choice(a, "--data-parallel-sharding-strategy", {"optim_grads_params"},
                                "optim_grads_params", &text));
  MEMSIM_RETURN_IF_ERROR(Choice(a, "--megatron-fsdp-version", {"1"}, "1", &text));
  // Hybrid FSDP (an outer data-parallel dimension) is not modelled.
  MEMSIM_RETURN_IF_ERROR(
      Choice(a, "--outer-dp-sharding-strategy", {"no_shard"}, "no_shard", &text));
  // auto runs the optimizer on the 16-bit shards: not modelled.
  MEMSIM_RETURN_IF_ERROR(Choice(a, "--megatron-fsdp-main-params-dtype", {"fp32"}, "fp32", &text));
  TrainingConfig& t = spec->training;
  for (auto [name, field] :
       {std::pair{"--megatron-fsdp-main-grads-dtype", &t.fsdp_main_grads_dtype},
        {"--megatron-fsdp-grad-comm-dtype", &t.fsdp_grad_comm_dtype}}) {
    MEMSIM_RETURN_IF_ERROR(Choice(a, name, {"auto", "fp32", "bf16"}, "auto", &text));
    if (text != "auto") *field = text == "bf16" ? Precision::kBf16 : Precision::kFp32;
  }
  // What the step around the buckets does (Note [Megatron-FSDP]): a fsdp_dtensor checkpoint
  // load makes the optimizer's states before training, even without a checkpoint there;
  // --log-params-norm resets the buckets after the step.
  t.fsdp_states_before_training =
      a.Has("--load") && a.Text("--ckpt-format", "torch_dist") == "fsdp_dtensor";
  if (!t.fsdp_states_before_training) {
    a.Ignore("--load");
    a.Ignore("--ckpt-format");
  }
  t.log_params_norm = a.Has("--log-params-norm");
  t.fsdp_meta_init = a.Has("--init-model-with-meta-device");
  // Note [Megatron-FSDP double buffers] in parallel/megatron_fsdp.h.
  t.fsdp_double_buffer = a.Has("--fsdp-double-buffer");
  t.fsdp_double_buffer_persistent_fallback =
      t.fsdp_double_buffer && a.Has("--fsdp-db-use-persist-buf-on-alloc-fail");
  if (!t.fsdp_double_buffer) a.Ignore("--fsdp-db-use-persist-buf-on-alloc-fail");
  // Megatron-FSDP brings its own distributed optimizer (--use-distributed-optimizer is
  // forced on).
  spec->layout.data_parallel = DataParallelKind::kMegatronFsdp;
  return Status::OK();
}

// The largest batch size of a --step-batch-size-schedule, "THRESHOLD:BATCH_SIZE ..." (spaces
// or commas between entries, values with an optional K, M, B or T suffix), checked as
// Megatron-Core's StepBatchsizeNumMicroBatchesCalculator checks it: thresholds are tokens
// (Megatron passes --seq-length), in samples the first is 0 and they strictly increase, and
// every batch size is positive.
Status LargestScheduledBatch(const std::string& schedule, int64_t seq_length, int64_t* largest) {
  auto bad = [&schedule](const std::string& why) {
    return Status::Error("--step-batch-size-schedule '" + schedule.substr(0, 60) + "': " + why +
                         " (expected \"THRESHOLD:BATCH_SIZE ...\", e.g. \"0:768 250B:1536\")");
  };
  // _parse_numeric_value: int(float(text) * suffix), here bounded to what an int64 holds.
  auto number = [](std::string text, double* out) {
    double multiplier = 1;
    if (!text.empty()) {
      const char suffix = static_cast<char>(std::toupper(static_cast<unsigned char>(text.back())));
      const double scale = suffix == 'T'   ? 1e12
                           : suffix == 'B' ? 1e9
                           : suffix == 'M' ? 1e6
                           : suffix == 'K' ? 1e3
                                           : 0;
      if (scale > 0) {
        multiplier = scale;
        text.pop_back();
      }
    }
    char* end = nullptr;
    const double v = std::strtod(text.c_str(), &end);
    if (text.empty() || end != text.c_str() + text.size() || !std::isfinite(v)) return false;
    *out = std::floor(v * multiplier);
    return *out >= 0 && *out < 9e18;
  };
  std::string entries = schedule;
  std::replace(entries.begin(), entries.end(), ',', ' ');
  std::istringstream stream(entries);
  std::string entry;
  std::vector<std::pair<int64_t, int64_t>> steps;  // (threshold in samples, batch size)
  while (stream >> entry) {
    const size_t colon = entry.find(':');
    double threshold = 0, batch = 0;
    if (colon == std::string::npos || !number(entry.substr(0, colon), &threshold) ||
        !number(entry.substr(colon + 1), &batch)) {
      return bad("invalid entry '" + entry.substr(0, 40) + "'");
    }
    if (batch < 1 || batch > static_cast<double>(std::numeric_limits<int32_t>::max())) {
      return bad("batch size " + entry.substr(colon + 1, 40) + " is not in [1, 2147483647]");
    }
    steps.emplace_back(static_cast<int64_t>(threshold) / std::max<int64_t>(1, seq_length),
                       static_cast<int64_t>(batch));
  }
  if (steps.empty()) return bad("no entries");
  std::sort(steps.begin(), steps.end());
  if (steps.front().first != 0) return bad("the first threshold must be 0");
  for (size_t k = 1; k < steps.size(); ++k) {
    if (steps[k].first == steps[k - 1].first) {
      return bad("thresholds must be distinct in samples of --seq-length " + Str(seq_length));
    }
  }
  *largest = 0;
  for (const auto& step : steps) *largest = std::max(*largest, step.second);
  return Status::OK();
}

// Data parallelism and the global batch. FinalizeRunSpec derives the data-parallel size
// and the microbatches of one iteration from them, and checks that they divide.
Status ReadDataParallelism(Args& a, RunSpec* spec, std::vector<std::string>* notes) {
  ParallelLayout& l = spec->layout;
  if (a.Has("--use-distributed-optimizer")) {
    l.data_parallel = DataParallelKind::kDistributedOptimizer;
  }
  MEMSIM_RETURN_IF_ERROR(
      a.Int("--num-distributed-optimizer-instances", &l.distributed_optimizer_instances));
  MEMSIM_RETURN_IF_ERROR(ReadMegatronFsdp(a, spec));
  // The buckets cut the distributed optimizer's shards (Note [Distributed optimizer
  // buffers] in parallel/ddp_buffers.h); elsewhere they reuse the same buffers.
  DdpBucketOptions& buckets = l.ddp_buckets;
  buckets.overlap_grad_reduce = a.Has("--overlap-grad-reduce");
  buckets.overlap_param_gather_with_optimizer_step =
      a.Has("--overlap-param-gather-with-optimizer-step");
  buckets.pad_for_high_nccl_busbw = a.Has("--ddp-pad-buckets-for-high-nccl-busbw");
  for (const auto& [name, out] : {std::pair{"--ddp-bucket-size", &buckets.bucket_size},
                                  std::pair{"--ddp-num-buckets", &buckets.num_buckets}}) {
    if (!a.Has(name)) continue;
    int64_t value = 0;
    MEMSIM_RETURN_IF_ERROR(a.Int(name, &value));
    if (value <= 0) {
      return Status::Error(std::string(name) + " must be positive, got " + std::to_string(value));
    }
    *out = value;
  }
  if (l.data_parallel != DataParallelKind::kDistributedOptimizer) {
    for (const char* name :
         {"--overlap-grad-reduce", "--overlap-param-gather-with-optimizer-step",
          "--ddp-pad-buckets-for-high-nccl-busbw", "--ddp-bucket-size", "--ddp-num-buckets"}) {
      a.Ignore(name);
    }
  }
  // Megatron-LM's default global batch is micro batch * dp: one microbatch an iteration.
  spec->training.num_microbatches = 1;
  spec->global_batch_size = 0;
  if (a.Has("--global-batch-size")) {
    MEMSIM_RETURN_IF_ERROR(a.Int("--global-batch-size", &spec->global_batch_size));
    if (spec->global_batch_size <= 0) {
      return Status::Error("--global-batch-size must be positive, got " +
                           Str(spec->global_batch_size));
    }
  }
  // num_microbatches_calculator.py: the running batch rounded down to a multiple of micro
  // batch * dp (the global batch stays what Megatron logs).
  spec->round_global_batch_down = a.Has("--decrease-batch-size-if-needed");
  if (a.Has("--step-batch-size-schedule")) {
    if (a.Has("--global-batch-size")) {
      return Status::Error(
          "Cannot specify both --step-batch-size-schedule and --global-batch-size (Megatron-LM "
          "refuses it)");
    }
    if (spec->round_global_batch_down) {
      return Status::Error(
          "Cannot specify both --step-batch-size-schedule and --decrease-batch-size-if-needed "
          "(Megatron-LM refuses it)");
    }
    MEMSIM_RETURN_IF_ERROR(LargestScheduledBatch(a.Text("--step-batch-size-schedule", ""),
                                                 spec->training.seq_length,
                                                 &spec->global_batch_size));
    notes->push_back(
        "--step-batch-size-schedule: memsim simulates the largest global batch of "
        "the schedule, " +
        Str(spec->global_batch_size) + " (memory grows with the batch, if at all)");
  }
  return Status::OK();
}

// Precision and the optimizer's state.
Status ReadPrecisionAndOptimizer(Args& a, TrainingConfig* training) {
  TrainingConfig& t = *training;
  std::string text;
  if (a.Has("--bf16") && a.Has("--fp16")) {
    return Status::Error("--bf16 and --fp16 exclude each other");
  }
  t.precision = a.Has("--bf16")   ? Precision::kBf16
                : a.Has("--fp16") ? Precision::kFp16
                                  : Precision::kFp32;
  t.fp32_residual_connection = a.Has("--fp32-residual-connection");
  if (a.Has("--output-logit-dtype")) {
    std::string dtype;
    MEMSIM_RETURN_IF_ERROR(Choice(a, "--output-logit-dtype", {"bf16", "fp32"}, "bf16", &dtype));
    t.output_logit_dtype = dtype == "fp32" ? Precision::kFp32 : Precision::kBf16;
  }
  if (a.Has("--fp16-lm-cross-entropy")) {
    if (t.precision != Precision::kFp16) {
      return Status::Error(
          "--fp16-lm-cross-entropy needs --fp16 (Megatron-LM asserts it: \"lm cross entropy in "
          "fp16 only support in fp16 mode\")");
    }
    // Megatron-Core's GPTModel stores fp16_lm_cross_entropy and never reads it (0.20,
    // gpt_model.py); vocab_parallel_cross_entropy takes float32 logits either way.
    a.Ignore("--fp16-lm-cross-entropy");
  }
  if (a.Has("--accumulate-allreduce-grads-in-fp32")) {
    // bf16 and fp32 gradients are fp32 already; fp16 ones would change dtype.
    if (t.precision == Precision::kFp16) {
      return NotModelled("--accumulate-allreduce-grads-in-fp32", "fp32 gradients in fp16 training");
    }
    a.Ignore("--accumulate-allreduce-grads-in-fp32");
  }
  // Megatron-LM reads it for bf16 only (and lets it win over fp32 accumulation).
  t.grad_reduce_in_bf16 = t.precision == Precision::kBf16 && a.Has("--grad-reduce-in-bf16");
  if (!t.grad_reduce_in_bf16) a.Ignore("--grad-reduce-in-bf16");
  // The precision-aware optimizer's dtypes (Note [Precision-aware optimizer]); Megatron-Core
  // asserts fp32 for each without it.
  t.precision_aware_optimizer = a.Has("--use-precision-aware-optimizer");
  for (auto [name, field] : {std::pair{"--main-grads-dtype", &t.main_grads_dtype},
                             {"--exp-avg-dtype", &t.exp_avg_dtype},
                             {"--exp-avg-sq-dtype", &t.exp_avg_sq_dtype}}) {
    const std::string dtype = a.Text(name, "fp32");
    if (dtype == "fp16" || dtype == "fp8") {
      return NotModelled(std::string(name) + " " + dtype,
                         "scaled optimizer states (their fp32 copies in the step)");
    }
    MEMSIM_RETURN_IF_ERROR(Choice(a, name, {"fp32", "bf16"}, "fp32", &text));
    *field = text == "bf16" ? Precision::kBf16 : Precision::kFp32;
    if (*field == Precision::kFp32) a.Ignore(name);
  }
  if (t.main_grads_dtype == Precision::kBf16 && a.Has("--accumulate-allreduce-grads-in-fp32")) {
    return Status::Error(
        "--main-grads-dtype can only be fp32 with --accumulate-allreduce-grads-in-fp32 (as "
        "Megatron-LM asserts)");
  }
  if (t.main_grads_dtype == Precision::kBf16 && t.precision != Precision::kBf16) {
    t.main_grads_dtype = Precision::kFp32;  // the gradient buffer keeps the training dtype
    a.Ignore("--main-grads-dtype");
  }
  if (a.Text("--main-params-dtype", "fp32") != "fp32") {
    return NotModelled("--main-params-dtype",
                       "fp16 master weights (their fp32 copies in the step)");
  }
  a.Ignore("--main-params-dtype");
  // --optimizer-cpu-offload (Note [Optimizer CPU offload] in models/optimizer.h); Megatron-LM's
  // fraction defaults to 1.
  if (a.Has("--optimizer-cpu-offload")) {
    t.optimizer_offload_fraction = 1.0;
    MEMSIM_RETURN_IF_ERROR(a.Float("--optimizer-offload-fraction", &t.optimizer_offload_fraction));
  } else {
    a.Ignore("--optimizer-offload-fraction");
  }
  t.gradient_accumulation_fusion = !a.Has("--no-gradient-accumulation-fusion");
  t.log_num_zeros_in_grad = a.Has("--log-num-zeros-in-grad");
  t.defer_embedding_wgrad = a.Has("--defer-embedding-wgrad-compute");
  t.delay_wgrad_compute = a.Has("--delay-wgrad-compute");
  MEMSIM_RETURN_IF_ERROR(a.Int("--wgrad-deferral-limit", &t.wgrad_deferral_limit));
  if (!t.defer_embedding_wgrad) a.Ignore("--wgrad-deferral-limit");
  // The fused cross-entropy: Megatron's native one (megatron/core/fusions/
  // fused_cross_entropy.py, VocabCrossEntropy) or Transformer Engine's kernel
  // (TeParallelCrossEntropy).
  if (a.Has("--cross-entropy-loss-fusion")) {
    MEMSIM_RETURN_IF_ERROR(
        Choice(a, "--cross-entropy-fusion-impl", {"native", "te"}, "native", &text));
    t.cross_entropy_fusion = true;
    t.te_cross_entropy = text == "te";
  }
  a.Ignore("--cross-entropy-fusion-impl");
  if (a.Text("--optimizer", "adam") == "dist_muon") {
    return NotModelled("--optimizer dist_muon",
                       "the layer-wise distributed Muon optimizer (Megatron-LM's deprecated "
                       "name for --optimizer muon --use-distributed-optimizer)");
  }
  MEMSIM_RETURN_IF_ERROR(Choice(a, "--optimizer", {"adam", "sgd", "muon"}, "adam", &text));
  MEMSIM_RETURN_IF_ERROR(ParseEnum(kOptimizerNames, text, "optimizer", &t.optimizer));
  if (t.optimizer != OptimizerKind::kMuon) {
    for (const char* name :
         {"--muon-num-ns-steps", "--muon-scalar-optimizer", "--muon-tp-mode",
          "--muon-fp32-matmul-prec", "--no-use-layer-wise-param-layout", "--muon-no-split-qkv"}) {
      a.Ignore(name);
    }
    return Status::OK();
  }
  // Note [Muon] in models/optimizer.h: the defaults are what memsim models.
  if (a.Has("--use-distributed-optimizer")) {
    // Note [Layer-wise optimizer]: Muon's distributed optimizer deals whole parameters.
    if (!a.Has("--no-use-layer-wise-param-layout")) {
      return NotModelled("--use-distributed-optimizer with --optimizer muon",
                         "the layer-wise optimizer's parameter layout (Muon's matrices placed by "
                         "LPT in padded shards of buffers of their own); add "
                         "--no-use-layer-wise-param-layout for the layout memsim models");
    }
    t.layer_wise_optimizer = true;
  } else {
    a.Ignore("--no-use-layer-wise-param-layout");
  }
  MEMSIM_RETURN_IF_ERROR(a.Int("--muon-num-ns-steps", &t.muon_ns_steps));
  if (t.muon_ns_steps < 1) return Status::Error("--muon-num-ns-steps must be at least 1");
  t.muon_split_qkv = !a.Has("--muon-no-split-qkv");
  MEMSIM_RETURN_IF_ERROR(Choice(a, "--muon-scalar-optimizer", {"adam"}, "adam", &text));
  MEMSIM_RETURN_IF_ERROR(Choice(a, "--muon-tp-mode", {"duplicated"}, "duplicated", &text));
  MEMSIM_RETURN_IF_ERROR(Choice(a, "--muon-fp32-matmul-prec", {"medium"}, "medium", &text));
  return Status::OK();
}

// FP8 training (Note [FP8 training] in models/fp8.h): --fp8-format turns it on (e4m3 and
// hybrid store the same bytes), --fp8-recipe picks the scaling; the margin, interval and
// amax algorithm change values, not memory.
Status ReadFp8(Args& a, TrainingConfig* training) {
  TrainingConfig& t = *training;
  const char* settings[] = {"--fp8-recipe",
                            "--fp8-param-gather",
                            "--fp8-amax-history-len",
                            "--first-last-layers-bf16",
                            "--num-layers-at-start-in-bf16",
                            "--num-layers-at-end-in-bf16",
                            "--no-fp8-wgrad"};
  if (!a.Has("--fp8-format")) {
    for (const char* name : settings) a.Ignore(name);
    return Status::OK();
  }
  std::string text;
  MEMSIM_RETURN_IF_ERROR(Choice(a, "--fp8-format", {"e4m3", "hybrid"}, "e4m3", &text));
  MEMSIM_RETURN_IF_ERROR(
      Choice(a, "--fp8-recipe", {"delayed", "tensorwise", "blockwise", "mxfp8"}, "delayed", &text));
  MEMSIM_RETURN_IF_ERROR(ParseEnum(kFp8RecipeNames, text, "fp8 recipe", &t.fp8));
  if (a.Has("--no-fp8-wgrad")) {
    return NotModelled("--no-fp8-wgrad", "16-bit weight-gradient GEMMs in FP8 training");
  }
  t.fp8_param_gather = a.Has("--fp8-param-gather");
  t.fp8_amax_history_len = 1;  // Megatron-LM's default, not Transformer Engine's 1024
  MEMSIM_RETURN_IF_ERROR(a.Int("--fp8-amax-history-len", &t.fp8_amax_history_len));
  if (t.fp8 != Fp8Recipe::kDelayed) a.Ignore("--fp8-amax-history-len");
  if (a.Has("--first-last-layers-bf16")) {
    t.fp8_bf16_layers_at_start = t.fp8_bf16_layers_at_end = 1;  // Megatron-LM's defaults
    MEMSIM_RETURN_IF_ERROR(a.Int("--num-layers-at-start-in-bf16", &t.fp8_bf16_layers_at_start));
    MEMSIM_RETURN_IF_ERROR(a.Int("--num-layers-at-end-in-bf16", &t.fp8_bf16_layers_at_end));
  } else {
    a.Ignore("--num-layers-at-start-in-bf16");
    a.Ignore("--num-layers-at-end-in-bf16");
  }
  return Status::OK();
}

// TP communication overlap (Note [Userbuffers] in ops/collectives.h). Reduce-scatter
// overlap, the split and bootstrap settings change no allocation PyTorch sees; neither does
// the --tp-comm-overlap-cfg file, whose methods size the userbuffers outside the allocator
// (memsim does not read it).
Status ReadTpCommOverlap(Args& a, TrainingConfig* training) {
  TrainingConfig& t = *training;
  const char* settings[] = {
      "--tp-comm-overlap-cfg",   "--no-tp-comm-overlap-ag",    "--no-tp-comm-bulk-dgrad",
      "--no-tp-comm-bulk-wgrad", "--tp-comm-overlap-rs-dgrad", "--no-tp-comm-overlap-rs",
      "--no-tp-comm-split-ag",   "--no-tp-comm-split-rs",      "--tp-comm-bootstrap-backend"};
  t.tp_comm_overlap = a.Has("--tp-comm-overlap");
  if (!t.tp_comm_overlap) {
    for (const char* name : settings) a.Ignore(name);
    return Status::OK();
  }
  t.tp_comm_overlap_ag = !a.Has("--no-tp-comm-overlap-ag");
  // rs_dgrad reduce-scatters the column-parallel input gradient instead of the bulk overlaps.
  const bool rs_dgrad = a.Has("--tp-comm-overlap-rs-dgrad");
  t.tp_comm_bulk_dgrad = !a.Has("--no-tp-comm-bulk-dgrad") && !rs_dgrad;
  t.tp_comm_bulk_wgrad = !a.Has("--no-tp-comm-bulk-wgrad") && !rs_dgrad;
  for (const char* name :
       {"--tp-comm-overlap-cfg", "--no-tp-comm-overlap-rs", "--no-tp-comm-split-ag",
        "--no-tp-comm-split-rs", "--tp-comm-bootstrap-backend"}) {
    a.Ignore(name);
  }
  return Status::OK();
}

// Kernels: Transformer Engine (Megatron-LM's default) picks its attention backend per
// GPU from the backends allowed (--attention-backend sets NVTE_FLASH_ATTN,
// NVTE_FUSED_ATTN and NVTE_UNFUSED_ATTN; "auto" leaves the environment's); "local"
// swaps in Megatron's own unfused DotProductAttention. The local implementation is
// unfused unless --use-flash-attn.
Status ReadKernels(Args& a, TrainingConfig* training) {
  TrainingConfig& t = *training;
  std::string text;
  MEMSIM_RETURN_IF_ERROR(Choice(a, "--transformer-impl", {"local", "transformer_engine"},
                                "transformer_engine", &text));
  const bool local = text == "local";
  t.profile = local ? ProfileKind::kMegatronLocal : ProfileKind::kTransformerEngine;
  std::string backend;
  MEMSIM_RETURN_IF_ERROR(Choice(a, "--attention-backend",
                                {"auto", "flash", "fused", "unfused", "local"}, "auto", &backend));
  if (local) {
    t.attention = a.Has("--use-flash-attn") ? AttentionKind::kFlash : AttentionKind::kEager;
    a.Ignore("--attention-backend");
  } else if (backend == "local") {
    t.attention = AttentionKind::kEager;
    a.Ignore("--use-flash-attn");
  } else {
    TeAttentionChoice choice;
    if (backend != "auto") {
      choice.flash = backend == "flash";
      choice.fused = backend == "fused";
      choice.unfused = backend == "unfused";
    }
    // LanguageModule pins Transformer Engine's FlashAttention generation.
    int64_t version = 0;
    MEMSIM_RETURN_IF_ERROR(a.Int("--flash-attention-version", &version));
    if (a.Has("--flash-attention-version") && (version < 2 || version > 4)) {
      return Status::Error("--flash-attention-version must be 2, 3 or 4, got " + Str(version));
    }
    choice.flash_version = static_cast<int>(version);
    t.te_attention = choice;
    a.Ignore("--use-flash-attn");
  }
  // Megatron's own attention (the local spec, --attention-backend local) reads it in
  // inference only.
  if (!t.te_attention) a.Ignore("--flash-attention-version");
  // TEDotProductAttention asks for the maxima (Note [Max attention logit]); clip_qk's alpha
  // and threshold change values only, checked as arguments.py asserts.
  t.log_max_attention_logit = a.Has("--log-max-attention-logit");
  t.qk_clip = a.Has("--qk-clip");
  if (backend == "local" && t.ReturnsMaxAttentionLogit()) {
    return Status::Error(
        "--attention-backend local runs Megatron-Core's own DotProductAttention, which returns no "
        "max attention logit (clip_qk fails on it); drop --log-max-attention-logit and "
        "--qk-clip or use a Transformer Engine backend");
  }
  MEMSIM_RETURN_IF_ERROR(a.Int("--mlp-chunks-for-training", &t.mlp_chunks_for_training));
  if (t.qk_clip) {
    double alpha = 0.5, threshold = 100;
    MEMSIM_RETURN_IF_ERROR(a.Float("--qk-clip-alpha", &alpha));
    MEMSIM_RETURN_IF_ERROR(a.Float("--qk-clip-threshold", &threshold));
    if (!(alpha > 0 && alpha < 1)) {
      return Status::Error("--qk-clip-alpha must be between 0 and 1, got " +
                           a.Text("--qk-clip-alpha", ""));
    }
    if (!(threshold > 0)) {
      return Status::Error("--qk-clip-threshold must be greater than 0, got " +
                           a.Text("--qk-clip-threshold", ""));
    }
  }
  a.Ignore("--qk-clip-alpha");
  a.Ignore("--qk-clip-threshold");
  // --deterministic-mode sets NVTE_ALLOW_NONDETERMINISTIC_ALGO=0, unless the environment
  // has one, CUBLAS_WORKSPACE_CONFIG=:4096:8, and torch.use_deterministic_algorithms(True)
  // (megatron/training/determinism.py).
  if (a.Has("--deterministic-mode")) {
    t.deterministic_algorithms = true;  // torch.use_deterministic_algorithms(True)
    if (t.te_attention) t.te_attention->deterministic = true;
    t.cublas_workspace_bytes = 4096 * 1024 * 8;
  }
  return Status::OK();
}

// Recomputation, with Megatron-LM's rules.
Status ReadRecomputation(Args& a, TrainingConfig* training) {
  TrainingConfig& t = *training;
  std::string text;
  std::string granularity = "none";
  if (a.Has("--recompute-activations")) {
    granularity = "selective";  // Megatron-LM lets it override --recompute-granularity
    a.Ignore("--recompute-granularity");
  } else if (a.Has("--recompute-granularity")) {
    MEMSIM_RETURN_IF_ERROR(
        Choice(a, "--recompute-granularity", {"full", "selective"}, "", &granularity));
  }
  t.recompute = granularity == "full"        ? RecomputeKind::kFull
                : granularity == "selective" ? RecomputeKind::kSelective
                                             : RecomputeKind::kNone;
  if (t.recompute == RecomputeKind::kFull) {
    if (!a.Has("--recompute-method") || !a.Has("--recompute-num-layers")) {
      return Status::Error(
          "--recompute-granularity full needs --recompute-method (uniform or block) and "
          "--recompute-num-layers (Megatron-LM requires both)");
    }
    MEMSIM_RETURN_IF_ERROR(Choice(a, "--recompute-method", {"uniform", "block"}, "", &text));
    t.recompute_method = text == "block" ? RecomputeMethod::kBlock : RecomputeMethod::kUniform;
    MEMSIM_RETURN_IF_ERROR(a.Int("--recompute-num-layers", &t.recompute_num_layers));
  } else if (a.Has("--recompute-method") || a.Has("--recompute-num-layers")) {
    return Status::Error(
        "--recompute-method and --recompute-num-layers need --recompute-granularity full "
        "(Megatron-LM rejects them otherwise)");
  }
  // ValidateTrainingConfig checks Megatron-LM's rules for it.
  t.distribute_saved_activations = a.Has("--distribute-saved-activations");
  // TransformerConfig: --recompute-modules (default core_attn) counts, and its names are
  // checked, only under selective granularity; --moe-layer-recompute (deprecated) makes it
  // selective and adds moe.
  if (a.Has("--moe-layer-recompute")) {
    if (t.recompute == RecomputeKind::kFull) {
      return Status::Error(
          "--moe-layer-recompute cannot be used with --recompute-granularity full "
          "(Megatron-Core rejects it)");
    }
    t.recompute = RecomputeKind::kSelective;
  }
  if (a.Has("--recompute-modules") && t.recompute != RecomputeKind::kSelective) {
    a.Ignore("--recompute-modules");
  } else if (a.Has("--recompute-modules")) {
    const std::vector<std::string>& names = a.Values("--recompute-modules");
    for (const std::string& name : names) {
      if (name == "gdn_norm_out" || name == "gdp_in_proj" || name == "gdp_qkv" || name == "mhc") {
        return NotModelled("--recompute-modules " + name,
                           "gated delta networks and hyper-connections");
      }
    }
    const Status parsed = ParseRecomputeModules(names, &t.recompute_modules);
    if (!parsed.ok()) return Status::Error("--recompute-modules: " + parsed.message());
  }
  if (a.Has("--moe-layer-recompute"))
    t.recompute_modules |= RecomputeModuleBit(RecomputeModule::kMoe);
  return Status::OK();
}

// Transformer Engine's CUDA graphs (Note [CUDA graphs] in parallel/cuda_graphs.h): which
// modules, and after how many eager steps they are captured.
Status ReadCudaGraphs(Args& a, TrainingConfig* t) {
  std::string impl = a.Text("--cuda-graph-impl", "none");
  // arguments.py (0.20) maps the deprecated switches onto --cuda-graph-impl.
  const bool enable = a.Has("--enable-cuda-graph"), external = a.Has("--external-cuda-graph");
  if (enable || external) {
    if (a.Has("--cuda-graph-impl")) {
      return Status::Error(
          "do not use --enable-cuda-graph or --external-cuda-graph with --cuda-graph-impl "
          "(Megatron-LM asserts it)");
    }
    if (enable && external) {
      return Status::Error(
          "--enable-cuda-graph and --external-cuda-graph cannot be enabled at the same time "
          "(Megatron-LM asserts it)");
    }
    impl = enable ? "local" : "transformer_engine";
  }
  const char* modules_arg = a.Has("--cuda-graph-scope") ? "--cuda-graph-scope"  // deprecated
                                                        : "--cuda-graph-modules";
  if (impl == "none") {
    for (const char* name : {"--cuda-graph-impl", "--cuda-graph-modules", "--cuda-graph-scope",
                             "--cuda-graph-warmup-steps", "--cuda-graph-retain-backward-graph"}) {
      a.Ignore(name);
    }
    return Status::OK();
  }
  if (impl != "transformer_engine") {
    return NotModelled(
        enable ? "--enable-cuda-graph (--cuda-graph-impl local)" : "--cuda-graph-impl " + impl,
        "CUDA graphs other than Transformer Engine's per-layer ones");
  }
  if (a.Has("--cuda-graph-scope") && a.Has("--cuda-graph-modules")) {
    return Status::Error(
        "--cuda-graph-scope and --cuda-graph-modules cannot be used together (Megatron-LM "
        "rejects it)");
  }
  if (a.Has("--cuda-graph-retain-backward-graph")) {
    return NotModelled("--cuda-graph-retain-backward-graph",
                       "graphs that keep their saved activations between replays");
  }
  t->cuda_graphs = true;
  uint32_t bits = 0;
  if (a.Has(modules_arg)) {
    std::vector<std::string> names;  // "full" is the deprecated spelling of the whole layer
    for (const std::string& name : a.Values(modules_arg)) {
      if (name != "full") names.push_back(name);
    }
    if (!ParseCudaGraphModules(names, &bits).ok()) {
      return NotModelled(modules_arg,
                         "CUDA graphs of modules other than attn, mlp, moe_router and "
                         "moe_preprocess");
    }
  }
  t->cuda_graph_modules = bits;
  return a.Int("--cuda-graph-warmup-steps", &t->cuda_graph_warmup_steps);
}

// train_step's tensor dumps (training.py, Megatron-LM 0.20), on the steps their intervals
// pick: parameters (`param.data.cpu()` after the optimizer step), weight gradients (the
// gradient buffers all-reduced in place instead of reduce-scattered, then `main_grad.cpu()`)
// and tokens per expert (a Python list) copy to the host and allocate nothing on the GPU.
// Refused where that is not so: FP8 parameters (a quantized tensor's copy dequantizes on
// the GPU) and Megatron-FSDP (its sharded gradients take another path).
Status ReadTensorDumps(Args& a, const TrainingConfig& t, const ParallelLayout& l) {
  for (const char* name :
       {"--save-params-interval", "--save-wgrads-interval", "--save-tokens-per-expert-interval"}) {
    int64_t interval = 0;
    MEMSIM_RETURN_IF_ERROR(a.Int(name, &interval));
    if (a.Has(name) && interval <= 0) {
      return Status::Error(std::string(name) + " must be positive, got " + Str(interval));
    }
  }
  if (a.Has("--save-params-interval") && t.fp8_param_gather) {
    return NotModelled("--save-params-interval",
                       "host copies of FP8 parameters, dequantized on the GPU first");
  }
  if (a.Has("--save-wgrads-interval") && l.data_parallel == DataParallelKind::kMegatronFsdp) {
    return NotModelled("--save-wgrads-interval", "Megatron-FSDP's gradients forced to all-reduce");
  }
  a.Ignore("--save-params-interval");
  a.Ignore("--save-wgrads-interval");
  a.Ignore("--save-tokens-per-expert-interval");
  return Status::OK();
}

// Memory management: emptying the cache (train_step's choices 0, 1, 2); CPU offloading and
// CUDA graphs only when off.
Status ReadMemoryManagement(Args& a, TrainingConfig* training) {
  int64_t level = 0;  // ValidateTrainingConfig checks its range
  MEMSIM_RETURN_IF_ERROR(a.Int("--empty-unused-memory-level", &level));
  training->empty_unused_memory_level = static_cast<int32_t>(std::clamp<int64_t>(
      level, std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max()));
  if (level == 0) a.Ignore("--empty-unused-memory-level");
  MEMSIM_RETURN_IF_ERROR(
      a.Int("--cpu-offloading-num-layers", &training->cpu_offloading_num_layers));
  if (training->cpu_offloading_num_layers == 0) a.Ignore("--cpu-offloading-num-layers");
  return ReadCudaGraphs(a, training);
}

// Fine-grained activation offloading (Note [Fine-grained activation offloading] in
// models/activation_offload.h): which regions, and the policies that keep more groups on
// the device only at their defaults.
Status ReadActivationOffloading(Args& a, TrainingConfig* t) {
  if (!a.Has("--fine-grained-activation-offloading")) {
    for (const char* name :
         {"--offload-modules", "--min-offloaded-tensor-size",
          "--delta-offload-bytes-across-pp-ranks", "--activation-offload-fraction",
          "--fine-grained-offloading-max-inflight-offloads"}) {
      a.Ignore(name);  // TransformerConfig reads them only with the switch
    }
    return Status::OK();
  }
  if (!a.Has("--offload-modules") || a.Values("--offload-modules").empty()) {
    return Status::Error(
        "--fine-grained-activation-offloading needs --offload-modules (Megatron-Core requires a "
        "non-empty list)");
  }
  for (const std::string& name : a.Values("--offload-modules")) {
    if (name == "fused_group_mlp" || name == "gdp_qkv") {
      return NotModelled("--offload-modules " + name,
                         "offloading the op fuser's grouped MLP or gated delta networks");
    }
  }
  const Status parsed = ParseOffloadModules(a.Values("--offload-modules"), &t->offload_modules);
  if (!parsed.ok()) return Status::Error("--offload-modules: " + parsed.message());
  MEMSIM_RETURN_IF_ERROR(a.Int("--min-offloaded-tensor-size", &t->min_offloaded_tensor_elements));
  // Timing only: the compute stream waits for older copies (Note [Offload copies on the
  // clock]).
  if (a.Has("--fine-grained-offloading-max-inflight-offloads")) {
    MEMSIM_RETURN_IF_ERROR(
        a.Int("--fine-grained-offloading-max-inflight-offloads", &t->max_inflight_offloads));
    if (t->max_inflight_offloads < 0) {
      return Status::Error("--fine-grained-offloading-max-inflight-offloads must be >= 0, got " +
                           std::to_string(t->max_inflight_offloads));
    }
  }
  int64_t delta = 0;
  MEMSIM_RETURN_IF_ERROR(a.Int("--delta-offload-bytes-across-pp-ranks", &delta));
  if (delta != 0) {
    return NotModelled("--delta-offload-bytes-across-pp-ranks",
                       "offloading fewer groups on later pipeline ranks");
  }
  a.Ignore("--delta-offload-bytes-across-pp-ranks");
  double fraction = 1.0;
  MEMSIM_RETURN_IF_ERROR(a.Float("--activation-offload-fraction", &fraction));
  if (fraction != 1.0) {
    return NotModelled("--activation-offload-fraction", "offloading a fraction of the groups");
  }
  a.Ignore("--activation-offload-fraction");
  return Status::OK();
}

// Every argument group of a launch line into `out->spec` (Note [Megatron arguments]).
Status Build(Args& a, int64_t world_size, MegatronArgsResult* out) {
  RunSpec& spec = out->spec;
  ModelConfig& m = spec.model;
  TrainingConfig& t = spec.training;
  ParallelLayout& l = spec.layout;
  m.name = "megatron";
  spec.model_source = "Megatron-LM arguments";

  for (const char* required : {"--num-layers", "--hidden-size", "--num-attention-heads",
                               "--seq-length", "--micro-batch-size"}) {
    if (!a.Has(required)) {
      return Status::Error(std::string("missing ") + required + " (Megatron-LM requires it)");
    }
  }
  // The vocabulary: --vocab-size, else what the tokenizer has. Of the tokenizers that
  // read files, memsim knows GPT2BPETokenizer's (GPT-2's vocab.json: 50,257 tokens),
  // pretrain_gpt.py's default.
  const std::string tokenizer = a.Text("--tokenizer-type", "GPT2BPETokenizer");
  const bool gpt2_vocabulary = tokenizer == "GPT2BPETokenizer";
  if (!a.Has("--vocab-size") && !a.Has("--padded-vocab-size") && !gpt2_vocabulary) {
    // An example the user's tokenizer likely has: Llama 2's SentencePiece model (also
    // Mistral 7B v0.1's and Mixtral 8x7B's) holds 32,000 tokens, Llama 3's 128,256.
    const std::string example = tokenizer == "Llama2Tokenizer"
                                    ? "32000 for Llama 2's and Mixtral's tokenizer.model"
                                    : "128256 for Llama 3";
    return Status::Error(
        "missing --vocab-size: memsim does not read tokenizer files "
        "(--tokenizer-type " +
        tokenizer + "), so give the vocabulary size (e.g. --vocab-size " + example + ")");
  }

  int64_t max_positions = 0;
  MEMSIM_RETURN_IF_ERROR(ReadModelShape(a, gpt2_vocabulary, &m, &t, &max_positions));
  MEMSIM_RETURN_IF_ERROR(ReadMixtureOfExperts(a, &m, &t, &l));
  MEMSIM_RETURN_IF_ERROR(ReadBatchAndParallelism(a, world_size, max_positions, &t, &l));
  MEMSIM_RETURN_IF_ERROR(ReadPipelineStages(a, m, &l));
  MEMSIM_RETURN_IF_ERROR(ReadDataParallelism(a, &spec, &out->notes));
  MEMSIM_RETURN_IF_ERROR(ReadPrecisionAndOptimizer(a, &t));
  // The layer-wise optimizer runs over plain DDP (Note [Layer-wise optimizer]).
  if (t.layer_wise_optimizer) l.data_parallel = DataParallelKind::kDdp;
  MEMSIM_RETURN_IF_ERROR(ReadKernels(a, &t));
  MEMSIM_RETURN_IF_ERROR(ReadFp8(a, &t));
  MEMSIM_RETURN_IF_ERROR(ReadTpCommOverlap(a, &t));
  MEMSIM_RETURN_IF_ERROR(ReadRecomputation(a, &t));
  MEMSIM_RETURN_IF_ERROR(ReadActivationOffloading(a, &t));
  MEMSIM_RETURN_IF_ERROR(ReadTensorDumps(a, t, l));
  return ReadMemoryManagement(a, &t);
}

// PYTORCH_CUDA_ALLOC_CONF, read as PyTorch's AllocatorConfig::parseArgs reads it: tokens
// split at ',', ':', '[' and ']', spaces dropped. max_split_size_mb, max_non_split_rounding_mb,
// roundup_power2_divisions (a number or a [MiB:divisions,...,>:divisions] list) and
// expandable_segments are modelled (simulator/caching_allocator_model.h);
// garbage_collection_threshold is checked and noted as inert, since PyTorch applies it only
// under a memory fraction and Megatron-LM sets none (Note [Garbage collection threshold]).
// Other settings are refused.
Status ParseAllocConf(const std::string& conf, TrainingConfig* t, std::vector<std::string>* notes) {
  std::vector<std::string> tokens;
  bool in_word = false;  // spaces are dropped, even inside a word
  for (const char c : conf) {
    if (c == ',' || c == ':' || c == '[' || c == ']') {
      tokens.emplace_back(1, c);
      in_word = false;
    } else if (c != ' ') {
      if (!in_word) tokens.emplace_back();
      tokens.back() += c;
      in_word = true;
    }
  }
  CachingAllocatorConfig& settings = t->allocator_settings;
  auto bad = [](const std::string& key, const std::string& rule) {
    return Status::Error("PYTORCH_CUDA_ALLOC_CONF " + key + " " + rule);
  };
  auto whole_number = [](const std::string& text, int64_t* value) {
    const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), *value);
    return error == std::errc() && end == text.data() + text.size() && *value >= 0;
  };
  // Divisions beyond 2^30 would split no interval further (CachingAllocatorConfig).
  auto power_of_two = [](int64_t v) {
    return v > 0 && v <= (int64_t{1} << 30) && (v & (v - 1)) == 0;
  };
  size_t i = 0;
  auto take = [&](const char* expected) {
    return i < tokens.size() && tokens[i] == expected ? (++i, true) : false;
  };
  while (i < tokens.size()) {
    if (take(",")) continue;  // empty pairs
    const std::string key = tokens[i++];
    if (!take(":") || i >= tokens.size()) {
      return Status::Error("PYTORCH_CUDA_ALLOC_CONF '" + key + "' has no ':VALUE'");
    }
    const std::string value = tokens[i];
    int64_t number = 0;
    if (key == "expandable_segments") {
      if (value != "True" && value != "False") {
        return bad(key, "must be True or False, not '" + value + "'");
      }
      settings.expandable_segments = value == "True";
      ++i;
    } else if (key == "max_split_size_mb" || key == "max_non_split_rounding_mb") {
      // PyTorch refuses less than 20 MiB; the upper bound keeps the bytes within 64 bits.
      if (!whole_number(value, &number) || number < 20 || number > (int64_t{1} << 40)) {
        return bad(key, "must be a whole number of MiB, at least 20, not '" + value + "'");
      }
      (key == "max_split_size_mb" ? settings.max_split_size_bytes
                                  : settings.max_non_split_rounding_bytes) = number << 20;
      ++i;
    } else if (key == "roundup_power2_divisions" && value != "[") {
      if (!whole_number(value, &number) || !power_of_two(number)) {
        return bad(key, "must be a power of two up to 2^30 or a [MiB:divisions,...] list, not '" +
                            value + "'");
      }
      settings.roundup_power2_divisions.fill(number);
      ++i;
    } else if (key == "roundup_power2_divisions") {
      // [SIZE_MIB:D, ..., >:D]: SIZE_MIB's interval (and, for the first, every one below)
      // takes D; '>' every interval above the last one named, the first when none was
      // (PyTorch 2.11 on an H200: simulator/caching_allocator_replay_test.cc).
      std::array<int64_t, 16>& divisions = settings.roundup_power2_divisions;
      size_t last_index = 0;
      bool first = true;
      ++i;
      while (!take("]")) {
        const std::string size = i < tokens.size() ? tokens[i++] : "";
        int64_t mib = 0;
        if (size != ">" && (!whole_number(size, &mib) || !power_of_two(mib))) {
          return bad(key, "list entries must be SIZE_MIB:DIVISIONS with powers of two, not '" +
                              size + "'");
        }
        if (!take(":") || i >= tokens.size() || !whole_number(tokens[i], &number) ||
            (number != 0 && !power_of_two(number))) {
          return bad(key,
                     "list entry '" + size + "' needs :DIVISIONS, 0 or a power of two up to 2^30");
        }
        ++i;
        if (size == ">") {
          std::fill(divisions.begin() + static_cast<std::ptrdiff_t>(
                                            std::min<size_t>(last_index + 1, divisions.size())),
                    divisions.end(), number);
        } else {
          const size_t index = std::min<size_t>(static_cast<size_t>(std::log2(mib)), 15);
          if (first) std::fill(divisions.begin(), divisions.begin() + index, number);
          first = false;
          divisions[index] = number;
          last_index = index;
        }
        if (i < tokens.size() && tokens[i] != "]" && !take(",")) {
          return bad(key, "list needs ',' between entries");
        }
        if (i >= tokens.size()) return bad(key, "list has no closing ']'");
      }
    } else if (key == "garbage_collection_threshold") {
      double threshold = 0;
      const auto [end, error] =
          std::from_chars(value.data(), value.data() + value.size(), threshold);
      // PyTorch's own bounds (AllocatorConfig::parseGarbageCollectionThreshold).
      if (error != std::errc() || end != value.data() + value.size() || !(threshold > 0) ||
          !(threshold < 1)) {
        return bad(key, "must be between 0 and 1 (exclusive), not '" + value + "'");
      }
      notes->push_back("PYTORCH_CUDA_ALLOC_CONF garbage_collection_threshold:" + value +
                       " has no effect: PyTorch applies it only under "
                       "torch.cuda.set_per_process_memory_fraction, which Megatron-LM never "
                       "calls");
      ++i;
    } else {
      return Status::Error("PYTORCH_CUDA_ALLOC_CONF '" + key + ":" + value +
                           "' is not modelled (memsim models max_split_size_mb, "
                           "max_non_split_rounding_mb, roundup_power2_divisions, "
                           "expandable_segments and garbage_collection_threshold); drop it to "
                           "simulate without it");
    }
    if (i < tokens.size() && !take(",")) {
      return Status::Error("PYTORCH_CUDA_ALLOC_CONF: expected ',' after " + key);
    }
  }
  if (settings.expandable_segments && settings.max_split_size_bytes > 0) {
    return Status::Error(
        "PYTORCH_CUDA_ALLOC_CONF: max_split_size_mb with expandable_segments "
        "is not modelled; drop one of them");
  }
  return Status::OK();
}

// Environment variables of a launch. Modelled ones change what the CUDA libraries
// allocate or which attention kernel runs; neutral ones tune communication, logging and
// kernel scheduling without changing any tensor's size.
const std::set<std::string>& ModelledEnv() {
  static const auto* names = new std::set<std::string>{
      "CUBLAS_WORKSPACE_CONFIG",
      "NVTE_FLASH_ATTN",
      "NVTE_FUSED_ATTN",
      "NVTE_UNFUSED_ATTN",
      "PYTORCH_CUDA_ALLOC_CONF",
      "PYTORCH_ALLOC_CONF",
      "NVTE_ALLOW_NONDETERMINISTIC_ALGO",
  };
  return *names;
}

const std::set<std::string>& NeutralEnv() {
  static const auto* names = new std::set<std::string>{
      "CUDA_DEVICE_MAX_CONNECTIONS",  // stream scheduling
      "NCCL_ALGO",
      "NCCL_DEBUG",
      "NCCL_NVLS_ENABLE",
      "NON_DETERMINSTIC_RESULTS",  // the functional tests' own switches, as they spell them
      "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE",
      "NVTE_BWD_LAYERNORM_SM_MARGIN",  // SMs left free for communication
      "NVTE_FWD_LAYERNORM_SM_MARGIN",
      "NVTE_CPU_OFFLOAD_V1",  // selects an offloading implementation; offloading is refused
      // Transformer Engine's CuTe DSL fused grouped MLP (ops/fused/grouped_mlp.py) runs on
      // compute capability 10 only; memsim's GPUs (A100, H100, H200) take the basic ops.
      "NVTE_CUTEDSL_FUSED_GROUPED_MLP",
      "N_REPEAT",
      "N_REPEATS",
      "PYTHONWARNINGS",
      "SKIP_PYTEST",
      "THROUGHPUT_START_STEP",
  };
  return *names;
}

Status ApplyEnvironment(const std::map<std::string, std::string>& env, const Args& a,
                        MegatronArgsResult* out) {
  TrainingConfig& t = out->spec.training;
  for (const auto& [name, value] : env) {
    if (NeutralEnv().count(name)) {
      out->ignored.push_back(name);
    } else if (!ModelledEnv().count(name)) {
      return Status::Error("unknown environment variable " + name +
                           "; if it does not change memory, leave it out of the environment "
                           "given to memsim");
    }
  }
  auto get = [&env](const char* name) {
    auto it = env.find(name);
    return it == env.end() ? std::string() : it->second;
  };
  if (env.count("CUBLAS_WORKSPACE_CONFIG")) {
    MEMSIM_RETURN_IF_ERROR(
        ParseCublasWorkspaceConfig(get("CUBLAS_WORKSPACE_CONFIG"), &t.cublas_workspace_bytes));
  }
  // PyTorch 2.9 on read PYTORCH_ALLOC_CONF first, then the older name.
  const std::string alloc_conf =
      env.count("PYTORCH_ALLOC_CONF") ? get("PYTORCH_ALLOC_CONF") : get("PYTORCH_CUDA_ALLOC_CONF");
  if (const std::string& conf = alloc_conf; !conf.empty()) {
    MEMSIM_RETURN_IF_ERROR(ParseAllocConf(conf, &t, &out->notes));
  }
  if (t.te_attention) {
    // Explicit backends come from --attention-backend, which overrides these.
    if (a.Text("--attention-backend", "auto") == "auto") {
      t.te_attention->flash = get("NVTE_FLASH_ATTN") != "0";
      t.te_attention->fused = get("NVTE_FUSED_ATTN") != "0";
      t.te_attention->unfused = get("NVTE_UNFUSED_ATTN") != "0";
    }
    if (get("NVTE_ALLOW_NONDETERMINISTIC_ALGO") == "0") t.te_attention->deterministic = true;
  }
  return Status::OK();
}

}  // namespace

std::vector<std::string> ModelledEnvNames() { return {ModelledEnv().begin(), ModelledEnv().end()}; }

Status ParseMegatronArgs(const std::vector<std::string>& args,
                         const std::map<std::string, std::string>& env, int64_t world_size,
                         MegatronArgsResult* out) {
  Args parsed;
  MEMSIM_RETURN_IF_ERROR(parsed.Parse(args));
  MegatronArgsResult result;
  try {
    MEMSIM_RETURN_IF_ERROR(Build(parsed, world_size, &result));
    MEMSIM_RETURN_IF_ERROR(ApplyEnvironment(env, parsed, &result));
  } catch (const std::overflow_error&) {
    return Status::Error("the Megatron-LM arguments give sizes too large for 64-bit counts");
  }
  std::vector<std::string> ignored = parsed.Ignored();
  ignored.insert(ignored.end(), result.ignored.begin(), result.ignored.end());
  result.ignored = std::move(ignored);
  *out = std::move(result);
  return Status::OK();
}

}  // namespace memsim
