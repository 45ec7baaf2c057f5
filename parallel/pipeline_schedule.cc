#include "parallel/pipeline_schedule.h"

#include <algorithm>
#include <stdexcept>

namespace memsim {

Status CheckMicrobatchGroup(int64_t pp, int64_t vpp, int64_t num_microbatches, int64_t group) {
  if (vpp == 1) return Status::OK();
  if (group < pp || group > num_microbatches) {
    return Status::Error(
        "interleaved pipelining needs the microbatch group size per virtual stage (" +
        std::to_string(group) + ") in [PP=" + std::to_string(pp) +
        ", microbatches=" + std::to_string(num_microbatches) + "] (Megatron-LM rejects it)");
  }
  const int64_t remainder = num_microbatches % group;
  if (remainder > 0 && remainder < pp) {
    return Status::Error("interleaved pipelining: " + std::to_string(num_microbatches) +
                         " microbatches leave a last group of " + std::to_string(remainder) +
                         ", fewer than PP=" + std::to_string(pp) + " (Megatron-LM rejects it)");
  }
  return Status::OK();
}

int64_t PipelineWarmup(int64_t pp, int64_t vpp, int64_t pp_rank, int64_t num_microbatches,
                       int64_t group, bool combined_1f1b) {
  if (group == 0) group = pp;
  // get_pp_rank_microbatches: everything is warm-up when the count reaches the total; the
  // combined 1F1B schedule warms up with one more interleaved forward.
  const int64_t interleaved_warmup =
      (pp - pp_rank - 1) * 2 + (vpp - 1) * group + (combined_1f1b ? 1 : 0);
  return std::min(vpp == 1 ? pp - pp_rank - 1 : interleaved_warmup, num_microbatches * vpp);
}

std::vector<PipelineStep> PipelineSchedule(int64_t pp, int64_t vpp, int64_t pp_rank,
                                           int64_t num_microbatches, int64_t group,
                                           bool combined_1f1b) {
  if (group == 0) group = pp;
  if (pp_rank < 0 || pp_rank >= pp || num_microbatches < 1 ||
      !CheckMicrobatchGroup(pp, vpp, num_microbatches, group).ok()) {
    throw std::invalid_argument("PipelineSchedule: arguments outside its REQUIRES");
  }
  const int64_t total = num_microbatches * vpp;
  const int64_t warmup = PipelineWarmup(pp, vpp, pp_rank, num_microbatches, group, combined_1f1b);
  // get_schedule_table: microbatches in groups of `group` (the last group takes the rest),
  // each group run through chunk 0, 1, ... in turn; backward visits chunks in reverse.
  std::vector<PipelineStep> table;
  table.reserve(static_cast<size_t>(total));
  for (int64_t first = 0; first < num_microbatches; first += group) {
    const int64_t end = first + group >= num_microbatches ? num_microbatches : first + group;
    for (int64_t chunk = 0; chunk < vpp; ++chunk) {
      for (int64_t mb = first; mb < end; ++mb) table.push_back({true, mb, chunk});
    }
    if (end == num_microbatches) break;
  }
  auto step = [&](int64_t k, bool forward) {
    PipelineStep s = table[static_cast<size_t>(k)];
    s.forward = forward;
    if (!forward) s.chunk = vpp - 1 - s.chunk;
    return s;
  };
  std::vector<PipelineStep> steps;
  steps.reserve(static_cast<size_t>(2 * total));
  for (int64_t k = 0; k < warmup; ++k) steps.push_back(step(k, true));
  // The combined 1F1B schedule runs a steady step's forward and backward layer by layer:
  // memsim lets the backward go first (Note [Combined 1F1B]).
  const bool backward_first = combined_1f1b && vpp > 1;
  for (int64_t k = 0; k < total - warmup; ++k) {
    if (backward_first) steps.push_back(step(k, false));
    steps.push_back(step(warmup + k, true));
    if (!backward_first) steps.push_back(step(k, false));
  }
  for (int64_t k = total - warmup; k < total; ++k) steps.push_back(step(k, false));
  return steps;
}

int64_t MaxInFlight(const std::vector<PipelineStep>& schedule) {
  int64_t in_flight = 0, max_in_flight = 0;
  for (const PipelineStep& s : schedule) {
    in_flight += s.forward ? 1 : -1;
    max_in_flight = std::max(max_in_flight, in_flight);
  }
  return max_in_flight;
}

}  // namespace memsim
