// A PyTorch memory snapshot (the pickle torch.cuda.memory._dump_snapshot writes), so
// PyTorch's memory_viz and existing snapshot analyzers open simulated runs:
//
//   {"segments": [{"device", "address", "total_size", "allocated_size", "active_size",
//                  "requested_size", "stream", "segment_type", "segment_pool_id",
//                  "is_expandable", "frames",
//                  "blocks": [{"address", "size", "requested_size", "state", "frames",
//                              "history": [{"addr", "real_size", "frames"}]}]}],
//    "device_traces": [[{"action", "addr", "size", "stream", "time_us", "frames"}]],
//    "allocator_settings": {}, "memsim": {...}}
//
// actions: alloc, free_requested, free_completed, segment_alloc, segment_free, and with
// expandable segments segment_map, segment_unmap (Note [Expandable segments]). Written as
// a plain protocol-2 pickle of dicts, lists, strings and ints (no GLOBAL opcodes; see
// Note [Streaming pickle] in pickle_writer.h), so a
// Python without torch loads it with pickle.load.
//
// Note [Snapshot formats]
// PyTorch changed the format in 2.0. PyTorch 1.13 (Debian's, the one memsim builds
// against) reads a bare list of segments and an allocated block's frames from its
// "history" entries; later PyTorch reads the dict above and a block's "frames" (and
// still accepts the bare list). So each allocated block carries both "frames" and one
// "history" entry, and SnapshotOptions::segments_only writes the bare list, which every
// version's torch.cuda._memory_viz (stats, segments, memory, compare) opens. Segment
// actions in the trace carry the frames of the allocation that made the allocator map
// or release the segment.
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

#include <ostream>
#include <string>

#include "simulator/recorder.h"
#include "simulator/status.h"

namespace memsim {

struct SnapshotOptions {
  int32_t device = 0;
  // The trace starts at this event (the allocator actions of earlier events are replayed
  // but not logged, as when PyTorch's _record_memory_history starts mid-run).
  int64_t first_traced_event = 0;
  // Write only the list of segments, PyTorch 1.13's format (Note [Snapshot formats]).
  bool segments_only = false;
};

// The snapshot of the allocator state right after event `through_event` (its segments
// and blocks) with the trace of the events from options.first_traced_event up to it.
// -1: before any event.
// REQUIRES: -1 <= through_event < recorder.events().size(), first_traced_event >= 0.
std::string SnapshotPickle(const Recorder& recorder, int64_t through_event,
                           const SnapshotOptions& options);
// Two snapshots from one replay, handed to their sinks as they are made (Note [Streaming
// pickle] in pickle_writer.h; the sinks' states tell of write errors): the allocator's
// segments alone right after `peak_event` (options.segments_only) to `peak_sink`, and the
// snapshot after `through_event` with `options` to `sink`.
// REQUIRES: -1 <= peak_event, through_event < recorder.events().size();
// !options.segments_only.
void StreamSnapshotAndPeak(const Recorder& recorder, int64_t through_event,
                           const SnapshotOptions& options, std::ostream* sink, int64_t peak_event,
                           std::ostream* peak_sink);

Status WriteSnapshot(const std::string& path, const Recorder& recorder, int64_t through_event,
                     const SnapshotOptions& options);

}  // namespace memsim
