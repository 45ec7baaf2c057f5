// The pipeline clock (Note [Pipeline clock]) against schedules worked out by hand, and on
// whole simulations: one iteration length for every stage, waits as plateaus.
#include "parallel/pipeline_clock.h"

#include <gtest/gtest.h>

#include <optional>

#include "parallel/rank_simulation.h"
#include "parallel/run_spec.h"
#include "tests/support/test_models.h"

namespace memsim {
namespace {

// Every stage's schedule (PipelineSchedule's order).
std::vector<std::vector<PipelineStep>> Schedules(int64_t pp, int64_t vpp, int64_t microbatches) {
  std::vector<std::vector<PipelineStep>> schedules;
  for (int64_t s = 0; s < pp; ++s) schedules.push_back(PipelineSchedule(pp, vpp, s, microbatches));
  return schedules;
}

// Step durations of the 1F1B cases below: forward 1 s, backward 2 s, in each stage's order.
const std::vector<std::vector<double>> k1F1BDurations = {{1, 1, 2, 1, 2, 2}, {1, 2, 1, 2, 1, 2}};

// 1F1B, PP 2, 3 microbatches, forward 1 s and backward 2 s on both stages. Stage 0 runs
// F0 F1 B0 F2 B1 B2, stage 1 F0 B0 F1 B1 F2 B2. By hand:
//   stage 0: F0 [0,1]  F1 [1,2]  B0 waits for stage 1's B0 [4,6]  F2 [6,7]
//            B1 waits for stage 1's B1 [7,9]  B2 waits for stage 1's B2 [10,12]
//   stage 1: F0 waits for stage 0's F0 [1,2]  B0 [2,4]  F1 [4,5]  B1 [5,7]
//            F2 waits for stage 0's F2 [7,8]  B2 [8,10]
// 12 s in all: Narayanan et al.'s (m + p - 1) * (f + b) = 4 * 3.
TEST(PipelineClock, OneForwardOneBackwardByHand) {
  const auto starts = PipelineStepStarts(Schedules(2, 1, 3), 1, 3, k1F1BDurations, {0, 0});
  ASSERT_EQ(starts.size(), 2u);
  EXPECT_EQ(starts[0], (std::vector<double>{0, 1, 4, 6, 7, 10}));
  EXPECT_EQ(starts[1], (std::vector<double>{1, 2, 4, 5, 7, 8}));
}

// A stage that may start late (a longer setup) delays the stages that wait for it.
TEST(PipelineClock, ALateStageDelaysItsReceivers) {
  const auto starts = PipelineStepStarts(Schedules(2, 1, 3), 1, 3, k1F1BDurations, {3, 0});
  ASSERT_EQ(starts.size(), 2u);
  EXPECT_EQ(starts[0], (std::vector<double>{3, 4, 7, 9, 10, 13}));
  EXPECT_EQ(starts[1], (std::vector<double>{4, 5, 7, 8, 10, 11}));
}

// Interleaved, PP 2, 2 chunks, 2 microbatches, every step 1 s. Stage 0 (all warm-up):
// F(0,c0) F(1,c0) F(0,c1) F(1,c1) B(0,c1) B(1,c1) B(0,c0) B(1,c0); stage 1: F(0,c0)
// F(1,c0) F(0,c1) B(0,c1) F(1,c1) B(1,c1) B(0,c0) B(1,c0). Chunk 1 of stage 0 receives
// from chunk 0 of stage 1, and backward (m, c0) of stage 1 from backward (m, c1) of
// stage 0. By hand: stage 0 at 0 1 2 3 5 7 8 9, stage 1 at 1 2 3 4 5 6 7 8; 10 s in all,
// (m v + p - 1) (f + b) = 5 * 2.
TEST(PipelineClock, InterleavedByHand) {
  const std::vector<std::vector<double>> durations(2, std::vector<double>(8, 1.0));
  const auto starts = PipelineStepStarts(Schedules(2, 2, 2), 2, 2, durations, {0, 0});
  ASSERT_EQ(starts.size(), 2u);
  EXPECT_EQ(starts[0], (std::vector<double>{0, 1, 2, 3, 5, 7, 8, 9}));
  EXPECT_EQ(starts[1], (std::vector<double>{1, 2, 3, 4, 5, 6, 7, 8}));
}

// Marker k's shift moves marker k and the events from its event to the next marker's.
TEST(PipelineClock, RecorderShiftsEventsByTheMarkerBeforeThem) {
  Recorder recorder;
  recorder.AddMarker(MarkerKind::kPhaseBegin);  // marker 0, before event 0, at 0 s
  AllocationRecord* a = recorder.OnAlloc(8);    // event 0 at 0 s
  recorder.AdvanceClock(1);
  recorder.AddMarker(MarkerKind::kIterationBegin);  // marker 1, before event 1, at 1 s
  AllocationRecord* b = recorder.OnAlloc(8);        // event 1 at 1 s
  recorder.AdvanceClock(1);
  recorder.OnFree(a->storage_id);                 // event 2 at 2 s
  recorder.AddMarker(MarkerKind::kIterationEnd);  // marker 2, before event 3, at 2 s
  recorder.AdvanceClock(1);
  recorder.OnFree(b->storage_id);  // event 3 at 3 s
  delete a;
  delete b;
  recorder.ShiftTimesAtMarkers({0.5, 10, 20});
  std::vector<double> events, markers;
  for (const MemoryEvent& e : recorder.events()) events.push_back(e.time_s);
  for (const Marker& m : recorder.markers()) markers.push_back(m.time_s);
  EXPECT_EQ(events, (std::vector<double>{0.5, 11, 12, 23}));
  EXPECT_EQ(markers, (std::vector<double>{0.5, 11, 22}));
}

std::optional<ValidatedRun> TinyPipelineRun(int64_t pp, int64_t vpp) {
  RunSpec spec;
  spec.model = test::Gpt(8, 256, 8);
  spec.training.seq_length = 256;
  spec.training.num_microbatches = 4;
  spec.layout.world_size = pp;
  spec.layout.pp = pp;
  spec.layout.vpp = vpp;
  spec.gpu = FindGpu("H100-80GB");
  std::optional<ValidatedRun> run;
  const Status status = FinalizeRunSpec(spec, &run);
  EXPECT_TRUE(status.ok()) << status.message();
  return run;
}

// Every stage's iteration has one length, and the first stage waits between its warm-up
// forwards and its first backward while the others work: it holds a plateau (no event)
// for longer than any gap of its own clock.
TEST(PipelineClock, StagesShareOneIterationLengthAndTheFirstWaits) {
  for (int64_t vpp : {1, 2}) {
    const std::optional<ValidatedRun> run = TinyPipelineRun(4, vpp);
    ASSERT_TRUE(run);
    std::vector<RankResult> stages;
    ASSERT_TRUE(SimulateAllClasses(*run, 1, &stages).ok());
    ASSERT_EQ(stages.size(), 4u);
    for (const RankResult& r : stages) {
      ASSERT_EQ(r.timeline.iterations().size(), 2u);
      for (size_t i = 0; i < 2; ++i) {
        const IterationSummary& it = r.timeline.iterations()[i];
        const IterationSummary& first = stages[0].timeline.iterations()[i];
        EXPECT_EQ(it.begin_time_s, first.begin_time_s) << "vpp " << vpp;
        EXPECT_EQ(it.end_time_s, first.end_time_s) << "vpp " << vpp;
      }
      // The order of events is kept exactly.
      const std::vector<MemoryEvent>& events = r.session->recorder().events();
      for (size_t e = 1; e < events.size(); ++e) {
        ASSERT_LE(events[e - 1].time_s, events[e].time_s) << "stage " << r.rank_class.pp_rank;
      }
    }
    // Stage 0 alone: its longest gap between events in the last iteration.
    RankResult alone;
    ASSERT_TRUE(SimulateRankClass(*run, stages[0].rank_class, &alone).ok());
    auto longest_gap = [](const RankResult& r) {
      const IterationSummary& it = r.timeline.iterations().back();
      const std::vector<MemoryEvent>& events = r.session->recorder().events();
      double gap = 0;
      for (int64_t e = it.begin_event + 1; e < it.end_event; ++e) {
        gap = std::max(
            gap, events[static_cast<size_t>(e)].time_s - events[static_cast<size_t>(e - 1)].time_s);
      }
      return gap;
    };
    EXPECT_GT(longest_gap(stages[0]), 2 * longest_gap(alone)) << "vpp " << vpp;
    // The stage's own clock is what the step time composes: the same as alone.
    EXPECT_EQ(stages[0].own_clock.compute_s, alone.own_clock.compute_s);
    EXPECT_EQ(stages[0].own_clock.optimizer_s, alone.own_clock.optimizer_s);
  }
}

// Without a pipeline nothing moves: the same times as the stage alone.
TEST(PipelineClock, NoPipelineKeepsTheOwnClock) {
  const std::optional<ValidatedRun> run = TinyPipelineRun(1, 1);
  ASSERT_TRUE(run);
  std::vector<RankResult> all;
  ASSERT_TRUE(SimulateAllClasses(*run, 1, &all).ok());
  RankResult alone;
  ASSERT_TRUE(SimulateRankClass(*run, all[0].rank_class, &alone).ok());
  const auto& a = all[0].session->recorder().events();
  const auto& b = alone.session->recorder().events();
  ASSERT_EQ(a.size(), b.size());
  for (size_t e = 0; e < a.size(); ++e) ASSERT_EQ(a[e].time_s, b[e].time_s);
}

}  // namespace
}  // namespace memsim
