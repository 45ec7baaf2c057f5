#include "parallel/layout.h"

#include <algorithm>

#include "simulator/check.h"
#include "simulator/checked_math.h"

namespace memsim {
namespace {

std::string Str(int64_t v) { return std::to_string(v); }

// Far above any real layout (kMaxLayers layers, one segment each), small enough to build.
constexpr size_t kMaxLayoutChars = size_t{1} << 22;

// `text` in quotes for an error, cut to its first 60 characters if longer (Status::Error
// escapes any control characters).
std::string Quoted(const std::string& text) {
  return "'" + text.substr(0, 60) + (text.size() > 60 ? "..." : "") + "'";
}

bool IsDigit(char c) { return c >= '0' && c <= '9'; }

// A repetition "*n" starting at text[star]: sets *count (capped past kMaxLayoutChars) and
// *end past its digits; false if there is none.
bool ParseCount(const std::string& text, size_t star, int64_t* count, size_t* end) {
  if (star + 1 >= text.size() || text[star] != '*' || !IsDigit(text[star + 1])) return false;
  *count = 0;
  for (*end = star + 1; *end < text.size() && IsDigit(text[*end]); ++*end) {
    *count = std::min<int64_t>(*count * 10 + (text[*end] - '0'),
                               static_cast<int64_t>(kMaxLayoutChars) + 1);
  }
  return true;
}

// One left-to-right pass of Python's re.sub over `text`: where `match(i, &body, &count,
// &end)` finds a repetition at i, `body` `count` times and on from `end`; elsewhere the
// character itself.
template <typename Match>
Status UnrollPass(const std::string& text, Match match, std::string* out) {
  out->clear();
  for (size_t i = 0; i < text.size();) {
    std::string body;
    int64_t count = 0;
    size_t end = 0;
    if (!match(i, &body, &count, &end)) {
      out->push_back(text[i++]);
      continue;
    }
    if (static_cast<double>(body.size()) * static_cast<double>(count) +
            static_cast<double>(out->size()) >
        static_cast<double>(kMaxLayoutChars)) {
      return Status::Error("expands to more than " + Str(static_cast<int64_t>(kMaxLayoutChars)) +
                           " characters");
    }
    for (int64_t c = 0; c < count; ++c) out->append(body);
    i = end;
  }
  return Status::OK();
}

// PipelineParallelLayerLayout.parse_str_to_list's unrolling: commas dropped, then
// r"\(([^)]+)\)\*(\d+)" and then r"(.)\*(\d+)" each substituted in one pass.
Status ExpandLayout(std::string text, std::string* expanded) {
  text.erase(std::remove(text.begin(), text.end(), ','), text.end());
  std::string groups_unrolled;
  size_t close = 0;  // the first ')' after the current '(' (linear over many '(')
  MEMSIM_RETURN_IF_ERROR(UnrollPass(
      text,
      [&text, &close](size_t i, std::string* body, int64_t* count, size_t* end) {
        if (text[i] != '(') return false;
        if (close != std::string::npos && close <= i) close = text.find(')', i + 1);
        if (close == std::string::npos || close == i + 1 ||
            !ParseCount(text, close + 1, count, end)) {
          return false;
        }
        *body = text.substr(i + 1, close - i - 1);
        return true;
      },
      &groups_unrolled));
  const std::string& t = groups_unrolled;
  return UnrollPass(
      t,
      [&t](size_t i, std::string* body, int64_t* count, size_t* end) {
        if (t[i] == '\n' || !ParseCount(t, i + 1, count, end)) return false;
        *body = t.substr(i, 1);
        return true;
      },
      expanded);
}

// Layers on each middle stage of an uneven split whose ends are both named (0 without one).
int64_t MiddleStageLayers(const ParallelLayout& l, const ModelConfig& m) {
  return l.pp > 2 ? (m.num_layers - l.first_stage_layers - l.last_stage_layers) / (l.pp - 2) : 0;
}

// Uneven first/last stages, as Megatron-Core splits them (TransformerConfig.__post_init__,
// get_num_layers_to_build and get_transformer_layer_offset, 0.20): the layers the named ends
// leave split evenly over the other stages, so one named end gives the other end the middle
// stages' count; with VPP each stage's layers split evenly over its virtual stages, whose
// layers follow in chunk order (chunk c of every stage before chunk c + 1).
// REQUIRES: first_stage_layers or last_stage_layers nonzero, both in [0, num_layers].
Status FinalizeUnevenStages(ParallelLayout* l, const ModelConfig& m) {
  if (l->pp < 2) return Status::Error("uneven first/last stage layers need PP >= 2");
  const bool first_named = l->first_stage_layers != 0;
  const bool last_named = l->last_stage_layers != 0;
  const int64_t other_stages = l->pp - (first_named ? 1 : 0) - (last_named ? 1 : 0);
  const int64_t rest = m.num_layers - l->first_stage_layers - l->last_stage_layers;
  // Megatron-Core: "either have middle pp stages and layers or none of them".
  if (rest < 0 || (rest == 0) != (other_stages == 0) ||
      (other_stages > 0 && rest % other_stages != 0)) {
    std::string named = first_named ? "the first stage's " + Str(l->first_stage_layers) : "";
    if (last_named) {
      named += (first_named ? " and " : "") + ("the last stage's " + Str(l->last_stage_layers));
    }
    if (rest < 0) {
      return Status::Error(named + " layers are more than the model's " + Str(m.num_layers));
    }
    if (other_stages == 0) {
      return Status::Error(named + " leave " + Str(rest) + " of " + Str(m.num_layers) +
                           " layers with no other stage to hold them (PP=" + Str(l->pp) + ")");
    }
    if (rest == 0) {
      return Status::Error(named + " take all " + Str(m.num_layers) +
                           " layers, leaving none for the other " + Str(other_stages) +
                           " stages (Megatron-Core needs both or neither)");
    }
    return Status::Error("the " + Str(rest) + " of " + Str(m.num_layers) + " layers left by " +
                         named + " do not split evenly over the other " + Str(other_stages) +
                         " pipeline stages");
  }
  if (!first_named) l->first_stage_layers = rest / other_stages;
  if (!last_named) l->last_stage_layers = rest / other_stages;
  const int64_t middle_stage_layers = MiddleStageLayers(*l, m);
  for (const auto& [layers, stage] :
       {std::pair{l->first_stage_layers, "first"}, std::pair{l->last_stage_layers, "last"},
        std::pair{middle_stage_layers, "middle"}}) {
    if (layers % l->vpp != 0) {
      return Status::Error("the " + std::string(stage) + " stage's " + Str(layers) +
                           " layers do not split over VPP=" + Str(l->vpp) +
                           " virtual stages (Megatron-Core requires it)");
    }
  }
  return Status::OK();
}

}  // namespace

Status ParsePipelineLayout(const std::string& text, int64_t pp, const ModelConfig& model,
                           std::vector<int64_t>* layers_per_segment) {
  MEMSIM_DCHECK(pp > 0);
  if (text.size() > kMaxLayoutChars) {
    return Status::Error("pipeline layout " + Quoted(text) + " is longer than " +
                         Str(static_cast<int64_t>(kMaxLayoutChars)) + " characters");
  }
  std::string flat;
  if (const Status expanded = ExpandLayout(text, &flat); !expanded.ok()) {
    return Status::Error("pipeline layout " + Quoted(text) + " " + expanded.message());
  }
  std::vector<std::string> segments(1);
  for (char c : flat) {
    if (c == '|') {
      segments.emplace_back();
    } else if (c == 'E' || c == 'L' || c == 't' || c == 'm') {
      segments.back().push_back(c);
    } else {
      return Status::Error("pipeline layout " + Quoted(text) + ": invalid layer character '" +
                           std::string(1, c) + "' (known: E embedding, t decoder layer, m MTP " +
                           "layer, L loss; | separates stages)");
    }
  }
  const int64_t num_segments = static_cast<int64_t>(segments.size());
  if (num_segments % pp != 0) {
    return Status::Error("pipeline layout " + Quoted(text) + " has " + Str(num_segments) +
                         " stages, not a multiple of PP=" + Str(pp));
  }
  // In layer order the segments are already in sequence (segment i = chunk i / pp of
  // stage i % pp, chunk-major).
  const auto count = [&flat](char c) {
    return static_cast<int64_t>(std::count(flat.begin(), flat.end(), c));
  };
  const size_t first_mtp = flat.find('m');
  std::string problem;
  if (count('E') != 1 || count('L') != 1 || flat.find('E') != flat.find_first_not_of('|') ||
      flat.find('L') != flat.find_last_not_of('|')) {
    problem = "needs one embedding E first and one loss L last";
  } else if (count('t') != model.num_layers) {
    problem =
        "has " + Str(count('t')) + " decoder layers t, not the model's " + Str(model.num_layers);
  } else if (count('m') != model.mtp_num_layers) {
    problem = "has " + Str(count('m')) + " MTP layers m, not --mtp-num-layers " +
              Str(model.mtp_num_layers);
  } else if (first_mtp != std::string::npos && flat.find('t', first_mtp) != std::string::npos) {
    problem = "places decoder layers after MTP layers";
  } else if (num_segments / pp > model.num_layers + 2) {
    // A chunk per layer, the embedding's and the loss's: more are empty chunks, whose
    // schedule steps only cost time.
    problem = "has " + Str(num_segments / pp) + " chunks per stage, more than the " +
              Str(model.num_layers) + " layers + 2 need";
  } else if (segments.front().find('E') == std::string::npos ||
             segments.back().find('L') == std::string::npos ||
             std::count(segments.back().begin(), segments.back().end(), 'm') !=
                 model.mtp_num_layers) {
    problem =
        "must hold the embedding in the first stage's first chunk and the loss and MTP layers "
        "in the last stage's last chunk (memsim does not model other placements)";
  }
  if (!problem.empty()) return Status::Error("pipeline layout " + Quoted(text) + " " + problem);
  layers_per_segment->clear();
  for (const std::string& segment : segments) {
    layers_per_segment->push_back(
        static_cast<int64_t>(std::count(segment.begin(), segment.end(), 't')));
  }
  return Status::OK();
}

Status FinalizeLayout(ParallelLayout* l, const ModelConfig& m) {
  for (auto [value, name] : {std::pair{l->world_size, "world size"},
                             {l->tp, "TP"},
                             {l->pp, "PP"},
                             {l->vpp, "VPP"},
                             {l->cp, "CP"},
                             {l->ep, "EP"}}) {
    if (value <= 0)
      return Status::Error(std::string(name) + " must be positive, got " + Str(value));
  }
  if (l->world_size > kMaxWorldSize) {
    return Status::Error("world size " + Str(l->world_size) + " is above memsim's limit of " +
                         Str(kMaxWorldSize) + " GPUs");
  }
  for (auto [value, name] :
       {std::pair{l->tp, "TP"}, {l->pp, "PP"}, {l->cp, "CP"}, {l->ep, "EP"}, {l->etp, "ETP"}}) {
    if (value > l->world_size) {
      return Status::Error(std::string(name) + "=" + Str(value) +
                           " is larger than the world size " + Str(l->world_size));
    }
  }
  l->layout_layers.clear();
  if (!l->pipeline_layout.empty()) {
    if (l->first_stage_layers != 0 || l->last_stage_layers != 0 || l->embedding_in_split ||
        l->loss_in_split) {
      return Status::Error(
          "a pipeline layout cannot be combined with uneven first/last stage layers or with "
          "counting the embedding or the loss in the pipeline split");
    }
    MEMSIM_RETURN_IF_ERROR(ParsePipelineLayout(l->pipeline_layout, l->pp, m, &l->layout_layers));
    const int64_t layout_vpp = static_cast<int64_t>(l->layout_layers.size()) / l->pp;
    if (l->vpp != 1 && l->vpp != layout_vpp) {
      return Status::Error("VPP=" + Str(l->vpp) + " disagrees with the pipeline layout's " +
                           Str(layout_vpp) + " chunks per stage; leave VPP out");
    }
    l->vpp = layout_vpp;
  } else if (l->vpp > m.num_layers) {
    return Status::Error("VPP=" + Str(l->vpp) + " is more virtual stages than the " +
                         Str(m.num_layers) + " layers");
  }
  if (l->first_stage_layers < 0 || l->last_stage_layers < 0 ||
      l->first_stage_layers > m.num_layers || l->last_stage_layers > m.num_layers) {
    return Status::Error("first/last stage layers must be in [0, " + Str(m.num_layers) + "]");
  }
  if (l->distributed_optimizer_instances <= 0) {
    return Status::Error("distributed optimizer instances must be positive");
  }
  if (l->etp < 0) return Status::Error("ETP must not be negative");
  if (l->etp == 0) l->etp = l->tp;
  const int64_t model_parallel = CheckedMul(CheckedMul(l->tp, l->pp), l->cp);
  if (l->world_size % model_parallel != 0) {
    return Status::Error("world size " + Str(l->world_size) +
                         " is not a multiple of TP*PP*CP = " + Str(l->tp) + "*" + Str(l->pp) + "*" +
                         Str(l->cp) + " = " + Str(model_parallel));
  }
  l->dp = l->world_size / model_parallel;
  if (m.num_attention_heads % l->tp != 0) {
    return Status::Error("TP=" + Str(l->tp) + " does not divide " + Str(m.num_attention_heads) +
                         " attention heads");
  }
  if (m.num_query_groups % l->tp != 0) {
    return Status::Error("TP=" + Str(l->tp) + " does not divide " + Str(m.num_query_groups) +
                         " query groups (kv heads)");
  }
  if (m.ffn_hidden_size % l->tp != 0) {
    return Status::Error("TP=" + Str(l->tp) + " does not divide FFN hidden size " +
                         Str(m.ffn_hidden_size));
  }
  if (l->sequence_parallel && l->tp == 1) l->sequence_parallel = false;  // as Megatron does
  if (l->vpp > 1 && l->pp == 1) {
    return Status::Error("VPP=" + Str(l->vpp) + " needs pipeline parallelism (PP > 1)");
  }
  if (l->vpp > 1 && !l->overlap_p2p_comm && l->pp <= 2) {
    return Status::Error(
        "interleaving without p2p overlap needs PP > 2 (Megatron-LM asserts it: "
        "two sends between the same ranks in one batch), got PP=" +
        Str(l->pp) + "; drop --no-overlap-p2p-communication or raise PP");
  }
  const int64_t chunks = CheckedMul(l->pp, l->vpp);
  const bool uneven = l->first_stage_layers != 0 || l->last_stage_layers != 0;
  if (uneven && (l->embedding_in_split || l->loss_in_split)) {
    return Status::Error(
        "uneven first/last stage layers cannot be combined with counting the embedding or "
        "the loss in the pipeline split (Megatron-Core refuses it too)");
  }
  const int64_t split_layers =
      m.num_layers + (l->embedding_in_split ? 1 : 0) + (l->loss_in_split ? 1 : 0);
  if (!l->pipeline_layout.empty()) {
    // ParsePipelineLayout placed every layer.
  } else if (!uneven) {
    if (split_layers % chunks != 0) {
      return Status::Error(
          "PP*VPP=" + Str(l->pp) + "*" + Str(l->vpp) + " does not divide " + Str(split_layers) +
          (split_layers != m.num_layers
               ? " layers (with the embedding and loss counted)"
               : " layers; give the first or last stage's layers for an uneven split "
                 "(--first-stage-layers/--last-stage-layers; Megatron-LM's "
                 "--decoder-first/last-pipeline-num-layers) or a pipeline layout"));
    }
  } else {
    MEMSIM_RETURN_IF_ERROR(FinalizeUnevenStages(l, m));
  }
  if (m.num_experts > 0) {
    if (m.num_experts % l->ep != 0) {
      return Status::Error("EP=" + Str(l->ep) + " does not divide " + Str(m.num_experts) +
                           " experts");
    }
    const int64_t expert_model_parallel = CheckedMul(l->etp, l->ep);
    const int64_t dense_ranks = CheckedMul(CheckedMul(l->tp, l->cp), l->dp);
    if (dense_ranks % expert_model_parallel != 0) {
      return Status::Error("ETP*EP=" + Str(l->etp) + "*" + Str(l->ep) +
                           " does not divide TP*CP*DP=" + Str(dense_ranks) + " ranks of a stage");
    }
    l->edp = dense_ranks / expert_model_parallel;
    const int64_t moe_ffn = m.moe_ffn_hidden_size;
    if (moe_ffn % l->etp != 0) {
      return Status::Error("ETP=" + Str(l->etp) + " does not divide the expert FFN size " +
                           Str(moe_ffn));
    }
  } else if (l->ep > 1) {
    return Status::Error("EP=" + Str(l->ep) +
                         " needs a mixture-of-experts model (num_experts > 0)");
  } else {
    l->edp = l->dp;
  }
  const int64_t instances = l->distributed_optimizer_instances;
  if (instances > 1 && (l->dp * l->cp % instances != 0 || l->edp % instances != 0)) {
    return Status::Error(Str(instances) +
                         " distributed optimizer instances do not divide DP*CP = " +
                         Str(l->dp * l->cp) + " (and expert DP = " + Str(l->edp) + ")");
  }
  return Status::OK();
}

int64_t OptimizerShards(const ParallelLayout& layout, bool experts) {
  if (layout.data_parallel == DataParallelKind::kDdp) return 1;
  if (layout.data_parallel == DataParallelKind::kMegatronFsdp) {
    return experts ? layout.edp : layout.dp * layout.cp;
  }
  if (layout.data_parallel != DataParallelKind::kDistributedOptimizer) {
    return experts ? layout.edp : layout.dp;  // ZeRO-2, FSDP: memsim's own sharding
  }
  return (experts ? layout.edp : layout.dp * layout.cp) / layout.distributed_optimizer_instances;
}

RankCoordinates CoordinatesOf(const ParallelLayout& l, int64_t rank) {
  RankCoordinates c;
  c.tp_rank = rank % l.tp;
  rank /= l.tp;
  c.cp_rank = rank % l.cp;
  rank /= l.cp;
  c.dp_rank = rank % l.dp;
  c.pp_rank = rank / l.dp;
  return c;
}

int64_t LayersOnStage(const ParallelLayout& l, const ModelConfig& m, int64_t pp_rank,
                      int64_t chunk) {
  MEMSIM_DCHECK(0 <= pp_rank && pp_rank < l.pp && 0 <= chunk && chunk < l.vpp);
  if (!l.layout_layers.empty()) return l.layout_layers[static_cast<size_t>(chunk * l.pp + pp_rank)];
  if (l.first_stage_layers == 0 && l.last_stage_layers == 0) {
    const int64_t split_layers =
        m.num_layers + (l.embedding_in_split ? 1 : 0) + (l.loss_in_split ? 1 : 0);
    int64_t layers = split_layers / (l.pp * l.vpp);
    if (l.embedding_in_split && pp_rank == 0 && chunk == 0) --layers;
    if (l.loss_in_split && pp_rank == l.pp - 1 && chunk == l.vpp - 1) --layers;
    return layers;
  }
  // Uneven: FinalizeLayout named both ends; a stage's layers split evenly over its chunks.
  MEMSIM_DCHECK(l.first_stage_layers > 0 && l.last_stage_layers > 0);
  const int64_t stage_layers = pp_rank == 0          ? l.first_stage_layers
                               : pp_rank == l.pp - 1 ? l.last_stage_layers
                                                     : MiddleStageLayers(l, m);
  return stage_layers / l.vpp;
}

int64_t FirstLayerOfStage(const ParallelLayout& l, const ModelConfig& m, int64_t pp_rank,
                          int64_t chunk) {
  // Interleaved chunks: chunk c of stage r holds model chunk c * pp + r.
  int64_t first = 0;
  for (int64_t c = 0; c <= chunk; ++c) {
    for (int64_t r = 0; r < l.pp; ++r) {
      if (c == chunk && r == pp_rank) return first;
      first += LayersOnStage(l, m, r, c);
    }
  }
  return first;
}

}  // namespace memsim
