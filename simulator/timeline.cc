#include "simulator/timeline.h"

#include <algorithm>
#include <limits>

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

}  // namespace

// Appends the allocator's stats after every event to a timeline, noting the allocated peak.
class Timeline::PointRecorder : public ReplayVisitor {
 public:
  PointRecorder(const CachingAllocatorModel& allocator, Timeline* timeline)
      : allocator_(allocator), timeline_(timeline) {}
  void OnAlloc(int64_t e, const MemoryEvent&, const CachingAllocatorModel::Allocation&) { Add(e); }
  void OnFree(int64_t e, const MemoryEvent&, const CachingAllocatorModel::Allocation&) { Add(e); }

 private:
  void Add(int64_t e) {
    const AllocatorStats& stats = allocator_.stats();
    AddAllocated(stats.allocated_bytes);
    std::vector<ReservedChange>& changes = timeline_->reserved_changes_;
    const int64_t reserved_before = changes.empty() ? 0 : changes.back().reserved_bytes;
    if (stats.reserved_bytes != reserved_before) changes.push_back({e, stats.reserved_bytes});
    if (stats.allocated_bytes > timeline_->peak_allocated_bytes_) {
      timeline_->peak_allocated_bytes_ = stats.allocated_bytes;
      timeline_->peak_event_ = e;
    }
  }
  void AddAllocated(int64_t bytes) {
    Timeline& t = *timeline_;
    const bool a_count_of_units =
        bytes % kAllocatedUnitBytes == 0 &&
        bytes / kAllocatedUnitBytes <= std::numeric_limits<uint32_t>::max();
    if (!t.in_bytes() && a_count_of_units) {
      t.allocated_units_.push_back(static_cast<uint32_t>(bytes / kAllocatedUnitBytes));
      return;
    }
    if (!t.in_bytes()) {  // the first point that is no count: every point moves to bytes
      t.allocated_bytes_.reserve(t.allocated_units_.capacity());
      for (const uint32_t units : t.allocated_units_) {
        t.allocated_bytes_.push_back(int64_t{units} * kAllocatedUnitBytes);
      }
      t.allocated_units_ = std::vector<uint32_t>();
    }
    t.allocated_bytes_.push_back(bytes);
  }

  const CachingAllocatorModel& allocator_;
  Timeline* timeline_;
};

int64_t Timeline::ReservedAfter(int64_t event) const {
  // The last change at or before `event`; none: nothing reserved yet.
  const auto after = std::upper_bound(
      reserved_changes_.begin(), reserved_changes_.end(), event,
      [](int64_t e, const ReservedChange& change) { return e < change.first_event; });
  return after == reserved_changes_.begin() ? 0 : std::prev(after)->reserved_bytes;
}

int64_t Timeline::PeakReservedIn(int64_t begin, int64_t end) const {
  MEMSIM_DCHECK(begin < end);
  int64_t peak_bytes = ReservedAfter(begin);
  const auto first_event_before = [](const ReservedChange& change, int64_t e) {
    return change.first_event < e;
  };
  const auto from = std::lower_bound(reserved_changes_.begin(), reserved_changes_.end(), begin + 1,
                                     first_event_before);
  const auto to = std::lower_bound(from, reserved_changes_.end(), end, first_event_before);
  for (auto change = from; change != to; ++change) {
    peak_bytes = std::max(peak_bytes, change->reserved_bytes);
  }
  return peak_bytes;
}

Timeline Timeline::Replay(const Recorder& recorder) {
  Timeline timeline;
  timeline.recorder_ = &recorder;
  CachingAllocatorModel allocator(recorder.allocator_settings());  // unlimited: never refuses
  timeline.allocated_units_.reserve(recorder.events().size());
  PointRecorder points(allocator, &timeline);
  ReplayAllocations(recorder, &allocator, static_cast<int64_t>(recorder.events().size()), points);
  timeline.reserved_changes_.shrink_to_fit();
  timeline.peak_reserved_bytes_ = allocator.stats().peak_reserved_bytes;
  timeline.peak_requested_bytes_ = allocator.stats().peak_requested_bytes;

  timeline.iterations_ = IterationRanges(recorder);
  for (IterationSummary& it : timeline.iterations_) {
    it.static_allocated_bytes = timeline.AllocatedBefore(it.begin_event);
    it.end_allocated_bytes = timeline.AllocatedBefore(it.end_event);
    it.peak_allocated_bytes = it.static_allocated_bytes;
    for (int64_t e = it.begin_event; e < it.end_event; ++e) {
      const int64_t allocated_bytes = timeline.AllocatedAfter(e);
      if (allocated_bytes > it.peak_allocated_bytes) {
        it.peak_allocated_bytes = allocated_bytes;
        it.peak_event = e;
      }
    }
    // Reserved memory only grows between empty_cache() markers, so the iteration's first
    // point is at least its start; the point before it may predate an empty_cache().
    if (it.begin_event < it.end_event) {
      it.peak_reserved_bytes = timeline.PeakReservedIn(it.begin_event, it.end_event);
    } else if (it.begin_event > 0) {
      it.peak_reserved_bytes = timeline.ReservedAfter(it.begin_event - 1);
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
