// Fine-grained activation offloading: what Megatron-Core's saved-tensor hooks copy to the
// host between a region's forward and its backward, and when the bytes come back.
//
// Note [Fine-grained activation offloading]
// Megatron-Core 0.20 (pipeline_parallel/fine_grained_activation_offload.py; the reading,
// with file and line for each rule, is docs/source-notes/fine-grained-activation-
// offloading.md) wraps each region of --offload-modules as
//     with off_interface(flag, x, name) as x: ...ops...
//     y = manager.group_offload(y, forced_released_tensors=[...])
// Every tensor autograd saves inside the `with` block goes to the region's group. At the
// commit (group_offload) the group's tensors of at least --min-offloaded-tensor-size
// elements are copied to the host and their device memory is gone: allocated memory drops
// at once (the caching allocator frees on the free call; record_stream only delays reuse).
// The forced-released tensors (the region's inputs) are resized to 0 bytes then too.
// In backward each region's start node reloads one group (bulk_reload): the top of its
// chunk's stack of offloaded groups, or, when that is empty, the top of the next backward
// chunk's (once that chunk's forward is complete). A reload is a new device tensor that
// lives until its consumer is done with it; a group not reloaded ahead is reloaded when
// its tensors are unpacked, which memsim places at the group's commit in backward.
// Which groups stay on the device (should_bulk_offload): none in the first iteration
// (warm-up); afterwards the last group of each name in the first backward chunk that has
// it (post_warmup_callback's margin), and the last group of each name of a chunk that is
// the front of the backward queue when it runs forward. So from the second iteration on a
// rank keeps one layer's regions and reloads one layer ahead.
//
// What memsim models and how:
//   - A region's saved tensors are its forced-released inputs (named by the layer, with how
//     many of its ops save each: a duplicated save is a second host copy and a second
//     reload) and every activation storage allocated inside the `with` block and alive at
//     its end other than the block's outputs (what autograd holds), each saved once unless
//     the region says its largest is saved twice (eager attention's probabilities, saved
//     by the softmax and by the bmm).
//   - Offloading evicts each storage (Recorder::Evict): its free is recorded while the
//     tensors that stand for it stay usable on meta.
//   - A reload restores the storage (Recorder::Restore), freed where its tensors die, as
//     without offloading; a forced-released input is evicted again at the region's start
//     node in backward (its reload lived until the region's ops were done). Extra saves and
//     inputs that recomputation regenerates (the norm output of --recompute-modules
//     layernorm, multi-latent attention's up projections under mla_up_proj) reload into new
//     tensors, kept until the region's start node in backward; so does an input viewing
//     less than half its storage, at its own size (Megatron copies such a view alone, and
//     the forced release frees the whole storage).
// Persistent storages (PersistentScope: a grown global buffer) are never taken for saved
// tensors. Not modelled: the per-stream pools of the reload stream (reserved memory, not
// allocated), the .contiguous() copies of saved views covering less than half their storage
// (for the tensors found by scanning, the threshold applies to a storage's elements, not a
// view's), and the pinned host memory. The three CI runs with offloading read 4.5-6.5% low at
// the peak (validation/tolerances.yaml): 300-500 MiB not identified without a GPU trace.
//
// Note [Offload copies on the clock]
// The copies run on streams of their own (PipelineOffloadManager's d2h_stream and
// h2d_stream), in issue order, at the host link's rate (HostCopySeconds in
// simulator/cost_model.h), and the compute stream waits only where Megatron-Core makes it:
//   - a group's offload is issued at its commit (on_group_commit_forward: the D2H stream
//     waits for compute first);
//   - a reload is issued where memsim reloads (the region's start node in backward
//     prefetches the next group, after the H2D stream waits for compute; or the group's
//     commit in backward when nothing prefetched it) and waits for the group's offload
//     (its offload event);
//   - the compute stream waits for a group's reload at its commit in backward
//     (on_group_commit_backward waits on the reload event), just before the region's
//     backward uses it: memsim advances the rank's clock to the reload's end there.
// Both directions share one queue: every GPU of the node copies at once, and the host
// memory's bandwidth per GPU is about one direction of its link (a DGX H100 socket's
// DDR5, about 280 GB/s, feeds four GPUs with 64 GB/s PCIe links; a Grace's 512 GB/s two
// GPUs sharing 450 GB/s of NVLink-C2C a direction), so the reloads wait for the offloads
// still queued. A save copied twice (Saved::copies) crosses twice each way. So the
// prefetch hides a reload behind one region's backward at most, and a forward that
// offloads faster than the link copies pushes its copies into the backward: with the CI
// runs' 36 GB a rank, iteration and direction, the copies, not the kernels, set the step
// on H100 (memsim read -75% and -78% with them free, -8% and -14% so; -33% and -37% with a
// queue per direction); on GB200, at 3.5 times the rate, they mostly hide behind the
// kernels (-40% -> -37%, a timing recorded in January 2026 and not explained). Not charged:
// the copies' host time (a few ops a group), the pinned host allocations, which PyTorch's
// host allocator caches after the first use. With
// --fine-grained-offloading-max-inflight-offloads K (unset by default and in the CI runs)
// each commit makes the compute stream wait for the offloads of the group's name in its
// chunk beyond the K newest (ChunkOffloadHandler._drain_offload_pending). Transformer Engine's
// layer offloading (Note [Layer CPU offloading]) copies on one stream the same way.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <set>
#include <utility>
#include <vector>

