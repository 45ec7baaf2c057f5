// ReplayAllocations: the one loop that feeds a recording's events to the caching-allocator
// model. The timeline, the out-of-memory search and the snapshot are observers of it.
//
// Note [Allocator replay]
// The recorder keeps storage-level events (exact sizes, in order); what the CUDA caching
// allocator would do with them (rounding, block reuse, splitting, segments) is decided by
// replaying them through a CachingAllocatorModel. Each consumer needs a different view of
// the same replay: the timeline the stats after every event, the capacity check the first
// allocation a full device refuses, the snapshot the blocks' addresses and the segment
// actions (through the model's AllocatorObserver). They share this loop, so the block a
// storage gets is decided in one place. A kEmptyCache marker (Session::EmptyCache,
// torch.cuda.empty_cache()) releases the free cached segments where it stands; visitors
// hear of it through OnEmptyCache before the model releases anything.
#pragma once

#include <cstdint>
#include <vector>

#include "simulator/caching_allocator_model.h"
#include "simulator/check.h"
#include "simulator/recorder.h"

namespace memsim {

// Replays events [0, end_event) of `recorder` through `*allocator`, emptying the cache at
// each kEmptyCache marker before the event it precedes (and after the last event when the
// whole log is replayed; visitor.OnEmptyCache(marker) first), calling, for each event e,
//   visitor.BeforeEvent(event)                 before the model sees it;
//   visitor.OnAlloc(e, event, allocation)      after an allocation succeeded;
//   visitor.OnFree(e, event, allocation)       after a free (the block the storage had).
// Returns the index of the first allocation the model refused (out of memory at its
// capacity), where the replay stops, or -1 when every event was replayed.
// REQUIRES: 0 <= end_event <= recorder.events().size(); `*allocator` is fresh.
template <typename Visitor>
int64_t ReplayAllocations(const Recorder& recorder, CachingAllocatorModel* allocator,
                          int64_t end_event, Visitor& visitor) {
  const std::vector<MemoryEvent>& events = recorder.events();
  const std::vector<StorageInfo>& storages = recorder.storages();
  MEMSIM_DCHECK(0 <= end_event && end_event <= static_cast<int64_t>(events.size()));
  std::vector<CachingAllocatorModel::Allocation> block_of_storage(storages.size());
  const std::vector<Marker>& markers = recorder.markers();
  size_t next_marker = 0;
  // Empties the cache at the kEmptyCache markers placed at or before event `e`.
  auto empty_cache_through = [&](int64_t e) {
    for (; next_marker < markers.size() && markers[next_marker].event_index <= e; ++next_marker) {
      if (markers[next_marker].kind != MarkerKind::kEmptyCache) continue;
      visitor.OnEmptyCache(markers[next_marker]);
      allocator->EmptyCache();
    }
  };
  for (int64_t e = 0; e < end_event; ++e) {
    empty_cache_through(e);
    const MemoryEvent& event = events[static_cast<size_t>(e)];
    const size_t id = static_cast<size_t>(event.storage_id);
    visitor.BeforeEvent(event);
    if (event.is_alloc) {
      const auto allocation = allocator->Malloc(storages[id].size_bytes);
      if (!allocation) return e;
      block_of_storage[id] = *allocation;
      visitor.OnAlloc(e, event, *allocation);
    } else {
      allocator->Free(block_of_storage[id].block_id);
      visitor.OnFree(e, event, block_of_storage[id]);
    }
  }
  if (end_event == static_cast<int64_t>(events.size())) empty_cache_through(end_event);
  return -1;
}

// A visitor that ignores everything; derive from it and hide the calls you need.
struct ReplayVisitor {
  void OnEmptyCache(const Marker&) {}
  void BeforeEvent(const MemoryEvent&) {}
  void OnAlloc(int64_t, const MemoryEvent&, const CachingAllocatorModel::Allocation&) {}
  void OnFree(int64_t, const MemoryEvent&, const CachingAllocatorModel::Allocation&) {}
};

}  // namespace memsim
