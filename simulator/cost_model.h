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
//   * plus kernel_launch_s for every op that is not free.
// The efficiencies are typical achieved fractions of peak for large transformer kernels;
// the aim is a timeline with the shape and roughly the duration of a real one, not a
// performance prediction. Collectives are charged as memory-bound ops on their buffers.
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
  int compute_capability;  // major * 10 + minor: 80 (A100), 90 (H100, H200)
  double half_flops;       // dense bf16/fp16 tensor-core peak, FLOP/s
  double fp32_flops;       // dense fp32 peak (no TF32), FLOP/s
  double bandwidth_bytes_per_s;
  // Links, per GPU and direction (Note [Communication time] in parallel/step_time.h):
  // NVLink inside a node, the GPU's network adapter between nodes.
  double nvlink_bytes_per_s;
  double network_bytes_per_s;
  int64_t gpus_per_node = 8;
  double matmul_efficiency = 0.6;
  double bandwidth_efficiency = 0.7;
  double kernel_launch_s = 3e-6;
  double link_efficiency = 0.8;  // NCCL's bus bandwidth as a fraction of the link's

  // What the caching allocator can reserve before cudaMalloc fails.
  int64_t usable_bytes() const { return memory_bytes - context_bytes; }
};

// Looks up a preset by name, case-insensitively ("H100-80GB", "h100"...). Null if unknown.
const GpuSpec* FindGpu(std::string_view name);
const std::vector<GpuSpec>& GpuPresets();
// "A100-80GB, H100-80GB, H200-141GB": for error messages and --help.
std::string GpuPresetNames();

enum class OpCostKind : uint8_t { kFree, kMatmul, kMemoryBound };

double MatmulSeconds(const GpuSpec& gpu, double flops, bool half_precision);
double MemoryBoundSeconds(const GpuSpec& gpu, double bytes);

}  // namespace memsim
