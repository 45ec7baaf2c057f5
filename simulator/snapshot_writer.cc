#include "simulator/snapshot_writer.h"

#include <limits>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <tuple>
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
// that one list (Note [Streaming pickle] in pickle_writer.h). Each distinct frame string
// is made and hashed once: later storages with the same module, op, step or shape refer
// to it by its handle.
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
    out_->BeginList();
    handle = out_->Remember();
    Frame([&] { Cached(&modules_, s.module, [&] { return ModuleName(s.module); }); }, 0,
          [&] { Cached(&ops_, s.op, [&] { return recorder_.names().Name(s.op); }); });
    Frame(
        [&] {
          Cached(&categories_, static_cast<int>(s.category),
                 [&] { return "memsim://category/" + std::string(CategoryName(s.category)); });
        },
        s.iteration,
        [&] {
          Cached(&steps_, std::make_tuple(static_cast<int>(s.phase), s.iteration, s.microbatch),
                 [&] {
                   return std::string(PhaseName(s.phase)) +
                          " iteration=" + std::to_string(s.iteration) +
                          " microbatch=" + std::to_string(s.microbatch);
                 });
        });
    // Replicated storages share their template's dims (Recorder::shape_dims), so the
    // offset names the shape; an untyped storage is named by its size.
    Frame([&] { out_->Literal("memsim://tensor"); }, 0,
          [&] {
            Cached(&shapes_,
                   std::make_tuple(s.ndim, static_cast<int>(s.dtype),
                                   s.ndim < 0 ? s.size_bytes : s.shape_offset),
                   [&] { return StorageShapeString(recorder_, s); });
          });
    out_->EndList();
  }

 private:
  std::string ModuleName(NameId module) const {
    const std::string& name = recorder_.names().Name(module);
    return name.empty() ? "<top>" : name;
  }
  // {filename: ..., line: ..., name: ...}, the strings written by the two callables.
  template <typename WriteFilename, typename WriteName>
  void Frame(WriteFilename&& filename, int64_t line, WriteName&& name) {
    out_->BeginDict();
    out_->Literal("filename");
    filename();
    out_->Literal("line");
    out_->Int(line);
    out_->Literal("name");
    name();
    out_->EndDict();
  }
  // Writes the string `make()` names for `key`, made and hashed the first time only.
  template <typename Map, typename Make>
  void Cached(Map* handles, const typename Map::key_type& key, Make&& make) {
    auto [it, added] = handles->try_emplace(key, -1);
    if (added) {
      it->second = out_->StringHandle(make());
    } else {
      out_->Reference(it->second);
    }
  }

  const Recorder& recorder_;
  PickleWriter* out_;
  std::vector<int64_t> handle_of_storage_;  // -1: not written yet
  std::unordered_map<NameId, int64_t> modules_, ops_;
  std::unordered_map<int, int64_t> categories_;
  std::map<std::tuple<int, int32_t, int32_t>, int64_t> steps_;  // (phase, iteration, microbatch)
  std::map<std::tuple<int8_t, int, int64_t>, int64_t> shapes_;  // (ndim, dtype, dims or size)
};

