// Note [FP8 kernels on the clock]: what a Transformer Engine FP8 linear's quantizations
// cost the virtual clock.
#include "models/fp8.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <limits>

#include "simulator/cost_model.h"
#include "simulator/session.h"

namespace memsim {
namespace {

// A GPU whose GEMMs and host cost nothing and whose memory moves 1 byte a second: the
// clock counts the bytes memory-bound kernels move.
GpuSpec OneBytePerSecondGpu() {
  GpuSpec gpu = *FindGpu("H100");
  gpu.half_flops = gpu.fp32_flops = std::numeric_limits<double>::infinity();
  gpu.bandwidth_bytes_per_s = 1;
  gpu.bandwidth_efficiency = 1;
  gpu.min_op_s = gpu.module_call_s = 0;
  return gpu;
}

// The forward of a [M, K] x [N, K]^T FP8 linear (no bias, no parallelism) on that GPU: one
// quantization of the bf16 input both ways, then the GEMM (free here). The cast reads the
// 2MK input bytes and writes MK bytes of data, MK of transpose and a 4-byte fp32
// scale_inv; current scaling's amax reads the input once more.
double ForwardClock(const GpuSpec& gpu, Fp8Recipe recipe, int64_t M, int64_t K, int64_t N) {
  Session session(&gpu);
  ActiveSession active(session);
  TrainingConfig training;
  training.precision = Precision::kBf16;
  training.fp8 = recipe;
  ParameterStore store(Precision::kBf16);
  Parameter* weight = store.Add("fc.weight", {N, K});
  MakeFp8Weight(weight, training);
  const at::Tensor x =
      at::empty({M, K}, at::TensorOptions().device(at::kMeta).dtype(at::kBFloat16));
  const double before = session.recorder().now_s();
  const at::Tensor y = Fp8Linear(x, *weight, nullptr, LinearParallelism(), Fp8LinearOptions());
  return session.recorder().now_s() - before;
}

TEST(Fp8Clock, AQuantizationMovesItsInputAndItsOutputs) {
  const int64_t M = 64, K = 32, N = 16;
  const GpuSpec gpu = OneBytePerSecondGpu();
  EXPECT_DOUBLE_EQ(ForwardClock(gpu, Fp8Recipe::kDelayed, M, K, N), 2 * M * K + 2 * M * K + 4);
  EXPECT_DOUBLE_EQ(ForwardClock(gpu, Fp8Recipe::kTensorwise, M, K, N),
                   2 * 2 * M * K + 2 * M * K + 4);
}

// On a host-bound GPU (1 s an op, kernels free) the forward is two ops, whatever the recipe:
// the quantize call, whose kernels Transformer Engine launches from C++, and the GEMM.
TEST(Fp8Clock, AQuantizationIsOneOpOfTheHost) {
  GpuSpec gpu = *FindGpu("H100");
  gpu.half_flops = gpu.fp32_flops = gpu.bandwidth_bytes_per_s =
      std::numeric_limits<double>::infinity();
  gpu.min_op_s = 1;
  gpu.module_call_s = 0;
  EXPECT_DOUBLE_EQ(ForwardClock(gpu, Fp8Recipe::kDelayed, 64, 32, 16), 2);
  EXPECT_DOUBLE_EQ(ForwardClock(gpu, Fp8Recipe::kTensorwise, 64, 32, 16), 2);
}

}  // namespace
}  // namespace memsim
