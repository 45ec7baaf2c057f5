#include "simulator/recorder.h"

#include "simulator/check.h"
#include "simulator/checked_math.h"

#include <ATen/SequenceNumber.h>

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>

namespace memsim {
namespace {
thread_local Recorder* tls_current_recorder = nullptr;
}  // namespace

Recorder* CurrentRecorder() { return tls_current_recorder; }

ScopedCurrentRecorder::ScopedCurrentRecorder(Recorder* recorder) : previous_(tls_current_recorder) {
  tls_current_recorder = recorder;
}
ScopedCurrentRecorder::~ScopedCurrentRecorder() { tls_current_recorder = previous_; }

Recorder::~Recorder() { DetachLiveRecords(); }

Category Recorder::CategoryForNewStorage() const {
  // Note [Memory categories] in attribution.h.
  if (!category_stack_.empty()) return category_stack_.back();
  if (collective_depth_ > 0) return Category::kCommunication;
  return phase_ == Phase::kForward ? Category::kActivation : Category::kTemporary;
}

AllocationRecord* Recorder::OnAlloc(int64_t size_bytes) {
  if (graph_mode_ == GraphMode::kCapture && graphed_depth_ == 0 && !in_graphed_backward_node()) {
    // Note [State made during the capture]: only state counts here outside graphed scopes.
    MEMSIM_DCHECK(adopt_next_ < 0);
    StorageInfo info;
    info.size_bytes = size_bytes;
    info.op = op_stack_.empty() ? 0 : op_stack_.back();
    info.module = current_module();
    info.category = CategoryForNewStorage();
    info.persistent = persistent_depth_ > 0;
    auto* record = new AllocationRecord{this, -1, c10::DataPtr()};
    deferred_.emplace_back(record, info);
    return record;
  }
  if (adopt_next_ >= 0) {
    const int64_t id = std::exchange(adopt_next_, -1);
    MEMSIM_DCHECK(storages().size_bytes(static_cast<size_t>(id)) == size_bytes &&
                  lives_[static_cast<size_t>(id)].free_event < 0 &&
                  live_records_[static_cast<size_t>(id)] == nullptr);
    auto* record = new AllocationRecord{this, id, c10::DataPtr()};
    live_records_[static_cast<size_t>(id)] = record;
    return record;
  }
  const int64_t id = NewStorage(size_bytes);
  auto* record = new AllocationRecord{this, id, c10::DataPtr()};
  live_records_.push_back(record);
  return record;
}

int64_t Recorder::NewStorage(int64_t size_bytes) {
  const int64_t id = static_cast<int64_t>(lives_.size());
  StorageKind kind;
  kind.size_bytes = size_bytes;
  kind.op = op_stack_.empty() ? 0 : op_stack_.back();
  kind.module = current_module();
  kind.phase = phase_;
  kind.category = CategoryForNewStorage();
  kind.persistent = persistent_depth_ > 0;
  StorageLife& life = lives_.emplace_back();
  life.kind = NewKind(kind);
  life.alloc_event = static_cast<int64_t>(events_.size());
  life.microbatch = microbatch_;
  events_.push_back({id, now_s_, true});
  live_bytes_ = CheckedAdd(live_bytes_, size_bytes);  // throws before a count can wrap
  peak_live_bytes_ = std::max(peak_live_bytes_, live_bytes_);
  return id;
}

uint32_t Recorder::NewKind(const StorageKind& kind) {
  if (kinds_.size() > std::numeric_limits<uint32_t>::max()) {
    throw std::overflow_error("memsim: more than 2^32 distinct storages in one rank's log");
  }
  kinds_.push_back(kind);
  return static_cast<uint32_t>(kinds_.size() - 1);
}

StorageKind& Recorder::OwnKind(int64_t storage_id) {
  StorageLife& life = lives_.at(static_cast<size_t>(storage_id));
  if (kinds_[life.kind].shared) {
    StorageKind own = kinds_[life.kind];
    own.shared = false;
    life.kind = NewKind(own);
  }
  return kinds_[life.kind];
}

uint32_t Recorder::ReplicaKind(uint32_t kind, NameId module) {
  if (kinds_[kind].module == module) {
    kinds_[kind].shared = true;
    return kind;
  }
  const uint64_t key = (static_cast<uint64_t>(kind) << 32) | static_cast<uint32_t>(module);
  if (const auto it = replica_kinds_.find(key); it != replica_kinds_.end()) return it->second;
  StorageKind renamed = kinds_[kind];
  renamed.module = module;
  renamed.shared = true;  // later replicas with the same rename find it here
  const uint32_t index = NewKind(renamed);
  replica_kinds_.emplace(key, index);
  return index;
}

void Recorder::Evict(int64_t storage_id) {
  AllocationRecord* record = live_records_.at(static_cast<size_t>(storage_id));
  if (record == nullptr) {
    throw std::logic_error("memsim: evicting storage " + std::to_string(storage_id) +
                           ", which is not alive");
  }
  OnFree(storage_id);
  evicted_.emplace(storage_id, record);
}

int64_t Recorder::Restore(int64_t storage_id) {
  auto it = evicted_.find(storage_id);
  if (it == evicted_.end()) return -1;  // never evicted, or its tensors died meanwhile
  AllocationRecord* record = it->second;
  // Attributed to what made the tensor: a reloaded activation is still that activation.
  const StorageInfo original = storages()[static_cast<size_t>(storage_id)];
  const int64_t id = RecordAllocationOf(record, original);
  evicted_.erase(it);  // once nothing can throw: the record stays evicted otherwise
  return id;
}

int64_t Recorder::RecordAllocationOf(AllocationRecord* record, const StorageInfo& made_as) {
  const int64_t id = NewStorage(made_as.size_bytes);
  StorageKind& kind = kinds_[lives_[static_cast<size_t>(id)].kind];  // new: its own
  kind.op = made_as.op;
  kind.module = made_as.module;
  kind.category = made_as.category;
  kind.persistent = made_as.persistent;
  kind.ndim = made_as.ndim;
  kind.dtype = made_as.dtype;
  kind.shape_offset = made_as.shape_offset;
  record->storage_id = id;
  live_records_.push_back(record);
  return id;
}

void Recorder::OnDeferredFree(AllocationRecord* record) {
  const auto it = std::find_if(deferred_.begin(), deferred_.end(),
                               [record](const auto& entry) { return entry.first == record; });
  MEMSIM_DCHECK(it != deferred_.end());
  deferred_.erase(it);
}

void Recorder::set_graph_mode(GraphMode mode) {
  MEMSIM_DCHECK(graphed_depth_ == 0);
  const bool capture_ends = graph_mode_ == GraphMode::kCapture && mode != GraphMode::kCapture;
  graph_mode_ = mode;
  if (!capture_ends) return;
  for (const auto& [record, made_as] : deferred_) RecordAllocationOf(record, made_as);
  deferred_.clear();
}

void Recorder::OnFree(int64_t storage_id) {
  if (!evicted_.empty()) {
    // The tensors of an evicted storage died: its free was recorded at Evict.
    if (auto it = evicted_.find(storage_id); it != evicted_.end()) {
      evicted_.erase(it);
      return;
    }
  }
  StorageLife& life = lives_.at(static_cast<size_t>(storage_id));
  MEMSIM_DCHECK(life.free_event < 0);  // each storage is freed once
  life.free_event = static_cast<int64_t>(events_.size());
  events_.push_back({storage_id, now_s_, false});
  live_bytes_ -= kinds_[life.kind].size_bytes;
  MEMSIM_DCHECK(live_bytes_ >= 0);
  live_records_[static_cast<size_t>(storage_id)] = nullptr;
}

void Recorder::SetPhase(Phase phase) {
  phase_ = phase;
  AddMarker(MarkerKind::kPhaseBegin);
}

void Recorder::SetMicrobatch(int32_t microbatch) {
  microbatch_ = microbatch;
  AddMarker(MarkerKind::kMicrobatchBegin);
}

NameId Recorder::PushChildModule(std::string_view child_name) {
  const NameId parent = current_module();
  NameId id;
  if (parent == 0) {
    id = names_.Intern(child_name);
  } else {
    std::string path = names_.Name(parent);
    path += '.';
    path += child_name;
    id = names_.Intern(path);
  }
  module_stack_.push_back(id);
  RecordModuleChange();
  return id;
}

void Recorder::PushAbsoluteModule(NameId module) {
  module_stack_.push_back(module);
  RecordModuleChange();
}

void Recorder::PopModule() {
  if (module_stack_.empty()) throw std::logic_error("memsim: PopModule without a module");
  module_stack_.pop_back();
  RecordModuleChange();
}

void Recorder::RecordModuleChange() {
  const uint64_t seq = at::sequence_number::peek();
  // No node was created since the last change: it is superseded.
  if (!module_changes_.empty() && module_changes_.back().first == seq) {
    module_changes_.back().second = current_module();
    return;
  }
  module_changes_.emplace_back(seq, current_module());
}

NameId Recorder::ModuleForSequenceNr(uint64_t seq) const {
  // Last change whose first sequence number is <= seq: the module current at creation.
  auto it = std::upper_bound(module_changes_.begin(), module_changes_.end(), seq,
                             [](uint64_t s, const auto& change) { return s < change.first; });
  if (it == module_changes_.begin()) return 0;
  return std::prev(it)->second;
}

void Recorder::BeginGraphedScope() {
  if (graphed_depth_++ == 0) graphed_scope_first_ = at::sequence_number::peek();
}

void Recorder::EndGraphedScope() {
  MEMSIM_DCHECK(graphed_depth_ > 0);
  if (--graphed_depth_ > 0) return;
  const uint64_t last = at::sequence_number::peek();
  if (last > graphed_scope_first_) graphed_sequence_nrs_.emplace_back(graphed_scope_first_, last);
}

bool Recorder::IsGraphedSequenceNr(uint64_t seq) const {
  // The last range starting at or before seq.
  auto it = std::upper_bound(graphed_sequence_nrs_.begin(), graphed_sequence_nrs_.end(), seq,
                             [](uint64_t s, const auto& range) { return s < range.first; });
  return it != graphed_sequence_nrs_.begin() && seq < std::prev(it)->second;
}

void Recorder::Retag(int64_t storage_id, Category category) {
  if (kinds_[lives_.at(static_cast<size_t>(storage_id)).kind].category == category) return;
  OwnKind(storage_id).category = category;
}

void Recorder::NoteTensorShape(int64_t storage_id, c10::IntArrayRef sizes, c10::ScalarType dtype) {
  if (kinds_[lives_[static_cast<size_t>(storage_id)].kind].ndim >= 0) return;
  StorageKind& kind = OwnKind(storage_id);
  kind.ndim = static_cast<int8_t>(std::min<size_t>(sizes.size(), 127));
  kind.shape_offset = static_cast<int64_t>(shape_dims_.size());
  shape_dims_.insert(shape_dims_.end(), sizes.begin(), sizes.begin() + kind.ndim);
  kind.dtype = dtype;
}

void Recorder::AdoptNextAllocation(int64_t storage_id) {
  MEMSIM_DCHECK(adopt_next_ < 0 && 0 <= storage_id &&
                storage_id < static_cast<int64_t>(lives_.size()));
  adopt_next_ = storage_id;
}

void Recorder::Reserve(int64_t events, int64_t storages) {
  MEMSIM_DCHECK(events >= 0 && storages >= 0);
  events_.reserve(events_.size() + static_cast<size_t>(events));
  lives_.reserve(lives_.size() + static_cast<size_t>(storages));
  live_records_.reserve(live_records_.size() + static_cast<size_t>(storages));
}

namespace {
// Shrinks `v` to its size unless its spare is under a sixteenth of it: a shrink copies it.
template <typename T>
void ShrinkIfWorthACopy(std::vector<T>* v) {
  if (v->capacity() - v->size() > v->size() / 16) v->shrink_to_fit();
}
}  // namespace

void Recorder::EndRecording() {
  DetachLiveRecords();
  ShrinkIfWorthACopy(&events_);
  ShrinkIfWorthACopy(&lives_);
  ShrinkIfWorthACopy(&kinds_);
  ShrinkIfWorthACopy(&shape_dims_);
  ShrinkIfWorthACopy(&markers_);
}

void Recorder::DetachLiveRecords() {
  for (AllocationRecord* record : live_records_) {
    if (record != nullptr) record->recorder = nullptr;
  }
  for (const auto& [id, record] : evicted_) record->recorder = nullptr;
  for (const auto& [record, info] : deferred_) record->recorder = nullptr;
  live_records_ = std::vector<AllocationRecord*>();
  evicted_.clear();
  deferred_.clear();
}

bool Recorder::AppendReplica(int64_t begin, int64_t end, double time_offset_s,
                             const ReplicaOuter& outer, IdShift* ids) {
  // The template's own storages, then check that every free names one of them or a
  // storage `outer` maps.
  IdShift own;
  int64_t allocations = 0;
  for (int64_t e = begin; e < end; ++e) {
    const MemoryEvent& event = events_[static_cast<size_t>(e)];
    if (!event.is_alloc) continue;
    if (allocations++ == 0) own.first = event.storage_id;
    own.last = event.storage_id + 1;
  }
  MEMSIM_DCHECK(own.last - own.first == allocations);  // consecutive ids
  auto outer_id = [&outer](int64_t id) -> int64_t {
    if (outer.shift.Maps(id)) return id + outer.shift.shift;
    for (const auto& [from, to] : outer.ids) {
      if (from == id) return to;
    }
    return -1;
  };
  for (int64_t e = begin; e < end; ++e) {
    const MemoryEvent& event = events_[static_cast<size_t>(e)];
    if (!event.is_alloc && !own.Maps(event.storage_id) && outer_id(event.storage_id) < 0) {
      return false;
    }
  }
  own.shift = static_cast<int64_t>(lives_.size()) - own.first;
  *ids = own;
  std::unordered_map<NameId, NameId> renamed;
  auto rename = [&](NameId module) {
    if (outer.renames.empty()) return module;
    auto it = renamed.find(module);
    if (it != renamed.end()) return it->second;
    const std::string& name = names_.Name(module);
    NameId to = module;
    for (const auto& [from_path, to_path] : outer.renames) {
      if (name.compare(0, from_path.size(), from_path) == 0 &&
          (name.size() == from_path.size() || name[from_path.size()] == '.')) {
        to = names_.Intern(to_path + name.substr(from_path.size()));
        break;
      }
    }
    return renamed[module] = to;
  };
  live_records_.resize(live_records_.size() + static_cast<size_t>(allocations), nullptr);
  for (int64_t e = begin; e < end; ++e) {
    const MemoryEvent event = events_[static_cast<size_t>(e)];  // copy: events_ grows
    if (event.is_alloc) {
      StorageLife life = lives_[static_cast<size_t>(event.storage_id)];  // copy: lives_ grows
      life.kind = ReplicaKind(life.kind, rename(kinds_[life.kind].module));
      life.alloc_event = static_cast<int64_t>(events_.size());
      life.free_event = -1;
      life.microbatch = microbatch_;
      const int64_t id = static_cast<int64_t>(lives_.size());
      MEMSIM_DCHECK(id == event.storage_id + own.shift);
      lives_.push_back(life);
      events_.push_back({id, event.time_s + time_offset_s, true});
      live_bytes_ += kinds_[life.kind].size_bytes;
      peak_live_bytes_ = std::max(peak_live_bytes_, live_bytes_);
    } else {
      const int64_t id =
          own.Maps(event.storage_id) ? event.storage_id + own.shift : outer_id(event.storage_id);
      StorageLife& life = lives_[static_cast<size_t>(id)];
      MEMSIM_DCHECK(life.free_event < 0);
      life.free_event = static_cast<int64_t>(events_.size());
      events_.push_back({id, event.time_s + time_offset_s, false});
      live_bytes_ -= kinds_[life.kind].size_bytes;
      if (AllocationRecord* record = live_records_[static_cast<size_t>(id)]) {
        record->recorder = nullptr;  // its tensor's free is the one just recorded
        live_records_[static_cast<size_t>(id)] = nullptr;
      }
    }
  }
  return true;
}

void Recorder::ShiftTimesAtMarkers(const std::vector<double>& shift_s) {
  MEMSIM_DCHECK(shift_s.size() == markers_.size());
  // Where two shifts meet, rounding may put an event a last bit before the one it follows;
  // the clamp keeps the order exact.
  size_t k = 0;
  double shift = 0;
  double previous_s = -std::numeric_limits<double>::infinity();
  for (size_t e = 0; e < events_.size(); ++e) {
    while (k < markers_.size() && markers_[k].event_index <= static_cast<int64_t>(e)) {
      shift = shift_s[k++];
    }
    previous_s = events_[e].time_s = std::max(previous_s, events_[e].time_s + shift);
  }
  previous_s = -std::numeric_limits<double>::infinity();
  for (size_t m = 0; m < markers_.size(); ++m) {
    previous_s = markers_[m].time_s = std::max(previous_s, markers_[m].time_s + shift_s[m]);
  }
  if (!shift_s.empty()) now_s_ = std::max(previous_s, now_s_ + shift_s.back());
}

void Recorder::BeginIteration(int32_t iteration) {
  iteration_ = iteration;
  iteration_starts_.push_back({static_cast<int64_t>(events_.size()), iteration});
  AddMarker(MarkerKind::kIterationBegin);
}

void Recorder::AddMarker(MarkerKind kind) {
  markers_.push_back(
      {kind, static_cast<int64_t>(events_.size()), now_s_, iteration_, microbatch_, phase_});
}

}  // namespace memsim
