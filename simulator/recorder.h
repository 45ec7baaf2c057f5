// Recorder: the ordered log of storage allocations and frees of one simulated rank,
// with the attribution state (op, module, phase, microbatch, iteration, category) that
// each allocation is stamped with.
//
// Threading: a Recorder is used by one thread at a time, the thread it is active on
// (see ScopedCurrentRecorder and ActiveSession). Every tensor it tracked may outlive it: on
// destruction it detaches the allocation records still alive, whose later frees are then ignored.
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "simulator/attribution.h"
#include "simulator/caching_allocator_model.h"
#include "simulator/check.h"
#include "simulator/cost_model.h"
#include "simulator/name_table.h"

namespace memsim {

class Recorder;

// The context of every tracked DataPtr: which recorder to tell when it is freed, and
// the real allocation behind it (empty on meta). Owned by the DataPtr (deleted in its
// deleter); see tracking_allocator.h.
struct AllocationRecord {
  Recorder* recorder;  // null once the recorder is gone
  int64_t storage_id;
  c10::DataPtr underlying;
};

// Everything known about one storage, as the log's readers see it: assembled from the
// packed log (Note [Packed storages]). Indexed by storage id (dense, from 0).
struct StorageInfo {
  int64_t size_bytes = 0;    // exact requested size (nbytes of the storage)
  int64_t alloc_event = -1;  // index into Recorder::events()
  int64_t free_event = -1;   // -1 while alive
  // Shape and dtype of the first tensor seen viewing this storage as an op output: the
  // dims are Recorder::shape_dims()[shape_offset, shape_offset + ndim) (a pool, so that
  // replicated storages share their template's).
  int64_t shape_offset = 0;
  NameId op = 0;      // innermost aten op that allocated it (0: none)
  NameId module = 0;  // module path (0: top level)
  int32_t iteration = -1;
  int32_t microbatch = -1;
  Phase phase = Phase::kSetup;
  Category category = Category::kUnattributed;
  // Made under a PersistentScope (a grown global buffer): state that outlives the op, which
  // autograd does not save.
  bool persistent = false;
  int8_t ndim = -1;  // -1: no tensor seen
  c10::ScalarType dtype = c10::ScalarType::Undefined;
};

// Note [Packed storages]
// The log holds one storage per allocation of a whole run: millions with many microbatches.
// A replica's storage (Recorder::AppendReplica) differs from its template's only in when it
// lived, the iteration and microbatch it belongs to, and, under a rename, its module. So a
// storage is kept as a 24-byte StorageLife pointing at a StorageKind that replicas share,
// and Recorder::storages() assembles the StorageInfo a reader asks for. A kind that a
// replica shares is never changed in place: Retag and NoteTensorShape give the storage a
// kind of its own. A storage's iteration is the one current at its allocation, and the
// iteration changes only where Recorder::BeginIteration marks it, so it is read off those
// marks, not kept per storage.

// What a storage is, apart from when it lived (see StorageInfo for the fields).
struct StorageKind {
  int64_t size_bytes = 0;
  int64_t shape_offset = 0;
  NameId op = 0;
  NameId module = 0;
  Phase phase = Phase::kSetup;
  Category category = Category::kUnattributed;
  bool persistent = false;
  int8_t ndim = -1;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  bool shared = false;  // more than one storage has it (or may: a replica's renamed kind)
};

// When a storage lived, and what it is.
struct StorageLife {
  int64_t alloc_event = -1;
  int64_t free_event = -1;
  uint32_t kind = 0;  // index into the recorder's kinds
  int32_t microbatch = -1;
};
static_assert(sizeof(StorageLife) <= 24, "StorageLife grew: the event log holds millions");

// Where an iteration began: the storages allocated from event `first_event` on belong to it.
struct IterationStart {
  int64_t first_event;
  int32_t iteration;
};

// The storages of a log as StorageInfo values, by id: a view of the recorder's packed
// storages (Note [Packed storages]), valid while the recorder lives (it sees storages added
// after it was made). Its values are assembled copies: keep a StorageInfo, not a pointer.
// life(id) refers into the log, valid until the recorder records another storage.
class StorageTable {
 public:
  // REQUIRES: `iteration_starts` ordered by first_event.
  StorageTable(const std::vector<StorageLife>& lives, const std::vector<StorageKind>& kinds,
               const std::vector<IterationStart>& iteration_starts)
      : lives_(&lives), kinds_(&kinds), iteration_starts_(&iteration_starts) {}
  size_t size() const { return lives_->size(); }
  // REQUIRES: id < size().
  StorageInfo operator[](size_t id) const {
    const StorageLife& life = (*lives_)[id];
    const StorageKind& kind = (*kinds_)[life.kind];
    StorageInfo info;
    info.size_bytes = kind.size_bytes;
    info.alloc_event = life.alloc_event;
    info.free_event = life.free_event;
    info.shape_offset = kind.shape_offset;
    info.op = kind.op;
    info.module = kind.module;
    info.iteration = IterationAt(life.alloc_event);
    info.microbatch = life.microbatch;
    info.phase = kind.phase;
    info.category = kind.category;
    info.persistent = kind.persistent;
    info.ndim = kind.ndim;
    info.dtype = kind.dtype;
    return info;
  }
  // Its size alone (what an allocator replay asks of every event).
  int64_t size_bytes(size_t id) const { return (*kinds_)[(*lives_)[id].kind].size_bytes; }
  // When it lived alone (what a search for the storages alive at an event reads).
  const StorageLife& life(size_t id) const { return (*lives_)[id]; }

