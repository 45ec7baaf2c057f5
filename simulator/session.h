// Session: the API that code driving a simulated training step talks to.
//
//   memsim::RegisterOps();                           // ops/ops.h: kernels the model needs
//   memsim::Session session(memsim::FindGpu("H100-80GB"));
//   {
//     memsim::ActiveSession active(session);       // this thread is now recorded
//     { memsim::CategoryScope params(Category::kParameter); /* build parameters */ }
//     for (int it = 0; it < 2; ++it) {
//       session.BeginIteration(it);                // static memory is read here
//       session.SetPhase(Phase::kForward);
//       { memsim::ModuleScope layer("layers.0"); /* forward ops */ }
//       session.SetPhase(Phase::kBackward);  loss.backward();
//       session.SetPhase(Phase::kOptimizer); /* optimizer step */
//       session.EndIteration();
//     }
//   }
//   Timeline timeline = Timeline::Replay(session.recorder(), ...);
//
// Scopes (ModuleScope, CategoryScope) act on the thread's active session and do nothing
// without one, so model code can use them unconditionally.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <string_view>

#include "simulator/attribution.h"
#include "simulator/cost_model.h"
#include "simulator/interceptor.h"
#include "simulator/recorder.h"

namespace memsim {

class Session {
 public:
  // `gpu` drives the virtual clock; null: every event has timestamp 0. `device_type` is
  // the device whose storages are recorded (CPU only in tests against real execution).
  // Installs the tracking allocator and the interceptor; the operators and kernels of
  // ops/ are registered by their own layer (RegisterOps in ops/ops.h).
  explicit Session(const GpuSpec* gpu = nullptr,
                   c10::DeviceType device_type = c10::DeviceType::Meta);
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  // Static memory of the iteration is the allocated memory at this point.
  // REQUIRES: iterations begin in increasing order, each after the previous one ended.
  void BeginIteration(int32_t iteration);
  void EndIteration();
  void SetPhase(Phase phase) { recorder_.SetPhase(phase); }
  // torch.cuda.empty_cache() here: allocated memory is unchanged, reserved memory drops
  // by the cached segments no block uses (Note [Allocator replay]).
  void EmptyCache() { recorder_.AddMarker(MarkerKind::kEmptyCache); }
  void SetMicrobatch(int32_t microbatch) { recorder_.SetMicrobatch(microbatch); }
  // Re-categorizes the storage behind `tensor` if this session tracked it.
  void Retag(const at::Tensor& tensor, Category category);

  Recorder& recorder() { return recorder_; }
  const Recorder& recorder() const { return recorder_; }
  const GpuSpec* gpu() const { return gpu_; }

 private:
  const GpuSpec* gpu_;
  Recorder recorder_;
};

// Records everything this thread allocates into `session` while alive. Nestable; the
// innermost wins. Not copyable or movable.
//
// `attribute_ops` false skips the dispatcher interceptor: allocations are still tracked
// with their sizes, module and phase, but not their op, backward module or time (the
// cheapest mode; benchmarks compare the two).
class ActiveSession {
 public:
  explicit ActiveSession(Session& session, bool attribute_ops = true)
      : current_(&session.recorder()) {
    if (attribute_ops) intercept_.emplace();
  }
  ActiveSession(const ActiveSession&) = delete;
  ActiveSession& operator=(const ActiveSession&) = delete;

 private:
  ScopedCurrentRecorder current_;
  std::optional<InterceptionGuard> intercept_;
};

// Names the module whose code runs inside it; paths nest ("layers.0" then "attn" gives
// "layers.0.attn").
class ModuleScope {
 public:
  explicit ModuleScope(std::string_view child_name);
  // Enters `path` from the top level, whatever is current (rank-wide buffers).
  struct Absolute {
    std::string_view path;
  };
  explicit ModuleScope(Absolute path);
  // Re-enters a module by its absolute id, as recomputation in backward does.
  explicit ModuleScope(NameId absolute_module);
  ~ModuleScope();
  ModuleScope(const ModuleScope&) = delete;
  ModuleScope& operator=(const ModuleScope&) = delete;

  // The current module of this thread's session (0 with none).
  static NameId Current();
  // Its path ("" at the top level or with no session).
  static std::string CurrentPath();

