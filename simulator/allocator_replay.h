// AllocatorReplay: the one loop that feeds a recording's events to the caching-allocator
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
#include <limits>
#include <stdexcept>
#include <vector>

#include "simulator/caching_allocator_model.h"
#include "simulator/check.h"
#include "simulator/recorder.h"

namespace memsim {

// A replay of `recorder`'s events through `*allocator`, fed in order in one or more
// stretches (a snapshot reads the allocator's state at an event, then goes on).
// ReplayThrough(end_event, visitor) replays events [next_event(), end_event), emptying the
// cache at each kEmptyCache marker before the event it precedes (and after the last event
// once the whole log is replayed; visitor.OnEmptyCache(marker) first), calling, for each
// event e,
//   visitor.BeforeEvent(event)                 before the model sees it;
//   visitor.OnAlloc(e, event, allocation)      after an allocation succeeded;
//   visitor.OnFree(e, event, allocation)       after a free (the block the storage had).
// It returns the index of the first allocation the model refused (out of memory at its
// capacity), where the replay stops for good, or -1 when every event was replayed.
// REQUIRES: `*allocator` is fresh and outlives the replay; next_event() <= end_event <=
// recorder.events().size(); nothing was refused.
class AllocatorReplay {
 public:
  AllocatorReplay(const Recorder& recorder, CachingAllocatorModel* allocator)
      : recorder_(recorder), allocator_(allocator), block_of_storage_(recorder.storages().size()) {}
  AllocatorReplay(const AllocatorReplay&) = delete;
  AllocatorReplay& operator=(const AllocatorReplay&) = delete;

  int64_t next_event() const { return next_event_; }

  template <typename Visitor>
  int64_t ReplayThrough(int64_t end_event, Visitor& visitor) {
    const std::vector<MemoryEvent>& events = recorder_.events();
    const StorageTable storages = recorder_.storages();
    MEMSIM_DCHECK(next_event_ <= end_event && end_event <= static_cast<int64_t>(events.size()));
    for (; next_event_ < end_event; ++next_event_) {
      const int64_t e = next_event_;
      EmptyCacheThrough(e, visitor);
      const MemoryEvent& event = events[static_cast<size_t>(e)];
      const size_t id = static_cast<size_t>(event.storage_id);
      visitor.BeforeEvent(event);
      if (event.is_alloc) {
        const auto allocation = allocator_->Malloc(storages.size_bytes(id));
        if (!allocation) return e;
        if (allocation->block_id > std::numeric_limits<int32_t>::max()) {
          throw std::overflow_error("memsim: more than 2^31 blocks in the allocator model");
        }
        block_of_storage_[id] = static_cast<int32_t>(allocation->block_id);
        visitor.OnAlloc(e, event, *allocation);
      } else {
        const CachingAllocatorModel::Allocation freed =
            allocator_->AllocatedBlock(block_of_storage_[id]);
        allocator_->Free(freed.block_id);
        visitor.OnFree(e, event, freed);
      }
    }
    if (end_event == static_cast<int64_t>(events.size())) EmptyCacheThrough(end_event, visitor);
    return -1;
  }

 private:
  // Empties the cache at the kEmptyCache markers placed at or before event `e`.
  template <typename Visitor>
  void EmptyCacheThrough(int64_t e, Visitor& visitor) {
    const std::vector<Marker>& markers = recorder_.markers();
    for (; next_marker_ < markers.size() && markers[next_marker_].event_index <= e;
         ++next_marker_) {
      if (markers[next_marker_].kind != MarkerKind::kEmptyCache) continue;
      visitor.OnEmptyCache(markers[next_marker_]);
      allocator_->EmptyCache();
    }
  }

  const Recorder& recorder_;
  CachingAllocatorModel* allocator_;
  // The model's block of each storage while it is allocated (ids, 4 bytes: one per storage
  // of the whole log, millions; Malloc's answer is read back from the model at the free).
  std::vector<int32_t> block_of_storage_;
  size_t next_marker_ = 0;
  int64_t next_event_ = 0;
};

// Replays events [0, end_event) of `recorder` in one stretch (AllocatorReplay).
template <typename Visitor>
int64_t ReplayAllocations(const Recorder& recorder, CachingAllocatorModel* allocator,
                          int64_t end_event, Visitor& visitor) {
  AllocatorReplay replay(recorder, allocator);
  return replay.ReplayThrough(end_event, visitor);
}

// A visitor that ignores everything; derive from it and hide the calls you need.
struct ReplayVisitor {
  void OnEmptyCache(const Marker&) {}
  void BeforeEvent(const MemoryEvent&) {}
  void OnAlloc(int64_t, const MemoryEvent&, const CachingAllocatorModel::Allocation&) {}
  void OnFree(int64_t, const MemoryEvent&, const CachingAllocatorModel::Allocation&) {}
};

}  // namespace memsim
