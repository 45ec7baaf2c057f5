// What the virtual clock charges (Note [Virtual clock] in cost_model.h), op by op: copies
// that may be views, stand-in kernels (Note [Stand-in kernels] in session.h), the ops the
// model does not run and Transformer Engine's module calls.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "simulator/cost_model.h"
#include "simulator/session.h"

namespace memsim {
namespace {

at::TensorOptions MetaFloat() { return at::TensorOptions().device(at::kMeta).dtype(at::kFloat); }

// A GPU whose every charged op costs exactly its host time: 1 ms an op, 5 ms a module call.
GpuSpec HostBoundGpu() {
  GpuSpec gpu = *FindGpu("H100");
  gpu.half_flops = gpu.fp32_flops = gpu.bandwidth_bytes_per_s = 1e30;
  gpu.min_op_s = 1e-3;
  gpu.module_call_s = 5e-3;
  return gpu;
}

// A GPU without host time whose memory moves 1 byte a second.
GpuSpec OneBytePerSecondGpu() {
  GpuSpec gpu = *FindGpu("H100");
  gpu.bandwidth_bytes_per_s = 1;
  gpu.bandwidth_efficiency = 1;
  gpu.min_op_s = 0;
  return gpu;
}

TEST(VirtualClock, OpsThatMayBeViewsCostOnlyWhenTheyCopy) {
  const GpuSpec gpu = HostBoundGpu();
  Session session(&gpu);
  {
    ActiveSession active(session);
    const at::Tensor a = at::empty({4, 8}, MetaFloat());
    const at::Tensor same_dtype = a.to(at::kFloat);       // a itself
    const at::Tensor contiguous = a.contiguous();         // a itself
    const at::Tensor flat = a.reshape({32});              // a view
    const at::Tensor unsafe = at::_unsafe_view(a, {32});  // a view its schema does not name
    EXPECT_EQ(session.recorder().now_s(), 0);
    const at::Tensor half = a.to(at::kHalf);                 // a cast: one op
    const at::Tensor transposed = a.t().contiguous();        // a copy: one op
    const at::Tensor flat_transposed = a.t().reshape({32});  // a copy: one op
    EXPECT_DOUBLE_EQ(session.recorder().now_s(), 3e-3);
  }
}

TEST(VirtualClock, ACopyReadsItsInputAndWritesItsOutput) {
  const GpuSpec gpu = OneBytePerSecondGpu();
  Session session(&gpu);
  {
    ActiveSession active(session);
    const at::Tensor a = at::empty({4, 8}, MetaFloat());
    const at::Tensor half = a.to(at::kHalf);  // 4 * 8 * 4 bytes read, 4 * 8 * 2 written
    EXPECT_DOUBLE_EQ(session.recorder().now_s(), 192);
  }
}

TEST(VirtualClock, StandInKernelsCostWhatTheirOutputsStandFor) {
  const GpuSpec gpu = HostBoundGpu();
  Session session(&gpu);
  {
    ActiveSession active(session);
    const at::Tensor buffer = at::empty({4, 8}, MetaFloat());  // an allocation: free
    EXPECT_EQ(session.recorder().now_s(), 0);
    {
      StandInKernelScope kernels;
      const at::Tensor sorted = at::empty({32}, MetaFloat());
      const at::Tensor indices = at::empty_like(sorted);
      const at::Tensor view = sorted.view({4, 8});  // still a view
    }
    EXPECT_DOUBLE_EQ(session.recorder().now_s(), 2e-3);
    const at::Tensor after = at::empty({4, 8}, MetaFloat());  // the scope has closed
    EXPECT_DOUBLE_EQ(session.recorder().now_s(), 2e-3);
  }
}

TEST(VirtualClock, UnmodelledOpsAndModuleCallsCostTheHostsTime) {
  const GpuSpec gpu = HostBoundGpu();
  Session session(&gpu);
  ChargeUnmodelledOps(5, 2);  // no active session: nothing to charge
  ChargeModuleCalls(1);
  EXPECT_EQ(session.recorder().now_s(), 0);
  {
    ActiveSession active(session);
    session.SetPhase(Phase::kForward);
    ChargeUnmodelledOps(5, 2);  // forward and backward ops
    EXPECT_DOUBLE_EQ(session.recorder().now_s(), 7e-3);
    ChargeModuleCalls(2);
    EXPECT_DOUBLE_EQ(session.recorder().now_s(), 17e-3);
    // A recomputation in backward: the forward's ops, half of each module call.
    session.SetPhase(Phase::kBackward);
    ChargeUnmodelledOps(5, 2);
    EXPECT_DOUBLE_EQ(session.recorder().now_s(), 22e-3);
    ChargeModuleCalls(2);
    EXPECT_DOUBLE_EQ(session.recorder().now_s(), 27e-3);
  }
  Session without_gpu;
  ActiveSession active(without_gpu);
  ChargeUnmodelledOps(5, 2);
  ChargeModuleCalls(1);
  EXPECT_EQ(without_gpu.recorder().now_s(), 0);
}

// A CUDA graph's replay launches its kernels without the host: ops cost their kernels
// alone, and neither unmodelled ops nor module calls cost anything; outside the graphed
// scope, and while capturing, the host's time counts.
TEST(VirtualClock, GraphReplaysCostTheKernelsOnly) {
  GpuSpec gpu = HostBoundGpu();
  gpu.bandwidth_bytes_per_s = 1;
  gpu.bandwidth_efficiency = 1;
  gpu.min_op_s = 1000;  // 4 * 8 * 4 * 2 = 256 bytes read and written: 256 s of kernel
  Session session(&gpu);
  ActiveSession active(session);
  const at::Tensor a = at::empty({4, 8}, MetaFloat());
  session.recorder().set_graph_mode(Recorder::GraphMode::kReplay);
  {
    GraphedScope graphed(true);
    const at::Tensor b = a + 1;
    ChargeUnmodelledOps(5, 2);
    ChargeModuleCalls(1);
    ChargeMemoryBoundKernel(
        44);  // a kernel the model stands for: its bytes, without the host's time
    EXPECT_DOUBLE_EQ(session.recorder().now_s(), 300);
  }
  const at::Tensor c = a + 1;  // eager code between the graphs
  EXPECT_DOUBLE_EQ(session.recorder().now_s(), 300 + 1000);
  ChargeMemoryBoundKernel(44);  // eager: the host's time
  EXPECT_DOUBLE_EQ(session.recorder().now_s(), 300 + 2000);
  session.recorder().set_graph_mode(Recorder::GraphMode::kCapture);
  {
    GraphedScope graphed(true);
    const at::Tensor d = a + 1;
    EXPECT_DOUBLE_EQ(session.recorder().now_s(), 300 + 3000);
  }
}

// A GPU-bound GEMM of 10^15 FLOPs runs at its precision's peak (cost_model.cc's data-sheet
// figures) times the achieved fraction: on the tensor cores 0.6, Blackwell's 0.35 (as the
// 7B runs measured); FP8 at twice the 16-bit peak where there are FP8 tensor cores (not on
// A100); fp32 on the CUDA cores at 0.6 everywhere.
TEST(VirtualClock, GemmsRunAtTheirPrecisionsPeak) {
  const GpuSpec& h100 = *FindGpu("H100");
  const GpuSpec& gb200 = *FindGpu("GB200");
  const GpuSpec& a100 = *FindGpu("A100");
  EXPECT_DOUBLE_EQ(MatmulKernelSeconds(h100, 1e15, GemmPrecision::kHalf), 1e15 / (989.4e12 * 0.6));
  EXPECT_DOUBLE_EQ(MatmulKernelSeconds(h100, 1e15, GemmPrecision::kFp8),
                   1e15 / (2 * 989.4e12 * 0.6));
  EXPECT_DOUBLE_EQ(MatmulKernelSeconds(h100, 1e15, GemmPrecision::kFp32), 1e15 / (66.9e12 * 0.6));
  EXPECT_DOUBLE_EQ(MatmulKernelSeconds(gb200, 1e15, GemmPrecision::kHalf), 1e15 / (2.5e15 * 0.35));
  EXPECT_DOUBLE_EQ(MatmulKernelSeconds(gb200, 1e15, GemmPrecision::kFp8), 1e15 / (5e15 * 0.35));
  EXPECT_DOUBLE_EQ(MatmulKernelSeconds(gb200, 1e15, GemmPrecision::kFp32), 1e15 / (90e12 * 0.6));
  EXPECT_DOUBLE_EQ(MatmulKernelSeconds(*FindGpu("B200"), 1e15, GemmPrecision::kHalf),
                   1e15 / (2.25e15 * 0.35));
  EXPECT_DOUBLE_EQ(MatmulKernelSeconds(a100, 1e15, GemmPrecision::kFp8), 1e15 / (312e12 * 0.6));
}

}  // namespace
}  // namespace memsim
