// Note [Offload copies on the clock]: when the copies of activation offloading end and where
// the compute stream waits for them.
#include "models/activation_offload.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <limits>

#include "simulator/cost_model.h"
#include "simulator/session.h"
#include "tests/support/recorded_rank.h"
#include "tests/support/test_models.h"
#include "tests/support/validated_run.h"

namespace memsim {
namespace {

// A GPU whose ops cost nothing and whose host link copies 1 byte a second.
GpuSpec OneBytePerSecondHostLink() {
  GpuSpec gpu = *FindGpu("H100");
  gpu.half_flops = gpu.fp32_flops = gpu.bandwidth_bytes_per_s =
      std::numeric_limits<double>::infinity();
  gpu.min_op_s = gpu.module_call_s = 0;
  gpu.host_link_bytes_per_s = 1;
  gpu.link_efficiency = 1;
  return gpu;
}

// One core_attn region that saves a `saved_bytes` activation; returns its output.
at::Tensor OffloadedRegion(ActivationOffloader& offloader, int64_t saved_bytes) {
  at::Tensor x = at::empty({8}, at::TensorOptions().device(at::kMeta)).requires_grad_(true);
  OffloadRegion region(&offloader, OffloadModule::kCoreAttn, &x);
  CategoryScope activations(Category::kActivation);
  const at::Tensor saved =
      at::empty({saved_bytes}, at::TensorOptions().device(at::kMeta).dtype(at::kByte));
  at::Tensor y = x * 2;
  region.EndSaving({y});
  region.Commit(&y, {});
  return y;
}

// Two microbatches' regions, A (100 bytes) and B (100 bytes), offloaded in forward at time 0:
// the link copies A out in [0, 100] and B in [100, 200]. A's backward runs first and reloads
// A itself (nothing prefetched it): A's offload ended at 100, but B's is still on the link,
// so the reload runs in [200, 300] and A's backward waits until 300 (with a queue per
// direction it would have waited until 200). A's start node then prefetches B, in
// [300, 400], and B's backward waits until 400.
TEST(OffloadCopies, ReloadsQueueBehindTheOffloadsOnOneHostLink) {
  const GpuSpec gpu = OneBytePerSecondHostLink();
  TrainingConfig training;
  training.offload_modules = OffloadModuleBit(OffloadModule::kCoreAttn);
  training.min_offloaded_tensor_elements = 0;
  ActivationOffloader offloader(training);
  Session session(&gpu);
  ActiveSession active(session);
  const ActivationOffloader::ChunkKey a{0, 0}, b{1, 0};
  offloader.BeginIteration(0, {a, b});
  offloader.BeginStep(/*forward=*/true, a);
  const at::Tensor from_a = OffloadedRegion(offloader, 100);
  offloader.BeginStep(/*forward=*/true, b);
  const at::Tensor from_b = OffloadedRegion(offloader, 100);
  EXPECT_EQ(session.recorder().now_s(), 0);  // the copies run beside the compute

  offloader.BeginStep(/*forward=*/false, a);
  from_a.backward(at::empty_like(from_a));
  EXPECT_DOUBLE_EQ(session.recorder().now_s(), 300);
  offloader.BeginStep(/*forward=*/false, b);
  from_b.backward(at::empty_like(from_b));
  EXPECT_DOUBLE_EQ(session.recorder().now_s(), 400);
}

// --fine-grained-offloading-max-inflight-offloads K: two core_attn regions of one chunk, 100
// bytes each, whose offloads end at 100 and 200. With K = 0 each commit waits for its own
// offload (the clock reaches 200 by the end of the forward); with K = 1 the second commit
// waits for the first (100); without a cap nothing waits (0).
TEST(OffloadCopies, MaxInflightOffloadsMakeTheComputeStreamWait) {
  const GpuSpec gpu = OneBytePerSecondHostLink();
  auto forward_clock = [&](int64_t max_inflight) {
    TrainingConfig training;
    training.offload_modules = OffloadModuleBit(OffloadModule::kCoreAttn);
    training.min_offloaded_tensor_elements = 0;
    training.max_inflight_offloads = max_inflight;
    ActivationOffloader offloader(training);
    Session session(&gpu);
    ActiveSession active(session);
    offloader.BeginIteration(0, {{0, 0}});
    offloader.BeginStep(/*forward=*/true, {0, 0});
    const at::Tensor first = OffloadedRegion(offloader, 100);
    const at::Tensor second = OffloadedRegion(offloader, 100);
    return session.recorder().now_s();
  };
  EXPECT_DOUBLE_EQ(forward_clock(0), 200);
  EXPECT_DOUBLE_EQ(forward_clock(1), 100);
  EXPECT_EQ(forward_clock(-1), 0);
}

// Note [Layer CPU offloading]'s copies on the clock, a 4-layer GPT (s 128, b 2, h 256,
// a 8, eager attention) with layers 0 and 1 offloaded, P bytes each (as
// Offloading.LayerCpuOffloadingKeepsTheLastLayersOnly counts them), on a GPU whose ops cost nothing
// and whose host link copies 1 byte a second: layer 0's offload runs in [0, P], layer 1's in [P,
// 2P]; layer 2 waits for layer 0's (P), layer 3 for layer 1's (2P). Backward: layer 2's start
// queues layer 1's reload [2P, 3P], layer 1's start layer 0's [3P, 4P]; layer 1 waits for its own
// (3P), layer 0 for its own (4P). Every byte crosses once each way, one after another.
TEST(OffloadCopies, LayerCpuOffloadingCopiesOnOneStream) {
  const int64_t s = 128, b = 2, h = 256, a = 8;
  ModelConfig m = test::Gpt(4, h, a);
  TrainingConfig t = test::EagerWithoutDropout(s, b);
  t.iterations = 1;
  t.cpu_offloading_num_layers = 2;
  const GpuSpec gpu = OneBytePerSecondHostLink();
  const int64_t per_layer = 2 * (a * b * s * s) + 2 * (2 * 4 * s * b * h);
  EXPECT_DOUBLE_EQ(test::RecordRank(test::Validated(m, t), 0, &gpu)->recorder().now_s(),
                   4.0 * per_layer);
}

}  // namespace
}  // namespace memsim