  class Iterator {
   public:
    Iterator(const StorageTable* table, size_t id) : table_(table), id_(id) {}
    StorageInfo operator*() const { return (*table_)[id_]; }
    Iterator& operator++() {
      ++id_;
      return *this;
    }
    bool operator!=(const Iterator& other) const { return id_ != other.id_; }

   private:
    const StorageTable* table_;
    size_t id_;
  };
  Iterator begin() const { return Iterator(this, 0); }
  Iterator end() const { return Iterator(this, size()); }

 private:
  // The iteration current at event `event` (-1 before the first).
  int32_t IterationAt(int64_t event) const {
    const auto after = std::upper_bound(
        iteration_starts_->begin(), iteration_starts_->end(), event,
        [](int64_t e, const IterationStart& start) { return e < start.first_event; });
    return after == iteration_starts_->begin() ? -1 : std::prev(after)->iteration;
  }

  const std::vector<StorageLife>* lives_;
  const std::vector<StorageKind>* kinds_;
  const std::vector<IterationStart>* iteration_starts_;
};

// One allocation or free. 16 bytes: whether it allocates shares a word with the storage id.
struct MemoryEvent {
  MemoryEvent(int64_t storage_id, double time_s, bool is_alloc)
      : storage_id(storage_id), is_alloc(is_alloc), time_s(time_s) {}
  int64_t storage_id : 63;  // REQUIRES: >= 0
  bool is_alloc : 1;
  double time_s;  // virtual clock, see cost_model.h
};
static_assert(sizeof(MemoryEvent) == 16, "MemoryEvent must pack into 16 bytes");

// What the interceptor caches per operator (keyed by its schema's address).
struct OpInfo {
  NameId name;
  // The next four as OpTraits (op_traits.h) says.
  bool is_collective;
  OpCostKind cost_kind;
  bool is_attention;
  bool is_attention_backward;
  bool is_linear;  // aten::linear: costed from input and weight
  // aten::empty and its kin: free, but for a stand-in kernel's output (Note [Stand-in
  // kernels] in session.h).
  bool is_allocation_only;
  // An ATen op whose first result may alias an input (every view, and to, contiguous,
  // reshape, flatten..., which return a new tensor when they cannot alias): free, unless it
  // returned a new storage; then it copied, and is charged as a memory-bound op.
  bool may_copy;
};

enum class MarkerKind : uint8_t {
  kIterationBegin,  // static memory is read here
  kIterationEnd,
  kPhaseBegin,
  kMicrobatchBegin,
  kEmptyCache,  // torch.cuda.empty_cache(): the replay releases every free cached segment
};

// A point in the event log: marker applies before event `event_index`.
struct Marker {
  MarkerKind kind;
  int64_t event_index;
  double time_s;
  int32_t iteration;
  int32_t microbatch;
  Phase phase;
};

class Recorder {
 public:
  // Only storages on `device_type` are recorded: on a GPU, CPU tensors (wrapped scalars,
  // host-side indices) take no device memory.
  explicit Recorder(c10::DeviceType device_type = c10::DeviceType::Meta)
      : device_type_(device_type) {}
  ~Recorder();
  c10::DeviceType device_type() const { return device_type_; }
  Recorder(const Recorder&) = delete;
  Recorder& operator=(const Recorder&) = delete;

