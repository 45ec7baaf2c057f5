// The virtual clock's cost model and the GPU presets it uses.
//
// Note [Virtual clock]
// Real traces plot memory against wall time, so every simulated event gets a timestamp
// from a deliberately simple roofline-style model, charged once per op the interceptor
// sees (ops a composite op decomposes into are charged with it):
//   * matrix multiplies (mm, bmm, addmm, baddbmm, addbmm, matmul, linear, fused attention):
//       seconds = FLOPs / (peak_flops(dtype) * matmul_efficiency)
//     with FLOPs = 2 * numel(A) * columns(B) for the last two tensor arguments A, B
//     (linear: 2 * numel(input) * rows(weight); attention: from q's shape);
//   * views and allocation-only ops (empty, view, transpose, ...): free;
//   * every other op (elementwise, reductions, copies, optimizer updates):
//       seconds = (bytes read + bytes written) / (memory_bandwidth * bandwidth_efficiency)
//   * and no op that is not free takes less than min_op_s.
// The efficiencies are typical achieved fractions of peak for large transformer kernels.
// min_op_s is the host's side: Megatron-LM issues its kernels from Python (module code,
// hooks, the dispatcher, the launch), and a GPU cannot run ahead of the host that feeds it,
// so a small op costs the host's time, not the kernel's. It is the one fitted constant,
// per host platform (GpuPresets): against the iteration times of Megatron-LM's functional
// tests (validation/) on 67 H100 cases, 80 us per op the interceptor sees took the median
// |error| from 84.7% (3 us added per launch) to 18.9%. Refitted on 213 cases in steps of
// 5 us: H100 85 us (76 cases, median 16.2%; even and odd halves 15.1% and 17.3%), GB200
// 100 us (74 two-node cases, 14.8%; 23.8% at 80 us), A100 125 us (9 cases, 7.3%; 31.3% at
// 80 us); GB200's single-node runs take about 5 times memsim's time and 7 times their
// two-node twins', which no GPU work explains, and are left out of the fit (VALIDATION.md).
// It stands for every kernel and Python step around an ATen op that memsim does not see,
// so it is per intercepted op, not per real kernel.
// Collectives are charged as memory-bound ops on their buffers.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace memsim {

struct GpuSpec {
  std::string name;
  int64_t memory_bytes;    // total device memory as nvidia-smi reports it
  int64_t context_bytes;   // taken by the CUDA context and NCCL before PyTorch allocates
  int compute_capability;  // major * 10 + minor: 80 (A100), 90 (H100, H200), 100 (B200), 103
  double half_flops;       // dense bf16/fp16 tensor-core peak, FLOP/s
  double fp32_flops;       // dense fp32 peak (no TF32), FLOP/s
  double bandwidth_bytes_per_s;
  // Links, per GPU and direction (Note [Communication time] in parallel/step_time.h):
  // NVLink inside a node, the GPU's network adapter between nodes.
  double nvlink_bytes_per_s;
  double network_bytes_per_s;
  int64_t gpus_per_node = 8;  // GPUs one NVLink domain joins: a node (a GB200 NVL72 rack: 72)
  double matmul_efficiency = 0.6;
  double bandwidth_efficiency = 0.7;
  double min_op_s = 85e-6;       // Note [Virtual clock]: the host's time per op, fitted
  double link_efficiency = 0.8;  // NCCL's bus bandwidth as a fraction of the link's

  // What the caching allocator can reserve before cudaMalloc fails.
  int64_t usable_bytes() const { return memory_bytes - context_bytes; }
};

// Looks up a preset by name, case-insensitively ("H100-80GB", "h100"...). Null if unknown.
const GpuSpec* FindGpu(std::string_view name);
const std::vector<GpuSpec>& GpuPresets();
// "A100-80GB, H100-80GB, ...": for error messages and --help.
std::string GpuPresetNames();

enum class OpCostKind : uint8_t { kFree, kMatmul, kMemoryBound };

double MatmulSeconds(const GpuSpec& gpu, double flops, bool half_precision);
double MemoryBoundSeconds(const GpuSpec& gpu, double bytes);

}  // namespace memsim