#include "models/model_config.h"

namespace memsim {

class OffloadGroup;

// One rank's copies between the GPU and pinned host memory, both directions in one queue in
// issue order (Note [Offload copies on the clock]). Used by one thread (the rank's).
class HostLinkQueue {
 public:
  // Queues a copy of `bytes`, which starts no earlier than `ready_s` and the rank's clock;
  // returns when it ends. The clock's time when no GPU is set.
  double Queue(int64_t bytes, double ready_s = 0.0);
  // The compute stream waits for a copy that ends at `done_s`: the rank's clock moves there.
  static void WaitUntil(double done_s);

 private:
  double free_s_ = 0.0;  // when the copies queued so far end, on the rank's virtual clock
};

// The offloading state of one rank: its chunk handlers, the backward queue, and what the
// warm-up iteration registered. Used by one thread (the rank's).
class ActivationOffloader {
 public:
  // A microbatch-chunk of the pipeline schedule: (microbatch, model chunk).
  using ChunkKey = std::pair<int64_t, int64_t>;

  explicit ActivationOffloader(const TrainingConfig& training);
  ~ActivationOffloader();  // where OffloadGroup is complete
  ActivationOffloader(const ActivationOffloader&) = delete;
  ActivationOffloader& operator=(const ActivationOffloader&) = delete;

  bool Offloads(OffloadModule module) const { return training_.Offloads(module); }

  // --- Driven by the rank's training loop. ---
  // Before an iteration's schedule runs: the chunks in the order their backward steps run.
  void BeginIteration(int32_t iteration, std::vector<ChunkKey> backward_order);
  // Before each step of the schedule.
  void BeginStep(bool forward, ChunkKey chunk);
  // After the schedule: the first iteration's registry decides what stays on the device.
  void EndIteration();

  // --- Driven by OffloadRegion and the nodes it inserts. ---
  // REQUIRES: BeginIteration ran; StartGroup inside a forward step (BeginStep).
  c10::intrusive_ptr<OffloadGroup> StartGroup(OffloadModule module);
  void Commit(const c10::intrusive_ptr<OffloadGroup>& group);
  void CommitBackward(OffloadGroup& group);
  void StartBackward(OffloadGroup& group);
  int64_t min_offloaded_tensor_elements() const { return training_.min_offloaded_tensor_elements; }

 private:
  struct ChunkState {
    size_t started = 0;                                       // groups started this iteration
    std::vector<c10::intrusive_ptr<OffloadGroup>> to_reload;  // offloaded, not yet popped, in
                                                              // commit order
    bool forward_done = false;
  };
  bool KeepsOnDevice(const OffloadGroup& group) const;
  // The first chunk at or after `from` in the backward order that registered `module`
  // (any module when null); -1 when none.
  int64_t FrontBackwardChunk(size_t from, const OffloadModule* module) const;
  void Reload(OffloadGroup& group);

