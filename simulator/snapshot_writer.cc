#include "simulator/snapshot_writer.h"

#include <limits>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "simulator/allocator_replay.h"
#include "simulator/atomic_file.h"
#include "simulator/caching_allocator_model.h"
#include "simulator/peak_analysis.h"
#include "simulator/pickle_writer.h"

namespace memsim {
namespace {

// Writes the frames of storages (Note [Snapshot frames] in snapshot_writer.h). A storage's
// list is written once; its block, its allocation and its frees in the trace all refer to
// that one list (Note [Streaming pickle] in pickle_writer.h).
class FrameWriter {
 public:
  FrameWriter(const Recorder& recorder, PickleWriter* out)
      : recorder_(recorder), out_(out), handle_of_storage_(recorder.storages().size(), -1) {}

  void StorageFrames(int64_t storage_id) {
    int64_t& handle = handle_of_storage_[static_cast<size_t>(storage_id)];
    if (handle >= 0) {
      out_->Reference(handle);
      return;
    }
    const StorageInfo& s = recorder_.storages()[static_cast<size_t>(storage_id)];
    const std::string& module = recorder_.names().Name(s.module);
    out_->BeginList();
    handle = out_->Remember();
    Frame(module.empty() ? "<top>" : module, 0, recorder_.names().Name(s.op));
    Frame("memsim://category/" + std::string(CategoryName(s.category)), s.iteration,
          std::string(PhaseName(s.phase)) + " iteration=" + std::to_string(s.iteration) +
              " microbatch=" + std::to_string(s.microbatch));
    Frame("memsim://tensor", 0, StorageShapeString(recorder_, s));
    out_->EndList();
  }

 private:
  void Frame(std::string_view filename, int64_t line, std::string_view name) {
    out_->BeginDict();
    out_->String("filename");
    out_->String(filename);
    out_->String("line");
    out_->Int(line);
    out_->String("name");
    out_->String(name);
    out_->EndDict();
  }

  const Recorder& recorder_;
  PickleWriter* out_;
  std::vector<int64_t> handle_of_storage_;  // -1: not written yet
};

// Logs each allocator action of the replay (Note [Allocator replay]) as a device_traces
// entry. Entries are kept as plain structs and written to the pickle after the replay,
// once the segments (which come first) are known.
class TraceBuilder final : public AllocatorObserver {
 public:
  TraceBuilder(const Recorder& recorder, const SnapshotOptions& options)
      : recorder_(recorder),
        first_event_(options.segments_only ? std::numeric_limits<int64_t>::max()
                                           : options.first_traced_event) {}

  // A segment is mapped or released while the allocator serves the current event: its
  // storage's frames say which allocation caused it (Note [Snapshot formats]).
  void OnSegmentAlloc(int64_t address, int64_t size_bytes, PoolKind) override {
    Add({Action::kSegmentAlloc, address, size_bytes, now_s_, current_storage_});
  }
  void OnSegmentFree(int64_t address, int64_t size_bytes, PoolKind) override {
    Add({Action::kSegmentFree, address, size_bytes, now_s_, current_storage_});
  }
  void OnSegmentMap(int64_t address, int64_t size_bytes, PoolKind) override {
    Add({Action::kSegmentMap, address, size_bytes, now_s_, current_storage_});
  }
  void OnSegmentUnmap(int64_t address, int64_t size_bytes, PoolKind) override {
    Add({Action::kSegmentUnmap, address, size_bytes, now_s_, current_storage_});
  }

  // ReplayAllocations' visitor (allocator_replay.h). The segments an empty_cache() releases
  // belong to no allocation.
  void OnEmptyCache(const Marker& marker) {
    now_s_ = marker.time_s;
    current_storage_ = -1;
  }
  void BeforeEvent(const MemoryEvent& event) {
    now_s_ = event.time_s;
    current_storage_ = event.storage_id;
    ++event_index_;
  }
  void OnAlloc(int64_t, const MemoryEvent& event, const CachingAllocatorModel::Allocation& block) {
    storage_at_address_[block.address] = event.storage_id;
    Add({Action::kAlloc, block.address, SizeOf(event), now_s_, event.storage_id});
  }
  // The model's Free reports no segment action, so logging after it keeps PyTorch's order.
  void OnFree(int64_t, const MemoryEvent& event, const CachingAllocatorModel::Allocation& block) {
    Add({Action::kFreeRequested, block.address, SizeOf(event), now_s_, event.storage_id});
    Add({Action::kFreeCompleted, block.address, SizeOf(event), now_s_, event.storage_id});
    storage_at_address_.erase(block.address);
  }

  // Writes the logged entries as a list of dicts.
  void WriteEntries(PickleWriter* out, FrameWriter* frames) const {
    static const char* const kActionNames[] = {"alloc",         "free_requested", "free_completed",
                                               "segment_alloc", "segment_free",   "segment_map",
                                               "segment_unmap"};
    out->BeginList();
    for (const Entry& e : entries_) {
      out->BeginDict();
      out->String("action");
      out->String(kActionNames[static_cast<size_t>(e.action)]);
      out->String("addr");
      out->Int(e.address);
      out->String("size");
      out->Int(e.size_bytes);
      out->String("stream");
      out->Int(0);
      out->String("time_us");
      out->Int(static_cast<int64_t>(e.time_s * 1e6));
      out->String("frames");
      if (e.storage_id >= 0) {
        frames->StorageFrames(e.storage_id);
      } else {
        out->BeginList();
        out->EndList();
      }
      out->EndDict();
    }
    out->EndList();
  }
  // Storage id of the allocated block at `address`.
  int64_t StorageAt(int64_t address) const { return storage_at_address_.at(address); }

