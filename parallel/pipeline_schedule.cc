#include "parallel/pipeline_schedule.h"

#include <algorithm>

namespace memsim {

std::vector<PipelineStep> PipelineSchedule(int64_t pp, int64_t vpp, int64_t pp_rank,
                                           int64_t num_microbatches) {
  const int64_t total = num_microbatches * vpp;
  int64_t warmup;
  if (vpp == 1) {
    warmup = std::min(pp - pp_rank - 1, num_microbatches);
  } else if (num_microbatches == pp) {
    warmup = total;  // all_warmup_microbatches
  } else {
    warmup = std::min((pp - pp_rank - 1) * 2 + (vpp - 1) * pp, total);
  }
  // Virtual microbatch k -> (microbatch, chunk), in groups of pp microbatches per chunk.
  auto step = [&](int64_t k, bool forward) {
    const int64_t in_group = k % (pp * vpp);
    int64_t chunk = in_group / pp;
    if (!forward) chunk = vpp - 1 - chunk;
    const int64_t microbatch = (k / (pp * vpp)) * pp + in_group % pp;
    return PipelineStep{forward, microbatch, chunk};
  };
  std::vector<PipelineStep> steps;
  steps.reserve(static_cast<size_t>(2 * total));
  for (int64_t k = 0; k < warmup; ++k) steps.push_back(step(k, true));
  for (int64_t k = 0; k < total - warmup; ++k) {
    steps.push_back(step(warmup + k, true));
    steps.push_back(step(k, false));
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
