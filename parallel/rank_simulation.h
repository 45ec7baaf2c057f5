// The engine's entry points: simulate one rank class (a pipeline stage) or all of a
// layout's, from a ValidatedRun (Note [One validated spec] in run_spec.h), and read
// what the simulation measured.
#pragma once

#include <memory>
#include <vector>

#include "parallel/rank_classes.h"
#include "parallel/run_spec.h"
#include "parallel/step_time.h"
#include "simulator/peak_analysis.h"
#include "simulator/session.h"
#include "simulator/status.h"
#include "simulator/timeline.h"

namespace memsim {

// Largest tensors alive at the peak that summaries list and --top may print.
inline constexpr size_t kLargestTensorsKept = 50;

// The simulation of one rank class (one pipeline stage).
struct RankResult {
  RankClass rank_class;
  int64_t parameters = 0;  // elements of the model shard each rank of the class holds
  std::unique_ptr<Session> session;
  Timeline timeline;
  PeakAnalysis peak;
  // The recording replayed on what the allocator can reserve (AllocatorCapacityBytes): the
  // verdict, and the headroom.
  CapacityReplay on_gpu;
  // What the stage's own virtual clock measured in the last iteration, before the stages
  // were put on one pipeline clock (Note [Pipeline clock] in parallel/pipeline_clock.h).
  StageClock own_clock;
  bool fits() const { return on_gpu.fits(); }
  // What the allocator can reserve (AllocatorCapacityBytes) minus the peak reserved on the
  // GPU; >= 0 whenever the step fits.
  int64_t headroom_bytes(const RunSpec& spec) const {
    return AllocatorCapacityBytes(spec) - on_gpu.peak_reserved_bytes;
  }
};

// Simulates the class of `run` alone, on its own clock. User errors (a missing kernel, a size
// overflow) come back as a Status.
Status SimulateRankClass(const ValidatedRun& run, const RankClass& rank_class, RankResult* result);

// Simulates every rank class on up to `jobs` threads, each stage on its own clock, then
// puts the stages on one pipeline clock (Note [Pipeline clock]) before replaying their
// timelines; results in stage order.
Status SimulateAllClasses(const ValidatedRun& run, int jobs, std::vector<RankResult>* results);

// The memory that lives through the whole step (parameters, gradient buffers, the
// optimizer's master weights and state): the largest allocated by any stage's setup,
// simulated without a training step. A layout whose setup exceeds the GPU cannot fit
// (allocated memory never exceeds reserved memory, which never exceeds the device), so
// plan and sweep rule it out without simulating its steps.
struct SetupMemory {
  int64_t peak_allocated_bytes = 0;
  int64_t pp_rank = 0;  // the stage that holds the most
};
Status SimulateSetup(const ValidatedRun& run, SetupMemory* setup);

// What each stage's own virtual clock measured in its last iteration (results in stage
// order), for EstimateStepTime; the stages ran `simulated_microbatches` microbatches.
std::vector<StageClock> MeasuredClocks(const std::vector<RankResult>& stages,
                                       int64_t simulated_microbatches);

// Megatron-LM's analytical estimate for pipeline stage `pp_rank` of `run`, in MiB (Note
// [Theoretical memory per stage] in parallel/theoretical_memory.h).
double TheoreticalMemoryMB(const ValidatedRun& run, int64_t pp_rank);

}  // namespace memsim
