#include "simulator/trace_writer.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "simulator/atomic_file.h"

namespace memsim {
namespace {

// Indices of the points of [begin, end) that survive thinning (see TraceOptions).
std::vector<int64_t> ThinnedIndices(const std::vector<TimelinePoint>& points, int64_t begin,
                                    int64_t end, double interval_s) {
  std::vector<int64_t> kept;
  if (interval_s <= 0) {
    for (int64_t i = begin; i < end; ++i) kept.push_back(i);
    return kept;
  }
  int64_t bucket_start = begin;
  while (bucket_start < end) {
    const double bucket_end_s = points[static_cast<size_t>(bucket_start)].time_s + interval_s;
    int64_t bucket_end = bucket_start + 1;  // a bucket always takes its first point
    int64_t lo_alloc = bucket_start, hi_alloc = bucket_start;
    int64_t lo_reserved = bucket_start, hi_reserved = bucket_start;
    while (bucket_end < end && points[static_cast<size_t>(bucket_end)].time_s < bucket_end_s) {
      const TimelinePoint& p = points[static_cast<size_t>(bucket_end)];
      if (p.allocated_bytes < points[static_cast<size_t>(lo_alloc)].allocated_bytes)
        lo_alloc = bucket_end;
      if (p.allocated_bytes > points[static_cast<size_t>(hi_alloc)].allocated_bytes)
        hi_alloc = bucket_end;
      if (p.reserved_bytes < points[static_cast<size_t>(lo_reserved)].reserved_bytes)
        lo_reserved = bucket_end;
      if (p.reserved_bytes > points[static_cast<size_t>(hi_reserved)].reserved_bytes)
        hi_reserved = bucket_end;
      ++bucket_end;
    }
    const std::set<int64_t> bucket = {bucket_start, lo_alloc,    hi_alloc,
                                      lo_reserved,  hi_reserved, bucket_end - 1};
    kept.insert(kept.end(), bucket.begin(), bucket.end());
    bucket_start = bucket_end;
  }
  return kept;
}

nlohmann::json Sample(double time_s, int64_t reserved_bytes, int64_t allocated_bytes) {
  return {{"timestamp_s", time_s},
          {"reserved_memory_MB", BytesToMiB(reserved_bytes)},
          {"allocated_memory_MB", BytesToMiB(allocated_bytes)}};
}

}  // namespace

nlohmann::json TraceJson(const Timeline& timeline, const TraceOptions& options) {
  nlohmann::json trace = nlohmann::json::object();
  const auto& points = timeline.points();
  for (const IterationSummary& it : timeline.iterations()) {
    nlohmann::json samples = nlohmann::json::array();
    // The iteration opens at its static memory, as the real tracer's first sample does.
    const int64_t reserved_at_start =
        it.begin_event > 0 ? points[static_cast<size_t>(it.begin_event - 1)].reserved_bytes : 0;
    samples.push_back(Sample(it.begin_time_s, reserved_at_start, it.static_allocated_bytes));
    double interval_s = options.sample_interval_s;
    if (interval_s <= 0 && options.max_intervals_per_iteration > 0 &&
        it.end_event - it.begin_event > 6 * options.max_intervals_per_iteration) {
      interval_s = (it.end_time_s - it.begin_time_s) /
                   static_cast<double>(options.max_intervals_per_iteration);
    }
    for (int64_t i : ThinnedIndices(points, it.begin_event, it.end_event, interval_s)) {
      const TimelinePoint& p = points[static_cast<size_t>(i)];
      samples.push_back(Sample(p.time_s, p.reserved_bytes, p.allocated_bytes));
    }
    trace[std::to_string(it.iteration)] = {
        {"samples", std::move(samples)},
        {"peak_allocated_MB", BytesToMiB(it.peak_allocated_bytes)},
        {"theoretical_memory_MB", options.theoretical_memory_mb},
        {"static_memory_MB", BytesToMiB(it.static_allocated_bytes)},
    };
  }
  return trace;
}

Status WriteTrace(const std::string& path, const Timeline& timeline, const TraceOptions& options) {
  return WriteFileAtomically(path, TraceJson(timeline, options).dump(1));
}

}  // namespace memsim
