// Parallel layouts against published numbers: Korthikanti et al. 2022 Table 2 with
// tensor and sequence parallelism, Megatron-LM's distributed-optimizer bytes per
// parameter, 1F1B and interleaved in-flight microbatches, rank classes.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <tuple>
#include "models/parameters.h"
#include "models/transformer.h"

#include "parallel/cuda_graphs.h"
#include "parallel/layout.h"
#include "parallel/pipeline_schedule.h"
#include "parallel/rank_classes.h"
#include "parallel/rank_training.h"
#include "parallel/run_spec.h"
#include "parallel/sharded_data_parallel.h"
#include "simulator/session.h"
#include "simulator/timeline.h"
#include "tests/support/recorded_rank.h"
#include "tests/support/recorder_queries.h"
#include "tests/support/test_models.h"
#include "tests/support/validated_run.h"
#include "tools/lib/megatron_args.h"
#include "tools/lib/validate.h"

namespace memsim {
namespace {

struct Shape {
  int64_t s, b, h, a;
};

ModelConfig Gpt(const Shape& x, int64_t layers, int64_t tp = 1) {
  ModelConfig m = test::Gpt(layers, x.h, x.a);
  EXPECT_TRUE(FinalizeModelConfig(&m, tp).ok());
  return m;
}

TrainingConfig Fp16Eager(const Shape& x) {
  TrainingConfig t;
  t.seq_length = x.s;
  t.micro_batch_size = x.b;
  t.precision = Precision::kFp16;
  t.attention = AttentionKind::kEager;
  return t;
}

// Bytes allocated in forward and alive when it ends, for one tensor-parallel rank.
int64_t ForwardBytes(const Shape& x, int64_t layers, const TrainingConfig& t, int64_t tp, bool sp,
                     int64_t cp = 1) {
  const ModelConfig m = Gpt(x, layers, tp);
  Session session;
  ActiveSession active(session);
  ParameterStore store(t.precision);
  ModelShard shard = ModelShard::Whole(m);
  shard.tp = tp;
  shard.sequence_parallel = sp;
  shard.cp = cp;
  TransformerModel model(m, t, shard, &store);
  store.AllocateGradBuffer();
  session.SetPhase(Phase::kForward);
  at::Tensor loss = model.Forward();
  const Recorder& r = session.recorder();
  int64_t bytes = 0;
  ForEachLiveStorage(r, static_cast<int64_t>(r.events().size()) - 1, [&](int64_t id) {
    const StorageInfo& s = r.storages()[static_cast<size_t>(id)];
    if (s.phase == Phase::kForward) bytes += s.size_bytes;
  });
  return bytes;
}

int64_t PerLayer(const Shape& x, const TrainingConfig& t, int64_t tp, bool sp, int64_t cp = 1) {
  return ForwardBytes(x, 2, t, tp, sp, cp) - ForwardBytes(x, 1, t, tp, sp, cp);
}

const Shape kShapes[] = {{128, 2, 256, 8}, {256, 1, 512, 16}, {64, 4, 128, 8}};

// Table 2 rows, per layer, plus the LayerNorms' float32 statistics (16sb; /t with SP).
TEST(TensorParallelActivations, Korthikanti) {
  for (const Shape& x : kShapes) {
    for (int64_t t : {2, 4}) {
      SCOPED_TRACE("s=" + std::to_string(x.s) + " b=" + std::to_string(x.b) + " h=" +
                   std::to_string(x.h) + " a=" + std::to_string(x.a) + " t=" + std::to_string(t));
      const int64_t sbh = x.s * x.b * x.h, as2b = x.a * x.s * x.s * x.b, sb = x.s * x.b;
      TrainingConfig none = Fp16Eager(x);
      TrainingConfig selective = none;
      selective.recompute = RecomputeKind::kSelective;
      // Tensor parallelism: sbh(10 + 24/t + 5as/(ht)).
      EXPECT_EQ(PerLayer(x, none, t, false), 10 * sbh + 24 * sbh / t + 5 * as2b / t + 16 * sb);
      // Tensor + sequence parallelism: sbh(34/t + 5as/(ht)).
      EXPECT_EQ(PerLayer(x, none, t, true), 34 * sbh / t + 5 * as2b / t + 16 * sb / t);
      // Tensor parallelism + selective recomputation: sbh(10 + 24/t).
      EXPECT_EQ(PerLayer(x, selective, t, false), 10 * sbh + 24 * sbh / t + 16 * sb);
      // Tensor + sequence parallelism + selective recomputation: 34 sbh / t.
      EXPECT_EQ(PerLayer(x, selective, t, true), 34 * sbh / t + 16 * sb / t);
    }
  }
}

// `dp` data-parallel ranks of `kind` over the whole of `m`, finalized.
ParallelLayout DataParallelLayout(const ModelConfig& m, int64_t dp, DataParallelKind kind) {
  ParallelLayout layout;
  layout.world_size = dp;
  layout.data_parallel = kind;
  EXPECT_TRUE(FinalizeLayout(&layout, m).ok());
  return layout;
}

// Bytes of parameters, gradients and optimizer state at the end of the first step.
int64_t ModelStateBytes(const ModelConfig& m, TrainingConfig t, const ParallelLayout& layout) {
  t.iterations = 1;
  const std::unique_ptr<Session> session = test::RecordRank(test::Validated(m, t, layout));
  const Recorder& r = session->recorder();
  int64_t step_end = -1;
  for (const Marker& mk : r.markers()) {
    if (mk.kind == MarkerKind::kIterationEnd) step_end = mk.event_index - 1;
  }
  return test::ModelStateBytesAfter(r, step_end);
}

// Note [Optimizer CPU offload] on the model of DistributedOptimizer.BytesPerParameter (bf16,
// the precision-aware optimizer, fp32 gradients): with --optimizer-offload-fraction 1 only
// the parameters and gradients stay, 6 bytes per parameter; with 0.5 the device part keeps
// FusedAdam's fp32 clone and two fp32 states, 12 bytes per element of the shards left after
// the greedy cut, taken in the optimizer's order (weight-decayed group first, each in the
// buffer's reverse order; Note [Distributed optimizer buffers]). d = 2, rank 1 (268,032
// elements, see BytesPerParameter): layer 0's fc1 weight share (62,208), qkv (49,152) and
// proj (16,384) weights, then the position embedding (8,192) pass half; the word embedding
// (131,072) and six 1-D tensors (1,024) stay: 132,096 elements. d = 4, rank 3: the position
// embedding's last 2,944 elements, then the whole word embedding: nothing stays.
TEST(DistributedOptimizer, CpuOffloadKeepsTheDevicePartOnly) {
  const Shape x{64, 1, 128, 4};
  const ModelConfig m = Gpt(x, 2);
  const int64_t params = 1024 * 128 + 64 * 128 + 2 * (12 * 128 * 128 + 13 * 128) + 2 * 128;
  for (const auto& [d, device_elements] : {std::pair<int64_t, int64_t>{2, 132'096}, {4, 0}}) {
    const ParallelLayout layout = DataParallelLayout(m, d, DataParallelKind::kDistributedOptimizer);
    TrainingConfig t = Fp16Eager(x);
    t.precision = Precision::kBf16;
    t.precision_aware_optimizer = true;
    t.optimizer_offload_fraction = 1.0;
    EXPECT_EQ(ModelStateBytes(m, t, layout), 6 * params) << "d=" << d;
    t.optimizer_offload_fraction = 0.5;
    EXPECT_EQ(ModelStateBytes(m, t, layout) - 6 * params, 12 * device_elements) << "d=" << d;
  }
}

// Megatron-LM's distributed optimizer documentation: 4 + 16/d (fp16), 6 + 12/d (bf16),
// 8 + 8/d (fp32) bytes per parameter.
TEST(DistributedOptimizer, BytesPerParameter) {
  const Shape x{64, 1, 128, 4};
  const ModelConfig m = Gpt(x, 2);
  // V*h + s*h + L*(12h^2 + 13h) + 2h; every tensor divides by 16.
  const int64_t params = 1024 * 128 + 64 * 128 + 2 * (12 * 128 * 128 + 13 * 128) + 2 * 128;
  // bf16 with --grad-reduce-in-bf16 keeps fp16's layout: 16-bit gradients, fp32 copies.
  // The precision-aware optimizer (Note [Precision-aware optimizer]): fp32 gradients read
  // as they are, Adam's fp32 states and 16 remainder bits per parameter: 6 + 10/d; with bf16
  // gradients and states 4 + 6/d, plus an fp32 [1] scale per bf16 state of each parameter
  // tensor the rank's shard meets (below); without remainders an fp32 master: 6 + 12/d.
  struct Case {
    Precision precision;
    int64_t fixed, sharded;
    bool bf16_grads = false;
    bool precision_aware = false;
    Precision states = Precision::kFp32;
    bool remainders = true;
  };
  for (const Case& c :
       {Case{Precision::kFp16, 4, 16}, Case{Precision::kBf16, 6, 12}, Case{Precision::kFp32, 8, 8},
        Case{Precision::kBf16, 4, 16, true}, Case{Precision::kBf16, 6, 10, false, true},
        Case{Precision::kBf16, 4, 6, false, true, Precision::kBf16},
        Case{Precision::kBf16, 6, 12, false, true, Precision::kFp32, false}}) {
    for (int64_t d : {2, 4, 16}) {
      const ParallelLayout layout =
          DataParallelLayout(m, d, DataParallelKind::kDistributedOptimizer);
      TrainingConfig t = Fp16Eager(x);
      t.precision = c.precision;
      t.grad_reduce_in_bf16 = c.bf16_grads;
      t.precision_aware_optimizer = c.precision_aware;
      t.main_grads_dtype = t.exp_avg_dtype = t.exp_avg_sq_dtype = c.states;
      t.store_param_remainders = c.remainders;
      // The scales are per parameter tensor the simulated rank's range meets (the last: with no
      // gap or padding every rank holds as much). One
      // bucket of 536,064 elements (no padding: every tensor's size is a multiple of 64, the
      // sum of 128) laid out in reverse: the final norm, layer 1, layer 0 from 198,528, the
      // position embedding from 396,800, the word embedding from 404,992. d = 2: rank 1's
      // [268,032, ...) meets layer 0's fc1 weight and the 8 tensors before it, and both
      // embeddings: 11; d = 4: [402,048, ...) both embeddings; d = 16: [502,560, ...) the
      // word embedding alone.
      const int64_t tensors = d == 2 ? 11 : d == 4 ? 2 : 1;
      const int64_t scales =
          c.precision_aware && c.states == Precision::kBf16 ? 2 * tensors * 4 : 0;
      EXPECT_EQ(ModelStateBytes(m, t, layout), params * c.fixed + params * c.sharded / d + scales)
          << PrecisionName(c.precision) << (c.bf16_grads ? " bf16 grads" : "")
          << (c.precision_aware ? " precision-aware" : "") << " states " << PrecisionName(c.states)
          << (c.remainders ? "" : " no remainders") << " d=" << d;
    }
  }
}

// Note [Distributed optimizer buffers]: the parameter buffer is allocated while the
// parameters still have their own storages, which are freed one by one as they move in, so
// the setup briefly holds the parameters twice: 2 + 2 (param_data) + 4 (fp32 grad_data)
// bytes per parameter in bf16, which plain DDP (no parameter buffer) never holds: 2 + 4.
// The tiny GPT's 536,064 parameters fill one bucket without padding (BytesPerParameter).
TEST(DistributedOptimizer, ParameterBufferBrieflyHoldsTheParametersTwice) {
  const Shape x{64, 1, 128, 4};
  const ModelConfig m = Gpt(x, 2);
  const int64_t params = 1024 * 128 + 64 * 128 + 2 * (12 * 128 * 128 + 13 * 128) + 2 * 128;
  for (const auto& [kind, bytes_per_parameter] :
       {std::pair{DataParallelKind::kDistributedOptimizer, 8}, {DataParallelKind::kDdp, 6}}) {
    TrainingConfig t = Fp16Eager(x);
    t.precision = Precision::kBf16;
    t.iterations = 1;
    const std::unique_ptr<Session> session =
        test::RecordRank(test::Validated(m, t, DataParallelLayout(m, 4, kind)));
    const Recorder& r = session->recorder();
    // Up to the optimizer's first master weight (masters add their own bytes after).
    int64_t buffers_end = 0;
    for (const StorageInfo& storage : r.storages()) {
      if (storage.category == Category::kOptimizerState) {
        buffers_end = storage.alloc_event;
        break;
      }
    }
    ASSERT_GT(buffers_end, 0);
    int64_t peak = 0;
    for (int64_t e = 1; e <= buffers_end; ++e) peak = std::max(peak, test::LiveBytesBefore(r, e));
    EXPECT_EQ(peak, bytes_per_parameter * params) << DataParallelName(kind);
  }
}

TEST(PipelineSchedule, OneForwardOneBackwardInFlight) {
  // Stage r holds min(pp - r, m) microbatches.
  for (int64_t pp : {2, 4, 8}) {
    for (int64_t m : {1, 3, 8, 16}) {
      for (int64_t r = 0; r < pp; ++r) {
        const auto schedule = PipelineSchedule(pp, 1, r, m);
        EXPECT_EQ(MaxInFlight(schedule), std::min(pp - r, m)) << pp << " " << m << " " << r;
        EXPECT_EQ(static_cast<int64_t>(schedule.size()), 2 * m);
      }
    }
  }
  // pp = 1: forward and backward of each microbatch in turn.
  const auto plain = PipelineSchedule(1, 1, 0, 2);
  ASSERT_EQ(plain.size(), 4u);
  EXPECT_TRUE(plain[0].forward && plain[0].microbatch == 0);
  EXPECT_TRUE(!plain[1].forward && plain[1].microbatch == 0);
}

TEST(PipelineSchedule, InterleavedFirstStageHoldsMore) {
  // First stage: pp*vpp + pp - 1 chunks in flight, i.e. L(1 + (pp-1)/(pp*vpp)) layers'
  // activations against 1F1B's L.
  for (int64_t pp : {2, 4}) {
    for (int64_t vpp : {2, 3}) {
      const int64_t m = 4 * pp;
      const auto schedule = PipelineSchedule(pp, vpp, 0, m);
      EXPECT_EQ(MaxInFlight(schedule), pp * vpp + pp - 1) << pp << " " << vpp;
      EXPECT_EQ(static_cast<int64_t>(schedule.size()), 2 * m * vpp);
      // Every (microbatch, chunk) runs forward once and backward once, forward first.
      std::map<std::pair<int64_t, int64_t>, int> seen;
      for (const PipelineStep& s : schedule) {
        int& state = seen[{s.microbatch, s.chunk}];
        EXPECT_EQ(state, s.forward ? 0 : 1);
        state += 1;
      }
      EXPECT_EQ(static_cast<int64_t>(seen.size()), m * vpp);
    }
  }
}

// Megatron-Core 0.20's get_pp_rank_microbatches: warm-up (pp - r - 1) * 2 + (vpp - 1) * g,
// clamped to all m * vpp steps; in flight = warm-up + 1 unless everything is warm-up.
TEST(PipelineSchedule, InterleavedWarmupFollowsMegatronCore) {
  struct Case {
    int64_t pp, vpp, m, group;
    std::vector<int64_t> in_flight;  // per stage, worked by hand from the formula
  };
  const Case cases[] = {
      // m == pp: stages 0 and 1 warm up everything (10, 8 >= 8), 2 and 3 do not (6, 4).
      {4, 2, 4, 0, {8, 8, 7, 5}},
      // 32 layers, PP 4, one layer per virtual stage (vpp 8), 4 microbatches: the last
      // stage warms up 28 of 32 and so holds 29, not all 32 (the pre-2025 rule).
      {4, 8, 4, 0, {32, 32, 31, 29}},
      // Groups of 3 on PP 2: warm-up 2 + 3 = 5 and 0 + 3 = 3.
      {2, 2, 6, 3, {6, 4}},
  };
  for (const Case& c : cases) {
    for (int64_t r = 0; r < c.pp; ++r) {
      EXPECT_EQ(MaxInFlight(PipelineSchedule(c.pp, c.vpp, r, c.m, c.group)),
                c.in_flight[static_cast<size_t>(r)])
          << c.pp << " " << c.vpp << " " << c.m << " " << c.group << " stage " << r;
    }
  }
  // Groups of 3: each group runs chunk 0 then chunk 1 (get_schedule_table).
  const auto schedule = PipelineSchedule(2, 2, 1, 6, 3);
  std::vector<std::pair<int64_t, int64_t>> forwards;
  for (const PipelineStep& s : schedule) {
    if (s.forward) forwards.emplace_back(s.microbatch, s.chunk);
  }
  const std::vector<std::pair<int64_t, int64_t>> expected = {{0, 0}, {1, 0}, {2, 0}, {0, 1},
                                                             {1, 1}, {2, 1}, {3, 0}, {4, 0},
                                                             {5, 0}, {3, 1}, {4, 1}, {5, 1}};
  EXPECT_EQ(forwards, expected);
  // The first backward is of the last chunk of microbatch 0: the last stage frees one
  // microbatch's logits before it makes the next.
  EXPECT_FALSE(schedule[4].forward);
  EXPECT_EQ(schedule[4].chunk, 1);
  EXPECT_EQ(schedule[4].microbatch, 0);
}

// Note [Combined 1F1B]: --overlap-moe-expert-parallel-comm warms up one more interleaved
// forward (get_pp_rank_microbatches) and runs each steady step's backward first: PP 4, VPP
// 2, 8 microbatches: warm-up 6 + 4 + 1, 4 + 4 + 1, 2 + 4 + 1, 0 + 4 + 1, the most in
// flight, and each steady step a backward then a forward. Without interleaving (and without
// a pipeline) the schedule is 1F1B's.
TEST(PipelineSchedule, CombinedOneForwardOneBackwardWarmsUpOneMore) {
  for (int64_t r = 0; r < 4; ++r) {
    const auto schedule = PipelineSchedule(4, 2, r, 8, 0, /*combined_1f1b=*/true);
    const int64_t warmup = (4 - r - 1) * 2 + 4 + 1;
    EXPECT_EQ(PipelineWarmup(4, 2, r, 8, 0, true), warmup);
    EXPECT_EQ(MaxInFlight(schedule), warmup) << r;
    ASSERT_EQ(schedule.size(), 32u);
    for (int64_t k = 0; k < 16 - warmup; ++k) {  // the steady steps: B(k), F(warmup + k)
      EXPECT_FALSE(schedule[static_cast<size_t>(warmup + 2 * k)].forward) << r << " " << k;
      EXPECT_TRUE(schedule[static_cast<size_t>(warmup + 2 * k + 1)].forward) << r << " " << k;
    }
  }
  // Without virtual stages (and without a pipeline) the combined schedule is 1F1B's.
  const auto schedule = [](int64_t pp, int64_t r, bool combined) {
    std::vector<std::tuple<bool, int64_t, int64_t>> steps;
    for (const PipelineStep& s : PipelineSchedule(pp, 1, r, 8, 0, combined)) {
      steps.emplace_back(s.forward, s.microbatch, s.chunk);
    }
    return steps;
  };
  for (int64_t r = 0; r < 4; ++r) EXPECT_EQ(schedule(4, r, true), schedule(4, r, false)) << r;
  EXPECT_EQ(schedule(1, 0, true), schedule(1, 0, false));
}

TEST(PipelineSchedule, MicrobatchGroupRules) {
  EXPECT_TRUE(CheckMicrobatchGroup(4, 2, 8, 4).ok());
  EXPECT_TRUE(CheckMicrobatchGroup(4, 2, 10, 5).ok());
  EXPECT_FALSE(CheckMicrobatchGroup(4, 2, 8, 3).ok());  // smaller than PP
  EXPECT_FALSE(CheckMicrobatchGroup(4, 2, 8, 9).ok());  // more than the microbatches
  EXPECT_FALSE(CheckMicrobatchGroup(4, 2, 6, 4).ok());  // last group of 2 < PP
  EXPECT_TRUE(CheckMicrobatchGroup(4, 1, 3, 0).ok());   // no interleaving, no rule
}

// A pipeline of `pp` stages of `vpp` chunks each and no other parallelism (world size pp).
ParallelLayout PipelineOnly(const ModelConfig& m, int64_t pp, int64_t vpp = 1) {
  ParallelLayout layout;
  layout.world_size = pp;
  layout.pp = pp;
  layout.vpp = vpp;
  EXPECT_TRUE(FinalizeLayout(&layout, m).ok());
  return layout;
}

int64_t StagePeak(const ModelConfig& m, const TrainingConfig& t, const ParallelLayout& layout,
                  int64_t pp_rank) {
  const std::unique_ptr<Session> session = test::RecordRank(test::Validated(m, t, layout), pp_rank);
  // Exact bytes (requested sizes): the caching allocator's block rounding depends on the
  // order of earlier frees, which differs between stages by up to a block's remainder.
  return Timeline::Replay(session->recorder()).peak_requested_bytes();
}

// Middle stages hold the same layers; stage r keeps pp - r microbatches, so each stage
// peaks one microbatch's stage activations above the next.
TEST(PipelineMemory, StagesPeakByInFlightMicrobatches) {
  const Shape x{512, 2, 512, 8};
  const ModelConfig m = Gpt(x, 6);
  TrainingConfig t = Fp16Eager(x);
  t.precision = Precision::kBf16;  // no fp32 master-gradient copies: the peak is activations
  t.num_microbatches = 12;
  t.iterations = 1;
  const ParallelLayout layout = PipelineOnly(m, 6);
  const int64_t p1 = StagePeak(m, t, layout, 1), p2 = StagePeak(m, t, layout, 2);
  const int64_t p3 = StagePeak(m, t, layout, 3), p4 = StagePeak(m, t, layout, 4);
  EXPECT_GT(p1 - p2, 0);
  EXPECT_EQ(p1 - p2, p2 - p3);
  EXPECT_EQ(p2 - p3, p3 - p4);
  // One microbatch of one layer, 16-bit eager: Table 2's sbh(34 + 5as/h) (the received
  // hidden state is the layer's input, which the paper counts; the sent output is
  // deallocated to a one-element bf16 stub, 2 bytes, as Megatron's
  // deallocate_output_tensor leaves it) plus the LayerNorm statistics.
  const int64_t sbh = x.s * x.b * x.h;
  EXPECT_EQ(p1 - p2, 34 * sbh + 5 * x.a * x.s * x.s * x.b + 16 * x.s * x.b + 2);
}

// What the pipeline keeps of microbatch `microbatch` right before marker `marker`: the
// storages it received or computed at the top level (the received inputs and output
// gradients, the inputs' gradients), as (phase, bytes), sorted.
std::vector<std::pair<Phase, int64_t>> KeptOfMicrobatch(const Recorder& r, const Marker& marker,
                                                        int32_t iteration, int32_t microbatch) {
  std::vector<std::pair<Phase, int64_t>> kept;
  ForEachLiveStorage(r, marker.event_index - 1, [&](int64_t id) {
    const StorageInfo& s = r.storages()[static_cast<size_t>(id)];
    if (s.module == 0 && s.iteration == iteration && s.microbatch == microbatch &&
        (s.phase == Phase::kForward || s.phase == Phase::kBackward)) {
      kept.emplace_back(s.phase, s.size_bytes);
    }
  });
  std::sort(kept.begin(), kept.end());
  return kept;
}

// The first marker of `kind` for (iteration, microbatch (-1: any), phase).
Marker MarkerAt(const Recorder& r, MarkerKind kind, int32_t iteration, int32_t microbatch,
                Phase phase) {
  for (const Marker& m : r.markers()) {
    if (m.kind == kind && m.iteration == iteration &&
        (microbatch < 0 || m.microbatch == microbatch) && m.phase == phase) {
      return m;
    }
  }
  ADD_FAILURE() << "no marker";
  return r.markers().back();
}

// Note [Tensors the schedule keeps]: after the optimizer step every chunk that receives
// its input still holds the last one and its gradient (TransformerBlock.input_tensor and
// its .grad), 2 x [S, B, H] 16-bit each; a chunk with the embedding holds nothing.
TEST(PipelineMemory, EachChunkKeepsItsLastInputAndGradientThroughTheStep) {
  const Shape x{256, 2, 256, 8};
  const ModelConfig m = Gpt(x, 4);
  TrainingConfig t = Fp16Eager(x);
  t.precision = Precision::kBf16;
  t.num_microbatches = 4;
  t.iterations = 2;
  const int64_t hidden_bytes = x.s * x.b * x.h * 2;
  for (int64_t vpp : {1, 2}) {
    const ParallelLayout layout = PipelineOnly(m, 2, vpp);
    for (int64_t stage : {0, 1}) {
      const std::unique_ptr<Session> session =
          test::RecordRank(test::Validated(m, t, layout), stage);
      const Recorder& r = session->recorder();
      // Chunks fed by the previous stage: all but the first stage's first.
      const int64_t fed = stage == 0 ? vpp - 1 : vpp;
      std::vector<std::pair<Phase, int64_t>> expected;
      for (int64_t c = 0; c < fed; ++c) expected.emplace_back(Phase::kForward, hidden_bytes);
      for (int64_t c = 0; c < fed; ++c) expected.emplace_back(Phase::kBackward, hidden_bytes);
      // Each chunk's last forward is of the last microbatch.
      const Marker end = MarkerAt(r, MarkerKind::kIterationEnd, 1, -1, Phase::kOptimizer);
      EXPECT_EQ(KeptOfMicrobatch(r, end, 1, 3), expected) << "vpp " << vpp << " stage " << stage;
    }
  }
}

// Two bf16 steps of `microbatches` with Transformer Engine's layers and `attention`.
TrainingConfig TeSteps(const Shape& x, AttentionKind attention, int64_t microbatches) {
  TrainingConfig t = Fp16Eager(x);
  t.precision = Precision::kBf16;
  t.profile = ProfileKind::kTransformerEngine;
  t.attention = attention;
  t.num_microbatches = microbatches;
  t.iterations = 2;
  return t;
}

// Note [FP32 residual stream]: stages send and receive float32 hidden states. A middle
// stage keeps 4SBH more a microbatch in flight than in 16-bit training: the received input
// is float32 and its first norm keeps a 16-bit copy of it, where 16-bit training's norm keeps
// the received input itself; the sent output's one-element stub is float32 (2 bytes more).
// After the step a fed chunk's last input and its gradient are float32, 4SBH each.
TEST(PipelineMemory, AnFp32ResidualStreamTravelsInFloat32) {
  const Shape x{256, 2, 256, 8};
  const ModelConfig m = Gpt(x, 6);
  auto training = [&](bool fp32_residual, int64_t microbatches) {
    TrainingConfig t = TeSteps(x, AttentionKind::kFlash, microbatches);
    t.fp32_residual_connection = fp32_residual;
    t.iterations = 1;
    return t;
  };
  const ParallelLayout six_stages = PipelineOnly(m, 6);
  auto per_microbatch = [&](bool fp32_residual) {
    const TrainingConfig t = training(fp32_residual, 12);
    return StagePeak(m, t, six_stages, 1) - StagePeak(m, t, six_stages, 2);
  };
  const int64_t sbh = x.s * x.b * x.h;
  EXPECT_EQ(per_microbatch(true) - per_microbatch(false), 4 * sbh + 2);

  const std::unique_ptr<Session> session =
      test::RecordRank(test::Validated(m, training(true, 4), PipelineOnly(m, 2)), 1);
  const Recorder& r = session->recorder();
  const Marker end = MarkerAt(r, MarkerKind::kIterationEnd, 0, -1, Phase::kOptimizer);
  EXPECT_EQ(KeptOfMicrobatch(r, end, 0, 3),
            (std::vector<std::pair<Phase, int64_t>>{{Phase::kForward, 4 * sbh},
                                                    {Phase::kBackward, 4 * sbh}}));
}

// TrainingConfig::keeps_microbatch_batches (Megatron-LM's RerunDataIterator from
// 5e4fc931ba to bf32f4415e): the whole model on one GPU (the data-reading rank), S = 32,
// B = 2, 3 microbatches: each batch, the mask bool [B, 1, S, S] (2048 B), tokens, labels
// and positions int64 [B, S] (512 B each) and the loss mask fp32 [B, S] (256 B), 3840 B,
// stays through the optimizer step: 11,520 B after it; at the next step's end only that
// step's are there. Without it none is.
TEST(PipelineMemory, AnIteratorThatKeepsBatchesHoldsThemThroughTheStep) {
  const Shape x{32, 2, 64, 4};
  const ModelConfig m = Gpt(x, 2);
  auto kept_after = [&](bool keeps, int32_t iteration) {
    TrainingConfig t = Fp16Eager(x);
    t.precision = Precision::kBf16;
    t.num_microbatches = 3;
    t.iterations = 2;
    t.keeps_microbatch_batches = keeps;
    const std::unique_ptr<Session> session = test::RecordRank(test::Validated(m, t), 0);
    const Recorder& r = session->recorder();
    const Marker end = MarkerAt(r, MarkerKind::kIterationEnd, iteration, -1, Phase::kOptimizer);
    std::map<int32_t, int64_t> bytes_by_iteration;
    ForEachLiveStorage(r, end.event_index - 1, [&](int64_t id) {
      const StorageInfo& info = r.storages()[static_cast<size_t>(id)];
      if (r.names().Name(info.module) == "batch")
        bytes_by_iteration[info.iteration] += info.size_bytes;
    });
    return bytes_by_iteration;
  };
  EXPECT_EQ(kept_after(true, 0), (std::map<int32_t, int64_t>{{0, 11520}}));
  EXPECT_EQ(kept_after(true, 1), (std::map<int32_t, int64_t>{{1, 11520}}));
  EXPECT_TRUE(kept_after(false, 0).empty());
}

// Note [Max attention logit], worked from TE 2.18 and Megatron-Core 0.20 by hand, as memsim
// models it: 2 layers, A = 4 heads, 3 microbatches of [S = 32, B = 2], 2 steps. Each step
// keeps one [A] bf16 per layer from its start until clip_qk's reset after the optimizer
// step. Each forward of a layer makes, under cuDNN fused attention, Max [B, A, S, 1]
// float32, its amax [A] float32, the cast [A] bf16 and torch.max's [A] bf16; under unfused
// attention the scores' amax [A] bf16 and torch.max's: [A] tensors 2 x 2 kept + 12 forwards
// x 3 (fused) or x 2 (unfused). (Megatron keeps a step's first cast itself, without
// torch.max: 4 fewer [A] tensors a step, and none kept before a layer's first forward.)
TEST(MaxAttentionLogit, EachLayerKeepsItsMaximumUntilTheOptimizerStep) {
  const Shape x{32, 2, 64, 4};
  const ModelConfig m = Gpt(x, 2);
  for (AttentionKind kind : {AttentionKind::kFused, AttentionKind::kEager}) {
    TrainingConfig t = TeSteps(x, kind, 3);
    t.log_max_attention_logit = true;
    const std::unique_ptr<Session> session = test::RecordRank(test::Validated(m, t), 0);
    const Recorder& r = session->recorder();
    auto in_core_attention = [&r](const StorageInfo& info) {
      const std::string& module = r.names().Name(info.module);
      return module.size() > 15 && module.compare(module.size() - 15, 15, ".core_attention") == 0;
    };
    // Storages made in core attention, by shape and dtype.
    auto made = [&](const std::vector<int64_t>& shape, at::ScalarType dtype) {
      int64_t n = 0;
      for (const StorageInfo& info : r.storages()) {
        n += in_core_attention(info) && info.dtype == dtype && r.ShapeOf(info).vec() == shape;
      }
      return n;
    };
    const std::vector<int64_t> heads = {x.a};
    if (kind == AttentionKind::kFused) {
      EXPECT_EQ(made({x.b, x.a, x.s, 1}, at::kFloat), 12);
      EXPECT_EQ(made(heads, at::kFloat), 12);
      EXPECT_EQ(made(heads, at::kBFloat16), 4 + 12 * 2);
    } else {
      EXPECT_EQ(made(heads, at::kBFloat16), 4 + 12 * 2);
      EXPECT_EQ(made(heads, at::kFloat), 0);
    }
    auto kept_at = [&](const Marker& marker) {
      std::set<std::string> modules;
      ForEachLiveStorage(r, marker.event_index - 1, [&](int64_t id) {
        const StorageInfo& info = r.storages()[static_cast<size_t>(id)];
        if (in_core_attention(info) && r.ShapeOf(info).vec() == heads) {
          modules.insert(r.names().Name(info.module));
        }
      });
      return modules;
    };
    for (int32_t it : {0, 1}) {
      EXPECT_EQ(kept_at(MarkerAt(r, MarkerKind::kPhaseBegin, it, -1, Phase::kOptimizer)),
                (std::set<std::string>{"decoder.layers.0.self_attention.core_attention",
                                       "decoder.layers.1.self_attention.core_attention"}));
      EXPECT_TRUE(
          kept_at(MarkerAt(r, MarkerKind::kIterationEnd, it, -1, Phase::kOptimizer)).empty());
    }
  }
}

// QK-clip (Note [Max attention logit]), worked from attention.py's clip_qk by hand for 2
// layers of 4 heads (G = A = 4, D = 16), bf16, plain DDP: after each step each layer makes
// torch.cat's copies of linear_qkv [3 * 64, 64], float32 for the main parameter and bf16 for
// the weight, and keeps qk_clip_balancing_eta ([4], viewed [4, 1, 1]) and the extended eta
// [4, D * A / G = 16, 1] as optimizer state. Only plain DDP is modelled.
TEST(MaxAttentionLogit, QkClipCopiesEachQueryKeyValueWeightAfterTheStep) {
  const Shape x{32, 2, 64, 4};
  const ModelConfig m = Gpt(x, 2);
  TrainingConfig t = TeSteps(x, AttentionKind::kFused, 2);
  t.qk_clip = true;
  const std::unique_ptr<Session> session = test::RecordRank(test::Validated(m, t), 0);
  const Recorder& r = session->recorder();
  auto in_attention = [&r](const StorageInfo& info) {
    const std::string& module = r.names().Name(info.module);
    return module == "decoder.layers.0.self_attention" ||
           module == "decoder.layers.1.self_attention";
  };
  int64_t float_copies = 0, bf16_copies = 0;
  for (const StorageInfo& info : r.storages()) {
    if (in_attention(info) && info.phase == Phase::kOptimizer &&
        r.ShapeOf(info).vec() == std::vector<int64_t>{192, 64}) {
      (info.dtype == at::kFloat ? float_copies : bf16_copies) += 1;
    }
  }
  EXPECT_EQ(float_copies, 4);
  EXPECT_EQ(bf16_copies, 4);
  std::multiset<std::vector<int64_t>> kept;
  const Marker end = MarkerAt(r, MarkerKind::kIterationEnd, 1, -1, Phase::kOptimizer);
  ForEachLiveStorage(r, end.event_index - 1, [&](int64_t id) {
    const StorageInfo& info = r.storages()[static_cast<size_t>(id)];
    if (in_attention(info)) {
      EXPECT_EQ(info.category, Category::kOptimizerState);
      EXPECT_EQ(info.dtype, at::kBFloat16);
      kept.insert(r.ShapeOf(info).vec());
    }
  });
  EXPECT_EQ(kept, (std::multiset<std::vector<int64_t>>{{4}, {4}, {4, 16, 1}, {4, 16, 1}}));
  // Tensor parallelism 2 with 2 query groups (G/tp = 1): linear_qkv [(4 + 2*2) * 16 / 2, 64]
  // = [64, 64]; clip_qk's extended eta divides the whole model's A*D = 64 query rows by this
  // rank's 1 group: [1, 64, 1].
  {
    ModelConfig gqa = test::Gpt(2, x.h, x.a);
    gqa.num_query_groups = 2;
    ASSERT_TRUE(FinalizeModelConfig(&gqa, 2).ok());
    ParallelLayout tp2;
    tp2.world_size = 2;
    tp2.tp = 2;
    const std::unique_ptr<Session> tp_session = test::RecordRank(test::Validated(gqa, t, tp2), 0);
    const Recorder& tr = tp_session->recorder();
    std::multiset<std::vector<int64_t>> tp_kept, tp_copies;
    ForEachLiveStorage(
        tr, MarkerAt(tr, MarkerKind::kIterationEnd, 1, -1, Phase::kOptimizer).event_index - 1,
        [&](int64_t id) {
          const StorageInfo& info = tr.storages()[static_cast<size_t>(id)];
          if (tr.names().Name(info.module) == "decoder.layers.0.self_attention") {
            tp_kept.insert(tr.ShapeOf(info).vec());
          }
        });
    EXPECT_EQ(tp_kept, (std::multiset<std::vector<int64_t>>{{1}, {1, 64, 1}}));
    for (const StorageInfo& info : tr.storages()) {
      if (tr.names().Name(info.module) == "decoder.layers.0.self_attention" &&
          info.phase == Phase::kOptimizer &&
          tr.ShapeOf(info).vec() == std::vector<int64_t>{64, 64}) {
        tp_copies.insert({info.dtype == at::kFloat ? 4 : 2});
      }
    }
    EXPECT_EQ(tp_copies, (std::multiset<std::vector<int64_t>>{{2}, {2}, {4}, {4}}));
  }
  ParallelLayout distributed;
  distributed.world_size = 2;
  distributed.data_parallel = DataParallelKind::kDistributedOptimizer;
  RunSpec spec;
  spec.model = m;
  spec.training = t;
  spec.layout = distributed;
  std::optional<ValidatedRun> run;
  EXPECT_NE(FinalizeRunSpec(spec, &run).message().find("plain DDP only"), std::string::npos);
  ModelConfig gated = m;
  gated.attention_output_gate = true;
  EXPECT_NE(ValidateTrainingConfig(t, gated).message().find("attention output gate"),
            std::string::npos);
}

// Transformer Engine drops FlashAttention when it returns the max logit, so Ampere takes
// cuDNN fused attention; the local spec, context parallelism and CUDA graphs are refused.
TEST(MaxAttentionLogit, RulesAndBackend) {
  TrainingConfig t;
  t.precision = Precision::kBf16;
  t.log_max_attention_logit = true;
  AttentionKind got = AttentionKind::kEager;
  ASSERT_TRUE(SelectTeAttention(TeAttentionChoice{}, t, ModelConfig(), 80, &got).ok());
  EXPECT_EQ(got, AttentionKind::kFused);
  TeAttentionChoice flash_only;
  flash_only.fused = flash_only.unfused = false;
  EXPECT_FALSE(SelectTeAttention(flash_only, t, ModelConfig(), 90, &got).ok());
  const Shape x{32, 2, 64, 4};
  const ModelConfig m = Gpt(x, 2);
  t.seq_length = x.s;
  t.attention = AttentionKind::kFused;
  EXPECT_NE(ValidateTrainingConfig(t, m).message().find("local DotProductAttention"),
            std::string::npos);
  t.profile = ProfileKind::kTransformerEngine;
  EXPECT_TRUE(ValidateTrainingConfig(t, m).ok());
  t.cuda_graphs = true;
  EXPECT_NE(ValidateTrainingConfig(t, m).message().find("CUDA graphs"), std::string::npos);
  t.cuda_graphs = false;
  t.attention = AttentionKind::kFlash;
  EXPECT_NE(ValidateTrainingConfig(t, m).message().find("drops FlashAttention"), std::string::npos);
}

// Note [Counting zeros in gradients], by hand for the tiny GPT of BytesPerParameter (tied
// embeddings, 2 layers of h = 128, bf16, plain DDP: fp32 main gradients, so the step's master
// gradients are views and the count's tensors are the only storages the step makes): each
// step makes a bool [numel] and an int64 [numel] tensor per counted parameter, one parameter
// at a time, so the step peaks 9 bytes per element of the largest gradient above its start,
// plus the running total and the sum (8 bytes each): the word embedding's 1024 * 128 on one
// stage. On the last stage of PP2 the output layer's copy of the tied embedding is `shared`
// and skipped: the largest is a layer's fc1 weight, 512 * 128.
TEST(CountZerosInGrads, ABoolAndAnInt64CopyOfEachGradientOneAtATime) {
  const Shape x{64, 1, 128, 4};
  const ModelConfig m = Gpt(x, 2);
  // A layer's tensors: two norms (weight, bias), qkv, proj, fc1 and fc2 (weight, bias).
  const std::vector<int64_t> layer = {128, 128, 3 * 128 * 128, 3 * 128, 128 * 128, 128,
                                      128, 128, 512 * 128,     512,     512 * 128, 128};
  for (int64_t pp : {1, 2}) {
    TrainingConfig t = Fp16Eager(x);
    t.precision = Precision::kBf16;
    t.iterations = 2;
    t.log_num_zeros_in_grad = true;
    ParallelLayout layout;
    layout.world_size = pp;
    layout.pp = pp;
    ASSERT_TRUE(FinalizeLayout(&layout, m).ok());
    const std::unique_ptr<Session> session =
        test::RecordRank(test::Validated(m, t, layout), /*pp_rank=*/pp - 1);
    const Recorder& r = session->recorder();
    std::vector<int64_t> expected = {128, 128};  // the final norm
    for (int64_t l = 0; l < 2 / pp; ++l)
      expected.insert(expected.end(), layer.begin(), layer.end());
    if (pp == 1) expected.insert(expected.end(), {1024 * 128, 64 * 128});  // both embeddings
    std::sort(expected.begin(), expected.end());
    const int64_t largest = expected.back();
    for (int32_t it : {0, 1}) {
      const int64_t begin =
          MarkerAt(r, MarkerKind::kPhaseBegin, it, -1, Phase::kOptimizer).event_index;
      const int64_t end =
          MarkerAt(r, MarkerKind::kIterationEnd, it, -1, Phase::kOptimizer).event_index;
      std::vector<int64_t> bools, int64s;
      for (const StorageInfo& info : r.storages()) {
        if (info.alloc_event < begin || info.alloc_event >= end) continue;
        if (info.dtype == at::kBool) bools.push_back(info.size_bytes);
        if (info.dtype == at::kLong && info.size_bytes > 8) int64s.push_back(info.size_bytes / 8);
      }
      std::sort(bools.begin(), bools.end());
      std::sort(int64s.begin(), int64s.end());
      EXPECT_EQ(bools, expected) << "pp=" << pp << " iteration " << it;
      EXPECT_EQ(int64s, expected) << "pp=" << pp << " iteration " << it;
      if (it == 0) continue;  // the first step's Adam states come after the count
      int64_t peak = 0;
      for (int64_t e = begin; e <= end; ++e) peak = std::max(peak, test::LiveBytesBefore(r, e));
      EXPECT_EQ(peak - test::LiveBytesBefore(r, begin), 9 * largest + 16) << "pp=" << pp;
    }
  }
}

// The schedule's locals (Note [Tensors the schedule keeps]): on the last stage (1F1B, no
// warm-up) microbatch 1's input gradient lives through microbatch 2's forward, and so does
// its input, which the popped output_tensor's spent graph holds until that forward returns;
// on the first stage microbatch 1's received output gradient lives until microbatch 2's is
// received.
TEST(PipelineMemory, TheScheduleKeepsTheLastGradientsIntoTheNextSteps) {
  const Shape x{256, 2, 256, 8};
  const ModelConfig m = Gpt(x, 4);
  TrainingConfig t = Fp16Eager(x);
  t.precision = Precision::kBf16;
  t.num_microbatches = 4;
  t.iterations = 1;
  const int64_t hidden_bytes = x.s * x.b * x.h * 2;
  const ValidatedRun run = test::Validated(m, t, PipelineOnly(m, 2));
  const std::unique_ptr<Session> first_stage = test::RecordRank(run, 0);
  const std::unique_ptr<Session> last_stage = test::RecordRank(run, 1);
  using Kept = std::vector<std::pair<Phase, int64_t>>;
  const Recorder& last = last_stage->recorder();
  // Before microbatch 2's forward: microbatch 1's input and its gradient.
  EXPECT_EQ(
      KeptOfMicrobatch(last, MarkerAt(last, MarkerKind::kPhaseBegin, 0, 2, Phase::kForward), 0, 1),
      (Kept{{Phase::kForward, hidden_bytes}, {Phase::kBackward, hidden_bytes}}));
  // After it (before microbatch 2's backward): the gradient alone.
  EXPECT_EQ(
      KeptOfMicrobatch(last, MarkerAt(last, MarkerKind::kPhaseBegin, 0, 2, Phase::kBackward), 0, 1),
      (Kept{{Phase::kBackward, hidden_bytes}}));
  // The input goes after microbatch 2's forward has made its last tensor.
  int64_t input_freed = -1, last_forward_alloc = -1;
  for (const StorageInfo& s : last.storages()) {
    if (s.iteration != 0 || s.phase != Phase::kForward) continue;
    if (s.microbatch == 1 && s.module == 0) input_freed = s.free_event;
    if (s.microbatch == 2) last_forward_alloc = std::max(last_forward_alloc, s.alloc_event);
  }
  EXPECT_GT(input_freed, last_forward_alloc);
  // Stage 0 (order F0 F1 B0 F2 B1 F3 B2 F4...): microbatch 1's output gradient, received in
  // its backward, is still there when microbatch 2's backward begins, after F3.
  const Recorder& first = first_stage->recorder();
  EXPECT_EQ(KeptOfMicrobatch(
                first, MarkerAt(first, MarkerKind::kPhaseBegin, 0, 2, Phase::kBackward), 0, 1),
            (Kept{{Phase::kBackward, hidden_bytes}}));
}

// The interleaved schedule receives a backward's output gradient with the input of the
// forward step before it: on stage 0 of PP 2, VPP 2 (order F2c0 B0c1 F3c0 B1c1 ...), the
// gradient for microbatch 1's backward of chunk 1 is alive when that backward begins,
// received during microbatch 3's forward of chunk 0 (whose chunk embeds: no input).
TEST(PipelineMemory, InterleavedScheduleReceivesTheOutputGradientAStepEarly) {
  const Shape x{256, 2, 256, 8};
  const ModelConfig m = Gpt(x, 4);
  TrainingConfig t = Fp16Eager(x);
  t.precision = Precision::kBf16;
  t.num_microbatches = 8;
  t.iterations = 1;
  const ParallelLayout layout = PipelineOnly(m, 2, 2);
  const std::unique_ptr<Session> session = test::RecordRank(test::Validated(m, t, layout));
  const Recorder& r = session->recorder();
  EXPECT_EQ(KeptOfMicrobatch(r, MarkerAt(r, MarkerKind::kPhaseBegin, 0, 1, Phase::kBackward), 0, 3),
            (std::vector<std::pair<Phase, int64_t>>{
                {Phase::kForward, 2},  // microbatch 3's sent output, deallocated to a stub
                {Phase::kForward, x.s * x.b * x.h * 2}}));
}

TEST(RankClasses, EightThousandGpusSimulateOneRankPerStage) {
  ModelConfig m = Gpt({2048, 1, 20480, 160}, 96, 8);
  ParallelLayout layout;
  layout.world_size = 8192;
  layout.tp = 8;
  layout.pp = 16;
  ASSERT_TRUE(FinalizeLayout(&layout, m).ok());
  EXPECT_EQ(layout.dp, 64);
  const std::vector<RankClass> classes = RankClasses(layout);
  ASSERT_EQ(classes.size(), 16u);
  std::vector<int> seen(8192, 0);
  for (const RankClass& c : classes) {
    EXPECT_EQ(c.num_ranks, 512);
    for (int64_t rank = c.representative; rank <= c.last_rank(); ++rank) {
      seen[static_cast<size_t>(rank)] += 1;
      EXPECT_EQ(CoordinatesOf(layout, rank).pp_rank, c.pp_rank);
    }
  }
  for (int count : seen) EXPECT_EQ(count, 1);
  // Megatron order tp-cp-dp-pp: rank 8 is tp 0, dp 1 of stage 0; rank 512 starts stage 1.
  EXPECT_EQ(CoordinatesOf(layout, 8).dp_rank, 1);
  EXPECT_EQ(CoordinatesOf(layout, 512).pp_rank, 1);
  EXPECT_EQ(classes[1].representative, 512);
}

// get_num_layers_to_build (Megatron-Core transformer_block.py) with the embedding and the
// loss counted in the split: 6 layers + 2 over PP 4 x VPP 2 is 1 per chunk, and the first
// chunk of stage 0 and the last chunk of stage 3 build none.
TEST(Layout, EmbeddingAndLossCountedInThePipelineSplit) {
  ModelConfig m = Gpt({128, 1, 512, 8}, 6, 1);
  ParallelLayout l;
  l.world_size = 4;
  l.pp = 4;
  l.vpp = 2;
  l.embedding_in_split = l.loss_in_split = true;
  ASSERT_TRUE(FinalizeLayout(&l, m).ok());
  // (stage, chunk) -> layers, first layer; chunk c of stage r is model chunk c * 4 + r.
  const int64_t expected[4][2][2] = {
      {{0, 0}, {1, 3}}, {{1, 0}, {1, 4}}, {{1, 1}, {1, 5}}, {{1, 2}, {0, 6}}};
  for (int64_t r = 0; r < 4; ++r) {
    for (int64_t c = 0; c < 2; ++c) {
      EXPECT_EQ(LayersOnStage(l, m, r, c), expected[r][c][0]) << r << "," << c;
      EXPECT_EQ(FirstLayerOfStage(l, m, r, c), expected[r][c][1]) << r << "," << c;
    }
  }
  // Only the embedding: 6 + 1 = 7 layers do not split over 4 x 2 chunks.
  l.loss_in_split = false;
  EXPECT_EQ(FinalizeLayout(&l, m).message(),
            "PP*VPP=4*2 does not divide 7 layers (with the embedding and loss counted)");
  // Not with an uneven split, as in Megatron-Core.
  l.vpp = 1;
  l.first_stage_layers = 1;
  l.last_stage_layers = 1;
  EXPECT_NE(FinalizeLayout(&l, m).message().find("cannot be combined"), std::string::npos);
}

// Uneven stages with virtual stages, run: 14 layers on PP 4 x VPP 2 with only the last
// stage named (2 layers) give every other stage 4, so chunks of 2, 2, 2, 1 layers, chunk c
// of stage r starting at layer c * 7 + 2r (Megatron-Core's get_transformer_layer_offset).
// The stages build exactly those layers' parameters.
TEST(Layout, UnevenVirtualStagesBuildTheirLayers) {
  const Shape x{16, 1, 64, 4};
  ParallelLayout l;
  l.world_size = 4;
  l.pp = 4;
  l.vpp = 2;
  l.last_stage_layers = 2;
  TrainingConfig t = Fp16Eager(x);
  t.num_microbatches = 4;
  t.iterations = 1;
  const ValidatedRun run = test::Validated(Gpt(x, 14), t, l);
  const std::set<int64_t> expected[4] = {{0, 1, 7, 8}, {2, 3, 9, 10}, {4, 5, 11, 12}, {6, 13}};
  for (int64_t stage = 0; stage < 4; ++stage) {
    const std::unique_ptr<Session> session = test::RecordRank(run, stage);
    const Recorder& r = session->recorder();
    std::set<int64_t> layers;
    for (const StorageInfo& info : r.storages()) {
      const std::string& module = r.names().Name(info.module);
      const std::string prefix = "decoder.layers.";
      if (info.category == Category::kParameter && module.rfind(prefix, 0) == 0) {
        layers.insert(std::stoll(module.substr(prefix.size())));
      }
    }
    EXPECT_EQ(layers, expected[stage]) << "stage " << stage;
  }
}

TEST(Layout, ReportsTheBrokenRule) {
  ModelConfig m = Gpt({128, 1, 4096, 32}, 32, 1);
  auto check = [&](ParallelLayout l) { return FinalizeLayout(&l, m).message(); };
  ParallelLayout l;
  l.world_size = 24;
  l.tp = 3;
  EXPECT_EQ(check(l), "TP=3 does not divide 32 attention heads");
  l = ParallelLayout();
  l.world_size = 12;
  l.tp = 8;
  EXPECT_EQ(check(l), "world size 12 is not a multiple of TP*PP*CP = 8*1*1 = 8");
  l = ParallelLayout();
  l.world_size = 6;
  l.pp = 6;
  EXPECT_EQ(check(l),
            "PP*VPP=6*1 does not divide 32 layers; give the first or last stage's layers for an "
            "uneven split (--first-stage-layers/--last-stage-layers; Megatron-LM's "
            "--decoder-first/last-pipeline-num-layers) or a pipeline layout");
  l = ParallelLayout();
  l.world_size = 4;
  l.ep = 2;
  EXPECT_EQ(check(l), "EP=2 needs a mixture-of-experts model (num_experts > 0)");
}

}  // namespace
}  // namespace memsim

namespace memsim {
namespace {

ModelConfig SmallMoe(double capacity_factor, int64_t tp = 2) {
  ModelConfig m = test::Llama(2, 256, 8, 4, 512, 1024);
  m.num_experts = 8;
  m.moe_router_topk = 2;
  m.moe_capacity_factor = capacity_factor;
  EXPECT_TRUE(FinalizeModelConfig(&m, tp).ok());
  return m;
}

// Note [Counting zeros in gradients] with stacked experts, by hand: Megatron has a parameter
// per expert, so a rank's share is counted expert by expert. A 2-layer MoE of 8 experts
// (h 256, SwiGLU experts of 512: fc1 [8 * 1024, 256], fc2 [256, 8 * 512]) under ZeRO-2 on
// 2 ranks: rank 0's share of each stacked tensor is its first half, experts 0-3 whole, so
// each fc1 is counted as 4 gradients of 1024 * 256 elements (8 in all; no other gradient
// of the rank has that size), not as 8 equal chunks of the share.
TEST(CountZerosInGrads, EachExpertOfAStackedTensorApart) {
  const ModelConfig m = SmallMoe(0, /*tp=*/1);
  TrainingConfig t;
  t.seq_length = 64;
  t.micro_batch_size = 1;
  t.iterations = 1;
  t.precision = Precision::kBf16;
  t.log_num_zeros_in_grad = true;
  const std::unique_ptr<Session> session = test::RecordRank(
      test::Validated(m, t, DataParallelLayout(m, 2, DataParallelKind::kZero2)), 0);
  const Recorder& r = session->recorder();
  const int64_t begin = MarkerAt(r, MarkerKind::kPhaseBegin, 0, -1, Phase::kOptimizer).event_index;
  int64_t expert_sized = 0;
  for (const StorageInfo& info : r.storages()) {
    expert_sized +=
        info.alloc_event >= begin && info.dtype == at::kBool && info.size_bytes == 1024 * 256;
  }
  EXPECT_EQ(expert_sized, 8);
}

// The GEMM workspaces (Note [Library workspaces]) a stage of `layout` allocates, by module.
std::map<std::string, int64_t> WorkspaceBytes(const ModelConfig& m, const TrainingConfig& t,
                                              const ParallelLayout& layout, int64_t pp_rank,
                                              const char* gpu) {
  const std::unique_ptr<Session> session =
      test::RecordRank(test::Validated(m, t, layout), pp_rank, FindGpu(gpu));
  const Recorder& r = session->recorder();
  std::map<std::string, int64_t> bytes;
  for (const StorageInfo& s : r.storages()) {
    const std::string module = r.names().Name(s.module);
    if (module.find("workspace") != std::string::npos) bytes[module] += s.size_bytes;
  }
  return bytes;
}

// The MoE router's gating GEMMs go through Transformer Engine's general_gemm in either
// implementation (Megatron-Core's RouterGatingLinearFunction): a local-implementation MoE
// stage holds TE's GEMM workspace (32 MiB + 1 KiB on Hopper, 4 MiB on Ampere) beside
// PyTorch's two cuBLAS workspaces (CUBLAS_WORKSPACE_CONFIG :4096:8, 32 MiB each), and a TE
// stage without the loss and with fused attention runs no GEMM through PyTorch at all.
TEST(ExpertParallel, RouterGemmsUseTransformerEnginesWorkspace) {
  const ModelConfig m = SmallMoe(0);
  TrainingConfig t;
  t.seq_length = 128;
  t.micro_batch_size = 1;
  t.iterations = 1;
  t.cublas_workspace_bytes = 32 << 20;
  ParallelLayout layout;
  layout.world_size = 4;
  layout.tp = 2;
  layout.pp = 2;
  ASSERT_TRUE(FinalizeLayout(&layout, m).ok());
  t.profile = ProfileKind::kMegatronLocal;
  t.attention = AttentionKind::kFlash;
  const std::map<std::string, int64_t> local = {
      {"cublas_workspace.backward_thread", 32 << 20},
      {"cublas_workspace.forward_thread", 32 << 20},
      {"transformer_engine.gemm_workspace", (32 << 20) + 1024}};
  EXPECT_EQ(WorkspaceBytes(m, t, layout, 0, "H100-80GB"), local);
  std::map<std::string, int64_t> ampere = local;
  ampere["transformer_engine.gemm_workspace"] = 4 << 20;
  EXPECT_EQ(WorkspaceBytes(m, t, layout, 0, "A100-80GB"), ampere);
  t.profile = ProfileKind::kTransformerEngine;
  t.attention = AttentionKind::kFused;
  EXPECT_EQ(
      WorkspaceBytes(m, t, layout, 0, "H100-80GB"),
      (std::map<std::string, int64_t>{{"transformer_engine.gemm_workspace", (32 << 20) + 1024}}));
}

// --moe-shared-expert-overlap (Note [Library workspaces]): the local implementation's shared
// experts run their GEMMs on a stream of their own in forward and backward, so a stage with
// MoE layers holds two more cuBLAS workspaces (:4096:8, 32 MiB each) than without the
// overlap; under Transformer Engine its one GEMM workspace serves every stream. Megatron-Core
// asserts the alltoall or flex dispatcher for it.
TEST(ExpertParallel, SharedExpertOverlapStreamHasItsOwnWorkspaces) {
  ModelConfig m = SmallMoe(0);
  m.moe_shared_expert_size = 256;
  ASSERT_TRUE(FinalizeModelConfig(&m, 2).ok());
  TrainingConfig t;
  t.seq_length = 128;
  t.micro_batch_size = 1;
  t.iterations = 1;
  t.cublas_workspace_bytes = 32 << 20;
  t.profile = ProfileKind::kMegatronLocal;
  t.attention = AttentionKind::kFlash;
  t.moe_dispatcher = MoeDispatcher::kAllToAll;
  ParallelLayout layout;
  layout.world_size = 2;
  layout.tp = 2;
  ASSERT_TRUE(FinalizeLayout(&layout, m).ok());
  std::map<std::string, int64_t> expected = WorkspaceBytes(m, t, layout, 0, "H100-80GB");
  t.moe_shared_expert_overlap = true;
  expected["cublas_workspace.shared_expert_stream.forward_thread"] = 32 << 20;
  expected["cublas_workspace.shared_expert_stream.backward_thread"] = 32 << 20;
  EXPECT_EQ(WorkspaceBytes(m, t, layout, 0, "H100-80GB"), expected);
  t.profile = ProfileKind::kTransformerEngine;
  t.attention = AttentionKind::kFused;
  const std::map<std::string, int64_t> te = WorkspaceBytes(m, t, layout, 0, "H100-80GB");
  t.moe_shared_expert_overlap = false;
  EXPECT_EQ(WorkspaceBytes(m, t, layout, 0, "H100-80GB"), te);
  t.moe_shared_expert_overlap = true;
  t.moe_dispatcher = MoeDispatcher::kAllGather;
  EXPECT_NE(ValidateTrainingConfig(t, m).message().find("alltoall or flex token dispatcher"),
            std::string::npos);
}

// --output-logit-dtype fp32 on bf16 training: the output layer's forward GEMM goes through
// Transformer Engine's general_gemm, its backward GEMMs through PyTorch. A dense last stage
// of Transformer Engine layers with fused attention then runs no GEMM through PyTorch on
// the forward thread (no forward cuBLAS workspace) unless the main thread runs GEMMs after
// the schedule; under the local implementation it holds TE's workspace beside PyTorch's two.
TEST(LibraryWorkspaces, Float32LogitsUseTransformerEnginesGemm) {
  ModelConfig m = test::Llama(2, 256, 8, 4, 512, 1024);
  ASSERT_TRUE(FinalizeModelConfig(&m).ok());
  TrainingConfig t;
  t.seq_length = 128;
  t.iterations = 1;
  t.cublas_workspace_bytes = 32 << 20;
  t.output_logit_dtype = Precision::kFp32;
  ParallelLayout layout;
  layout.world_size = 2;
  layout.pp = 2;
  ASSERT_TRUE(FinalizeLayout(&layout, m).ok());
  const int64_t te = (32 << 20) + 1024;
  t.profile = ProfileKind::kTransformerEngine;
  t.attention = AttentionKind::kFused;
  EXPECT_EQ(WorkspaceBytes(m, t, layout, 1, "H100-80GB"),
            (std::map<std::string, int64_t>{{"cublas_workspace.backward_thread", 32 << 20},
                                            {"transformer_engine.gemm_workspace", te}}));
  t.profile = ProfileKind::kMegatronLocal;
  t.attention = AttentionKind::kFlash;
  EXPECT_EQ(WorkspaceBytes(m, t, layout, 1, "H100-80GB"),
            (std::map<std::string, int64_t>{{"cublas_workspace.backward_thread", 32 << 20},
                                            {"cublas_workspace.forward_thread", 32 << 20},
                                            {"transformer_engine.gemm_workspace", te}}));
  // Deferred output-layer weight gradients run on the main thread when the schedule ends
  // (drain_embedding_wgrad_compute), and Muon's Newton-Schulz iterations in the optimizer
  // step: the forward thread's workspace is made then.
  t.profile = ProfileKind::kTransformerEngine;
  t.attention = AttentionKind::kFused;
  t.defer_embedding_wgrad = true;
  const std::map<std::string, int64_t> main_thread = {
      {"cublas_workspace.backward_thread", 32 << 20},
      {"cublas_workspace.forward_thread", 32 << 20},
      {"transformer_engine.gemm_workspace", te}};
  EXPECT_EQ(WorkspaceBytes(m, t, layout, 1, "H100-80GB"), main_thread);
  t.defer_embedding_wgrad = false;
  t.optimizer = OptimizerKind::kMuon;
  EXPECT_EQ(WorkspaceBytes(m, t, layout, 1, "H100-80GB"), main_thread);
  EXPECT_EQ(WorkspaceBytes(m, t, layout, 0, "H100-80GB"),
            (std::map<std::string, int64_t>{{"cublas_workspace.forward_thread", 32 << 20},
                                            {"transformer_engine.gemm_workspace", te}}));
  t.optimizer = OptimizerKind::kAdam;
  t.profile = ProfileKind::kMegatronLocal;
  t.attention = AttentionKind::kFlash;
  t.output_logit_dtype = Precision::kBf16;  // the input's dtype: torch.matmul, as without it
  EXPECT_EQ(WorkspaceBytes(m, t, layout, 1, "H100-80GB"),
            (std::map<std::string, int64_t>{{"cublas_workspace.backward_thread", 32 << 20},
                                            {"cublas_workspace.forward_thread", 32 << 20}}));
}

// `m` (SmallMoe) on TP2 EP2 of 8 GPUs with sequence parallelism and the alltoall dispatcher,
// S = 512, B = 2: T = S*B/tp = 512 tokens a rank, one step.
RunSpec SmallMoeAllToAll(const ModelConfig& m) {
  RunSpec spec;
  spec.model = m;
  spec.training.seq_length = 512;
  spec.training.micro_batch_size = 2;
  spec.training.iterations = 1;
  spec.training.moe_dispatcher = MoeDispatcher::kAllToAll;
  spec.layout.world_size = 8;
  spec.layout.tp = 2;
  spec.layout.ep = 2;
  spec.layout.sequence_parallel = true;
  return spec;
}

// Sizes of the storages rank 0 of SmallMoeAllToAll(m) allocated in forward inside `module`
// (whole name) or by `op`; one of them empty.
std::multiset<int64_t> ForwardAllocations(const ModelConfig& m, const std::string& module,
                                          const std::string& op) {
  const std::unique_ptr<Session> session = test::RecordRank(test::Validated(SmallMoeAllToAll(m)));
  const Recorder& r = session->recorder();
  std::multiset<int64_t> sizes;
  for (const StorageInfo& s : r.storages()) {
    if (s.phase == Phase::kForward &&
        (module.empty() ? r.names().Name(s.op) == op : r.names().Name(s.module) == module)) {
      sizes.insert(s.size_bytes);
    }
  }
  return sizes;
}

// Mixtral-style MoE on TP2 PP1 EP2 with the alltoall dispatcher, T = S*B/tp = 512 tokens
// with sequence parallelism, K = 2 of E = 8 experts: the all-to-all carries a rank's D
// dispatched rows of H bf16 values out and back, and the R rows its experts receive come in
// with their probabilities, one bf16 value a row. Evenly routed, D = R = T*K; with a
// capacity factor cf an expert takes at most c = ceil(cf * T*K / E) of a rank's tokens
// (moe_utils.get_capacity), D = min(T*K, E*c), and padded to capacity D = R = E*c; when the
// busiest rank's experts take f times the mean (--moe-imbalance), R = ceil(f * T*K), at
// most E*c.
TEST(ExpertParallel, AllToAllRowsFollowTheCapacity) {
  struct Case {
    double cf;
    bool pad;
    double f;
    int64_t d, r;
  };
  // T*K = 1024; c = 64 (cf 0.5), 160 (1.25), 192 (1.5), 256 (2).
  for (const Case& c : {Case{0, false, 1, 1024, 1024}, Case{0.5, false, 1, 512, 512},
                        Case{1.5, false, 1, 1024, 1024}, Case{0.5, true, 1, 512, 512},
                        Case{1.5, true, 1, 1536, 1536}, Case{2, true, 1, 2048, 2048},
                        Case{0, false, 1.5, 1024, 1536}, Case{1.25, false, 1.5, 1024, 1280},
                        Case{1.25, true, 1.5, 1280, 1280}}) {
    ModelConfig m = SmallMoe(c.cf);
    m.moe_pad_to_capacity = c.pad;
    m.moe_imbalance_factor = c.f;
    // Per MoE layer (2 layers): the probabilities, the tokens in and the tokens back.
    EXPECT_EQ(ForwardAllocations(m, "", "memsim::comm_all_to_all"),
              (std::multiset<int64_t>{c.r * 2, c.r * 2, c.r * 256 * 2, c.r * 256 * 2, c.d * 256 * 2,
                                      c.d * 256 * 2}))
        << c.cf << (c.pad ? " padded" : "") << " f " << c.f;
  }
  // c = 640 of the 512 tokens: Megatron-LM's padded permute cannot take it.
  ModelConfig too_large = SmallMoe(5);
  too_large.moe_pad_to_capacity = true;
  const RunSpec spec = SmallMoeAllToAll(too_large);
  std::optional<ValidatedRun> run;
  EXPECT_EQ(FinalizeRunSpec(spec, &run).message(),
            "padding expert inputs to capacity needs a capacity of at most the 512 tokens a rank "
            "routes, got 640 (top-k x capacity factor above the experts): Megatron-LM fails on "
            "it; lower the capacity factor");
}

// apply_router_token_dropping (moe_utils.py), per MoE layer, c = 64 of T = 512 tokens, E = 8
// (bf16 probabilities): topk over each expert's column, values [c, E] bf16 and indices [c, E]
// int64; zeros [T, E] bf16 scattered into a new [T, E] bf16, made bool [T, E]; the map and
// the mask, a new bool [T, E] (not when padded: the mask is the map); the probabilities times
// it, [T, E] bf16. The position policy ranks the map as int32 [T, E], and its top-k values
// are int32.
TEST(ExpertParallel, TokenDroppingMasksTheRouting) {
  auto router_allocations = [](const ModelConfig& m) {
    return ForwardAllocations(m, "decoder.layers.0.mlp.router", "");
  };
  const std::multiset<int64_t> dropless = router_allocations(SmallMoe(0));
  auto added = [&](ModelConfig m) {
    std::multiset<int64_t> with = router_allocations(std::move(m));
    for (int64_t size : dropless) {
      auto it = with.find(size);
      EXPECT_NE(it, with.end()) << size;
      if (it != with.end()) with.erase(it);
    }
    return with;
  };
  const int64_t T = 512, E = 8, c = 64;
  EXPECT_EQ(added(SmallMoe(0.5)), (std::multiset<int64_t>{c * E * 2, c * E * 8, T * E * 2,
                                                          T * E * 2, T * E, T * E, T * E * 2}));
  ModelConfig padded = SmallMoe(0.5);
  padded.moe_pad_to_capacity = true;
  EXPECT_EQ(added(padded),
            (std::multiset<int64_t>{c * E * 2, c * E * 8, T * E * 2, T * E * 2, T * E, T * E * 2}));
  ModelConfig position = SmallMoe(0.5);
  position.moe_drop_by_position = true;
  EXPECT_EQ(added(position), (std::multiset<int64_t>{T * E * 4, c * E * 4, c * E * 8, T * E * 2,
                                                     T * E * 2, T * E, T * E, T * E * 2}));
  // The permutation's argsort int64 [E * T]: the probabilities gather through a view of it
  // and keep it until backward; padded, the first c of each expert are copied out and the
  // permuted probabilities index their own int64 [E * c], so it goes in forward.
  auto argsort_freed_in = [&](const ModelConfig& m) {
    const std::unique_ptr<Session> session = test::RecordRank(test::Validated(SmallMoeAllToAll(m)));
    const Recorder& r = session->recorder();
    std::set<Phase> phases;
    for (const StorageInfo& s : r.storages()) {
      if (r.names().Name(s.module) == "decoder.layers.0.mlp.token_dispatcher" &&
          s.dtype == at::kLong && s.size_bytes == E * T * 8 && s.free_event >= 0) {
        Phase at = Phase::kSetup;  // the phase whose marker last precedes the free
        for (const Marker& marker : r.markers()) {
          if (marker.kind == MarkerKind::kPhaseBegin && marker.event_index <= s.free_event) {
            at = marker.phase;
          }
        }
        phases.insert(at);
      }
    }
    return phases;
  };
  EXPECT_EQ(argsort_freed_in(SmallMoe(0.5)), std::set<Phase>{Phase::kBackward});
  EXPECT_EQ(argsort_freed_in(padded), std::set<Phase>{Phase::kForward});
}

// Megatron's default allgather dispatcher on EP2 (etp = tp = 1, T = S*B tokens): the
// hidden states of both ranks are gathered into Megatron's persistent global buffer,
// [2T, H] bf16 once for all layers; the local probabilities [E_local, 2T] bf16 and their
// mask [E_local, 2T] bool are saved per layer.
TEST(ExpertParallel, AllGatherDispatcherUsesThePersistentGlobalBuffer) {
  ModelConfig m = test::Llama(2, 256, 8, 4, 512, 1024);
  m.num_experts = 8;
  m.moe_router_topk = 2;
  ASSERT_TRUE(FinalizeModelConfig(&m).ok());
  TrainingConfig t;
  t.seq_length = 128;
  t.micro_batch_size = 2;
  t.iterations = 1;
  t.profile = ProfileKind::kTransformerEngine;
  ParallelLayout l;
  l.world_size = 2;
  l.ep = 2;
  ASSERT_TRUE(FinalizeLayout(&l, m).ok());
  const std::unique_ptr<Session> session = test::RecordRank(test::Validated(m, t, l));
  const Recorder& r = session->recorder();
  const int64_t gathered = 2 * 128 * 2;  // 2T
  std::vector<int64_t> global_buffers;
  int64_t masks = 0, local_probs = 0;
  for (const StorageInfo& s : r.storages()) {
    const std::string& module = r.names().Name(s.module);
    if (module == "mpu.global_memory_buffer") global_buffers.push_back(s.size_bytes);
    if (s.phase != Phase::kForward || module.find("token_dispatcher") == std::string::npos) {
      continue;
    }
    if (s.dtype == at::kBool && s.size_bytes == 4 * gathered) ++masks;  // E_local = 4
    if (s.dtype == at::kBFloat16 && s.size_bytes == 4 * gathered * 2) ++local_probs;
  }
  EXPECT_EQ(global_buffers, std::vector<int64_t>{gathered * 256 * 2});
  // Per layer (one microbatch): 4 * 2T bools three times (the permutation's transposed
  // map, the kept local map [2T, 4], masked_select's transposed mask [4, 2T]) and 4 * 2T
  // bf16 probabilities twice (the local slice [2T, 4] and its transpose [4, 2T]).
  EXPECT_EQ(masks, 2 * 3);
  EXPECT_EQ(local_probs, 2 * 2);
}

TEST(ExpertParallel, ExpertsShardOverEpAndMixtralHasItsParameterCount) {
  ModelConfig m = test::Mixtral8x7b();
  ASSERT_TRUE(FinalizeModelConfig(&m).ok());
  auto count = [&](int64_t ep) {
    Session session;
    ActiveSession active(session);
    TrainingConfig t;
    ParameterStore store(Precision::kBf16);
    ModelShard shard = ModelShard::Whole(m);
    shard.ep = ep;
    TransformerModel model(m, t, shard, &store);
    return store.num_elements();
  };
  EXPECT_EQ(count(1), 46702792704);  // mistralai/Mixtral-8x7B-v0.1
  // With EP=8 each rank holds one expert per layer: 7/8 of the expert weights go.
  EXPECT_EQ(count(8), 46702792704 - int64_t{32} * 7 * 3 * 4096 * 14336);
}

}  // namespace
}  // namespace memsim

namespace memsim {
namespace {

// The event logs of two simulations of one stage are identical: every event in order,
// with its storage's size, attribution (module, op, phase, category, microbatch,
// iteration, shape) and time; so is every number derived from them.
void ExpectSameEventLog(const Recorder& a, const Recorder& b, const std::string& what) {
  EXPECT_EQ(a.events().size(), b.events().size()) << what;
  EXPECT_EQ(a.storages().size(), b.storages().size()) << what;
  for (size_t e = 0; e < std::min(a.events().size(), b.events().size()); ++e) {
    const MemoryEvent& ea = a.events()[e];
    const MemoryEvent& eb = b.events()[e];
    const StorageInfo& sa = a.storages()[static_cast<size_t>(ea.storage_id)];
    const StorageInfo& sb = b.storages()[static_cast<size_t>(eb.storage_id)];
    const std::string where = what + ", event " + std::to_string(e) + " (" +
                              a.names().Name(sa.module) + " vs " + b.names().Name(sb.module) + ")";
    ASSERT_EQ(ea.storage_id, eb.storage_id)
        << where << " alloc events " << sa.alloc_event << " / " << sb.alloc_event << " phases "
        << static_cast<int>(sa.phase) << " size " << sa.size_bytes << " / " << sb.size_bytes
        << " op " << a.names().Name(sa.op) << " / " << b.names().Name(sb.op);
    ASSERT_EQ(ea.is_alloc, eb.is_alloc) << where;
    ASSERT_EQ(sa.size_bytes, sb.size_bytes) << where;
    ASSERT_EQ(a.names().Name(sa.module), b.names().Name(sb.module)) << where;
    ASSERT_EQ(a.names().Name(sa.op), b.names().Name(sb.op)) << where;
    ASSERT_EQ(sa.phase, sb.phase) << where;
    ASSERT_EQ(sa.category, sb.category) << where;
    ASSERT_EQ(sa.microbatch, sb.microbatch) << where;
    ASSERT_EQ(sa.iteration, sb.iteration) << where;
    ASSERT_EQ(sa.dtype, sb.dtype) << where;
    ASSERT_EQ(a.ShapeOf(sa), b.ShapeOf(sb)) << where;
    ASSERT_NEAR(ea.time_s, eb.time_s, 1e-12 + 1e-9 * std::abs(ea.time_s)) << where;
  }
}

// Note [Layer replication]: copying the steady layer's events gives the event log of
// running every layer: GPT (LayerNorm, GeLU, eager attention), Llama (RMSNorm, SwiGLU,
// GQA, flash attention) with tensor and sequence parallelism, MoE with dense first
// layers, every recomputation mode (full runs every layer: tested that it still does
// the same), first, middle and last pipeline stages, and with microbatches replicated.
TEST(LayerReplication, EqualsRunningEveryLayer) {
  struct Case {
    std::string name;
    ModelConfig model;
    TrainingConfig training;
    ParallelLayout layout;
  };
  std::vector<Case> cases;
  const Shape x{256, 2, 256, 8};
  // 12 layers per stage: full recomputation checkpoints 6 groups of 2 (uniform), or the
  // first 2 layers one by one and runs 10 plain (block).
  for (auto [recompute, method] : std::vector<std::pair<RecomputeKind, RecomputeMethod>>{
           {RecomputeKind::kNone, RecomputeMethod::kUniform},
           {RecomputeKind::kSelective, RecomputeMethod::kUniform},
           {RecomputeKind::kFull, RecomputeMethod::kUniform},
           {RecomputeKind::kFull, RecomputeMethod::kBlock}}) {
    Case gpt{"gpt " + std::string(NameOf(kRecomputeMethodNames, method)),
             test::Gpt(24, x.h, x.a),
             Fp16Eager(x),
             {}};
    gpt.training.recompute = recompute;
    gpt.training.recompute_method = method;
    gpt.training.recompute_num_layers = 2;
    gpt.layout.world_size = 4;
    gpt.layout.pp = 2;
    gpt.layout.data_parallel = DataParallelKind::kDistributedOptimizer;
    cases.push_back(gpt);
  }
  Case llama{"llama tp2 sp", test::Llama(14, 256, 8, 2, 704, 1024), Fp16Eager(x), {}};
  llama.training.precision = Precision::kBf16;
  llama.training.attention = AttentionKind::kFlash;
  llama.training.recompute = RecomputeKind::kSelective;
  llama.layout.world_size = 2;
  llama.layout.tp = 2;
  llama.layout.sequence_parallel = true;
  cases.push_back(llama);
  // A layer without RoPE (--no-rope-freq) breaks the run of alike layers in two.
  Case nope = llama;
  nope.name = "llama, layer 8 without RoPE";
  nope.model.no_rope_layers = {0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0};
  cases.push_back(nope);
  // The MLP in sequence chunks, and the max attention logits with QK-clip's step.
  Case chunks = llama;
  chunks.name = "llama tp2 sp, transformer engine, mlp in 3 chunks, qk-clip";
  chunks.training.profile = ProfileKind::kTransformerEngine;
  chunks.training.attention = AttentionKind::kFused;
  chunks.training.mlp_chunks_for_training = 3;
  chunks.training.qk_clip = true;
  cases.push_back(chunks);
  Case moe{"moe, 2 dense first", test::Llama(9, 256, 8, 2, 512, 1024), Fp16Eager(x), {}};
  moe.model.num_experts = 4;
  moe.model.moe_router_topk = 2;
  moe.model.moe_first_k_dense_layers = 2;
  moe.training.precision = Precision::kBf16;
  moe.training.attention = AttentionKind::kFlash;
  moe.layout.world_size = 2;
  moe.layout.ep = 2;
  cases.push_back(moe);
  // Checkpointed MoE layers are never copied; the dense ones beside them may be.
  Case moe_full = moe;
  moe_full.name = "moe, 5 dense first, full recompute (block of 7)";
  moe_full.model.moe_first_k_dense_layers = 5;
  moe_full.training.recompute = RecomputeKind::kFull;
  moe_full.training.recompute_method = RecomputeMethod::kBlock;
  moe_full.training.recompute_num_layers = 7;
  cases.push_back(moe_full);
  // Full recomputation keeping a TP share of each checkpoint's input.
  Case distributed = cases[2];
  distributed.name = "gpt tp2, distributed saved activations";
  distributed.layout.world_size = 8;
  distributed.layout.tp = 2;
  distributed.training.distribute_saved_activations = true;
  cases.push_back(distributed);
  // Selective recomputation of every module (Note [Recompute modules]): output-discarding
  // norms, MLPs checkpointed with and without Transformer Engine's fused pre-MLP norm;
  // the experts' activation, shared experts and whole MoE layers; MLA's up projections.
  const uint32_t all_modules = (1u << std::size(kRecomputeModuleNames)) - 1;
  const uint32_t dense_modules = all_modules & ~RecomputeModuleBit(RecomputeModule::kMoeAct) &
                                 ~RecomputeModuleBit(RecomputeModule::kMlaUpProj);
  Case gpt_modules = cases[0];
  gpt_modules.name = "gpt, recompute modules";
  gpt_modules.training.recompute = RecomputeKind::kSelective;
  gpt_modules.training.recompute_modules = dense_modules;
  cases.push_back(gpt_modules);
  Case llama_te = llama;
  llama_te.name = "llama tp2 sp, transformer engine, recompute modules";
  llama_te.training.profile = ProfileKind::kTransformerEngine;
  llama_te.training.recompute_modules = dense_modules;
  cases.push_back(llama_te);
  // An fp32 residual stream (Note [FP32 residual stream]): a layer frees its float32 input in
  // forward, so the layers run one by one; full recomputation's checkpoints keep their
  // inputs, and groups are copied.
  Case llama_fp32 = llama_te;
  llama_fp32.name = "llama tp2 sp, transformer engine, fp32 residual stream";
  llama_fp32.training.fp32_residual_connection = true;
  cases.push_back(llama_fp32);
  Case gpt_fp32 = cases[2];
  gpt_fp32.name = "gpt, transformer engine, fp32 residual stream, full recompute";
  gpt_fp32.training.profile = ProfileKind::kTransformerEngine;
  gpt_fp32.training.fp32_residual_connection = true;
  cases.push_back(gpt_fp32);
  Case moe_modules = moe;
  moe_modules.name = "moe, shared experts, grouped GEMM, recompute modules but moe";
  moe_modules.model.moe_shared_expert_size = 256;
  moe_modules.training.moe_grouped_gemm = true;
  moe_modules.training.recompute = RecomputeKind::kSelective;
  moe_modules.training.recompute_modules = all_modules &
                                           ~RecomputeModuleBit(RecomputeModule::kMlaUpProj) &
                                           ~RecomputeModuleBit(RecomputeModule::kMoe);
  cases.push_back(moe_modules);
  moe_modules.name = "moe, recompute modules, transformer engine";
  moe_modules.training.profile = ProfileKind::kTransformerEngine;
  moe_modules.training.recompute_modules =
      all_modules & ~RecomputeModuleBit(RecomputeModule::kMlaUpProj);
  cases.push_back(moe_modules);
  Case mla{"mla, recompute modules",
           test::WithLatentAttention(test::Llama(9, 256, 4, 4, 512, 1024), 64, 32, 16, 8, 16),
           Fp16Eager(x),
           {}};
  mla.training.precision = Precision::kBf16;
  mla.training.attention = AttentionKind::kFused;
  mla.training.profile = ProfileKind::kTransformerEngine;
  mla.training.recompute = RecomputeKind::kSelective;
  mla.training.recompute_modules = all_modules & ~RecomputeModuleBit(RecomputeModule::kMoeAct);
  mla.layout.world_size = 2;
  mla.layout.tp = 2;
  mla.layout.sequence_parallel = true;
  cases.push_back(mla);
  // FP8 (Note [FP8 training]): the weights' FP8 copies and the delayed recipe's state,
  // made with the parameters; blockwise gathers under sequence parallelism.
  Case gpt_fp8 = cases[2];
  gpt_fp8.name = "gpt, transformer engine, fp8 delayed, full recompute";
  gpt_fp8.training.profile = ProfileKind::kTransformerEngine;
  gpt_fp8.training.fp8 = Fp8Recipe::kDelayed;
  cases.push_back(gpt_fp8);
  Case llama_fp8 = llama_te;
  llama_fp8.name = "llama tp2 sp, transformer engine, fp8 blockwise, bf16 first layer";
  llama_fp8.training.fp8 = Fp8Recipe::kBlockwise;
  llama_fp8.training.fp8_bf16_layers_at_start = 1;
  cases.push_back(llama_fp8);
  // TP communication overlap: gathers and input gradients in userbuffers (Note
  // [Userbuffers]), in 16 bits and with FP8.
  Case llama_userbuffers = llama_te;
  llama_userbuffers.name = "llama tp2 sp, transformer engine, userbuffers";
  llama_userbuffers.training.tp_comm_overlap = true;
  cases.push_back(llama_userbuffers);
  llama_userbuffers.name += ", fp8 tensorwise";
  llama_userbuffers.training.fp8 = Fp8Recipe::kTensorwise;
  cases.push_back(llama_userbuffers);
  // FP8 experts and shared experts, and MLA's FP8 projections.
  Case moe_fp8 = moe_modules;
  moe_fp8.name = "moe, fp8 tensorwise, recompute modules";
  moe_fp8.training.fp8 = Fp8Recipe::kTensorwise;
  cases.push_back(moe_fp8);
  Case mla_fp8 = mla;
  mla_fp8.name = "mla, fp8 blockwise, recompute modules";
  mla_fp8.training.fp8 = Fp8Recipe::kBlockwise;
  cases.push_back(mla_fp8);
  mla_fp8.name = "mla, fp8 delayed";
  mla_fp8.training.fp8 = Fp8Recipe::kDelayed;
  mla_fp8.training.recompute = RecomputeKind::kNone;
  cases.push_back(mla_fp8);
  // DeepEP's dispatcher keeps three tensors per layer to its next forward (Note [DeepEP
  // dispatch]); delayed weight gradients run inside the layer's backward (Note [Delayed
  // weight gradients]).
  Case deepep = moe_modules;
  deepep.name = "moe, transformer engine, flex dispatcher with DeepEP";
  deepep.training.moe_dispatcher = MoeDispatcher::kDeepEp;
  deepep.training.moe_permute_fusion = true;
  cases.push_back(deepep);
  Case delayed = moe;
  delayed.name = "moe, transformer engine, combined 1F1B, delayed weight gradients";
  delayed.training.profile = ProfileKind::kTransformerEngine;
  delayed.training.moe_dispatcher = MoeDispatcher::kAllToAll;
  delayed.training.delay_wgrad_compute = true;
  delayed.layout.combined_1f1b = true;
  cases.push_back(delayed);
  for (Case& c : cases) {
    c.training.num_microbatches = 4;
    SCOPED_TRACE(c.name);
    const ValidatedRun run = test::Validated(c.model, c.training, c.layout);
    for (int64_t stage = 0; stage < run.spec().layout.pp; ++stage) {
      for (bool microbatches : {false, true}) {
        Session full, replicated;
        {
          ActiveSession active(full);
          RunRankTraining(run, stage, full, {microbatches, false});
        }
        {
          ActiveSession active(replicated);
          RunRankTraining(run, stage, replicated, {microbatches, true});
        }
        const std::string what =
            c.name + " recompute " + std::string(NameOf(kRecomputeNames, c.training.recompute)) +
            " stage " + std::to_string(stage) + (microbatches ? " (microbatches copied)" : "");
        ExpectSameEventLog(full.recorder(), replicated.recorder(), what);
      }
    }
  }
}

// The run of validation case `name` (validation/cases/NAME.yaml) as its launch line gives it,
// on its GPU, not yet finalized.
RunSpec CaseSpec(const std::string& name) {
  ValidationCase c;
  EXPECT_TRUE(
      LoadValidationCase(std::string(MEMSIM_SOURCE_DIR) + "/validation/cases/" + name + ".yaml", &c)
          .ok())
      << name;
  MegatronArgsResult parsed;
  EXPECT_TRUE(ParseMegatronArgs(c.args, c.env, c.world_size, &parsed).ok()) << name;
  parsed.spec.gpu = FindGpu(c.gpu);
  return parsed.spec;
}

// The same for Megatron-LM's CI configurations read from their launch lines: a MoE GPT
// with shared experts, grouped GEMMs, the all-to-all dispatcher, TP4 SP EP2 ETP2 PP2 and
// unfused weight gradients; a dense GPT with them too, and in FP8 with FP8 parameters
// under TP4 SP CP2, and under TP2 SP PP2 with TP communication overlap (validation/cases).
TEST(LayerReplication, EqualsRunningEveryLayerOnMegatronCiConfigs) {
  for (const char* name :
       {"moe__gpt3_moe_mcore_te_tp4_ep2_etp2_pp2_resume_torch_dist_dist_optimizer",
        "gpt__gpt3_mcore_te_tp1_pp1_resume_torch_dist_dist_optimizer",
        "gpt__gpt3_weekly_mcore_tp4_cp2_current_scaling_native_fp8_tp_sp_cp_tp_overlap",
        "gpt__gpt3_weekly_mcore_tp2_pp2_current_scaling_native_fp8_tp_pp_sp_tp_overlap"}) {
    RunSpec case_spec = CaseSpec(name);
    case_spec.training.num_microbatches = 2;
    case_spec.global_batch_size = 0;
    std::optional<ValidatedRun> run;
    ASSERT_TRUE(FinalizeRunSpec(case_spec, &run).ok()) << name;
    const RunSpec& spec = run->spec();
    for (int64_t stage = 0; stage < spec.layout.pp; ++stage) {
      Session full(spec.gpu), replicated(spec.gpu);
      {
        ActiveSession active(full);
        RunRankTraining(*run, stage, full, {true, false});
      }
      {
        ActiveSession active(replicated);
        RunRankTraining(*run, stage, replicated, {true, true});
      }
      ExpectSameEventLog(full.recorder(), replicated.recorder(),
                         std::string(name) + " stage " + std::to_string(stage));
    }
  }
}

// One iteration of stage 0 of a validation case, and where its optimizer step begins and
// its iteration ends.
struct CaseStep {
  std::unique_ptr<Session> session;
  int64_t optimizer_begin = -1, step_end = -1;
};
CaseStep RunCaseStep(const std::string& name, std::optional<int64_t> simulated_rank) {
  RunSpec spec = CaseSpec(name);
  spec.training.iterations = 1;
  spec.training.simulated_rank = simulated_rank;
  const ValidatedRun run = test::Validated(spec);
  CaseStep step;
  step.session = test::RecordRank(run, 0, run.spec().gpu);
  for (const Marker& mk : step.session->recorder().markers()) {
    if (mk.kind == MarkerKind::kIterationEnd) step.step_end = mk.event_index - 1;
    if (mk.kind == MarkerKind::kPhaseBegin && mk.phase == Phase::kOptimizer) {
      step.optimizer_begin = mk.event_index;
    }
  }
  return step;
}

// Note [Distributed optimizer buffers] against a real run: Megatron-LM's pretrain_gpt.py on
// an H200 as rank 7 of 8 (validation/fake_pg; a 16-layer Llama, hidden 2048, DP 8 with two
// optimizer instances, so each shards over 4 ranks and rank 7 is the instance's rank 3).
// Its allocator history (validation/fake_pg/traces/
// llama_1b_local_dp8_two_optimizer_instances.trace.json.gz) has, under
// _build_model_and_main_param_groups, 50 bf16 clones each followed by its fp32 master;
// these are the masters' sizes in the order the run made them: a quarter of the output
// layer, then per bucket (40M elements, cut across layers) the pieces rank 3's ranges
// meet, a piece of the word embedding, then sixteen whole norm weights (the second
// parameter group, without weight decay, comes last). memsim makes the same tensors in the
// same order.
TEST(DistributedOptimizer, RankSevensMastersAreTheRealRunsOwn) {
  const CaseStep step = RunCaseStep("fake_pg__llama_1b_local_dp8_two_optimizer_instances__h200",
                                    /*simulated_rank=*/7);
  const Recorder& r = step.session->recorder();
  std::vector<int64_t> masters;
  for (const StorageInfo& s : r.storages()) {
    if (s.phase == Phase::kSetup && s.category == Category::kOptimizerState &&
        s.dtype == at::kFloat) {
      masters.push_back(s.size_bytes);
    }
  }
  std::vector<int64_t> real = {262668288, 15724544};
  for (int layer = 0; layer < 15; ++layer) real.insert(real.end(), {25165824, 19918848});
  real.insert(real.end(), {25165824, 266864640});
  real.insert(real.end(), 16, 8192);
  EXPECT_EQ(masters, real);
}

// Note [Layer-wise optimizer] on Megatron-LM's CI run of distributed Muon (validation case
// gpt3_moe_mcore_te_ep8_resume_torch_dist_dist_muon: 12 layers, H 512, 8 experts on EP8 over
// 8 GPUs, so DP 8 and expert DP 1; bf16; --no-use-layer-wise-param-layout). Worked from
// Megatron-Core's source: the 88 dense parameters sorted by numel are the 50 norm weights
// and biases (512, Adam), 12 routers (8x512), 12 linear_proj (512x512), the position
// embedding (1024x512), 12 linear_qkv (1536x512), all Muon, and last the word embedding
// (50304x512, Adam); dealt 0..7, 7..0, .. they give rank 7 the most: the word embedding and
// six norms (Adam, 25,758,720 elements), the routers of two layers and two linear_proj
// (Muon, 532,480), and every local expert weight (Muon, 12,582,912). State: fp32 masters of
// 38,874,112 elements, Muon momenta of 13,115,392, Adam moments of 2 x 25,758,720:
// 414,027,776 bytes. Beside it every rank keeps its 51,520,512 bf16 parameters and full
// fp32 gradient buffers (plain DDP). The step's all-gather holds the whole dense model in
// bf16 at once: rank 7's 26,291,200 elements flat and the 12,646,400 of the others.
TEST(LayerWiseOptimizer, DistributedMuonOnMegatronsCiRun) {
  const CaseStep step = RunCaseStep("moe__gpt3_moe_mcore_te_ep8_resume_torch_dist_dist_muon",
                                    /*simulated_rank=*/std::nullopt);
  const Recorder& r = step.session->recorder();
  EXPECT_EQ(test::ModelStateBytesAfter(r, step.step_end),
            51520512 * 2 + 51520512 * 4 + 414027776);  // 723,150,848
  std::vector<int64_t> gathered;
  for (int64_t e = step.optimizer_begin; e <= step.step_end; ++e) {
    const MemoryEvent& event = r.events()[static_cast<size_t>(e)];
    const StorageInfo& s = r.storages()[static_cast<size_t>(event.storage_id)];
    if (event.is_alloc && s.category == Category::kCommunication) gathered.push_back(s.size_bytes);
  }
  // Its own elements, then the other ranks' from the same deal: ranks 0 and 1 own 2,097,152
  // Muon and 3,584 Adam elements, ranks 2-4 1,843,200 and 3,072, rank 5 1,581,056 and
  // 3,072, rank 6 1,318,912 and 3,072; 2 bytes each.
  EXPECT_EQ(gathered, (std::vector<int64_t>{26291200 * 2, 2100736 * 2, 2100736 * 2, 1846272 * 2,
                                            1846272 * 2, 1846272 * 2, 1584128 * 2, 1321984 * 2}));
}

// The same test on 4 GPUs (EP4, two experts a rank; the GB200 one-node case), whose logged
// rank 3 is not the fullest: dealt 0..3, 3..0, rank 0 takes the word embedding. Rank 3
// owns 12 norms (6,144 elements, Adam), 4 routers, 2 linear_proj and 4 linear_qkv
// (3,686,400, Muon) and its 24 expert weights (25,165,824, Muon): 6,144 x 12 + 28,852,224 x 8
// = 230,891,520 bytes of state, beside 64,103,424 bf16 parameters and fp32 gradients.
TEST(LayerWiseOptimizer, TheMeasuredRankIsTheOneSimulated) {
  const CaseStep step = RunCaseStep(
      "moe__gpt3_moe_mcore_te_ep8_resume_torch_dist_dist_muon_1node__gb200", /*rank=*/3);
  EXPECT_EQ(test::ModelStateBytesAfter(step.session->recorder(), step.step_end),
            64103424 * 2 + 64103424 * 4 + 230891520);
}

// Runs stage `stage` of `layout` with and without microbatch replication and expects the
// same event log (sizes, order, attribution, times) and the same peaks.
void ExpectReplicationChangesNothing(const ModelConfig& m, const TrainingConfig& t,
                                     const ParallelLayout& layout, int64_t stage) {
  const ValidatedRun run = test::Validated(m, t, layout);
  Session full, replicated;
  {
    ActiveSession active(full);
    RunRankTraining(run, stage, full, {/*microbatches=*/false, /*layers=*/false});
  }
  {
    ActiveSession active(replicated);
    RunRankTraining(run, stage, replicated, {/*microbatches=*/true, /*layers=*/false});
  }
  const Recorder& a = full.recorder();
  const Recorder& b = replicated.recorder();
  ASSERT_EQ(a.events().size(), b.events().size()) << "vpp " << layout.vpp << " stage " << stage;
  for (size_t e = 0; e < a.events().size(); ++e) {
    const StorageInfo& sa = a.storages()[static_cast<size_t>(a.events()[e].storage_id)];
    const StorageInfo& sb = b.storages()[static_cast<size_t>(b.events()[e].storage_id)];
    ASSERT_EQ(a.events()[e].is_alloc, b.events()[e].is_alloc) << e;
    ASSERT_EQ(sa.size_bytes, sb.size_bytes) << e;
    ASSERT_EQ(sa.microbatch, sb.microbatch) << e;
    ASSERT_EQ(a.names().Name(sa.module), b.names().Name(sb.module)) << e;
    ASSERT_DOUBLE_EQ(a.events()[e].time_s, b.events()[e].time_s) << e;
  }
  const Timeline ta = Timeline::Replay(a), tb = Timeline::Replay(b);
  EXPECT_EQ(ta.peak_allocated_bytes(), tb.peak_allocated_bytes());
  EXPECT_EQ(ta.peak_reserved_bytes(), tb.peak_reserved_bytes());
}

// Note [Microbatch replication]: copying the steady state's events gives the same event
// log (sizes, order, attribution) as running every microbatch.
TEST(MicrobatchReplication, EqualsRunningEveryMicrobatch) {
  const Shape x{256, 2, 256, 8};
  const ModelConfig m = Gpt(x, 8);
  TrainingConfig t = Fp16Eager(x);
  t.num_microbatches = 8;
  for (int64_t vpp : {1, 2}) {
    ParallelLayout layout;
    layout.world_size = 4;
    layout.pp = 2;
    layout.vpp = vpp;
    layout.data_parallel = DataParallelKind::kDistributedOptimizer;
    ASSERT_TRUE(FinalizeLayout(&layout, m).ok());
    for (int64_t stage : {0, 1}) ExpectReplicationChangesNothing(m, t, layout, stage);
  }
}

// Longer pipelines: PP 4 with and without interleaving, and interleaved with as many
// microbatches as stages (stages 0 and 1 warm up every forward: no gradient received early).
TEST(MicrobatchReplication, EqualsRunningEveryMicrobatchOnLongerPipelines) {
  const Shape x{256, 2, 256, 8};
  const ModelConfig m = Gpt(x, 8);
  TrainingConfig t = Fp16Eager(x);
  struct Case {
    int64_t vpp, microbatches;
  };
  for (const Case& c : {Case{1, 8}, Case{2, 8}, Case{2, 4}}) {
    t.num_microbatches = c.microbatches;
    const ParallelLayout layout = PipelineOnly(m, 4, c.vpp);
    for (int64_t stage = 0; stage < 4; ++stage) {
      SCOPED_TRACE("vpp " + std::to_string(c.vpp) + " m " + std::to_string(c.microbatches));
      ExpectReplicationChangesNothing(m, t, layout, stage);
    }
  }
}

// An fp32 residual stream (Note [FP32 residual stream]): float32 sends, receives and kept
// inputs, layers that free their input in forward; PP 4, with and without interleaving.
TEST(MicrobatchReplication, EqualsRunningEveryMicrobatchWithAnFp32ResidualStream) {
  const Shape x{256, 2, 256, 8};
  const ModelConfig m = Gpt(x, 8);
  TrainingConfig t = Fp16Eager(x);
  t.profile = ProfileKind::kTransformerEngine;
  t.fp32_residual_connection = true;
  t.num_microbatches = 8;
  for (int64_t vpp : {1, 2}) {
    const ParallelLayout layout = PipelineOnly(m, 4, vpp);
    for (int64_t stage = 0; stage < 4; ++stage) {
      SCOPED_TRACE("vpp " + std::to_string(vpp));
      ExpectReplicationChangesNothing(m, t, layout, stage);
    }
  }
}

// The combined 1F1B schedule (Note [Combined 1F1B]): an MoE model on EP 2, PP 2, VPP 2.
TEST(MicrobatchReplication, EqualsRunningEveryMicrobatchWithCombined1F1B) {
  ModelConfig m = test::Llama(4, 256, 8, 4, 512, 1024);
  m.num_experts = 4;
  m.moe_router_topk = 2;
  ASSERT_TRUE(FinalizeModelConfig(&m).ok());
  TrainingConfig t;
  t.seq_length = 128;
  t.micro_batch_size = 2;
  t.precision = Precision::kBf16;
  t.moe_dispatcher = MoeDispatcher::kAllToAll;
  t.num_microbatches = 6;
  ParallelLayout layout;
  layout.world_size = 4;
  layout.pp = 2;
  layout.vpp = 2;
  layout.ep = 2;
  layout.combined_1f1b = true;
  ASSERT_TRUE(FinalizeLayout(&layout, m).ok());
  for (int64_t stage : {0, 1}) ExpectReplicationChangesNothing(m, t, layout, stage);
}

// The same with Megatron-FSDP, whose gathers and gradient buckets come and go inside each
// step (Note [Megatron-FSDP]).
TEST(MicrobatchReplication, EqualsRunningEveryMicrobatchWithMegatronFsdp) {
  const Shape x{256, 2, 256, 8};
  const ModelConfig m = Gpt(x, 4);
  TrainingConfig t = Fp16Eager(x);
  t.precision = Precision::kBf16;
  t.num_microbatches = 6;
  ParallelLayout layout;
  layout.world_size = 4;
  layout.data_parallel = DataParallelKind::kMegatronFsdp;
  ASSERT_TRUE(FinalizeLayout(&layout, m).ok());
  ExpectReplicationChangesNothing(m, t, layout, 0);
}

}  // namespace
}  // namespace memsim

namespace memsim {
namespace {

// Megatron-Core's local layers keep the global memory buffer (the eager baddbmm input,
// [B*A/t, S, S] 16-bit, shared with the sequence-parallel all-gather) across iterations;
// Transformer Engine's layers allocate per use, and only the output layer (Megatron's own
// ColumnParallelLinear) grows the buffer, to its gathered input [S, B, H] 16-bit. Static
// memory differs by the difference.
TEST(Profiles, LocalKeepsTheGlobalBufferTransformerEngineDoesNot) {
  const Shape x{512, 2, 256, 8};
  const ModelConfig m = Gpt(x, 2, 2);
  TrainingConfig t = Fp16Eager(x);
  ParallelLayout layout;
  layout.world_size = 2;
  layout.tp = 2;
  layout.sequence_parallel = true;
  ASSERT_TRUE(FinalizeLayout(&layout, m).ok());
  auto static_memory = [&](ProfileKind profile) {
    TrainingConfig tt = t;
    tt.profile = profile;
    const std::unique_ptr<Session> session = test::RecordRank(test::Validated(m, tt, layout));
    return Timeline::Replay(session->recorder()).iterations().back().static_allocated_bytes;
  };
  // B*A/t = 2*8/2 = 8 score matrices of 512^2 fp16 = 4 MiB (more than the all-gather's
  // S*B*H*2 = 512 KiB, so the local buffer has that size; TE's has the gather's).
  EXPECT_EQ(
      static_memory(ProfileKind::kMegatronLocal) - static_memory(ProfileKind::kTransformerEngine),
      int64_t{8} * 512 * 512 * 2 - int64_t{512} * 2 * 256 * 2);
}

}  // namespace
}  // namespace memsim

namespace memsim {
namespace {

// Context parallelism: a layer keeps what flash attention keeps at sequence S/cp, except
// that ring attention saves k and v stacked into its send buffer ([2, B, S/cp, G, D],
// the same bytes as the two copies) and no RNG state: 36 s'bh + 4 a s' b + 16 s'b bytes
// with s' = S/cp (b > 1).
TEST(ContextParallel, ActivationsShrinkWithTheSequenceShard) {
  const Shape x{1024, 2, 256, 8};
  TrainingConfig t = Fp16Eager(x);
  t.attention = AttentionKind::kFlash;
  for (int64_t cp : {2, 4}) {
    const int64_t s = x.s / cp;
    EXPECT_EQ(PerLayer(x, t, 1, false, cp), 36 * s * x.b * x.h + 4 * x.a * s * x.b + 16 * s * x.b)
        << "cp=" << cp;
  }
}

// The ring's receive buffers: cp - 1 per layer in forward, each like the stacked kv
// (2 * B * S/cp * H values in 16 bits), all alive until the layer's attention ends.
TEST(ContextParallel, RingReceiveBuffers) {
  const Shape x{1024, 2, 256, 8};
  const ModelConfig m = Gpt(x, 1);
  TrainingConfig t = Fp16Eager(x);
  t.attention = AttentionKind::kFlash;
  for (int64_t cp : {2, 4}) {
    Session session;
    ActiveSession active(session);
    ParameterStore store(t.precision);
    ModelShard shard = ModelShard::Whole(m);
    shard.cp = cp;
    TransformerModel model(m, t, shard, &store);
    store.AllocateGradBuffer();
    session.SetPhase(Phase::kForward);
    at::Tensor loss = model.Forward();
    const Recorder& r = session.recorder();
    const int64_t kv_bytes = 2 * x.b * (x.s / cp) * x.h * 2;
    int64_t buffers = 0;
    for (const StorageInfo& st : r.storages()) {
      buffers += r.names().Name(st.op) == "aten::empty_like" && st.size_bytes == kv_bytes &&
                 r.names().Name(st.module).find("core_attention") != std::string::npos;
    }
    EXPECT_EQ(buffers, cp - 1) << "cp=" << cp;
  }
}

}  // namespace
}  // namespace memsim

namespace memsim {
namespace {

// FSDP (ZeRO-3), bf16: layer parameters, their fp32 gradient shards and optimizer state
// all fall as 1/DP; the root unit (embeddings, final norm) stays whole with its gradient
// buffer. While a layer runs forward its full parameters are gathered: one layer's in
// forward, two in backward (BACKWARD_PRE prefetch).
TEST(Fsdp, ShardsFallAsOneOverDpAndGathersOneLayerAtATime) {
  const Shape x{128, 1, 128, 4};
  const ModelConfig m = Gpt(x, 4);
  const int64_t h = 128;
  const int64_t layer_params = 12 * h * h + 13 * h;
  const int64_t root_params = 1024 * h + 128 * h + 2 * h;  // word + position embeddings, final norm
  TrainingConfig t = Fp16Eager(x);
  t.precision = Precision::kBf16;
  for (int64_t dp : {2, 4, 8}) {
    ParallelLayout layout;
    layout.world_size = dp;
    layout.data_parallel = DataParallelKind::kFsdp;
    ASSERT_TRUE(FinalizeLayout(&layout, m).ok());
    const std::unique_ptr<Session> session = test::RecordRank(test::Validated(m, t, layout));
    const Recorder& r = session->recorder();
    int64_t iteration1 = -1;
    for (const Marker& mk : r.markers()) {
      if (mk.kind == MarkerKind::kIterationBegin && mk.iteration == 1) iteration1 = mk.event_index;
    }
    const int64_t state = test::ModelStateBytesAfter(r, iteration1 - 1);
    // Layers: 2 (bf16 shard) + 4 (fp32 grad shard) + 4 + 8 (master, Adam), all / dp.
    // Root: 2 + 4 whole, 12 / dp.
    EXPECT_EQ(state, 4 * layer_params * 18 / dp + root_params * 6 + root_params * 12 / dp)
        << "dp=" << dp;
    // Gathered parameters alive over the step, beyond the persistent ones.
    int64_t live = 0, peak_forward = 0, peak_backward = 0, persistent = 0;
    for (int64_t e = 0; e < static_cast<int64_t>(r.events().size()); ++e) {
      const MemoryEvent& ev = r.events()[static_cast<size_t>(e)];
      const StorageInfo& s = r.storages()[static_cast<size_t>(ev.storage_id)];
      if (s.category != Category::kParameter) continue;
      live += ev.is_alloc ? s.size_bytes : -s.size_bytes;
      if (s.phase == Phase::kSetup) persistent = live;
      if (s.phase == Phase::kForward) peak_forward = std::max(peak_forward, live - persistent);
      if (s.phase == Phase::kBackward) peak_backward = std::max(peak_backward, live - persistent);
    }
    EXPECT_EQ(peak_forward, layer_params * 2) << "dp=" << dp;
    EXPECT_EQ(peak_backward, 2 * layer_params * 2) << "dp=" << dp;
  }
}

// Megatron-FSDP runs of a GPT: the most bytes alive at once of the all-gathered weight
// buckets and of the full gradient buckets, and the model state alive when iteration 1
// begins (parameters, gradients and optimizer state).
struct MegatronFsdpRun {
  int64_t gathered_peak = 0, grad_bucket_peak = 0, state_at_iteration1 = 0;
  int64_t double_buffers_peak = 0;  // Note [Megatron-FSDP double buffers]
};
std::unique_ptr<Session> RecordMegatronFsdp(const ModelConfig& m, const TrainingConfig& t,
                                            int64_t dp, const GpuSpec* gpu = nullptr) {
  RunSpec spec;
  spec.model = m;
  spec.training = t;
  spec.layout.world_size = dp;
  spec.layout.data_parallel = DataParallelKind::kMegatronFsdp;
  spec.gpu = gpu;
  EXPECT_TRUE(FinalizeLayout(&spec.layout, m).ok());
  return test::RecordRank(test::Validated(spec), 0, gpu);
}

MegatronFsdpRun RunMegatronFsdp(const ModelConfig& m, const TrainingConfig& t, int64_t dp,
                                const GpuSpec* gpu = nullptr) {
  const std::unique_ptr<Session> session = RecordMegatronFsdp(m, t, dp, gpu);
  const Recorder& r = session->recorder();
  MegatronFsdpRun run;
  int64_t gathered = 0, grad_buckets = 0, double_buffers = 0;
  for (const MemoryEvent& ev : r.events()) {
    const StorageInfo& s = r.storages()[static_cast<size_t>(ev.storage_id)];
    const std::string module = r.names().Name(s.module);
    const int64_t bytes = ev.is_alloc ? s.size_bytes : -s.size_bytes;
    if (module == "megatron_fsdp.all_gather") gathered += bytes;
    if (module == "megatron_fsdp.grad_buckets") grad_buckets += bytes;
    if (module == "megatron_fsdp.double_buffers") double_buffers += bytes;
    run.gathered_peak = std::max(run.gathered_peak, gathered);
    run.grad_bucket_peak = std::max(run.grad_bucket_peak, grad_buckets);
    run.double_buffers_peak = std::max(run.double_buffers_peak, double_buffers);
  }
  int64_t iteration1 = -1;
  for (const Marker& mk : r.markers()) {
    if (mk.kind == MarkerKind::kIterationBegin && mk.iteration == 1) iteration1 = mk.event_index;
  }
  run.state_at_iteration1 = test::ModelStateBytesAfter(r, iteration1 - 1);
  return run;
}

// Note [Megatron-FSDP], bf16 with the default dtypes (bf16 gradient shards and buckets, fp32
// main weights), a 4-layer GPT (h = 128: 198,272 parameters a layer; 147,712 outside them:
// word and position embeddings, final norm; the output layer is tied). A layer's bucket is
// padded to a multiple of d * 512 (its largest row is fc2's, 4h), the non-unit one to
// d * 128: with d = 2, S = 198,656 (194 * 1024) and 147,712 (577 * 256); with d = 4,
// 198,656 (97 * 2048) and 147,968 (289 * 512). Each rank keeps S / d of every bucket as
// bf16 weights and bf16 gradients, fp32 masters and Adam's two states (12 bytes) per
// parameter / d. After the step start_param_sync gathers the non-unit bucket with
// prefetch: far under the billion-element prefetch window, the whole model, which stays
// gathered; --log-params-norm's reset releases all but the non-unit bucket (before
// Megatron-LM #4717 that too). The whole model is gathered at once in the step too, and
// every gradient bucket stays queued until the backward ends.
TEST(MegatronFsdp, BucketsShardsAndTheWholeSmallModelGathered) {
  const Shape x{128, 1, 128, 4};
  const ModelConfig m = Gpt(x, 4);
  TrainingConfig t = Fp16Eager(x);
  t.precision = Precision::kBf16;
  struct Case {
    int64_t dp, layer_bucket, root_bucket;
  };
  for (const Case& c : {Case{2, 198'656, 147'712}, Case{4, 198'656, 147'968}}) {
    const int64_t parameters = 4 * 198'272 + 147'712;
    const int64_t shards = (4 * c.layer_bucket + c.root_bucket) / c.dp;
    const int64_t state = shards * 2 + shards * 2 + parameters / c.dp * 12;
    const MegatronFsdpRun run = RunMegatronFsdp(m, t, c.dp);
    EXPECT_EQ(run.state_at_iteration1, state + (4 * c.layer_bucket + c.root_bucket) * 2)
        << "dp=" << c.dp;
    TrainingConfig logged = t;
    logged.log_params_norm = true;
    EXPECT_EQ(RunMegatronFsdp(m, logged, c.dp).state_at_iteration1, state + c.root_bucket * 2)
        << "dp=" << c.dp;
    logged.fsdp_reset_releases_non_unit = true;
    EXPECT_EQ(RunMegatronFsdp(m, logged, c.dp).state_at_iteration1, state) << "dp=" << c.dp;
    EXPECT_EQ(run.gathered_peak, (4 * c.layer_bucket + c.root_bucket) * 2) << "dp=" << c.dp;
    EXPECT_EQ(run.grad_bucket_peak, (4 * c.layer_bucket + c.root_bucket) * 2) << "dp=" << c.dp;
  }
}

// Multi-token prediction under Megatron-FSDP (the GPT with RoPE, which MTP needs: no
// position embedding): the MTP layer's transformer layer is a unit of its own (a bucket like
// a decoder layer's, S = 198,656), its norms and projection join the non-unit bucket: the
// word embedding and final norm (131,328) with enorm, hnorm and MTP's final norm (256 each
// with biases) and eh_proj [128, 256] make 164,864 elements, padded to d * 256 (eh_proj's
// row) = 512: 322 * 512 exactly. After the step the whole model is gathered, as without MTP.
// (Those totals are the same were the MTP layer non-unit; with double buffers they differ:
// the MTP layer matches the decoder's, so only the non-unit bucket is gathered on its own.)
TEST(MegatronFsdp, MultiTokenPredictionLayerIsAUnitOfItsOwn) {
  const Shape x{128, 1, 128, 4};
  ModelConfig m = test::Gpt(4, x.h, x.a);
  m.mtp_num_layers = 1;
  m.position = PositionKind::kRope;
  ASSERT_TRUE(FinalizeModelConfig(&m).ok());
  TrainingConfig t = Fp16Eager(x);
  t.precision = Precision::kBf16;
  const int64_t layer = 198'656, root = 164'864;
  const int64_t parameters = 5 * 198'272 + 131'328 + 33'536;
  const int64_t shards = (5 * layer + root) / 2;
  const int64_t state = shards * 2 + shards * 2 + parameters / 2 * 12;
  const MegatronFsdpRun run = RunMegatronFsdp(m, t, 2);
  EXPECT_EQ(run.state_at_iteration1, state + (5 * layer + root) * 2);
  EXPECT_EQ(run.gathered_peak, (5 * layer + root) * 2);
  t.fsdp_double_buffer = true;
  const MegatronFsdpRun buffered = RunMegatronFsdp(m, t, 2);
  EXPECT_EQ(buffered.gathered_peak, root * 2);
  EXPECT_EQ(buffered.double_buffers_peak, 4 * layer * 2);
}

// Note [Megatron-FSDP double buffers], bf16, a 6-layer GPT at d = 2 (layers as above:
// S = 198,656, one bucket each; non-unit 147,712): all six layers match, so the weights get
// two persistent buffers of S and the gradients two more (4 * S * 2 bytes), and only the
// non-unit buckets come and go. The step's start_param_sync gathers the non-unit bucket
// without prefetch, so iteration 1 begins with it and the buffers beside the shards, not
// with the whole model gathered. --fsdp-db-use-persist-buf-on-alloc-fail keeps the
// non-unit buckets in persistent buffers too (weights and gradients).
TEST(MegatronFsdp, DoubleBuffersHoldTwoLayersPersistently) {
  const Shape x{128, 1, 128, 4};
  const ModelConfig m = Gpt(x, 6);
  TrainingConfig t = Fp16Eager(x);
  t.precision = Precision::kBf16;
  const int64_t layer = 198'656, root = 147'712;
  const int64_t parameters = 6 * 198'272 + 147'712;
  const int64_t shards = (6 * layer + root) / 2;
  const int64_t state = shards * 2 + shards * 2 + parameters / 2 * 12;
  EXPECT_EQ(RunMegatronFsdp(m, t, 2).state_at_iteration1, state + (6 * layer + root) * 2);

  t.fsdp_double_buffer = true;
  const MegatronFsdpRun buffered = RunMegatronFsdp(m, t, 2);
  EXPECT_EQ(buffered.double_buffers_peak, 4 * layer * 2);
  EXPECT_EQ(buffered.gathered_peak, root * 2);
  EXPECT_EQ(buffered.grad_bucket_peak, root * 2);
  EXPECT_EQ(buffered.state_at_iteration1, state + root * 2 + 4 * layer * 2);

  t.fsdp_double_buffer_persistent_fallback = true;
  const MegatronFsdpRun fallback = RunMegatronFsdp(m, t, 2);
  EXPECT_EQ(fallback.double_buffers_peak, 4 * layer * 2 + 2 * root * 2);
  EXPECT_EQ(fallback.gathered_peak, 0);
  EXPECT_EQ(fallback.state_at_iteration1, state + 4 * layer * 2 + 2 * root * 2);
}

// --init-model-with-meta-device under Megatron-FSDP (Note [Megatron-FSDP]): the model is
// never whole on the GPU. On the 4-layer GPT at d = 8 (940,800 parameters, bf16; layer
// buckets padded to 49 * 4096 = 200,704 elements, the non-unit one to 145 * 1024 = 148,480)
// the setup ends with the bf16 weight and gradient shards, (4 * 25,088 + 18,560) * 2 bytes
// each, and the fp32 masters, 940,800 / 8 * 4: 946,048 bytes either way. Materialized, the
// setup first holds every parameter (1,881,600 bytes); on the meta device it never does:
// until the gradient shards it holds at most the last layer's bucket (401,408 bytes), the
// four shards before it (93,824 elements, 187,648 bytes) and one made parameter, fc1's or
// fc2's [512, 128] (131,072 bytes): 720,128.
TEST(MegatronFsdp, MetaDeviceInitNeverHoldsTheWholeModel) {
  const Shape x{128, 1, 128, 4};
  const ModelConfig m = Gpt(x, 4);
  TrainingConfig t = Fp16Eager(x);
  t.precision = Precision::kBf16;
  t.iterations = 1;
  struct Setup {
    int64_t peak = 0, at_end = 0, peak_before_grad_shards = 0;
  };
  auto setup_of = [&](bool meta_init) {
    t.fsdp_meta_init = meta_init;
    const std::unique_ptr<Session> session = RecordMegatronFsdp(m, t, 8);
    const Recorder& r = session->recorder();
    Setup setup;
    int64_t alive = 0;
    bool grad_shards = false;
    for (const MemoryEvent& ev : r.events()) {
      const StorageInfo& info = r.storages()[static_cast<size_t>(ev.storage_id)];
      if (info.phase != Phase::kSetup && ev.is_alloc) break;
      grad_shards = grad_shards || r.names().Name(info.module) == "megatron_fsdp.grad_shards";
      alive += ev.is_alloc ? info.size_bytes : -info.size_bytes;
      setup.peak = std::max(setup.peak, alive);
      if (!grad_shards) setup.peak_before_grad_shards = setup.peak;
    }
    setup.at_end = alive;
    return setup;
  };
  const Setup materialized = setup_of(false);
  const Setup meta = setup_of(true);
  EXPECT_EQ(materialized.at_end, 946'048);
  EXPECT_EQ(meta.at_end, 946'048);
  EXPECT_GE(materialized.peak, 940'800 * 2);
  EXPECT_LT(meta.peak, 940'800 * 2);
  EXPECT_EQ(meta.peak_before_grad_shards, 720'128);
}

// Note [Megatron-FSDP] around the step, on the 4-layer GPT at d = 2 (layer buckets 198,656
// elements, non-unit 147,712, bf16): a fsdp_dtensor checkpoint load's dummy step makes
// Adam's two fp32 states (8 bytes per parameter / d) before the first forward, beside the
// fp32 masters (4) of the setup; and the
// final norm's hook of Megatron-FSDP before 41f3b6f308 gathers the layers again, so at the
// start of the backward the whole model is gathered, where otherwise only the non-unit
// bucket is.
TEST(MegatronFsdp, LoadStatesAndTheOldFinalNormGather) {
  const Shape x{128, 1, 128, 4};
  const ModelConfig m = Gpt(x, 4);
  TrainingConfig t = Fp16Eager(x);
  t.precision = Precision::kBf16;
  const int64_t parameters = 4 * 198'272 + 147'712;
  auto live = [](const Recorder& r, const Marker& at, const std::string& module,
                 Category category) {
    int64_t bytes = 0;
    ForEachLiveStorage(r, at.event_index - 1, [&](int64_t id) {
      const StorageInfo& s = r.storages()[static_cast<size_t>(id)];
      if (r.names().Name(s.module) == module && s.category == category) bytes += s.size_bytes;
    });
    return bytes;
  };
  for (bool load : {false, true}) {
    TrainingConfig loaded = t;
    loaded.fsdp_states_before_training = load;
    const std::unique_ptr<Session> session = RecordMegatronFsdp(m, loaded, 2);
    const Recorder& r = session->recorder();
    const Marker begin = MarkerAt(r, MarkerKind::kIterationBegin, 0, -1, Phase::kSetup);
    EXPECT_EQ(live(r, begin, "optimizer", Category::kOptimizerState),
              parameters / 2 * (load ? 4 + 8 : 4))
        << "load=" << load;
  }
  for (bool every_forward : {false, true}) {
    TrainingConfig old = t;
    old.fsdp_final_norm_gathers_every_forward = every_forward;
    const std::unique_ptr<Session> session = RecordMegatronFsdp(m, old, 2);
    const Recorder& r = session->recorder();
    const Marker backward = MarkerAt(r, MarkerKind::kPhaseBegin, 0, 0, Phase::kBackward);
    EXPECT_EQ(live(r, backward, "megatron_fsdp.all_gather", Category::kParameter),
              (every_forward ? 4 * 198'656 + 147'712 : 147'712) * 2)
        << "every_forward=" << every_forward;
  }
}

// The same GPT at d = 2 in fp32 with FP8 parameters (Transformer Engine, tensorwise, on a
// GB200, whose FP8 GEMMs keep no transposes). Buckets split by dtype
// (param_and_grad_buffer.py): each layer's 12h^2 = 196,608 GEMM weights are an FP8 bucket
// (1-byte data; auto gradients bf16), its 1,664 biases and norm weights an fp32 one (fp32
// gradients), the non-unit bucket fp32 as before; every S is the bucket's size (multiples
// of d * 512, d and d * 128). Per rank: the weight and gradient shards at those widths,
// an fp32 main weight (fp32 training keeps one too) and Adam's two states per parameter
// / d (12 bytes), each FP8 weight's fp32 scale_inv, and the whole model gathered after
// the step (start_param_sync).
TEST(MegatronFsdp, Fp32TrainingWithFp8Parameters) {
  const Shape x{128, 1, 128, 4};
  const ModelConfig m = Gpt(x, 4);
  TrainingConfig t = Fp16Eager(x);
  t.precision = Precision::kFp32;
  t.profile = ProfileKind::kTransformerEngine;
  t.fp8 = Fp8Recipe::kTensorwise;
  t.fp8_param_gather = true;
  const MegatronFsdpRun run = RunMegatronFsdp(m, t, 2, FindGpu("GB200-186GB"));
  const int64_t fp8 = 4 * 196'608, wide = 4 * 1'664 + 147'712, parameters = 940'800;
  EXPECT_EQ(run.state_at_iteration1, fp8 / 2 * (1 + 2) + wide / 2 * (4 + 4) + parameters / 2 * 12 +
                                         16 * 4 + fp8 * 1 + wide * 4);
  EXPECT_EQ(run.gathered_peak, fp8 * 1 + wide * 4);
  EXPECT_EQ(run.grad_bucket_peak, fp8 * 2 + wide * 4);
}

// Without gradient accumulation fusion the output layer's weight gradient is param.grad,
// which Megatron-FSDP's post-accumulate hook copies into the non-unit bucket once the output
// layer's backward has returned: that bucket's gradient (the first gradient bucket of the
// backward) is allocated after the logits' gradient [s, b, V] is gone and before the final
// norm's backward. With the fusion the GEMM writes into the bucket, allocated before.
TEST(MegatronFsdp, NonUnitGradientsAfterTheOutputLayerWithoutFusion) {
  const Shape x{64, 1, 128, 4};     // s != h: the logits' gradient is no weight's size
  const ModelConfig m = Gpt(x, 4);  // vocabulary 1024, tied output layer
  TrainingConfig t = Fp16Eager(x);
  t.precision = Precision::kBf16;
  t.iterations = 1;
  for (bool fusion : {true, false}) {
    t.gradient_accumulation_fusion = fusion;
    const std::unique_ptr<Session> session = RecordMegatronFsdp(m, t, 2);
    const Recorder& r = session->recorder();
    int64_t bucket_alloc = -1, logits_grad_free = -1, final_norm_backward = -1;
    for (const StorageInfo& s : r.storages()) {
      if (s.phase != Phase::kBackward) continue;
      const std::string module = r.names().Name(s.module);
      if (module == "megatron_fsdp.grad_buckets" && bucket_alloc < 0) bucket_alloc = s.alloc_event;
      if (s.size_bytes == x.s * x.b * 1024 * 2 && logits_grad_free < 0) {
        logits_grad_free = s.free_event;
      }
      if (module == "decoder.final_layernorm" && final_norm_backward < 0) {
        final_norm_backward = s.alloc_event;
      }
    }
    ASSERT_GE(bucket_alloc, 0);
    ASSERT_GE(logits_grad_free, 0);
    ASSERT_GE(final_norm_backward, 0);
    EXPECT_EQ(bucket_alloc > logits_grad_free, !fusion) << "fusion=" << fusion;
    EXPECT_LT(bucket_alloc, final_norm_backward) << "fusion=" << fusion;
  }
}

// The prefetch window and the reduce-scatter queue of a model whose layers exceed them
// (h = 8192: 805,412,864 parameters a layer, bucket S = 805,437,440 at d = 2; 9,453,568
// outside the layers). P = 805,412,864 (half of twice the mean layer) lets one layer be
// prefetched past the one running, so at most the non-unit bucket and two layers are
// gathered, in forward and in backward. The queue holds up to C = 1,610,825,728 elements:
// the third layer's reduce-scatter frees the first one's bucket, so three layer buckets
// and the non-unit one are the most alive at once.
TEST(MegatronFsdp, PrefetchWindowAndQueueBoundWhatIsGathered) {
  const Shape x{128, 1, 8192, 64};
  const ModelConfig m = Gpt(x, 4);
  TrainingConfig t = Fp16Eager(x);
  t.precision = Precision::kBf16;
  t.iterations = 1;
  const MegatronFsdpRun run = RunMegatronFsdp(m, t, 2);
  EXPECT_EQ(run.gathered_peak, (9'453'568 + 2 * int64_t{805'437'440}) * 2);
  EXPECT_EQ(run.grad_bucket_peak, (9'453'568 + 3 * int64_t{805'437'440}) * 2);
}

// --defer-embedding-wgrad-compute: the last stage keeps the output layer's 16-bit output
// gradient [S, B, V] of the first `limit` microbatches (all with 0) until the pipeline
// flush, while later microbatches' come and go: at most min(m, limit + 1) are alive at
// once (m with limit 0, 1 without deferral), and none when the optimizer step begins.
TEST(DeferredEmbeddingWgrad, KeepsOutputGradientsUntilTheFlush) {
  const Shape x{128, 2, 128, 4};
  const ModelConfig m = Gpt(x, 2);  // vocabulary 1024
  const ParallelLayout layout = PipelineOnly(m, 2);
  const int64_t grad_bytes = x.s * x.b * m.padded_vocab_size * 2;
  struct Case {
    bool defer;
    int64_t limit, most_alive;
  };
  for (const Case& c : {Case{false, 0, 1}, Case{true, 0, 4}, Case{true, 2, 3}, Case{true, 1, 2}}) {
    TrainingConfig t = Fp16Eager(x);
    t.precision = Precision::kBf16;
    t.num_microbatches = 4;
    t.iterations = 1;
    t.defer_embedding_wgrad = c.defer;
    t.wgrad_deferral_limit = c.limit;
    ASSERT_TRUE(ValidateTrainingConfig(t, m).ok());
    const std::unique_ptr<Session> session =
        test::RecordRank(test::Validated(m, t, layout), /*pp_rank=*/1);
    const Recorder& r = session->recorder();
    int64_t optimizer_begin = -1;
    for (const Marker& mk : r.markers()) {
      if (mk.kind == MarkerKind::kPhaseBegin && mk.phase == Phase::kOptimizer) {
        optimizer_begin = mk.event_index;
      }
    }
    ASSERT_GT(optimizer_begin, 0);
    auto is_output_grad = [&](const StorageInfo& s) {
      return s.phase == Phase::kBackward && s.size_bytes == grad_bytes;
    };
    int64_t alive = 0, most = 0, at_optimizer = 0;
    for (int64_t e = 0; e < static_cast<int64_t>(r.events().size()); ++e) {
      const MemoryEvent& ev = r.events()[static_cast<size_t>(e)];
      if (e == optimizer_begin) at_optimizer = alive;
      if (!is_output_grad(r.storages()[static_cast<size_t>(ev.storage_id)])) continue;
      alive += ev.is_alloc ? 1 : -1;
      most = std::max(most, alive);
    }
    EXPECT_EQ(most, c.most_alive) << "defer " << c.defer << " limit " << c.limit;
    EXPECT_EQ(at_optimizer, 0) << "defer " << c.defer << " limit " << c.limit;
  }
}

// ZeRO-2: parameters whole (2 bytes), gradients as fp32 shards (4/dp) plus one bucket,
// optimizer state sharded (12/dp).
TEST(Zero2, GradientsShardedWithOneBucket) {
  const Shape x{128, 1, 128, 4};
  const ModelConfig m = Gpt(x, 2);
  const int64_t params = 1024 * 128 + 128 * 128 + 2 * (12 * 128 * 128 + 13 * 128) + 2 * 128;
  for (int64_t dp : {2, 4}) {
    const ParallelLayout layout = DataParallelLayout(m, dp, DataParallelKind::kZero2);
    TrainingConfig t = Fp16Eager(x);
    t.precision = Precision::kBf16;
    const int64_t bucket_bytes = kGradientBucketElements * 4;  // fp32 (bf16 training)
    EXPECT_EQ(ModelStateBytes(m, t, layout), params * 2 + params * 16 / dp + bucket_bytes)
        << "dp=" << dp;
  }
}

}  // namespace
}  // namespace memsim

namespace memsim {
namespace {

// Interleaved 1F1B: stage r holds (pp - r - 1) * 2 + (vpp - 1) * pp + 1 model chunks in
// flight, so neighbouring middle stages differ by two chunks' activations (here one
// layer per chunk: Table 2's bytes, the LayerNorm statistics and the deallocated
// output's 2-byte stub each). The peaks: stage 1 in its backward of microbatch 1 in chunk
// 1, with chunk 0's microbatches 0-5 and chunk 1's 1-3 in flight (9 inputs), microbatch 0's
// input gradient (the schedule's input_tensor_grad), microbatch 1's received output
// gradient and the next forward's input, received before this backward: 12 [S, B, H]
// pipeline tensors; stage 2 in its backward of microbatch 1 in chunk 0, with chunk 0's 1-7
// in flight (7), the same three, chunk 1's input of microbatch 3 with its gradient (the
// chunk keeps its last input) and the stale input_tensor of its last warm-up step
// (microbatch 2's of chunk 1) with its gradient: 14 (Note [Tensors the schedule keeps]).
// So the two more chunks of stage 1 come without the two inputs Table 2 counts, and two
// tensors fewer.
TEST(PipelineMemory, InterleavedStagesDifferByTwoChunks) {
  const Shape x{512, 2, 512, 8};
  const ModelConfig m = Gpt(x, 8);
  TrainingConfig t = Fp16Eager(x);
  t.precision = Precision::kBf16;
  t.num_microbatches = 8;
  t.iterations = 1;
  const ParallelLayout layout = PipelineOnly(m, 4, 2);
  for (int64_t r = 0; r < 4; ++r) {
    EXPECT_EQ(MaxInFlight(PipelineSchedule(4, 2, r, 8)), (4 - r - 1) * 2 + (2 - 1) * 4 + 1);
  }
  const int64_t p1 = StagePeak(m, t, layout, 1), p2 = StagePeak(m, t, layout, 2);
  const int64_t sbh = x.s * x.b * x.h;
  const int64_t chunk = 34 * sbh + 5 * x.a * x.s * x.s * x.b + 16 * x.s * x.b + 2;
  EXPECT_EQ(p1 - p2, 2 * chunk - 4 * (2 * sbh));
  // Without p2p overlap the next input arrives after the backward and the steady loop
  // rebinds input_tensor: 11 pipeline tensors at either peak, as Table 2 has them.
  ParallelLayout no_overlap = layout;
  no_overlap.overlap_p2p_comm = false;
  EXPECT_EQ(StagePeak(m, t, no_overlap, 1) - StagePeak(m, t, no_overlap, 2),
            2 * chunk - 2 * (2 * sbh));
}

// Megatron-Core's offloading policy over training steps (Note [Fine-grained activation
// offloading] in models/activation_offload.h), on a 2-layer GPT (s 128, b 2, h 256, a 8,
// eager attention, core_attn and attn_proj offloaded): the first iteration offloads both
// layers' groups, 2bas^2 + 8sbh bytes each (Activations.OffloadingCoreAttentionAndProjection);
// from the second the last layer of the first backward chunk keeps its groups, so one
// layer's go. Every reload is let go again: after each step the same memory is allocated.
TEST(Offloading, FirstIterationOffloadsEveryLayerThenTheLastStays) {
  const int64_t s = 128, b = 2, h = 256, a = 8;
  ModelConfig m = test::Gpt(2, h, a);
  TrainingConfig t = test::EagerWithoutDropout(s, b);
  t.profile = ProfileKind::kTransformerEngine;
  // Live bytes when each iteration's backward begins, and when it ends.
  auto measure = [&](const TrainingConfig& training) {
    const std::unique_ptr<Session> session = test::RecordRank(test::Validated(m, training));
    const Recorder& r = session->recorder();
    std::vector<int64_t> before_backward, at_end;
    for (const Marker& marker : r.markers()) {
      if (marker.kind == MarkerKind::kPhaseBegin && marker.phase == Phase::kBackward) {
        before_backward.push_back(test::LiveBytesBefore(r, marker.event_index));
      } else if (marker.kind == MarkerKind::kIterationEnd) {
        at_end.push_back(test::LiveBytesBefore(r, marker.event_index));
      }
    }
    return std::make_pair(before_backward, at_end);
  };
  const auto kept = measure(t);
  t.offload_modules =
      OffloadModuleBit(OffloadModule::kCoreAttn) | OffloadModuleBit(OffloadModule::kAttnProj);
  t.min_offloaded_tensor_elements = 0;
  const auto offloaded = measure(t);
  const int64_t per_layer = 2 * b * a * s * s + 8 * s * b * h;
  ASSERT_EQ(kept.first.size(), 2u);
  ASSERT_EQ(offloaded.first.size(), 2u);
  EXPECT_EQ(kept.first[0] - offloaded.first[0], 2 * per_layer);
  EXPECT_EQ(kept.first[1] - offloaded.first[1], per_layer);
  EXPECT_EQ(offloaded.second, kept.second);
}

// Note [CUDA graphs]: Transformer Engine keeps one static input set per graphed layer in
// flight. 1F1B on the first of 2 stages with 4 microbatches holds 2 microbatches (one
// warm-up forward, then one more before the first backward), so 3-layer chunks need 6;
// interleaved on the last of 2 stages with 4 virtual chunks of 2 layers and 4
// microbatches, 6 warm-up forwards and the first steady one are in flight: 14 (the CI case
// gpt3_mcore_te_tp2_pp2_ep4_etp1_resume_torch_dist_attn_cudagraph).
TEST(CudaGraphs, StaticInputSetsPerGraphedLayerInFlight) {
  EXPECT_EQ(GraphedLayersInFlight(PipelineSchedule(2, 1, 0, 4), {3}), 6);
  EXPECT_EQ(GraphedLayersInFlight(PipelineSchedule(2, 4, 1, 4), {2, 2, 2, 2}), 14);
  EXPECT_EQ(GraphedLayersInFlight(PipelineSchedule(1, 1, 0, 3), {5}), 5);
}

// With CUDA graphs captured before the first iteration, a replayed step ends with what an
// eager step ends with plus the graphs' static buffers: on a 2-layer GPT without a
// pipeline (one microbatch in flight) two input sets, each a hidden state [s, b, h] in
// bf16 and a [b, 1, s, s] byte mask, and one output-gradient and one input-gradient hidden
// state: 2 (2sbh + bs^2) + 4sbh bytes.
TEST(CudaGraphs, ReplayedStepsKeepTheStaticBuffers) {
  const int64_t s = 128, b = 2, h = 256, a = 8;
  ModelConfig m = test::Gpt(2, h, a);
  TrainingConfig t;
  t.seq_length = s;
  t.micro_batch_size = b;
  t.num_microbatches = 2;
  t.profile = ProfileKind::kTransformerEngine;
  auto after_last_step = [&](const TrainingConfig& training) {
    const std::unique_ptr<Session> session = test::RecordRank(test::Validated(m, training));
    const Recorder& r = session->recorder();
    int64_t end = -1;
    for (const Marker& marker : r.markers()) {
      if (marker.kind == MarkerKind::kIterationEnd) end = marker.event_index;
    }
    return test::LiveBytesBefore(r, end);
  };
  const int64_t eager = after_last_step(t);
  t.cuda_graphs = true;
  t.cuda_graph_modules = CudaGraphModuleBit(CudaGraphModule::kAttn);
  t.cuda_graph_warmup_steps = 0;
  EXPECT_EQ(after_last_step(t) - eager, 2 * (2 * s * b * h + b * s * s) + 4 * s * b * h);
}

// Note [Layer CPU offloading] on a 4-layer GPT without a pipeline (s 128, b 2, h 256, a 8,
// eager attention, one microbatch): with the first 2 layers offloaded, when the backward
// begins layers 0 and 1 are gone; each layer saved its input, its attention probabilities
// and what else it allocated of at least 256K elements, the same for every layer, so the
// device holds the eager run's activations less two layers' worth of those. A step ends
// with what the eager one ends with.
TEST(Offloading, LayerCpuOffloadingKeepsTheLastLayersOnly) {
  const int64_t s = 128, b = 2, h = 256, a = 8;
  ModelConfig m = test::Gpt(4, h, a);
  TrainingConfig t = test::EagerWithoutDropout(s, b);
  t.iterations = 1;
  auto measure = [&](const TrainingConfig& training) {
    const std::unique_ptr<Session> session = test::RecordRank(test::Validated(m, training));
    const Recorder& r = session->recorder();
    int64_t backward = -1, end = -1;
    for (const Marker& marker : r.markers()) {
      if (marker.kind == MarkerKind::kPhaseBegin && marker.phase == Phase::kBackward) {
        backward = marker.event_index;
      } else if (marker.kind == MarkerKind::kIterationEnd) {
        end = marker.event_index;
      }
    }
    return std::make_pair(test::LiveBytesBefore(r, backward), test::LiveBytesBefore(r, end));
  };
  const auto eager = measure(t);
  t.cpu_offloading_num_layers = 2;
  const auto offloaded = measure(t);
  // Per layer, of what Megatron-Core's local layers save, the tensors of at least 256K
  // elements: not the input, the LayerNorm outputs (sbh = 64K elements each) or the qkv
  // output (3sbh = 192K); the probabilities (abs^2 = 256K) and fc1's and GeLU's outputs
  // (4sbh = 256K each). The persistent baddbmm buffer is not saved: it stays.
  const int64_t per_layer = 2 * (a * b * s * s) + 2 * (2 * 4 * s * b * h);
  EXPECT_EQ(eager.first - offloaded.first, 2 * per_layer);
  EXPECT_EQ(offloaded.second, eager.second);
}

}  // namespace
}  // namespace memsim