 private:
  Recorder* recorder_;
};

// Gives every storage allocated inside it `category` (Note [Memory categories]).
class CategoryScope {
 public:
  explicit CategoryScope(Category category);
  ~CategoryScope();
  CategoryScope(const CategoryScope&) = delete;
  CategoryScope& operator=(const CategoryScope&) = delete;

 private:
  Recorder* recorder_;
};

// Marks what is allocated inside it as persistent state (Recorder::PushPersistent,
// StorageInfo::persistent): it counts whatever CUDA graphs' mode (Note [CUDA graphs] in
// parallel/cuda_graphs.h), and offloading never takes it for a saved tensor.
class PersistentScope {
 public:
  PersistentScope();
  ~PersistentScope();
  PersistentScope(const PersistentScope&) = delete;
  PersistentScope& operator=(const PersistentScope&) = delete;

 private:
  Recorder* recorder_;
};

// A region Transformer Engine's CUDA graphs capture (Note [CUDA graphs] in
// parallel/cuda_graphs.h): what it and its backward allocate counts only while capturing.
// Inactive (no effect) when `active` is false.
class GraphedScope {
 public:
  explicit GraphedScope(bool active);
  ~GraphedScope();
  GraphedScope(const GraphedScope&) = delete;
  GraphedScope& operator=(const GraphedScope&) = delete;

 private:
  Recorder* recorder_;
};

// Note [Stand-in kernels]
// The model often stands for a kernel by allocating its output with at::empty (a sort, a
// scan, an index_select, a masked_select): memory needs the output, not the work.
// The virtual clock charges nothing for an allocation, but the real run launches the
// kernel, and on host-bound runs each launch costs the host's time per op (Note [Virtual
// clock] in cost_model.h). Inside a StandInKernelScope each allocation-only op (empty,
// empty_like, empty_strided) is charged as one memory-bound kernel writing its output.
// Open one only where every at::empty stands for one kernel's output, not for a buffer a
// charged op then fills.
class StandInKernelScope {
 public:
  StandInKernelScope();
  ~StandInKernelScope();
  StandInKernelScope(const StandInKernelScope&) = delete;
  StandInKernelScope& operator=(const StandInKernelScope&) = delete;

 private:
  Recorder* recorder_;
};

// Ops whose host time the fitted min_op_s already holds (Note [Virtual clock] in
// cost_model.h): every run it was fitted to ran them while memsim did not, so their host
// time went into the other ops' share. Inside a KernelTimeOnlyScope an op costs its
// kernel's time only.
class KernelTimeOnlyScope {
 public:
  KernelTimeOnlyScope();
  ~KernelTimeOnlyScope();
  KernelTimeOnlyScope(const KernelTimeOnlyScope&) = delete;
  KernelTimeOnlyScope& operator=(const KernelTimeOnlyScope&) = delete;

 private:
  Recorder* recorder_;
};

// Ops the real run launches that the model does not run, because they change no memory it
// tracks (counts summed on the GPU, device-to-host copies, a host sync): each costs the
// host's time per op (Note [Virtual clock] in cost_model.h). Called where the model meets
// them in forward, it charges `forward_ops` and, unless this forward is a recomputation
// (the recorder is in backward), whose backward share was charged when it first ran,
// `backward_ops` too. No effect without an active session with a GPU, or inside a CUDA
// graph's replay.
void ChargeUnmodelledOps(int64_t forward_ops, int64_t backward_ops);

// One memory-bound kernel the model stands for without running it, whose outputs (if any)
// it allocates apart (Transformer Engine's quantization kernels, Note [FP8 kernels on the
// clock] in models/fp8.h): it moves `bytes` (read and written) and costs the host's time
// per op at least, or the kernel alone in a CUDA graph's replay. No effect without an
// active session with a GPU. REQUIRES: bytes >= 0.
void ChargeMemoryBoundKernel(double bytes);

// `calls` calls of Transformer Engine modules (a linear, a norm, attention, a grouped
// linear): their Python around the kernels (argument checks, FP8 state, the autograd
// function's forward and backward) costs the host GpuSpec::module_call_s each beyond their
// ops (Note [Virtual clock]), charged at the forward; a recomputation charges half, the
// forward's share taken as half. No effect without an active session with a GPU, or
// inside a CUDA graph's replay. REQUIRES: calls >= 0.
void ChargeModuleCalls(int64_t calls);

}  // namespace memsim