  // --- Called by the tracking allocator. ---
  // Records an allocation stamped with the current attribution; returns its record. In the
  // capture pass, state made outside graphed scopes is deferred instead (Note [State made
  // during the capture]): its record has storage id -1 until set_graph_mode ends the pass.
  AllocationRecord* OnAlloc(int64_t size_bytes);
  void OnFree(int64_t storage_id);
  // The free of a deferred record (storage id -1): nothing was recorded, nothing will be.
  void OnDeferredFree(AllocationRecord* record);

  // --- Attribution state, driven by Session scopes and the interceptor. ---
  void SetPhase(Phase phase);
  // Starts iteration `iteration`: storages allocated from here on belong to it. The only
  // way the iteration changes (Note [Packed storages]); adds its kIterationBegin marker.
  void BeginIteration(int32_t iteration);
  void SetMicrobatch(int32_t microbatch);
  // Attributes what follows to `microbatch` without starting one (no marker); see
  // MicrobatchAttribution.
  void AttributeToMicrobatch(int32_t microbatch) { microbatch_ = microbatch; }
  Phase phase() const { return phase_; }
  int32_t iteration() const { return iteration_; }
  int32_t microbatch() const { return microbatch_; }

  // Module stack. Entries are absolute paths; PushChildModule composes with the top.
  NameId PushChildModule(std::string_view child_name);
  void PushAbsoluteModule(NameId module);
  void PopModule();
  // The same for a backward node's module (Note [Backward attribution]): nodes created
  // while it runs belong to scopes opened inside it, so no change point is recorded.
  void PushBackwardNodeModule(NameId module) { module_stack_.push_back(module); }
  void PopBackwardNodeModule() {
    MEMSIM_DCHECK(!module_stack_.empty());
    module_stack_.pop_back();
  }
  NameId current_module() const { return module_stack_.empty() ? 0 : module_stack_.back(); }
  // The module that was current when the autograd node with sequence number `seq` was
  // created in forward (see Note [Backward attribution] in interceptor.h).
  NameId ModuleForSequenceNr(uint64_t seq) const;

  void PushCategory(Category category) { category_stack_.push_back(category); }
  void PopCategory() {
    MEMSIM_DCHECK(!category_stack_.empty());
    category_stack_.pop_back();
  }
  // Op stack, maintained by the interceptor.
  void PushOp(const OpInfo& op) {
    op_stack_.push_back(op.name);
    collective_depth_ += op.is_collective ? 1 : 0;
  }
  void PopOp(const OpInfo& op) {
    MEMSIM_DCHECK(!op_stack_.empty() && op_stack_.back() == op.name);
    op_stack_.pop_back();
    collective_depth_ -= op.is_collective ? 1 : 0;
  }
  // Null when `key` was never added.
  const OpInfo* FindOp(const void* key) const {
    auto it = op_infos_.find(key);
    return it == op_infos_.end() ? nullptr : &it->second;
  }
  const OpInfo& AddOp(const void* key, OpInfo info) { return op_infos_[key] = info; }
  // Re-categorizes a live storage (gradients that autograd allocated, for example).
  void Retag(int64_t storage_id, Category category);
  // Stores shape and dtype for a storage that has none yet.
  void NoteTensorShape(int64_t storage_id, c10::IntArrayRef sizes, c10::ScalarType dtype);

