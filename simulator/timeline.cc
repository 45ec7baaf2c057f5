#include "simulator/timeline.h"

#include <algorithm>

#include "simulator/allocator_replay.h"

namespace memsim {
namespace {

// Iteration boundaries from the recorder's markers.
std::vector<IterationSummary> IterationRanges(const Recorder& recorder) {
  std::vector<IterationSummary> ranges;
  const int64_t num_events = static_cast<int64_t>(recorder.events().size());
  for (const Marker& m : recorder.markers()) {
    if (m.kind == MarkerKind::kIterationBegin) {
      if (!ranges.empty() && ranges.back().end_event < 0) ranges.back().end_event = m.event_index;
      ranges.push_back({m.iteration, m.event_index, -1, 0, 0, 0, 0, -1, m.time_s, m.time_s});
    } else if (m.kind == MarkerKind::kIterationEnd && !ranges.empty()) {
      ranges.back().end_event = m.event_index;
      ranges.back().end_time_s = m.time_s;
    }
  }
  if (ranges.empty()) ranges.push_back({0, 0, num_events, 0, 0, 0, 0, -1, 0.0, recorder.now_s()});
  if (ranges.back().end_event < 0) {
    ranges.back().end_event = num_events;
    ranges.back().end_time_s = recorder.now_s();
  }
  return ranges;
}

// Appends the allocator's stats after every event, noting the allocated peak.
class PointRecorder : public ReplayVisitor {
 public:
  PointRecorder(const CachingAllocatorModel& allocator, std::vector<TimelinePoint>* points,
                int64_t* peak_allocated_bytes, int64_t* peak_event)
      : allocator_(allocator),
        points_(points),
        peak_allocated_bytes_(peak_allocated_bytes),
        peak_event_(peak_event) {}
  void OnAlloc(int64_t e, const MemoryEvent&, const CachingAllocatorModel::Allocation&) { Add(e); }
  void OnFree(int64_t e, const MemoryEvent&, const CachingAllocatorModel::Allocation&) { Add(e); }

 private:
  void Add(int64_t e) {
    const AllocatorStats& stats = allocator_.stats();
    points_->push_back({stats.allocated_bytes, stats.reserved_bytes});
    if (stats.allocated_bytes > *peak_allocated_bytes_) {
      *peak_allocated_bytes_ = stats.allocated_bytes;
      *peak_event_ = e;
    }
  }
  const CachingAllocatorModel& allocator_;
  std::vector<TimelinePoint>* points_;
  int64_t* peak_allocated_bytes_;
  int64_t* peak_event_;
};

}  // namespace

Timeline Timeline::Replay(const Recorder& recorder) {
  Timeline timeline;
  timeline.recorder_ = &recorder;
  CachingAllocatorModel allocator(recorder.allocator_settings());  // unlimited: never refuses
  timeline.points_.reserve(recorder.events().size());
  PointRecorder points(allocator, &timeline.points_, &timeline.peak_allocated_bytes_,
                       &timeline.peak_event_);
  ReplayAllocations(recorder, &allocator, static_cast<int64_t>(recorder.events().size()), points);
  timeline.peak_reserved_bytes_ = allocator.stats().peak_reserved_bytes;
  timeline.peak_requested_bytes_ = allocator.stats().peak_requested_bytes;

  timeline.iterations_ = IterationRanges(recorder);
  for (IterationSummary& it : timeline.iterations_) {
    it.static_allocated_bytes = timeline.AllocatedBefore(it.begin_event);
    it.end_allocated_bytes = timeline.AllocatedBefore(it.end_event);
    it.peak_allocated_bytes = it.static_allocated_bytes;
    // Reserved memory only grows between empty_cache() markers, so the iteration's first
    // point is at least its start; the point before it may predate an empty_cache().
    it.peak_reserved_bytes =
        it.begin_event > 0 && it.begin_event == it.end_event
            ? timeline.points_[static_cast<size_t>(it.begin_event - 1)].reserved_bytes
            : 0;
    for (int64_t e = it.begin_event; e < it.end_event; ++e) {
      const TimelinePoint& p = timeline.points_[static_cast<size_t>(e)];
      if (p.allocated_bytes > it.peak_allocated_bytes) {
        it.peak_allocated_bytes = p.allocated_bytes;
        it.peak_event = e;
      }
      it.peak_reserved_bytes = std::max(it.peak_reserved_bytes, p.reserved_bytes);
    }
  }
  return timeline;
}

CapacityReplay ReplayWithCapacity(const Recorder& recorder, int64_t capacity_bytes) {
  MEMSIM_DCHECK(capacity_bytes > 0);
  CachingAllocatorConfig config = recorder.allocator_settings();
  config.capacity_bytes = capacity_bytes;
  CachingAllocatorModel allocator(config);
  // The stats before each allocation (only an allocation can be refused): at the refused
  // one, what the device held when it was requested.
  struct BeforeEachAllocation : ReplayVisitor {
    explicit BeforeEachAllocation(const CachingAllocatorModel& a) : allocator(a) {}
    void BeforeEvent(const MemoryEvent& event) {
      if (event.is_alloc) before = allocator.stats();
    }
    const CachingAllocatorModel& allocator;
    AllocatorStats before;
  } visitor(allocator);
  CapacityReplay replay;
  replay.oom_event = ReplayAllocations(recorder, &allocator,
                                       static_cast<int64_t>(recorder.events().size()), visitor);
  if (replay.oom_event >= 0) {
    replay.allocated_bytes_at_oom = visitor.before.allocated_bytes;
    replay.reserved_bytes_at_oom = visitor.before.reserved_bytes;
  }
  replay.peak_reserved_bytes = allocator.stats().peak_reserved_bytes;
  return replay;
}

CapacityReplay ReplayWithCapacity(const Recorder& recorder, int64_t capacity_bytes,
                                  const Timeline& unlimited) {
  // CachingAllocatorModel refuses a segment only when reserved memory would exceed the
  // capacity; reserved memory after each segment is at most the unlimited peak. Not so
  // under a memory fraction with expandable segments (Note [Expandable segments]) or a
  // garbage collection threshold, which frees segments before the capacity is reached.
  const CachingAllocatorConfig& settings = recorder.allocator_settings();
  if (unlimited.peak_reserved_bytes() > capacity_bytes ||
      (settings.capacity_is_fraction &&
       (settings.expandable_segments || settings.garbage_collection_threshold > 0))) {
    return ReplayWithCapacity(recorder, capacity_bytes);
  }
  CapacityReplay replay;
  replay.peak_reserved_bytes = unlimited.peak_reserved_bytes();
  return replay;
}

}  // namespace memsim
