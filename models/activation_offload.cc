#include "models/activation_offload.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <optional>

#include "models/backward_call.h"
#include "simulator/check.h"
#include "simulator/checked_math.h"
#include "simulator/cost_model.h"
#include "simulator/recorder.h"
#include "simulator/session.h"
#include "simulator/tracking_allocator.h"

namespace memsim {

// A region's group: what it saved and where its bytes are.
class OffloadGroup : public torch::CustomClassHolder {
 public:
  struct Saved {
    int64_t storage_id;    // the storage the tensor views
    int64_t reload_bytes;  // what each copy brings back (Note: a thin view, its own bytes)
    NameId module;         // where the tensor was made: copies are attributed there
    int copies;            // reloads into new tensors
    bool evict;            // the commit evicts the storage (its first entry in the group)
    bool restore;          // a reload restores the storage itself (once)
    bool forced;           // a forced-released input: evicted again at the start node in backward
  };

  ActivationOffloader* owner = nullptr;
  OffloadModule module = OffloadModule::kAttnNorm;
  ActivationOffloader::ChunkKey chunk{-1, -1};
  size_t index = 0;  // in its chunk's start order
  std::vector<Saved> saved;
  bool offloaded = false;
  bool reloaded = false;
  double offloaded_s = 0.0;  // when its D2H copies end (Note [Offload copies on the clock])
  double reloaded_s = 0.0;   // when its H2D copies end
  std::vector<int64_t> restored_forced;  // the ids the forced inputs' reloads restored
  std::vector<at::Tensor> copies;        // reloads into new tensors

