// A PyTorch memory snapshot (the pickle torch.cuda.memory._dump_snapshot writes), so
// PyTorch's memory_viz and existing snapshot analyzers open simulated runs:
//
//   {"segments": [{"device", "address", "total_size", "allocated_size", "active_size",
//                  "requested_size", "stream", "segment_type", "segment_pool_id",
//                  "is_expandable", "frames",
//                  "blocks": [{"address", "size", "requested_size", "state", "frames"}]}],
//    "device_traces": [[{"action", "addr", "size", "stream", "time_us", "frames"}]],
//    "allocator_settings": {}, "memsim": {...}}
//
// actions: alloc, free_requested, free_completed, segment_alloc, segment_free. Written as
// a plain protocol-2 pickle of dicts, lists, strings and ints (no GLOBAL opcodes), so a
// Python without torch loads it with pickle.load.
//
// Note [Snapshot frames]
// A real snapshot's frames are Python/C++ stack frames. memsim writes three per block:
//   {filename: <module path or "<top>">, line: 0, name: <aten op>}
//   {filename: "memsim://category/<category>", line: <iteration>,
//    name: "<phase> iteration=<i> microbatch=<m>"}
//   {filename: "memsim://tensor", line: 0, name: "<dtype>[<shape>]"}
// so keyword-based analyzers find module and op names, and memsim's own analyzer reads
// categories exactly.
#pragma once

#include <string>

#include "simulator/recorder.h"
#include "simulator/status.h"

namespace memsim {

struct SnapshotOptions {
  int32_t device = 0;
  // Keep at most this many device_traces entries (the latest ones, as PyTorch's
  // _record_memory_history(max_entries=...) does); 0: all.
  int64_t max_trace_entries = 0;
};

// The snapshot of the allocator state right after event `through_event` (its segments
// and blocks) with the trace of every event up to it. -1: before any event.
// REQUIRES: -1 <= through_event < recorder.events().size().
std::string SnapshotPickle(const Recorder& recorder, int64_t through_event,
                           const SnapshotOptions& options);

Status WriteSnapshot(const std::string& path, const Recorder& recorder, int64_t through_event,
                     const SnapshotOptions& options);

}  // namespace memsim