  // --- Virtual clock (Note [Virtual clock] in cost_model.h); null gpu: no time passes. ---
  void set_gpu(const GpuSpec* gpu) { gpu_ = gpu; }
  const GpuSpec* gpu() const { return gpu_; }
  double now_s() const { return now_s_; }
  void AdvanceClock(double seconds) { now_s_ += seconds; }
  // A launched kernel of `kernel_s` on the GPU: the host's time per op at least, but in a
  // CUDA graph's replay or a KernelTimeOnlyScope (Note [Virtual clock]). REQUIRES: gpu() is
  // set.
  void ChargeKernel(double kernel_s) {
    const bool host_free = in_graph_replay() || kernel_time_only_depth_ > 0;
    AdvanceClock(host_free ? kernel_s : std::max(gpu_->min_op_s, kernel_s));
  }
  void PushKernelTimeOnly() { ++kernel_time_only_depth_; }
  void PopKernelTimeOnly() {
    MEMSIM_DCHECK(kernel_time_only_depth_ > 0);
    --kernel_time_only_depth_;
  }
  // While positive, the interceptor charges allocation-only ops as the kernels whose
  // outputs they stand for (Note [Stand-in kernels] in session.h).
  void PushStandInKernels() { ++stand_in_depth_; }
  void PopStandInKernels() {
    MEMSIM_DCHECK(stand_in_depth_ > 0);
    --stand_in_depth_;
  }
  bool charges_stand_ins() const { return stand_in_depth_ > 0; }

  void AddMarker(MarkerKind kind);
  // Moves the log onto another clock (Note [Pipeline clock] in parallel/pipeline_clock.h):
  // marker k happens shift_s[k] later, and so does every event from marker k's event up to
  // the next marker's (events before the first marker keep their time).
  // REQUIRES: shift_s.size() == markers().size(); the shifted times stay nondecreasing.
  void ShiftTimesAtMarkers(const std::vector<double>& shift_s);

  // --- Replication (Note [Microbatch replication] in parallel/rank_training.cc). ---
  // How a copy's storages relate to its template's. Storage ids are handed out in event
  // order, so the storages a range of events allocates have consecutive ids, and a copy
  // of the range allocates theirs in the same order: template id t in [first, last)
  // became t + shift.
  struct IdShift {
    int64_t first = 0, last = 0, shift = 0;  // empty: maps nothing
    bool Maps(int64_t id) const { return first <= id && id < last; }
  };
  // What a copy's frees of storages allocated before its range refer to, and how the
  // module paths of the storages it allocates change.
  struct ReplicaOuter {
    IdShift shift;                                 // template ids mapped by a shift
    std::vector<std::pair<int64_t, int64_t>> ids;  // (template id, copy's id), the others
    // (from, to): module paths equal to `from` or under it ("from.x") are renamed under
    // `to` (the first pair that matches); none: unchanged.
    std::vector<std::pair<std::string, std::string>> renames;
  };
  // Appends a copy of events [begin, end), shifted by `time_offset_s`, stamped with the
  // current iteration and microbatch. Storages the copied events allocate get new ids,
  // described by `*ids`; a copied free of a storage allocated before `begin` is
  // translated through `outer`. Returns false and appends nothing if a free refers to a
  // storage neither maps. The copies have no tensors behind them; a copied free of a
  // storage that a tensor still holds detaches that tensor, whose own free is then not
  // recorded again.
  bool AppendReplica(int64_t begin, int64_t end, double time_offset_s, const ReplicaOuter& outer,
                     IdShift* ids);
  // The next allocation on this thread's tracking allocator is storage `storage_id`, a
  // copy's (AppendReplica) still alive, instead of a new one: a tensor now stands for it,
  // and its free is recorded when that tensor dies. No event is recorded.
  // REQUIRES: `storage_id` is alive, has no tensor, and the allocation has its size.
  void AdoptNextAllocation(int64_t storage_id);

