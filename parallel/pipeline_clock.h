// The pipeline clock: every stage's recording moved onto one clock on which the stages
// run their schedules together, as a real pipeline does.
//
// Note [Pipeline clock]
// Each pipeline stage is simulated alone (one rank class per stage), and its virtual clock
// (Note [Virtual clock] in simulator/cost_model.h) only counts its own ops: alone, stage 0
// would run its warm-up forwards back to back and its iteration would be shorter than the
// last stage's. A real stage waits: a forward step cannot start before the previous
// stage has sent its activations, a backward step before the next stage has sent its
// gradients. So, once every stage has been simulated, the steps of their schedules
// (PipelineStep, one forward or backward of one microbatch's model chunk) are placed on
// one clock:
//   - each step keeps its duration on its own stage's clock (the time from its start to
//     the next step's start, or to the optimizer for the last one);
//   - forward (m, c) on stage s starts after its own stage's previous step and after
//     forward (m, c) of stage s-1 ends (for s = 0 and c > 0: forward (m, c-1) of the last
//     stage); backward (m, c) after backward (m, c) of stage s+1 (for the last stage and
//     c < vpp-1: backward (m, c+1) of stage 0): receives wait for sends. A send does not
//     wait for its receive, and the transfer takes no time (the step time, Note [Step
//     time], counts communication apart);
//   - every stage begins an iteration together (iteration 0 once the slowest setup is
//     done), starts the optimizer together when the last stage's last backward is done
//     (the gradient-norm all-reduce spans the pipeline), and ends the iteration when the
//     slowest stage's optimizer is done, so all stages' iterations have one length.
// The time a stage spends waiting is idle: its memory holds a plateau, as real traces do
// while the later stages work. Events keep their order and their offsets inside a step;
// only the gaps between steps change. The stages' own clocks (before the move) are what
// EstimateStepTime composes; the two agree on the pipeline's shape (PipelineSeconds is this
// schedule's length for stages of equal speed) but not to the last digit.
#pragma once

#include <cstdint>
#include <vector>

#include "parallel/layout.h"
#include "parallel/pipeline_schedule.h"
#include "simulator/recorder.h"
#include "simulator/status.h"

namespace memsim {

// Start times of every stage's steps, in schedule order, when step k of stage s
// (schedules[s][k]) takes durations_s[s][k] and stage s may start its first step at
// ready_s[s] (Note [Pipeline clock]). Empty if the schedules deadlock (a memsim bug).
// REQUIRES: schedules[s] is PipelineSchedule(pp, vpp, s, num_microbatches, group, combined) for
// pp = schedules.size(); durations_s[s].size() == schedules[s].size(); durations >= 0.
std::vector<std::vector<double>> PipelineStepStarts(
    const std::vector<std::vector<PipelineStep>>& schedules, int64_t vpp, int64_t num_microbatches,
    const std::vector<std::vector<double>>& durations_s, const std::vector<double>& ready_s);

// Moves the recordings of all stages (stages[s] is pipeline stage s, recorded by
// RunRankTraining for `layout` with `num_microbatches`) onto one pipeline clock. A layout
// without pipeline parallelism is left as it is. An error means the recordings do not
// follow the schedule (a memsim bug); they are then left unchanged.
Status PutStagesOnPipelineClock(const ParallelLayout& layout, int64_t num_microbatches,
                                const std::vector<Recorder*>& stages);

}  // namespace memsim
