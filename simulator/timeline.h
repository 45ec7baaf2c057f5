// Timeline: a Recorder's events replayed through the caching-allocator model, giving the
// memory_allocated / memory_reserved values PyTorch would report after every event, and
// per-iteration static memory and peaks.
#pragma once

#include <cstdint>
#include <vector>

#include "simulator/caching_allocator_model.h"
#include "simulator/recorder.h"

namespace memsim {

// State after one event (its time is the event's: Timeline::time_s).
struct TimelinePoint {
  int64_t allocated_bytes;  // torch.cuda.memory_allocated(): rounded block sizes
  int64_t reserved_bytes;   // torch.cuda.memory_reserved(): segment sizes
};

struct IterationSummary {
  int32_t iteration;
  int64_t begin_event;             // first event of the iteration
  int64_t end_event;               // one past its last event
  int64_t static_allocated_bytes;  // allocated at its start (Session::BeginIteration)
  // Allocated after its last event: after the optimizer step, when Megatron-LM's
  // training_log reads torch.cuda.memory_allocated() ("mem-allocated-bytes").
  int64_t end_allocated_bytes;
  int64_t peak_allocated_bytes;
  int64_t peak_reserved_bytes;
  int64_t peak_event;  // event after which allocated memory peaked; -1: at the start
  double begin_time_s;
  double end_time_s;
};

class Timeline {
 public:
  // Replays with unlimited device memory: the numbers are what the step needs.
  // REQUIRES: `recorder` outlives the timeline and records nothing more (the timeline
  // reads its events' times rather than keep a copy: a point per event adds up).
  static Timeline Replay(const Recorder& recorder);

  // One point per event of the recording.
  int64_t num_points() const {
    return static_cast<int64_t>(in_bytes() ? allocated_bytes_.size() : allocated_units_.size());
  }
  // The state after event `event`. Allocated memory changes with every event and is kept
  // per event (in 4 bytes while it fits); reserved memory changes only when a segment is
  // reserved or released, so only its changes are kept (a point per event in full was 16
  // bytes, millions of them).
  // REQUIRES: 0 <= event < num_points().
  TimelinePoint point(int64_t event) const { return {AllocatedAfter(event), ReservedAfter(event)}; }
  // point(event).allocated_bytes without the search for the reserved bytes.
  int64_t AllocatedAfter(int64_t event) const {
    const size_t e = static_cast<size_t>(event);
    return in_bytes() ? allocated_bytes_[e] : int64_t{allocated_units_[e]} * kAllocatedUnitBytes;
  }
  // Reads points at nondecreasing events without a search each (a trace visits them all).
  class Cursor {
   public:
    // REQUIRES: `timeline` outlives the cursor.
    explicit Cursor(const Timeline& timeline) : timeline_(&timeline) {}
    // REQUIRES: `event` is no earlier than the previous call's; 0 <= event < num_points().
    TimelinePoint At(int64_t event) {
      const std::vector<ReservedChange>& changes = timeline_->reserved_changes_;
      for (; next_change_ < changes.size() && changes[next_change_].first_event <= event;
           ++next_change_) {
        reserved_bytes_ = changes[next_change_].reserved_bytes;
      }
      return {timeline_->AllocatedAfter(event), reserved_bytes_};
    }

   private:
    const Timeline* timeline_;
    size_t next_change_ = 0;
    int64_t reserved_bytes_ = 0;
  };
  // The virtual time of event `event`, after which point(event) holds.
  double time_s(int64_t event) const {
    return recorder_->events()[static_cast<size_t>(event)].time_s;
  }
  // Iterations in order; a recording without iteration markers is one iteration, 0.
  const std::vector<IterationSummary>& iterations() const { return iterations_; }
  int64_t peak_allocated_bytes() const { return peak_allocated_bytes_; }
  int64_t peak_reserved_bytes() const { return peak_reserved_bytes_; }
  int64_t peak_requested_bytes() const { return peak_requested_bytes_; }
  int64_t peak_event() const { return peak_event_; }  // -1 with no events
  // The allocated bytes just before event `event` (0 before the first).
  int64_t AllocatedBefore(int64_t event) const {
    return event <= 0 ? 0 : AllocatedAfter(event - 1);
  }

 private:
  class PointRecorder;  // fills the points while the allocator model replays (timeline.cc)
  // Reserved memory from event `first_event` on (after it), until the next change.
  struct ReservedChange {
    int64_t first_event;
    int64_t reserved_bytes;
  };
  // point(event).reserved_bytes: a binary search of the changes.
  int64_t ReservedAfter(int64_t event) const;
  // The most reserved after any event of [begin, end). REQUIRES: begin < end.
  int64_t PeakReservedIn(int64_t begin, int64_t end) const;

  const Recorder* recorder_ = nullptr;
  // Allocated memory after each event. Every block is a multiple of 512 bytes, so it is
  // kept as a count of 512-byte units in 32 bits (up to 2 TiB) while every point is such a
  // count; the first that is not moves them all to bytes.
  static constexpr int64_t kAllocatedUnitBytes = 512;
  std::vector<uint32_t> allocated_units_;
  std::vector<int64_t> allocated_bytes_;  // empty until a point was no count of units
  bool in_bytes() const { return !allocated_bytes_.empty(); }
  std::vector<ReservedChange> reserved_changes_;  // by first_event, increasing
  std::vector<IterationSummary> iterations_;
  int64_t peak_allocated_bytes_ = 0;
  int64_t peak_reserved_bytes_ = 0;
  int64_t peak_requested_bytes_ = 0;
  int64_t peak_event_ = -1;
};

// The recording replayed on a device of a given capacity: the caching allocator frees its
// cache and retries before giving up, as PyTorch does, so a step fits exactly when no
// segment it needs can be reserved (not when the unlimited peak is below the capacity).
struct CapacityReplay {
  int64_t oom_event = -1;  // the allocation that fails; -1: the whole recording fits
  // Reserved memory at its highest before the end (or the failure): <= the capacity.
  int64_t peak_reserved_bytes = 0;
  // At the failing allocation, before it: what was allocated and reserved.
  int64_t allocated_bytes_at_oom = 0;
  int64_t reserved_bytes_at_oom = 0;
  bool fits() const { return oom_event < 0; }
};

// Replays `recorder` against a device of `capacity_bytes`.
// REQUIRES: capacity_bytes > 0.
CapacityReplay ReplayWithCapacity(const Recorder& recorder, int64_t capacity_bytes);

// The same, given the recording's unlimited replay: when that never reserved more than
// the capacity, the allocator was never refused a segment, so a replay on the device
// would make every decision it made; the answer is read off it instead of replaying
// again (most layouts that are simulated fit).
// REQUIRES: capacity_bytes > 0; `unlimited` is Timeline::Replay(recorder).
CapacityReplay ReplayWithCapacity(const Recorder& recorder, int64_t capacity_bytes,
                                  const Timeline& unlimited);

// Calls `fn(storage_id)` for every storage alive right after event `event`.
template <typename Fn>
void ForEachLiveStorage(const Recorder& recorder, int64_t event, Fn&& fn) {
  const StorageTable storages = recorder.storages();
  for (size_t id = 0; id < storages.size(); ++id) {
    const StorageLife& s = storages.life(id);
    if (s.alloc_event > event) break;  // storages are allocated in id order
    if (s.free_event == -1 || s.free_event > event) fn(static_cast<int64_t>(id));
  }
}

}  // namespace memsim