  // --- CUDA graphs (Note [CUDA graphs] in parallel/cuda_graphs.h). ---
  //
  // Note [State made during the capture]
  // The capture pass runs the whole schedule, while the real capture runs the graphed
  // callables alone: a buffer or workspace an ungraphed module makes on its first use (the
  // output layer's global buffer, TE's dummy weight gradients, the experts' grouped-GEMM
  // workspaces) does not exist during the real capture when no eager step ran before it
  // (--cuda-graph-warmup-steps 0), and is made in the first step after it. So state
  // (PersistentScope, or a category other than activations, temporaries and communication)
  // allocated outside graphed scopes during the capture pass is deferred: recorded as
  // allocated when the pass ends, if its tensors are still alive, and never if they died.
  // State made before the pass (parameters, optimizer state, what eager steps made) counts
  // throughout, as it does on the GPU.
  // What PyTorch's allocated_bytes sees of the graphed scopes: everything (eager steps),
  // only them (the capture pass, which runs nothing else), or nothing of them (replays).
  enum class GraphMode : uint8_t { kEager, kCapture, kReplay };
  // Leaving the capture pass records the allocations it deferred whose tensors are alive,
  // in the order they were made (Note [State made during the capture]).
  // REQUIRES: no graphed scope is open.
  void set_graph_mode(GraphMode mode);
  // Graphed scopes nest; the autograd nodes created inside one are graphed in backward.
  void BeginGraphedScope();
  // REQUIRES: a BeginGraphedScope() still open.
  void EndGraphedScope();
  bool in_graphed_scope() const { return graphed_depth_ > 0; }
  // Whether what runs now is a CUDA graph's replay: its kernels launch without the host
  // code around them (Note [Virtual clock] in cost_model.h).
  bool in_graph_replay() const {
    return graph_mode_ == GraphMode::kReplay && (graphed_depth_ > 0 || in_graphed_backward_node());
  }
  // Persistent state made wherever it is first needed (a grown global buffer): it counts in
  // every graph mode, whatever category the scope around it gives it.
  void PushPersistent() { ++persistent_depth_; }
  void PopPersistent() {
    MEMSIM_DCHECK(persistent_depth_ > 0);
    --persistent_depth_;
  }
  // Whether the node with forward sequence number `seq` was created in a graphed scope.
  bool IsGraphedSequenceNr(uint64_t seq) const;
  void PushBackwardNodeGraphed(bool graphed) { backward_graphed_.push_back(graphed); }
  bool in_graphed_backward_node() const {
    return !backward_graphed_.empty() && backward_graphed_.back();
  }
  void PopBackwardNodeGraphed() {
    MEMSIM_DCHECK(!backward_graphed_.empty());
    backward_graphed_.pop_back();
  }
  // Whether an allocation now is one the run's allocated memory counts (else the tracking
  // allocator does not record it, nor its free). State the driving code names (parameters,
  // gradients, optimizer state, workspaces and caches) counts in every mode: the runtime
  // makes it wherever it is first needed.
  bool Counts() const {
    if (graph_mode_ == GraphMode::kEager || persistent_depth_ > 0) return true;
    if (!category_stack_.empty() && category_stack_.back() != Category::kActivation &&
        category_stack_.back() != Category::kTemporary &&
        category_stack_.back() != Category::kCommunication) {
      return true;
    }
    const bool graphed = graphed_depth_ > 0 || in_graphed_backward_node();
    return graph_mode_ == GraphMode::kCapture ? graphed : !graphed;
  }

