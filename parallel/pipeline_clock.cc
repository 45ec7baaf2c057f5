#include "parallel/pipeline_clock.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

namespace memsim {
namespace {

constexpr double kNotYet = std::numeric_limits<double>::quiet_NaN();

// Where one iteration's regions begin in a stage's markers (indices into markers()).
struct IterationMarkers {
  size_t begin = 0;             // kIterationBegin
  std::vector<size_t> steps;    // kMicrobatchBegin of each schedule step, in order
  size_t optimizer = SIZE_MAX;  // kPhaseBegin of the optimizer
  size_t end = SIZE_MAX;        // kIterationEnd
};

// The iterations of `recorder`, each with one step per entry of a schedule of
// `schedule_size` steps; an error names what does not match.
Status ReadIterations(const Recorder& recorder, size_t schedule_size, int64_t pp_rank,
                      std::vector<IterationMarkers>* iterations) {
  const std::vector<Marker>& markers = recorder.markers();
  bool open = false;
  for (size_t k = 0; k < markers.size(); ++k) {
    const Marker& m = markers[k];
    if (m.kind == MarkerKind::kIterationBegin) {
      iterations->push_back({k, {}, SIZE_MAX, SIZE_MAX});
      open = true;
    } else if (open && m.kind == MarkerKind::kMicrobatchBegin) {
      iterations->back().steps.push_back(k);
    } else if (open && m.kind == MarkerKind::kPhaseBegin && m.phase == Phase::kOptimizer) {
      iterations->back().optimizer = k;
    } else if (open && m.kind == MarkerKind::kIterationEnd) {
      iterations->back().end = k;
      open = false;
    }
  }
  for (const IterationMarkers& it : *iterations) {
    if (it.steps.size() != schedule_size || it.optimizer == SIZE_MAX || it.end == SIZE_MAX ||
        (!it.steps.empty() && it.optimizer < it.steps.back())) {
      return Status::Error("memsim bug: pipeline stage " + std::to_string(pp_rank) + " recorded " +
                           std::to_string(it.steps.size()) + " steps where its schedule has " +
                           std::to_string(schedule_size) + " (please report it)");
    }
  }
  return Status::OK();
}

}  // namespace

std::vector<std::vector<double>> PipelineStepStarts(
    const std::vector<std::vector<PipelineStep>>& schedules, int64_t vpp, int64_t num_microbatches,
    const std::vector<std::vector<double>>& durations_s, const std::vector<double>& ready_s) {
  const size_t stages = schedules.size();
  const auto pp = static_cast<int64_t>(stages);
  MEMSIM_DCHECK(durations_s.size() == stages && ready_s.size() == stages);
  // End time of each (stage, direction, chunk, microbatch); NaN until scheduled.
  std::vector<double> ends(stages * 2 * static_cast<size_t>(vpp * num_microbatches), kNotYet);
  auto end_of = [&](int64_t s, bool forward, int64_t chunk, int64_t mb) -> double& {
    return ends[((static_cast<size_t>(s) * 2 + (forward ? 1 : 0)) * static_cast<size_t>(vpp) +
                 static_cast<size_t>(chunk)) *
                    static_cast<size_t>(num_microbatches) +
                static_cast<size_t>(mb)];
  };
  // When the step's input arrives: -infinity if it comes from this stage itself.
  auto input_ready = [&](int64_t s, const PipelineStep& step) {
    if (step.forward) {
      if (s > 0) return end_of(s - 1, true, step.chunk, step.microbatch);
      if (step.chunk > 0) return end_of(pp - 1, true, step.chunk - 1, step.microbatch);
    } else {
      if (s < pp - 1) return end_of(s + 1, false, step.chunk, step.microbatch);
      if (step.chunk < vpp - 1) return end_of(0, false, step.chunk + 1, step.microbatch);
    }
    return -std::numeric_limits<double>::infinity();
  };

  std::vector<std::vector<double>> starts(stages);
  std::vector<double> free_at = ready_s;  // when each stage's previous step ended
  size_t remaining = 0;
  for (const auto& schedule : schedules) remaining += schedule.size();
  while (remaining > 0) {
    bool progress = false;
    for (int64_t s = 0; s < pp; ++s) {
      const auto si = static_cast<size_t>(s);
      while (starts[si].size() < schedules[si].size()) {
        const size_t k = starts[si].size();
        const PipelineStep& step = schedules[si][k];
        const double input = input_ready(s, step);
        if (std::isnan(input)) break;  // its sender has not run it yet
        const double start = std::max(free_at[si], input);
        starts[si].push_back(start);
        free_at[si] = start + durations_s[si][k];
        end_of(s, step.forward, step.chunk, step.microbatch) = free_at[si];
        --remaining;
        progress = true;
      }
    }
    // Megatron-LM's schedules never deadlock; if these did, the schedule code is wrong.
    if (!progress) return {};
  }
  return starts;
}

Status PutStagesOnPipelineClock(const ParallelLayout& layout, int64_t num_microbatches,
                                const std::vector<Recorder*>& stages) {
  MEMSIM_DCHECK(stages.size() == static_cast<size_t>(layout.pp));
  if (layout.pp == 1) return Status::OK();
  const size_t pp = stages.size();
  std::vector<std::vector<PipelineStep>> schedules;
  std::vector<std::vector<IterationMarkers>> iterations(pp);
  for (size_t s = 0; s < pp; ++s) {
    schedules.push_back(PipelineSchedule(layout.pp, layout.vpp, static_cast<int64_t>(s),
                                         num_microbatches, layout.microbatch_group_size,
                                         layout.combined_1f1b));
    MEMSIM_RETURN_IF_ERROR(ReadIterations(*stages[s], schedules.back().size(),
                                          static_cast<int64_t>(s), &iterations[s]));
    if (iterations[s].size() != iterations[0].size()) {
      return Status::Error("memsim bug: pipeline stages recorded different numbers of iterations");
    }
  }

  // shifts[s][k]: how much later marker k of stage s, and the events it opens, happen.
  std::vector<std::vector<double>> shifts(pp);
  for (size_t s = 0; s < pp; ++s) shifts[s].assign(stages[s]->markers().size(), 0.0);
  std::vector<double> after_end_shift(pp, 0.0);  // the last iteration's end shift, per stage
  for (size_t i = 0; i < iterations[0].size(); ++i) {
    auto time = [&](size_t s, size_t marker) { return stages[s]->markers()[marker].time_s; };
    double begin = 0;  // every stage begins together, once the slowest can
    for (size_t s = 0; s < pp; ++s) {
      begin = std::max(begin, time(s, iterations[s][i].begin) + after_end_shift[s]);
    }
    std::vector<std::vector<double>> durations(pp);
    std::vector<double> ready(pp);
    for (size_t s = 0; s < pp; ++s) {
      const IterationMarkers& it = iterations[s][i];
      for (size_t k = 0; k < it.steps.size(); ++k) {
        const size_t next = k + 1 < it.steps.size() ? it.steps[k + 1] : it.optimizer;
        durations[s].push_back(time(s, next) - time(s, it.steps[k]));
      }
      ready[s] = begin + time(s, it.steps.front()) - time(s, it.begin);
    }
    const std::vector<std::vector<double>> starts =
        PipelineStepStarts(schedules, layout.vpp, num_microbatches, durations, ready);
    if (starts.empty()) return Status::Error("memsim bug: the pipeline schedules deadlock");
    double optimizer = 0;  // the last backward of any stage is done
    for (size_t s = 0; s < pp; ++s) {
      optimizer = std::max(optimizer, starts[s].back() + durations[s].back());
    }
    double end = 0;
    for (size_t s = 0; s < pp; ++s) {
      const IterationMarkers& it = iterations[s][i];
      end = std::max(end, optimizer + time(s, it.end) - time(s, it.optimizer));
    }
    // Each region's shift, from its opening marker up to the next region's.
    for (size_t s = 0; s < pp; ++s) {
      const IterationMarkers& it = iterations[s][i];
      std::vector<double>& shift = shifts[s];
      const size_t next_begin =
          i + 1 < iterations[s].size() ? iterations[s][i + 1].begin : shift.size();
      auto fill = [&](size_t from, size_t to, double value) {
        std::fill(shift.begin() + static_cast<std::ptrdiff_t>(from),
                  shift.begin() + static_cast<std::ptrdiff_t>(to), value);
      };
      fill(it.begin, it.steps.front(), begin - time(s, it.begin));
      for (size_t k = 0; k < it.steps.size(); ++k) {
        const size_t to = k + 1 < it.steps.size() ? it.steps[k + 1] : it.optimizer;
        fill(it.steps[k], to, starts[s][k] - time(s, it.steps[k]));
      }
      fill(it.optimizer, it.end, optimizer - time(s, it.optimizer));
      after_end_shift[s] = end - time(s, it.end);
      fill(it.end, next_begin, after_end_shift[s]);
    }
  }
  for (size_t s = 0; s < pp; ++s) stages[s]->ShiftTimesAtMarkers(shifts[s]);
  return Status::OK();
}

}  // namespace memsim