// Logs each allocator action of the replay (Note [Allocator replay]) as a device_traces
// entry. Entries are kept as plain structs and written to the pickle after the replay,
// once the segments (which come first) are known.
class TraceBuilder final : public AllocatorObserver {
 public:
  TraceBuilder(const Recorder& recorder, const SnapshotOptions& options)
      : recorder_(recorder),
        first_event_(options.segments_only ? std::numeric_limits<int64_t>::max()
                                           : options.first_traced_event) {
    // An entry per traced event, and a few segment actions: hundreds of MB with many
    // microbatches, so not grown by doubling.
    const int64_t events = static_cast<int64_t>(recorder.events().size());
    if (first_event_ < events) entries_.reserve(static_cast<size_t>(events - first_event_) + 64);
  }

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
    Add({Action::kFree, block.address, SizeOf(event), now_s_, event.storage_id});
    storage_at_address_.erase(block.address);
  }

  // Writes the logged entries as a list of dicts; a free is two, free_requested and
  // free_completed (PyTorch logs both when the block has no pending stream uses).
  void WriteEntries(PickleWriter* out, FrameWriter* frames) const {
    static const char* const kActionNames[] = {"alloc",        "free_requested", "segment_alloc",
                                               "segment_free", "segment_map",    "segment_unmap"};
    out->BeginList();
    for (const Entry& e : entries_) {
      WriteEntry(e, kActionNames[static_cast<size_t>(e.action)], out, frames);
      if (e.action == Action::kFree) WriteEntry(e, "free_completed", out, frames);
    }
    out->EndList();
  }
  // Storage id of the allocated block at `address`.
  int64_t StorageAt(int64_t address) const { return storage_at_address_.at(address); }

 private:
  enum class Action : uint8_t {
    kAlloc,
    kFree,  // free_requested, then free_completed
    kSegmentAlloc,
    kSegmentFree,
    kSegmentMap,
    kSegmentUnmap
  };
  struct Entry {
    Entry(Action action, int64_t address, int64_t size_bytes, double time_s, int64_t storage_id)
        : address(address),
          size_bytes(size_bytes),
          time_s(time_s),
          storage_id(storage_id),
          action(action) {}
    int64_t address;
    int64_t size_bytes;
    double time_s;
    // For segment actions, the storage whose event caused them; -1: none.
    int64_t storage_id : 56;
    Action action : 8;
  };
  static_assert(sizeof(Entry) == 32, "a snapshot keeps millions of entries");

  static void WriteEntry(const Entry& e, const char* action, PickleWriter* out,
                         FrameWriter* frames) {
    out->BeginDict();
    out->Literal("action");
    out->Literal(action);
    out->Literal("addr");
    out->Int(e.address);
    out->Literal("size");
    out->Int(e.size_bytes);
    out->Literal("stream");
    out->Int(0);
    out->Literal("time_us");
    out->Int(static_cast<int64_t>(e.time_s * 1e6));
    out->Literal("frames");
    if (e.storage_id >= 0) {
      frames->StorageFrames(e.storage_id);
    } else {
      out->BeginList();
      out->EndList();
    }
    out->EndDict();
  }

  int64_t SizeOf(const MemoryEvent& event) const {
    return recorder_.storages().size_bytes(static_cast<size_t>(event.storage_id));
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
    out->Literal("device");
    out->Int(options.device);
    out->Literal("address");
    out->Int(seg.address);
    out->Literal("total_size");
    out->Int(seg.size_bytes);
    out->Literal("allocated_size");
    out->Int(allocated);
    out->Literal("active_size");
    out->Int(allocated);
    out->Literal("requested_size");
    out->Int(requested);
    out->Literal("stream");
    out->Int(0);
    out->Literal("segment_type");
    out->Literal(seg.pool == PoolKind::kSmall ? "small" : "large");
    out->Literal("segment_pool_id");
    out->Pair(0, 0);
    out->Literal("is_expandable");
    out->Bool(seg.expandable);
    out->Literal("frames");
    out->BeginList();
    out->EndList();
    out->Literal("blocks");
    out->BeginList();
    for (const AllocatorBlockView& b : seg.blocks) {
      out->BeginDict();
      out->Literal("address");
      out->Int(b.address);
      out->Literal("size");
      out->Int(b.size_bytes);
      out->Literal("requested_size");
      out->Int(b.requested_bytes);
      out->Literal("state");
      out->Literal(b.allocated ? "active_allocated" : "inactive");
      out->Literal("frames");
      if (b.allocated) {
        const int64_t storage_id = trace.StorageAt(b.address);
        frames->StorageFrames(storage_id);
        // PyTorch 1.13 reads frames here (Note [Snapshot formats]).
        out->Literal("history");
        out->BeginList();
        out->BeginDict();
        out->Literal("addr");
        out->Int(b.address);
        out->Literal("real_size");
        out->Int(b.requested_bytes);
        out->Literal("frames");
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

// A replay of a recording with the snapshot's observers, read at one or more events on
// the way (an AllocatorReplay fed in stretches).
class SnapshotReplay {
 public:
  // `options` says which events the trace keeps (the earliest any pickle written will need).
  SnapshotReplay(const Recorder& recorder, const SnapshotOptions& options)
      : recorder_(recorder),
        trace_(recorder, options),
        allocator_(recorder.allocator_settings(), &trace_),
        replay_(recorder, &allocator_) {}

  // The snapshot right after `through_event` into `out`, ending the pickle.
  // REQUIRES: through_event >= every event replayed so far - 1.
  void Write(int64_t through_event, const SnapshotOptions& options, PickleWriter* out) {
    replay_.ReplayThrough(through_event + 1, trace_);
    FrameWriter frames(recorder_, out);
    if (options.segments_only) {
      WriteSegments(allocator_, trace_, options, out, &frames);
      return;
    }
    out->BeginDict();
    out->Literal("segments");
    WriteSegments(allocator_, trace_, options, out, &frames);
    out->Literal("device_traces");
    out->BeginList();
    trace_.WriteEntries(out, &frames);
    out->EndList();
    out->Literal("allocator_settings");
    out->BeginDict();
    out->EndDict();
    out->Literal("memsim");
    out->BeginDict();
    out->Literal("format");
    out->Literal("memsim snapshot 1");
    out->Literal("through_event");
    out->Int(through_event);
    out->Literal("first_traced_event");
    out->Int(options.first_traced_event);
    out->EndDict();
    out->EndDict();
  }

 private:
  const Recorder& recorder_;
  TraceBuilder trace_;
  CachingAllocatorModel allocator_;
  AllocatorReplay replay_;
};

}  // namespace

std::string SnapshotPickle(const Recorder& recorder, int64_t through_event,
                           const SnapshotOptions& options) {
  PickleWriter out;
  SnapshotReplay(recorder, options).Write(through_event, options, &out);
  return out.Finish();
}

void StreamSnapshotAndPeak(const Recorder& recorder, int64_t through_event,
                           const SnapshotOptions& options, std::ostream* sink, int64_t peak_event,
                           std::ostream* peak_sink) {
  MEMSIM_DCHECK(-1 <= peak_event && !options.segments_only);
  SnapshotReplay replay(recorder, options);
  SnapshotOptions peak = options;
  peak.segments_only = true;
  // The replay goes forward only: the earlier event's pickle first.
  auto write = [&](int64_t event, const SnapshotOptions& o, std::ostream* to) {
    PickleWriter out(to);
    replay.Write(event, o, &out);
    out.Finish();
  };
  if (peak_event <= through_event) write(peak_event, peak, peak_sink);
  write(through_event, options, sink);
  if (peak_event > through_event) write(peak_event, peak, peak_sink);
}

Status WriteSnapshot(const std::string& path, const Recorder& recorder, int64_t through_event,
                     const SnapshotOptions& options) {
  std::unique_ptr<AtomicFileWriter> file;
  MEMSIM_RETURN_IF_ERROR(AtomicFileWriter::Open(path, &file));
  PickleWriter out(&file->stream());
  SnapshotReplay(recorder, options).Write(through_event, options, &out);
  out.Finish();
  return file->Publish();
}

}  // namespace memsim