  const TrainingConfig& training_;
  int32_t iteration_ = 0;
  std::vector<ChunkKey> backward_order_;
  std::map<ChunkKey, size_t> backward_position_;
  size_t backward_next_ = 0;  // the backward queue's front: first chunk not yet in backward
  std::map<ChunkKey, ChunkState> chunks_;
  ChunkKey forward_chunk_{-1, -1};
  bool in_forward_ = false;
  // The first iteration's group names per chunk, in start order (the warm-up registry).
  std::map<ChunkKey, std::vector<OffloadModule>> registry_;
  // (chunk, index in its start order) of the groups post_warmup_callback keeps.
  std::set<std::pair<ChunkKey, size_t>> kept_;
  HostLinkQueue host_link_;
  // Per chunk and name (a ChunkOffloadHandler's FIFO), when the offloads the compute stream
  // has not waited for end, oldest first (TrainingConfig::max_inflight_offloads).
  std::map<std::pair<ChunkKey, OffloadModule>, std::deque<double>> inflight_offloads_;
};

// A tensor a region hands to group_offload's forced_released_tensors.
struct ForcedRelease {
  at::Tensor tensor;
  int saves = 1;             // how many of the region's ops save it
  bool regenerated = false;  // recomputation in backward restores its storage itself
};

// One offloaded region, as the layers write it:
//     OffloadRegion region(offloader, OffloadModule::kCoreAttn, &q);  // with ... as q
//     ... ops ...
//     region.EndSaving({context});                                    // end of the block
//     region.Commit(&context, {{q}, {k}, {v}});                       // group_offload
// Every call is a no-op when `offloader` is null or does not offload `module`.
class OffloadRegion {
 public:
  // Passes *x through the group's start node, whose backward reloads the next group.
  OffloadRegion(ActivationOffloader* offloader, OffloadModule module, at::Tensor* x);
  ~OffloadRegion();  // where OffloadGroup is complete
  OffloadRegion(const OffloadRegion&) = delete;
  OffloadRegion& operator=(const OffloadRegion&) = delete;

  // The end of the `with` block: the activations allocated since the start and alive now,
  // but not `outputs`, are what the block's ops saved. `largest_saved_twice`: the largest
  // of them is saved by two ops.
  // REQUIRES: called once.
  void EndSaving(const std::vector<at::Tensor>& outputs, bool largest_saved_twice = false);
  // group_offload: offloads the group unless policy keeps it, and passes *y through the
  // commit node, whose backward reloads the group if nothing did before.
  // REQUIRES: EndSaving ran.
  void Commit(at::Tensor* y, const std::vector<ForcedRelease>& forced);
  // Whether the region offloads (the offloader offloads its module).
  bool active() const { return offloader_ != nullptr; }

 private:
  ActivationOffloader* offloader_ = nullptr;  // null: inactive
  bool saving_ended_ = false;
  c10::intrusive_ptr<OffloadGroup> group_;
  int64_t first_storage_ = 0;
};

// Note [Layer CPU offloading]
// --cpu-offloading-num-layers N (Megatron-Core 0.20's TransformerBlock over Transformer
// Engine 2.18's get_cpu_offload_context, the default v2 implementation of cpu_offload.py;
// Megatron-LM allows it only without pipeline parallelism or recomputation): the first N of
// the block's L layers are offloaded, each microbatch. Every tensor autograd saves in such a
// layer with at least 256K elements, other than parameters, goes to the host; its device
// memory goes when layer L - N + i starts (the offload has finished by then), so at most
// L - N layers' activations are on the device. In backward layer i comes back (new device
// tensors) when layer L - 1 - N + i's backward starts, and goes when layer i - 1's starts.
// memsim takes a layer's saved tensors as its input and the activations it allocated that
// are alive when it ends, other than its output (as OffloadRegion does), evicts them then
// and restores them (Recorder::Evict, Restore); what is still alive of a reload when the
// next layer's backward starts is evicted again. No device buffers are kept (v2).
// The copies run on TE's one offload stream (Note [Offload copies on the clock]): layer i's
// offload is queued when layer i + 1 starts, layer L - N + i waits for it to end
// (release_activation_forward_gpu_memory), layer i's reload is queued when layer
// L - 1 - N + i's backward starts and layer i's backward waits for it (pop_tensor).
class LayerCpuOffloader {
 public:
  // `layers`: the block's L; `offloaded`: N. REQUIRES: 0 < N < L.
  LayerCpuOffloader(int64_t layers, int64_t offloaded);
  LayerCpuOffloader(const LayerCpuOffloader&) = delete;
  LayerCpuOffloader& operator=(const LayerCpuOffloader&) = delete;

  // Runs layer `index` (0-based in the block) of the current microbatch's forward on `x`.
  // REQUIRES: the block's layers run in order, one microbatch's forward after the other's
  // backward (no pipeline).
  at::Tensor RunLayer(int64_t index, const at::Tensor& x,
                      const std::function<at::Tensor(const at::Tensor&)>& run);
  // The start of layer `index`'s backward (TE's bwd_step), from the node RunLayer adds.
  void BackwardStep(int64_t index);

 private:
  struct LayerState {
    std::vector<int64_t> saved;     // storage ids, evicted when a later layer starts
    std::vector<int64_t> restored;  // what their reloads restored
    int64_t bytes = 0;              // the saved storages' bytes, copied each way
    double offloaded_s = 0.0;       // when the offload ends
    double reloaded_s = 0.0;        // when the reload ends
  };
  int64_t layers_, offloaded_;
  HostLinkQueue host_link_;
  std::vector<LayerState> state_;  // this microbatch's, per offloaded layer
};

}  // namespace memsim
