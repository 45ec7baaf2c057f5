#include "simulator/trace_writer.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <string>

#include "simulator/atomic_file.h"

namespace memsim {
namespace {

// Indices of the points of [begin, end) that survive thinning (see TraceOptions).
std::vector<int64_t> ThinnedIndices(const Timeline& timeline, int64_t begin, int64_t end,
                                    double interval_s) {
  std::vector<int64_t> kept;
  if (interval_s <= 0) {
    for (int64_t i = begin; i < end; ++i) kept.push_back(i);
    return kept;
  }
  // A point with the event it follows.
  struct Indexed {
    int64_t event;
    TimelinePoint point;
  };
  Timeline::Cursor points(timeline);
  int64_t bucket_start = begin;
  while (bucket_start < end) {
    const double bucket_end_s = timeline.time_s(bucket_start) + interval_s;
    int64_t bucket_end = bucket_start + 1;  // a bucket always takes its first point
    const Indexed first{bucket_start, points.At(bucket_start)};
    Indexed lo_alloc = first, hi_alloc = first, lo_reserved = first, hi_reserved = first;
    while (bucket_end < end && timeline.time_s(bucket_end) < bucket_end_s) {
      const Indexed p{bucket_end, points.At(bucket_end)};
      if (p.point.allocated_bytes < lo_alloc.point.allocated_bytes) lo_alloc = p;
      if (p.point.allocated_bytes > hi_alloc.point.allocated_bytes) hi_alloc = p;
      if (p.point.reserved_bytes < lo_reserved.point.reserved_bytes) lo_reserved = p;
      if (p.point.reserved_bytes > hi_reserved.point.reserved_bytes) hi_reserved = p;
      ++bucket_end;
    }
    const std::set<int64_t> bucket = {bucket_start,      lo_alloc.event,    hi_alloc.event,
                                      lo_reserved.event, hi_reserved.event, bucket_end - 1};
    kept.insert(kept.end(), bucket.begin(), bucket.end());
    bucket_start = bucket_end;
  }
  return kept;
}

// Appends `value` as nlohmann::json writes a number, so that the text is what dumping the
// trace as a JSON document would give (its readers parse it; a test checks the bytes). The
// serializer writes a finite double with nlohmann::detail::to_chars (serializer.hpp's
// dump_float) and anything else as null; calling it directly spares a serializer and a
// string per number, which were a fifth of a sweep's time.
void AppendNumber(double value, std::string* out) {
  if (!std::isfinite(value)) {
    out->append("null");
    return;
  }
  char buffer[64];
  const char* end = nlohmann::detail::to_chars(buffer, buffer + sizeof(buffer), value);
  out->append(buffer, static_cast<size_t>(end - buffer));
}

// One sample object, at dump(1)'s depth 3 (keys in std::map's order, as nlohmann's).
void AppendSample(double time_s, int64_t reserved_bytes, int64_t allocated_bytes,
                  std::string* out) {
  out->append("   {\n    \"allocated_memory_MB\": ");
  AppendNumber(BytesToMiB(allocated_bytes), out);
  out->append(",\n    \"reserved_memory_MB\": ");
  AppendNumber(BytesToMiB(reserved_bytes), out);
  out->append(",\n    \"timestamp_s\": ");
  AppendNumber(time_s, out);
  out->append("\n   }");
}

// Iteration `it`'s entry, from its opening brace to its closing one.
void AppendIteration(const Timeline& timeline, const IterationSummary& it,
                     const TraceOptions& options, std::string* out) {
  out->append("{\n  \"peak_allocated_MB\": ");
  AppendNumber(BytesToMiB(it.peak_allocated_bytes), out);
  out->append(",\n  \"samples\": [\n");
  // The iteration opens at its static memory, as the real tracer's first sample does.
  const int64_t reserved_at_start =
      it.begin_event > 0 ? timeline.point(it.begin_event - 1).reserved_bytes : 0;
  AppendSample(it.begin_time_s, reserved_at_start, it.static_allocated_bytes, out);
  double interval_s = options.sample_interval_s;
  if (interval_s <= 0 && options.max_intervals_per_iteration > 0 &&
      it.end_event - it.begin_event > 6 * options.max_intervals_per_iteration) {
    interval_s = (it.end_time_s - it.begin_time_s) /
                 static_cast<double>(options.max_intervals_per_iteration);
  }
  Timeline::Cursor points(timeline);
  for (int64_t i : ThinnedIndices(timeline, it.begin_event, it.end_event, interval_s)) {
    const TimelinePoint p = points.At(i);
    out->append(",\n");
    AppendSample(timeline.time_s(i), p.reserved_bytes, p.allocated_bytes, out);
  }
  out->append("\n  ],\n  \"static_memory_MB\": ");
  AppendNumber(BytesToMiB(it.static_allocated_bytes), out);
  out->append(",\n  \"theoretical_memory_MB\": ");
  AppendNumber(options.theoretical_memory_mb, out);
  out->append("\n }");
}

}  // namespace

std::string TraceText(const Timeline& timeline, const TraceOptions& options) {
  // Iterations by key as a JSON object orders them (std::map: "10" before "2"); a repeated
  // iteration keeps its last entry.
  std::map<std::string, const IterationSummary*> iterations;
  for (const IterationSummary& it : timeline.iterations()) {
    iterations[std::to_string(it.iteration)] = &it;
  }
  if (iterations.empty()) return "{}";
  std::string out = "{\n";
  bool first = true;
  for (const auto& [key, it] : iterations) {
    out.append(first ? " \"" : ",\n \"").append(key).append("\": ");
    first = false;
    AppendIteration(timeline, *it, options, &out);
  }
  out.append("\n}");
  return out;
}

Status WriteTrace(const std::string& path, const Timeline& timeline, const TraceOptions& options) {
  return WriteFileAtomically(path, TraceText(timeline, options));
}

}  // namespace memsim
