// memory_trace_rank{R}.json: the schema real runs write (the memory tracer that recorded
// the real traces memsim grew from), so existing plots and tools read simulated traces too.
//
//   { "<iteration>": { "samples": [ {"timestamp_s", "reserved_memory_MB",
//                                    "allocated_memory_MB"}, ... ],
//                      "peak_allocated_MB", "theoretical_memory_MB", "static_memory_MB" } }
//
// MB means 2^20 bytes. theoretical_memory_MB is -1 when no analytical estimate is given.
#pragma once

#include <string>

#include "simulator/status.h"
#include "simulator/timeline.h"

namespace memsim {

struct TraceOptions {
  // Samples closer together than this are thinned; 0 keeps one sample per event.
  // Thinning keeps, in each interval, the first and last samples and those with the
  // lowest and highest allocated and reserved memory, so every local extreme that
  // matters, and the peak, survive: max(allocated_memory_MB) == peak_allocated_MB.
  double sample_interval_s = 0.0;
  double theoretical_memory_mb = -1.0;
  // With sample_interval_s == 0: thin each iteration to this many intervals (about 6
  // samples each at most); 0 keeps one sample per event.
  int64_t max_intervals_per_iteration = 0;
};

// The trace as text, written as it goes: what building it as one nlohmann::json document
// and dumping it with an indent of 1 gives, byte for byte, without the document (a sweep's
// hundreds of traces spent most of their writing time building and freeing it).
std::string TraceText(const Timeline& timeline, const TraceOptions& options);

// Writes TraceText to `path` atomically.
Status WriteTrace(const std::string& path, const Timeline& timeline, const TraceOptions& options);

inline double BytesToMiB(int64_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

}  // namespace memsim