  // What crosses the host link each way: every save once, a save reloaded into new
  // tensors once per reload.
  int64_t LinkBytes() const {
    int64_t bytes = 0;
    for (const Saved& s : saved) {
      bytes = CheckedAdd(bytes, CheckedMul(s.reload_bytes, int64_t{s.restore} + s.copies));
    }
    return bytes;
  }
};

namespace {

int64_t ElementsOf(const StorageInfo& storage) {
  const int64_t element_bytes = storage.dtype == c10::ScalarType::Undefined
                                    ? 1
                                    : static_cast<int64_t>(c10::elementSize(storage.dtype));
  return storage.size_bytes / element_bytes;
}

// Whether `s` is an activation autograd may hold, alive now, of at least `min_elements`
// elements (not persistent state).
bool IsSavedActivation(const StorageInfo& s, int64_t min_elements) {
  const bool activation =
      s.category == Category::kActivation || s.category == Category::kCommunication;
  return activation && !s.persistent && s.free_event < 0 && ElementsOf(s) >= min_elements;
}

// Those of the storages allocated from `first` on, other than `outputs`: what autograd holds.
std::vector<int64_t> ActivationsSavedSince(const Recorder& recorder, int64_t first,
                                           const std::vector<int64_t>& outputs,
                                           int64_t min_elements) {
  std::vector<int64_t> saved;
  const StorageTable storages = recorder.storages();
  for (int64_t id = first; id < static_cast<int64_t>(storages.size()); ++id) {
    if (IsSavedActivation(storages[static_cast<size_t>(id)], min_elements) &&
        std::find(outputs.begin(), outputs.end(), id) == outputs.end()) {
      saved.push_back(id);
    }
  }
  return saved;
}

// Evicts those of `ids` still alive: a reload whose tensors outlive its consumers, or saved
// tensors that something else still holds.
void EvictLive(Recorder& recorder, const std::vector<int64_t>& ids) {
  for (int64_t id : ids) {
    if (recorder.storages()[static_cast<size_t>(id)].free_event < 0) recorder.Evict(id);
  }
}

// TE's min_offloaded_tensor_size in cpu_offload.py (Note [Layer CPU offloading]).
constexpr int64_t kLayerOffloadMinElements = 256 * 1024;

}  // namespace

double HostLinkQueue::Queue(int64_t bytes, double ready_s) {
  const Recorder& recorder = *CurrentRecorder();
  if (recorder.gpu() == nullptr) return recorder.now_s();
  const double start = std::max({recorder.now_s(), ready_s, free_s_});
  free_s_ = start + HostCopySeconds(*recorder.gpu(), static_cast<double>(bytes));
  return free_s_;
}

void HostLinkQueue::WaitUntil(double done_s) {
  Recorder& recorder = *CurrentRecorder();
  if (done_s > recorder.now_s()) recorder.AdvanceClock(done_s - recorder.now_s());
}

ActivationOffloader::ActivationOffloader(const TrainingConfig& training) : training_(training) {}
ActivationOffloader::~ActivationOffloader() = default;

void ActivationOffloader::BeginIteration(int32_t iteration, std::vector<ChunkKey> backward_order) {
  iteration_ = iteration;
  backward_order_ = std::move(backward_order);
  backward_position_.clear();
  for (size_t i = 0; i < backward_order_.size(); ++i) backward_position_[backward_order_[i]] = i;
  backward_next_ = 0;
  chunks_.clear();
  in_forward_ = false;
  inflight_offloads_.clear();
}

void ActivationOffloader::BeginStep(bool forward, ChunkKey chunk) {
  if (in_forward_) chunks_[forward_chunk_].forward_done = true;
  in_forward_ = forward;
  if (forward) {
    forward_chunk_ = chunk;
    return;
  }
  // pop_backward_chunk: the queue's front moves past the chunk whose backward runs.
  auto it = backward_position_.find(chunk);
  if (it != backward_position_.end()) backward_next_ = std::max(backward_next_, it->second + 1);
}

void ActivationOffloader::EndIteration() {
  if (iteration_ != 0) return;
  // post_warmup_callback: for each name, the last group of that name in the first backward
  // chunk that has one stays on the device, for as many names as the most any chunk has.
  size_t margin = 0;
  for (const auto& [chunk, names] : registry_) {
    const std::set<OffloadModule> distinct(names.begin(), names.end());
    margin = std::max(margin, distinct.size());
  }
  std::vector<OffloadModule> order;  // the names as the callback's dict first meets them
  std::map<OffloadModule, std::pair<ChunkKey, size_t>> last_of_name;
  for (auto it = backward_order_.rbegin(); it != backward_order_.rend(); ++it) {
    auto found = registry_.find(*it);
    if (found == registry_.end()) continue;
    for (size_t i = 0; i < found->second.size(); ++i) {
      const OffloadModule name = found->second[i];
      if (last_of_name.count(name) == 0) order.push_back(name);
      last_of_name[name] = {*it, i};
    }
  }
  for (size_t i = 0; i < order.size() && i < margin; ++i) kept_.insert(last_of_name[order[i]]);
}

int64_t ActivationOffloader::FrontBackwardChunk(size_t from, const OffloadModule* module) const {
  for (size_t i = from; i < backward_order_.size(); ++i) {
    auto found = registry_.find(backward_order_[i]);
    if (found == registry_.end() || found->second.empty()) continue;
    if (module == nullptr ||
        std::find(found->second.begin(), found->second.end(), *module) != found->second.end()) {
      return static_cast<int64_t>(i);
    }
  }
  return -1;
}

bool ActivationOffloader::KeepsOnDevice(const OffloadGroup& group) const {
  if (iteration_ == 0) return false;  // warm-up offloads everything
  if (kept_.count({group.chunk, group.index}) > 0) return true;
  // The front of the backward queue keeps the last group of each name: it is needed next.
  const int64_t front = FrontBackwardChunk(backward_next_, &group.module);
  if (front < 0 || backward_order_[static_cast<size_t>(front)] != group.chunk) return false;
  const std::vector<OffloadModule>& names = registry_.at(group.chunk);
  MEMSIM_DCHECK(group.index < names.size());  // every iteration starts the same groups
  return std::find(names.begin() + static_cast<std::ptrdiff_t>(group.index) + 1, names.end(),
                   group.module) == names.end();
}

c10::intrusive_ptr<OffloadGroup> ActivationOffloader::StartGroup(OffloadModule module) {
  auto group = c10::make_intrusive<OffloadGroup>();
  group->owner = this;
  group->module = module;
  group->chunk = forward_chunk_;
  group->index = chunks_[forward_chunk_].started++;
  if (iteration_ == 0) registry_[forward_chunk_].push_back(module);
  return group;
}

void ActivationOffloader::Commit(const c10::intrusive_ptr<OffloadGroup>& group) {
  Recorder* recorder = CurrentRecorder();
  if (recorder == nullptr || KeepsOnDevice(*group)) return;
  group->offloaded = true;
  group->offloaded_s = host_link_.Queue(group->LinkBytes());
  // _drain_offload_pending: the compute stream waits for the name's older offloads.
  if (training_.max_inflight_offloads >= 0) {
    std::deque<double>& pending = inflight_offloads_[{group->chunk, group->module}];
    pending.push_back(group->offloaded_s);
    while (static_cast<int64_t>(pending.size()) > training_.max_inflight_offloads) {
      HostLinkQueue::WaitUntil(pending.front());
      pending.pop_front();
    }
  }
  for (const OffloadGroup::Saved& saved : group->saved) {
    if (saved.evict) recorder->Evict(saved.storage_id);
  }
  chunks_[group->chunk].to_reload.push_back(group);
}

void ActivationOffloader::Reload(OffloadGroup& group) {
  Recorder* recorder = CurrentRecorder();
  if (recorder == nullptr || !group.offloaded || group.reloaded) return;
  group.reloaded = true;
  group.reloaded_s = host_link_.Queue(group.LinkBytes(), group.offloaded_s);
  for (const OffloadGroup::Saved& saved : group.saved) {
    int copies = saved.copies;
    if (saved.restore) {
      const int64_t restored = recorder->Restore(saved.storage_id);
      if (restored < 0) {
        ++copies;  // its tensors are gone; the reload is a tensor of its own
      } else if (saved.forced) {
        group.restored_forced.push_back(restored);
      }
    }
    ModuleScope module(saved.module);
    CategoryScope category(Category::kActivation);
    for (int i = 0; i < copies; ++i) {
      group.copies.push_back(
          at::empty({saved.reload_bytes},
                    at::TensorOptions().device(recorder->device_type()).dtype(at::kByte)));
    }
  }
}

void ActivationOffloader::CommitBackward(OffloadGroup& group) {
  Reload(group);
  // The region's backward waits for its reload (Note [Offload copies on the clock]).
  if (CurrentRecorder() != nullptr && group.reloaded) HostLinkQueue::WaitUntil(group.reloaded_s);
}

void ActivationOffloader::StartBackward(OffloadGroup& group) {
  // The region's ops are done with its reloads: the forced inputs' go, as do the copies.
  group.copies.clear();
  if (Recorder* recorder = CurrentRecorder()) EvictLive(*recorder, group.restored_forced);
  group.restored_forced.clear();
  // bulk_reload: the top of this chunk's stack, else the next backward chunk's last group.
  ChunkState& chunk = chunks_[group.chunk];
  ChunkState* source = &chunk;
  if (chunk.to_reload.empty()) {
    const int64_t front = FrontBackwardChunk(backward_next_, nullptr);
    if (front < 0) return;
    auto next = chunks_.find(backward_order_[static_cast<size_t>(front)]);
    if (next == chunks_.end() || !next->second.forward_done || next->second.to_reload.empty()) {
      return;
    }
    source = &next->second;
  }
  c10::intrusive_ptr<OffloadGroup> popped = std::move(source->to_reload.back());
  source->to_reload.pop_back();
  Reload(*popped);
}

OffloadRegion::OffloadRegion(ActivationOffloader* offloader, OffloadModule module, at::Tensor* x) {
  if (offloader == nullptr || !offloader->Offloads(module) || CurrentRecorder() == nullptr) return;
  offloader_ = offloader;
  group_ = offloader->StartGroup(module);
  first_storage_ = static_cast<int64_t>(CurrentRecorder()->storages().size());
  // Its backward reloads the next group.
  *x = CallOnBackward(*x, [group = group_] { group->owner->StartBackward(*group); });
}

OffloadRegion::~OffloadRegion() = default;

void OffloadRegion::EndSaving(const std::vector<at::Tensor>& outputs, bool largest_saved_twice) {
  if (offloader_ == nullptr) return;
  MEMSIM_DCHECK(!saving_ended_);
  saving_ended_ = true;
  const Recorder& recorder = *CurrentRecorder();
  std::vector<int64_t> output_ids;
  for (const at::Tensor& t : outputs) {
    output_ids.push_back(TrackingAllocator::StorageIdOf(t, recorder));
  }
  std::optional<size_t> largest;  // an index: saved grows
  for (int64_t id : ActivationsSavedSince(recorder, first_storage_, output_ids,
                                          offloader_->min_offloaded_tensor_elements())) {
    const StorageInfo& s = recorder.storages()[static_cast<size_t>(id)];
    group_->saved.push_back({id, s.size_bytes, s.module, /*copies=*/0, /*evict=*/true,
                             /*restore=*/true, /*forced=*/false});
    if (!largest || s.size_bytes > group_->saved[*largest].reload_bytes) {
      largest = group_->saved.size() - 1;
    }
  }
  if (largest_saved_twice && largest) group_->saved[*largest].copies = 1;
}

void OffloadRegion::Commit(at::Tensor* y, const std::vector<ForcedRelease>& forced) {
  if (offloader_ == nullptr) return;
  MEMSIM_DCHECK(saving_ended_);
  const Recorder& recorder = *CurrentRecorder();
  for (const ForcedRelease& f : forced) {
    const int64_t id = TrackingAllocator::StorageIdOf(f.tensor, recorder);
    // tensor_need_offloading_checker: the tensor's own elements decide.
    if (id < 0 || recorder.storages()[static_cast<size_t>(id)].free_event >= 0 ||
        f.tensor.numel() < offloader_->min_offloaded_tensor_elements()) {
      continue;
    }
    const StorageInfo& s = recorder.storages()[static_cast<size_t>(id)];
    // A view covering less than half its storage is copied (and reloaded) at its own size;
    // the forced release frees the whole storage either way.
    const int64_t view_bytes = CheckedMul(f.tensor.numel(), f.tensor.element_size());
    const bool whole = 2 * view_bytes >= s.size_bytes;
    const bool first =
        std::none_of(group_->saved.begin(), group_->saved.end(),
                     [id](const OffloadGroup::Saved& e) { return e.storage_id == id; });
    const bool restore = first && whole && !f.regenerated;
    group_->saved.push_back({id, whole ? s.size_bytes : view_bytes, s.module,
                             /*copies=*/restore ? f.saves - 1 : f.saves, /*evict=*/first, restore,
                             /*forced=*/true});
  }
  offloader_->Commit(group_);
  // Its backward waits for the group's reload, which memsim makes there when nothing
  // prefetched it.
  *y = CallOnBackward(*y, [group = group_] { group->owner->CommitBackward(*group); });
}

LayerCpuOffloader::LayerCpuOffloader(int64_t layers, int64_t offloaded)
    : layers_(layers), offloaded_(offloaded) {
  MEMSIM_DCHECK(0 < offloaded && offloaded < layers);
}

at::Tensor LayerCpuOffloader::RunLayer(int64_t index, const at::Tensor& x,
                                       const std::function<at::Tensor(const at::Tensor&)>& run) {
  Recorder* recorder = CurrentRecorder();
  if (recorder == nullptr || !at::GradMode::is_enabled()) return run(x);
  if (index == 0) state_.assign(static_cast<size_t>(offloaded_), LayerState());
  // fwd_step: the layer L - N layers back has finished its copy; its memory goes now.
  const int64_t done = index - (layers_ - offloaded_);
  if (done >= 0 && done < offloaded_) {
    const LayerState& layer = state_[static_cast<size_t>(done)];
    HostLinkQueue::WaitUntil(layer.offloaded_s);
    EvictLive(*recorder, layer.saved);
  }
  const int64_t first = static_cast<int64_t>(recorder->storages().size());
  at::Tensor y = run(x);
  if (index < offloaded_) {
    // What the layer allocated and autograd holds, and its input (its first op saves it).
    const int64_t output = TrackingAllocator::StorageIdOf(y, *recorder);
    const int64_t input = TrackingAllocator::StorageIdOf(x, *recorder);
    LayerState& layer = state_[static_cast<size_t>(index)];
    layer.saved = ActivationsSavedSince(*recorder, first, {output}, kLayerOffloadMinElements);
    if (input >= 0 && input != output &&
        IsSavedActivation(recorder->storages()[static_cast<size_t>(input)],
                          kLayerOffloadMinElements)) {
      layer.saved.insert(layer.saved.begin(), input);
    }
    // The next layer's fwd_step queues the copies: this layer's ops are done.
    for (int64_t id : layer.saved) {
      layer.bytes =
          CheckedAdd(layer.bytes, recorder->storages()[static_cast<size_t>(id)].size_bytes);
    }
    layer.offloaded_s = host_link_.Queue(layer.bytes);
  }
  return CallOnBackward(y, [this, index] { BackwardStep(index); });
}

void LayerCpuOffloader::BackwardStep(int64_t index) {
  Recorder* recorder = CurrentRecorder();
  if (recorder == nullptr || state_.empty()) return;
  // The reloads of the layer after this one are done with.
  if (index + 1 < offloaded_) {
    EvictLive(*recorder, state_[static_cast<size_t>(index + 1)].restored);
    state_[static_cast<size_t>(index + 1)].restored.clear();
  }
  // The layer L - 1 - N layers ahead of this one's backward comes back.
  const int64_t reload = index - (layers_ - 1 - offloaded_);
  if (reload >= 0 && reload < offloaded_) {
    LayerState& layer = state_[static_cast<size_t>(reload)];
    for (int64_t id : layer.saved) {
      const int64_t restored = recorder->Restore(id);
      if (restored >= 0) layer.restored.push_back(restored);
    }
    layer.reloaded_s = host_link_.Queue(layer.bytes, layer.offloaded_s);
  }
  // Its backward unpacks its saved tensors: it waits for their reload.
  if (index < offloaded_) HostLinkQueue::WaitUntil(state_[static_cast<size_t>(index)].reloaded_s);
}

}  // namespace memsim