  // --- Offloading (Note [Fine-grained activation offloading] in models/activation_offload.h).
  // Records the free of live storage `storage_id` while its tensors keep it: its bytes
  // moved to the host. The tensors' own free later records nothing.
  // REQUIRES: `storage_id` is alive (std::logic_error otherwise).
  void Evict(int64_t storage_id);
  // Brings an evicted storage's bytes back as a new storage allocated now (attributed to
  // the op and module that made the original), which its tensors free when they die.
  // Returns the new id, or -1 when `storage_id` is not evicted (never was, or its tensors
  // died meanwhile: nothing to bring back).
  int64_t Restore(int64_t storage_id);

  // The caching allocator's settings in the simulated process (PYTORCH_CUDA_ALLOC_CONF):
  // every replay of this recording (timeline, capacity check, snapshots) uses them.
  // Capacity and segment placement are not settings of the process (each replay chooses
  // its own), so they are dropped here.
  void SetAllocatorSettings(CachingAllocatorConfig settings) {
    settings.capacity_bytes = 0;
    settings.segment_address = nullptr;
    allocator_settings_ = settings;
  }
  const CachingAllocatorConfig& allocator_settings() const { return allocator_settings_; }

  // Makes room for `events` more events and `storages` more storages at once, where the
  // caller knows that many copies are coming: the log's vectors are a run's largest, and
  // growing them by doubling copies them again and again and briefly holds them twice.
  void Reserve(int64_t events, int64_t storages);
  // Closes the log once the step is recorded, before it is kept for replays and reports:
  // the tensors still alive are detached (their frees are not recorded, as after the
  // recorder's death), which drops the table of live records (a pointer per storage), and
  // the log's vectors lose their spare capacity (grown by doubling, they hold up to twice
  // what they use; a vector whose spare is small, Reserve having guessed well, is not
  // copied for it). REQUIRES: nothing is recorded after it.
  void EndRecording();

  // --- Results. ---
  const std::vector<MemoryEvent>& events() const { return events_; }
  StorageTable storages() const { return StorageTable(lives_, kinds_, iteration_starts_); }
  const std::vector<Marker>& markers() const { return markers_; }
  const NameTable& names() const { return names_; }
  const std::vector<int64_t>& shape_dims() const { return shape_dims_; }
  // The dims of a storage's shape (empty if no tensor was seen).
  c10::IntArrayRef ShapeOf(const StorageInfo& storage) const {
    return storage.ndim <= 0 ? c10::IntArrayRef()
                             : c10::IntArrayRef(shape_dims_.data() + storage.shape_offset,
                                                static_cast<size_t>(storage.ndim));
  }
  NameTable& names() { return names_; }
  // Bytes currently alive (sum of exact sizes), and the most ever alive.
  int64_t live_bytes() const { return live_bytes_; }
  int64_t peak_live_bytes() const { return peak_live_bytes_; }

 private:
  Category CategoryForNewStorage() const;
  // Appends storage and allocation event for `size_bytes` with the current attribution.
  int64_t NewStorage(int64_t size_bytes);
  // The allocation, now, of the storage `record` stands for, attributed as `made_as` (its
  // size, op, module, category, shape); returns its id.
  int64_t RecordAllocationOf(AllocationRecord* record, const StorageInfo& made_as);
  void RecordModuleChange();
  // Tells the records of the tensors still alive that this recorder no longer hears them.
  void DetachLiveRecords();
  // Appends `kind` to the kinds; returns its index (Note [Packed storages]).
  uint32_t NewKind(const StorageKind& kind);
  // The kind of storage `storage_id`, to change: a copy of its own first if others share it.
  StorageKind& OwnKind(int64_t storage_id);
  // The kind a replica's storage has: its template's `kind`, with its module `module`.
  uint32_t ReplicaKind(uint32_t kind, NameId module);

