#include "parallel/rank_simulation.h"

#include <stdexcept>
#include <string>

#include "parallel/parallel_for.h"
#include "parallel/pipeline_clock.h"
#include "parallel/rank_training.h"
#include "parallel/theoretical_memory.h"

namespace memsim {

namespace {

// What the stage's own clock (before PutStagesOnPipelineClock) measured in its last
// iteration, for EstimateStepTime; `microbatches` is filled in by MeasuredClocks.
StageClock OwnClock(const Recorder& recorder) {
  StageClock clock;
  const Marker* begin = nullptr;
  const Marker* optimizer = nullptr;
  const Marker* end = nullptr;
  for (const Marker& marker : recorder.markers()) {
    if (marker.kind == MarkerKind::kIterationBegin) {
      begin = &marker;
      optimizer = end = nullptr;
    } else if (marker.kind == MarkerKind::kPhaseBegin && marker.phase == Phase::kOptimizer) {
      optimizer = &marker;
    } else if (marker.kind == MarkerKind::kIterationEnd) {
      end = &marker;
    }
  }
  if (begin == nullptr) return clock;  // no training step (setup only)
  const double end_s = end != nullptr ? end->time_s : recorder.now_s();
  const int64_t end_event =
      end != nullptr ? end->event_index : static_cast<int64_t>(recorder.events().size());
  const double optimizer_s = optimizer != nullptr ? optimizer->time_s : end_s;
  clock.compute_s = optimizer_s - begin->time_s;
  clock.optimizer_s = end_s - optimizer_s;
  ForEachLiveStorage(recorder, end_event - 1, [&](int64_t id) {
    const StorageInfo& s = recorder.storages()[static_cast<size_t>(id)];
    if (s.category == Category::kGradient) clock.gradient_bytes += s.size_bytes;
    if (s.category == Category::kParameter) clock.parameter_bytes += s.size_bytes;
  });
  return clock;
}

// Runs the training step of the class's stage (its recording, on its own clock).
Status RecordRankClass(const ValidatedRun& run, const RankClass& rank_class, RankResult* result) {
  const RunSpec& spec = run.spec();
  result->rank_class = rank_class;
  result->session = std::make_unique<Session>(spec.gpu);
  try {
    ActiveSession active(*result->session);
    result->parameters = RunRankTraining(run, rank_class.pp_rank, *result->session);
    result->own_clock = OwnClock(result->session->recorder());
  } catch (const UserError& e) {
    return Status::Error(e.what());
  } catch (const std::overflow_error& e) {
    return Status::Error(std::string(e.what()) + ": the configuration's sizes exceed 64 bits");
  } catch (const c10::Error& e) {
    const std::string what = e.what_without_backtrace();
    return Status::Error("simulating pipeline stage " + std::to_string(rank_class.pp_rank) +
                         " failed: " + what.substr(0, what.find('\n')));
  } catch (const std::exception& e) {
    // Anything else is a memsim bug; it must still end as one line, never an abort of
    // the worker thread this may run on.
    return Status::Error("internal error simulating pipeline stage " +
                         std::to_string(rank_class.pp_rank) + ": " + e.what());
  }
  result->session->recorder().EndRecording();
  return Status::OK();
}

// Replays the recording through the allocator model: timeline, peak and verdict.
Status ReplayRankClass(const ValidatedRun& run, RankResult* result) {
  const RunSpec& spec = run.spec();
  try {
    const Recorder& recorder = result->session->recorder();
    result->timeline = Timeline::Replay(recorder);
    result->peak = AnalyzePeak(recorder, result->timeline, kLargestTensorsKept);
    if (spec.gpu != nullptr) {
      result->on_gpu = ReplayWithCapacity(recorder, AllocatorCapacityBytes(spec), result->timeline);
    }
  } catch (const std::exception& e) {
    return Status::Error("internal error replaying pipeline stage " +
                         std::to_string(result->rank_class.pp_rank) + ": " + e.what());
  }
  return Status::OK();
}

}  // namespace

Status SimulateRankClass(const ValidatedRun& run, const RankClass& rank_class, RankResult* result) {
  MEMSIM_RETURN_IF_ERROR(RecordRankClass(run, rank_class, result));
  return ReplayRankClass(run, result);
}

Status SimulateAllClasses(const ValidatedRun& run, int jobs, std::vector<RankResult>* results) {
  const std::vector<RankClass> classes = RankClasses(run.spec().layout);
  results->clear();
  results->resize(classes.size());
  std::vector<Status> statuses(classes.size());
  ParallelFor(classes.size(), jobs,
              [&](size_t i) { statuses[i] = RecordRankClass(run, classes[i], &(*results)[i]); });
  for (const Status& s : statuses) MEMSIM_RETURN_IF_ERROR(s);
  std::vector<Recorder*> stages;
  for (RankResult& r : *results) stages.push_back(&r.session->recorder());
  MEMSIM_RETURN_IF_ERROR(
      PutStagesOnPipelineClock(run.spec().layout, run.spec().training.num_microbatches, stages));
  ParallelFor(classes.size(), jobs,
              [&](size_t i) { statuses[i] = ReplayRankClass(run, &(*results)[i]); });
  for (const Status& s : statuses) MEMSIM_RETURN_IF_ERROR(s);
  return Status::OK();
}

Status SimulateSetup(const ValidatedRun& run, SetupMemory* setup) {
  std::vector<RankResult> stages;
  MEMSIM_RETURN_IF_ERROR(SimulateAllClasses(run.SetupOnly(), /*jobs=*/1, &stages));
  *setup = SetupMemory();
  for (const RankResult& r : stages) {
    if (r.timeline.peak_allocated_bytes() > setup->peak_allocated_bytes) {
      setup->peak_allocated_bytes = r.timeline.peak_allocated_bytes();
      setup->pp_rank = r.rank_class.pp_rank;
    }
  }
  return Status::OK();
}

std::vector<StageClock> MeasuredClocks(const std::vector<RankResult>& stages,
                                       int64_t simulated_microbatches) {
  std::vector<StageClock> clocks;
  for (const RankResult& r : stages) {
    clocks.push_back(r.own_clock);
    clocks.back().microbatches = simulated_microbatches;
  }
  return clocks;
}

double TheoreticalMemoryMB(const ValidatedRun& run, int64_t pp_rank) {
  return ComputeTheoreticalMemory(run, pp_rank).total_mb;
}

}  // namespace memsim
