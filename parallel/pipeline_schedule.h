// The order in which a pipeline stage runs its microbatches' forward and backward steps,
// as Megatron-LM's schedules do (megatron/core/pipeline_parallel/schedules.py).
//
// Note [Pipeline memory]
// A stage holds the activations of every microbatch whose forward has run and whose
// backward has not. 1F1B (forward_backward_pipelining_without_interleaving): stage r
// warms up with min(pp - r - 1, m) forwards, then alternates one forward and one
// backward, so it holds at most min(pp - r, m) microbatches. Interleaved 1F1B with vpp
// model chunks per stage: (pp - r - 1) * 2 + (vpp - 1) * pp warm-up forwards (all of
// them when m == pp), chunk of virtual microbatch k = (k mod pp*vpp) / pp, so the first
// stage holds 1 + (pp - 1)/(pp * vpp) times the activations of 1F1B.
#pragma once

#include <cstdint>
#include <vector>

namespace memsim {

struct PipelineStep {
  bool forward;
  int64_t microbatch;
  int64_t chunk;  // model chunk on this stage (0 without interleaving)
};

// REQUIRES: 0 <= pp_rank < pp, vpp >= 1, num_microbatches >= 1 and, when vpp > 1,
// num_microbatches a multiple of pp (Megatron's requirement for interleaving).
std::vector<PipelineStep> PipelineSchedule(int64_t pp, int64_t vpp, int64_t pp_rank,
                                           int64_t num_microbatches);

// The most microbatch-chunks whose forward has run and backward has not, over the schedule.
int64_t MaxInFlight(const std::vector<PipelineStep>& schedule);

}  // namespace memsim
