#include "simulator/snapshot_writer.h"

#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/jit/serialization/pickler.h>

#include <limits>
#include <unordered_map>
#include <vector>

#include "simulator/allocator_replay.h"
#include "simulator/atomic_file.h"
#include "simulator/caching_allocator_model.h"
#include "simulator/peak_analysis.h"

namespace memsim {
namespace {

using List = c10::impl::GenericList;

List NewList() { return List(c10::AnyType::get()); }

// Note [Snapshot speed]
// A snapshot holds a dict per trace entry and per frame: hundreds of thousands of them
// for a long run, so building the pickle's values dominated writing one. Values that
// repeat (every key, the action names, each module and op name) are made once and
// shared by reference count; the pickler memoizes strings by value, so the bytes written
// are the same as with a fresh string each time.
class Strings {
 public:
  const c10::IValue& Get(const std::string& s) {
    auto it = values_.find(s);
    if (it == values_.end()) it = values_.emplace(s, c10::IValue(s)).first;
    return it->second;
  }

 private:
  std::unordered_map<std::string, c10::IValue> values_;
};

// A dict with string keys and values of any type (pickled as a plain dict).
class Dict {
 public:
  Dict() : dict_(c10::StringType::get(), c10::AnyType::get()) {}
  template <typename T>
  void insert(const c10::IValue& key, T&& value) {
    dict_.insert_or_assign(key, c10::IValue(std::forward<T>(value)));
  }
  operator c10::IValue() const { return c10::IValue(dict_); }

 private:
  c10::impl::GenericDict dict_;
};

// The keys and fixed strings of the format, shared by every dict that uses them.
struct Keys {
  explicit Keys(Strings* s)
      : filename(s->Get("filename")),
        line(s->Get("line")),
        name(s->Get("name")),
        action(s->Get("action")),
        addr(s->Get("addr")),
        size(s->Get("size")),
        stream(s->Get("stream")),
        time_us(s->Get("time_us")),
        frames(s->Get("frames")) {}
  c10::IValue filename, line, name, action, addr, size, stream, time_us, frames;
};

// Builds the frames of storages (Note [Snapshot frames] in snapshot_writer.h).
class FrameBuilder {
 public:
  explicit FrameBuilder(const Recorder& recorder) : recorder_(recorder), keys_(&strings_) {}

  List StorageFrames(int64_t storage_id) {
    const StorageInfo& s = recorder_.storages()[static_cast<size_t>(storage_id)];
    const std::string& module = recorder_.names().Name(s.module);
    List frames = NewList();
    frames.push_back(Frame(strings_.Get(module.empty() ? "<top>" : module), 0,
                           strings_.Get(recorder_.names().Name(s.op))));
    frames.push_back(Frame(
        strings_.Get("memsim://category/" + std::string(CategoryName(s.category))), s.iteration,
        c10::IValue(std::string(PhaseName(s.phase)) + " iteration=" + std::to_string(s.iteration) +
                    " microbatch=" + std::to_string(s.microbatch))));
    frames.push_back(
        Frame(strings_.Get("memsim://tensor"), 0, c10::IValue(StorageShapeString(recorder_, s))));
    return frames;
  }

  c10::IValue TraceEntry(const c10::IValue& action, int64_t address, int64_t size_bytes,
                         double time_s, const List& frames) {
    Dict entry;
    entry.insert(keys_.action, action);
    entry.insert(keys_.addr, address);
    entry.insert(keys_.size, size_bytes);
    entry.insert(keys_.stream, int64_t{0});
    entry.insert(keys_.time_us, static_cast<int64_t>(time_s * 1e6));
    entry.insert(keys_.frames, frames);
    return entry;
  }

  Strings& strings() { return strings_; }

 private:
  c10::IValue Frame(const c10::IValue& filename, int64_t line, const c10::IValue& name) {
    Dict frame;
    frame.insert(keys_.filename, filename);
    frame.insert(keys_.line, line);
    frame.insert(keys_.name, name);
    return frame;
  }

  const Recorder& recorder_;
  Strings strings_;
  Keys keys_;
};

// Logs each allocator action of the replay (Note [Allocator replay]) as a device_traces
// entry. Entries are kept as plain structs and turned into pickle values only for the
// ones written.
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

  // ReplayAllocations' visitor (allocator_replay.h).
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

