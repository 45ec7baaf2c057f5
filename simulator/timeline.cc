#include "simulator/timeline.h"

#include <algorithm>

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

Timeline Timeline::Replay(const Recorder& recorder) {
  Timeline timeline;
  CachingAllocatorModel allocator;
  std::vector<int64_t> block_of_storage(recorder.storages().size(), -1);
  const auto& storages = recorder.storages();
  timeline.points_.reserve(recorder.events().size());
  for (const MemoryEvent& event : recorder.events()) {
    const size_t id = static_cast<size_t>(event.storage_id);
    if (event.is_alloc) {
      block_of_storage[id] = allocator.Malloc(storages[id].size_bytes)->block_id;
    } else {
      allocator.Free(block_of_storage[id]);
    }
    const AllocatorStats& stats = allocator.stats();
    timeline.points_.push_back(
        {event.time_s, stats.allocated_bytes, stats.reserved_bytes, stats.requested_bytes});
    if (stats.allocated_bytes > timeline.peak_allocated_bytes_) {
      timeline.peak_allocated_bytes_ = stats.allocated_bytes;
      timeline.peak_event_ = static_cast<int64_t>(timeline.points_.size()) - 1;
    }
  }
  timeline.peak_reserved_bytes_ = allocator.stats().peak_reserved_bytes;
  timeline.peak_requested_bytes_ = allocator.stats().peak_requested_bytes;

  timeline.iterations_ = IterationRanges(recorder);
  for (IterationSummary& it : timeline.iterations_) {
    it.static_allocated_bytes = timeline.AllocatedBefore(it.begin_event);
    it.end_allocated_bytes = timeline.AllocatedBefore(it.end_event);
    it.peak_allocated_bytes = it.static_allocated_bytes;
    it.peak_reserved_bytes =
        it.begin_event > 0
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
  CachingAllocatorModel allocator(CachingAllocatorConfig{capacity_bytes});
  std::vector<int64_t> block_of_storage(recorder.storages().size(), -1);
  const auto& events = recorder.events();
  CapacityReplay replay;
  for (size_t e = 0; e < events.size(); ++e) {
    const size_t id = static_cast<size_t>(events[e].storage_id);
    if (events[e].is_alloc) {
      const AllocatorStats before = allocator.stats();
      auto allocation = allocator.Malloc(recorder.storages()[id].size_bytes);
      if (!allocation) {
        replay.oom_event = static_cast<int64_t>(e);
        replay.allocated_bytes_at_oom = before.allocated_bytes;
        replay.reserved_bytes_at_oom = before.reserved_bytes;
        break;
      }
      block_of_storage[id] = allocation->block_id;
    } else {
      allocator.Free(block_of_storage[id]);
    }
  }
  replay.peak_reserved_bytes = allocator.stats().peak_reserved_bytes;
  return replay;
}

}  // namespace memsim