 private:
  enum class Action : uint8_t {
    kAlloc,
    kFreeRequested,
    kFreeCompleted,
    kSegmentAlloc,
    kSegmentFree,
    kSegmentMap,
    kSegmentUnmap
  };
  struct Entry {
    Action action;
    int64_t address;
    int64_t size_bytes;
    double time_s;
    int64_t storage_id;  // for segment actions, the storage whose event caused them
  };

  int64_t SizeOf(const MemoryEvent& event) const {
    return recorder_.storages()[static_cast<size_t>(event.storage_id)].size_bytes;
  }

  void Add(const Entry& entry) {
    if (event_index_ >= first_event_) entries_.push_back(entry);
  }

  const Recorder& recorder_;
  int64_t first_event_;
  double now_s_ = 0;
  int64_t current_storage_ = -1;
  int64_t event_index_ = -1;  // of the event being replayed
  std::vector<Entry> entries_;
  std::unordered_map<int64_t, int64_t> storage_at_address_;
};

}  // namespace

namespace {

void WriteSegments(const CachingAllocatorModel& allocator, const TraceBuilder& trace,
                   const SnapshotOptions& options, PickleWriter* out, FrameWriter* frames) {
  out->BeginList();
  for (const AllocatorSegmentView& seg : allocator.Segments()) {
    out->BeginDict();
    int64_t allocated = 0;
    int64_t requested = 0;
    for (const AllocatorBlockView& b : seg.blocks) {
      if (!b.allocated) continue;
      allocated += b.size_bytes;
      requested += b.requested_bytes;
    }
    out->String("device");
    out->Int(options.device);
    out->String("address");
    out->Int(seg.address);
    out->String("total_size");
    out->Int(seg.size_bytes);
    out->String("allocated_size");
    out->Int(allocated);
    out->String("active_size");
    out->Int(allocated);
    out->String("requested_size");
    out->Int(requested);
    out->String("stream");
    out->Int(0);
    out->String("segment_type");
    out->String(seg.pool == PoolKind::kSmall ? "small" : "large");
    out->String("segment_pool_id");
    out->Pair(0, 0);
    out->String("is_expandable");
    out->Bool(seg.expandable);
    out->String("frames");
    out->BeginList();
    out->EndList();
    out->String("blocks");
    out->BeginList();
    for (const AllocatorBlockView& b : seg.blocks) {
      out->BeginDict();
      out->String("address");
      out->Int(b.address);
      out->String("size");
      out->Int(b.size_bytes);
      out->String("requested_size");
      out->Int(b.requested_bytes);
      out->String("state");
      out->String(b.allocated ? "active_allocated" : "inactive");
      out->String("frames");
      if (b.allocated) {
        const int64_t storage_id = trace.StorageAt(b.address);
        frames->StorageFrames(storage_id);
        // PyTorch 1.13 reads frames here (Note [Snapshot formats]).
        out->String("history");
        out->BeginList();
        out->BeginDict();
        out->String("addr");
        out->Int(b.address);
        out->String("real_size");
        out->Int(b.requested_bytes);
        out->String("frames");
        frames->StorageFrames(storage_id);
        out->EndDict();
        out->EndList();
      } else {
        out->BeginList();
        out->EndList();
      }
      out->EndDict();
    }
    out->EndList();
    out->EndDict();
  }
  out->EndList();
}

}  // namespace

std::string SnapshotPickle(const Recorder& recorder, int64_t through_event,
                           const SnapshotOptions& options) {
  TraceBuilder trace(recorder, options);
  CachingAllocatorModel allocator(recorder.allocator_settings(), &trace);
  ReplayAllocations(recorder, &allocator, through_event + 1, trace);

  PickleWriter out;
  FrameWriter frames(recorder, &out);
  if (options.segments_only) {
    WriteSegments(allocator, trace, options, &out, &frames);
    return out.Finish();
  }
  out.BeginDict();
  out.String("segments");
  WriteSegments(allocator, trace, options, &out, &frames);
  out.String("device_traces");
  out.BeginList();
  trace.WriteEntries(&out, &frames);
  out.EndList();
  out.String("allocator_settings");
  out.BeginDict();
  out.EndDict();
  out.String("memsim");
  out.BeginDict();
  out.String("format");
  out.String("memsim snapshot 1");
  out.String("through_event");
  out.Int(through_event);
  out.String("first_traced_event");
  out.Int(options.first_traced_event);
  out.EndDict();
  out.EndDict();
  return out.Finish();
}

Status WriteSnapshot(const std::string& path, const Recorder& recorder, int64_t through_event,
                     const SnapshotOptions& options) {
  return WriteFileAtomically(path, SnapshotPickle(recorder, through_event, options));
}

}  // namespace memsim