  List TakeEntries(FrameBuilder* builder) {
    static const char* const kActionNames[] = {"alloc", "free_requested", "free_completed",
                                               "segment_alloc", "segment_free"};
    std::vector<c10::IValue> actions;
    for (const char* name : kActionNames) actions.push_back(builder->strings().Get(name));
    List list = NewList();
    list.reserve(entries_.size());
    // A storage's alloc and frees share one frames list (and the pickle memoizes it).
    std::unordered_map<int64_t, List> frames;
    const List no_frames = NewList();
    for (const Entry& e : entries_) {
      List entry_frames = no_frames;
      if (e.storage_id >= 0) {
        auto it = frames.find(e.storage_id);
        if (it == frames.end()) {
          it = frames.emplace(e.storage_id, builder->StorageFrames(e.storage_id)).first;
        }
        entry_frames = it->second;
      }
      list.push_back(builder->TraceEntry(actions[static_cast<size_t>(e.action)], e.address,
                                         e.size_bytes, e.time_s, entry_frames));
    }
    return list;
  }
  // Storage id of the allocated block at `address`.
  int64_t StorageAt(int64_t address) const { return storage_at_address_.at(address); }

 private:
  enum class Action : uint8_t {
    kAlloc,
    kFreeRequested,
    kFreeCompleted,
    kSegmentAlloc,
    kSegmentFree
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

std::string SnapshotPickle(const Recorder& recorder, int64_t through_event,
                           const SnapshotOptions& options) {
  TraceBuilder trace(recorder, options);
  CachingAllocatorModel allocator(CachingAllocatorConfig{}, &trace);
  ReplayAllocations(recorder, &allocator, through_event + 1, trace);
  FrameBuilder builder(recorder);

  List segments = NewList();
  for (const AllocatorSegmentView& seg : allocator.Segments()) {
    List blocks = NewList();
    int64_t allocated = 0;
    int64_t requested = 0;
    for (const AllocatorBlockView& b : seg.blocks) {
      Dict block;
      block.insert("address", b.address);
      block.insert("size", b.size_bytes);
      block.insert("requested_size", b.requested_bytes);
      block.insert("state", b.allocated ? "active_allocated" : "inactive");
      const List frames =
          b.allocated ? builder.StorageFrames(trace.StorageAt(b.address)) : NewList();
      block.insert("frames", frames);
      if (b.allocated) {  // PyTorch 1.13 reads frames here (Note [Snapshot formats])
        Dict history;
        history.insert("addr", b.address);
        history.insert("real_size", b.requested_bytes);
        history.insert("frames", frames);
        List entries = NewList();
        entries.push_back(history);
        block.insert("history", entries);
      }
      blocks.push_back(block);
      if (b.allocated) {
        allocated += b.size_bytes;
        requested += b.requested_bytes;
      }
    }
    Dict segment;
    segment.insert("device", int64_t{options.device});
    segment.insert("address", seg.address);
    segment.insert("total_size", seg.size_bytes);
    segment.insert("allocated_size", allocated);
    segment.insert("active_size", allocated);
    segment.insert("requested_size", requested);
    segment.insert("stream", int64_t{0});
    segment.insert("segment_type", seg.pool == PoolKind::kSmall ? "small" : "large");
    segment.insert("segment_pool_id", c10::ivalue::Tuple::create({int64_t{0}, int64_t{0}}));
    segment.insert("is_expandable", false);
    segment.insert("frames", NewList());
    segment.insert("blocks", blocks);
    segments.push_back(segment);
  }

  c10::IValue snapshot = segments;
  if (!options.segments_only) {
    List device_traces = NewList();
    device_traces.push_back(trace.TakeEntries(&builder));
    Dict memsim_info;
    memsim_info.insert("format", "memsim snapshot 1");
    memsim_info.insert("through_event", through_event);
    memsim_info.insert("first_traced_event", options.first_traced_event);
    Dict dict;
    dict.insert("segments", segments);
    dict.insert("device_traces", device_traces);
    dict.insert("allocator_settings", Dict());
    dict.insert("memsim", memsim_info);
    snapshot = dict;
  }

  std::string out;
  torch::jit::Pickler pickler([&](const char* data, size_t n) { out.append(data, n); },
                              /*tensor_table=*/nullptr, /*type_renamer=*/nullptr,
                              /*memoized_class_types=*/nullptr, /*get_tensor_id=*/nullptr,
                              /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(snapshot);
  pickler.stop();
  return out;
}

Status WriteSnapshot(const std::string& path, const Recorder& recorder, int64_t through_event,
                     const SnapshotOptions& options) {
  return WriteFileAtomically(path, SnapshotPickle(recorder, through_event, options));
}

}  // namespace memsim