  c10::DeviceType device_type_;
  std::vector<MemoryEvent> events_;
  std::vector<StorageLife> lives_;  // by storage id (Note [Packed storages])
  std::vector<StorageKind> kinds_;
  std::vector<IterationStart> iteration_starts_;  // as BeginIteration made them
  // (template kind, module) -> the kind replicas with that module share.
  std::unordered_map<uint64_t, uint32_t> replica_kinds_;
  std::vector<AllocationRecord*> live_records_;  // by storage id; null once freed
  GraphMode graph_mode_ = GraphMode::kEager;
  int graphed_depth_ = 0;
  int persistent_depth_ = 0;
  int stand_in_depth_ = 0;
  int kernel_time_only_depth_ = 0;
  uint64_t graphed_scope_first_ = 0;  // the outermost open graphed scope's first sequence nr
  // [first, last) sequence numbers of the nodes created in graphed scopes; sorted.
  std::vector<std::pair<uint64_t, uint64_t>> graphed_sequence_nrs_;
  std::vector<bool> backward_graphed_;  // per running backward node
  // Evicted storages whose tensors are alive: their records, until Restore or their free.
  std::unordered_map<int64_t, AllocationRecord*> evicted_;
  // State the capture pass made outside graphed scopes, alive, in the order it was made:
  // each record with the storage it will be (attribution, no event yet).
  std::vector<std::pair<AllocationRecord*, StorageInfo>> deferred_;
  std::vector<Marker> markers_;
  CachingAllocatorConfig allocator_settings_;
  std::vector<int64_t> shape_dims_;
  NameTable names_;

  Phase phase_ = Phase::kSetup;
  int32_t iteration_ = -1;
  int32_t microbatch_ = -1;
  std::vector<NameId> module_stack_;
  std::vector<Category> category_stack_;
  std::vector<NameId> op_stack_;
  std::unordered_map<const void*, OpInfo> op_infos_;
  const GpuSpec* gpu_ = nullptr;
  int collective_depth_ = 0;
  // (first sequence number, module) each time the current module changed; sorted.
  std::vector<std::pair<uint64_t, NameId>> module_changes_;

  double now_s_ = 0.0;
  int64_t adopt_next_ = -1;  // AdoptNextAllocation's storage, until the allocation comes
  int64_t live_bytes_ = 0;
  int64_t peak_live_bytes_ = 0;
};

}  // namespace memsim

namespace memsim {

// The recorder active on this thread, or null. Set with ScopedCurrentRecorder.
Recorder* CurrentRecorder();

// Attributes what `recorder` records while the guard lives to `microbatch`, then restores
// the running one: for a tensor one pipeline step receives for a later microbatch's step.
class MicrobatchAttribution {
 public:
  MicrobatchAttribution(Recorder& recorder, int32_t microbatch)
      : recorder_(recorder), previous_(recorder.microbatch()) {
    recorder_.AttributeToMicrobatch(microbatch);
  }
  ~MicrobatchAttribution() { recorder_.AttributeToMicrobatch(previous_); }
  MicrobatchAttribution(const MicrobatchAttribution&) = delete;
  MicrobatchAttribution& operator=(const MicrobatchAttribution&) = delete;

 private:
  Recorder& recorder_;
  int32_t previous_;
};

// Makes `recorder` this thread's current recorder for the guard's lifetime.
class ScopedCurrentRecorder {
 public:
  explicit ScopedCurrentRecorder(Recorder* recorder);
  ~ScopedCurrentRecorder();
  ScopedCurrentRecorder(const ScopedCurrentRecorder&) = delete;
  ScopedCurrentRecorder& operator=(const ScopedCurrentRecorder&) = delete;

 private:
  Recorder* previous_;
};

}  // namespace memsim
