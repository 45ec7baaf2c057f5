// memsim plan: the step-time arithmetic by hand, and the search (pruning, dominance,
// screening with fewer microbatches, verification) against brute force.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <regex>
#include <string>

#include "parallel/step_time.h"
#include "simulator/caching_allocator_model.h"
#include "tests/support/command_runner.h"
#include "tests/support/test_models.h"
#include "tools/lib/plan.h"

namespace memsim {
namespace {

const GpuSpec& H100() { return *FindGpu("H100-80GB"); }

TEST(StepTime, PipelineTermByHand) {
  // m * slowest + (sum - slowest) / v.
  EXPECT_DOUBLE_EQ(PipelineSeconds({1, 2, 3}, 4, 1), 4 * 3 + 3.0);
  EXPECT_DOUBLE_EQ(PipelineSeconds({1, 2, 3}, 4, 2), 4 * 3 + 1.5);
  EXPECT_DOUBLE_EQ(PipelineSeconds({2}, 8, 1), 16);
}

TEST(StepTime, CollectivesByHand) {
  // H100: NVLink 450 GB/s, network 50 GB/s, 80% of it achieved, 8 GPUs a node.
  EXPECT_DOUBLE_EQ(CollectiveSeconds(H100(), CollectiveKind::kAllReduce, 1e9, 8, 1),
                   2 * 7.0 / 8 * 1e9 / (450e9 * 0.8));
  // Eight GPUs eight ranks apart span 64 ranks: the network.
  EXPECT_DOUBLE_EQ(CollectiveSeconds(H100(), CollectiveKind::kAllReduce, 1e9, 8, 8),
                   2 * 7.0 / 8 * 1e9 / (50e9 * 0.8));
  // Four GPUs two apart span 8 ranks: one node.
  EXPECT_DOUBLE_EQ(CollectiveSeconds(H100(), CollectiveKind::kAllGather, 1e9, 4, 2),
                   3.0 / 4 * 1e9 / (450e9 * 0.8));
  EXPECT_DOUBLE_EQ(CollectiveSeconds(H100(), CollectiveKind::kReduceScatter, 1e9, 1, 1), 0);
}

TEST(StepTime, WholeStepByHand) {
  ModelConfig model = test::Gpt(4, 1024, 16);
  TrainingConfig training;
  training.seq_length = 1024;
  training.micro_batch_size = 1;
  training.num_microbatches = 4;
  ParallelLayout layout;
  layout.world_size = 8;
  layout.tp = 2;
  layout.pp = 2;
  layout.data_parallel = DataParallelKind::kDistributedOptimizer;
  ASSERT_TRUE(FinalizeModelConfig(&model, layout.tp).ok());
  ASSERT_TRUE(FinalizeLayout(&layout, model).ok());
  ASSERT_EQ(layout.dp, 2);
  std::vector<StageClock> clocks(2);
  clocks[0] = {0.4, 4, 0.01, 1000000000, 500000000};
  clocks[1] = {0.6, 4, 0.02, 1000000000, 500000000};
  const StepTime step = EstimateStepTime(model, training, layout, H100(), clocks);

  // TP: 4 all-reduces per layer of [1024, 1, 1024] bf16 over 2 GPUs (NVLink), 2 layers.
  const double nvlink = 450e9 * 0.8;
  const double activation = 1024.0 * 1024 * 2;
  const double comm = 2 * 4 * (2 * 0.5 * activation / nvlink);
  const double t0 = 0.1 + comm, t1 = 0.15 + comm;
  // DP over 2 GPUs, 2 ranks apart: reduce-scatter the grads, all-gather the params (NVLink).
  const double dp = 0.5 * 1e9 / nvlink + 0.5 * 0.5e9 / nvlink;
  EXPECT_NEAR(step.total_s, 4 * t1 + t0 + dp + 0.02, 1e-12);
  EXPECT_NEAR(step.compute_s, 4 * 0.15, 1e-12);
  EXPECT_NEAR(step.model_parallel_comm_s, 4 * comm, 1e-12);
  EXPECT_NEAR(step.bubble_s, t0, 1e-12);
  EXPECT_NEAR(step.data_parallel_comm_s, dp, 1e-12);
  EXPECT_NEAR(step.optimizer_s, 0.02, 1e-12);
  // 4 microbatches of 1 x 1024 tokens on each of 2 data-parallel replicas, 8 GPUs.
  EXPECT_NEAR(step.tokens_per_s_per_gpu, 4 * 1024 * 2 / step.total_s / 8, 1e-9);
}

// A GPU like an H100 with `usable_bytes` of memory, to put layouts on both sides of it.
GpuSpec SmallGpu(int64_t usable_bytes) {
  GpuSpec gpu = H100();
  gpu.memory_bytes = gpu.context_bytes + usable_bytes;
  return gpu;
}

RunSpec SmallRun(const GpuSpec* gpu) {
  RunSpec base;
  base.model = test::Gpt(4, 512, 8, 4096);
  base.model_source = "test gpt";
  base.gpu = gpu;
  base.layout.world_size = 4;
  base.training.seq_length = 512;
  base.training.iterations = 2;
  base.global_batch_size = 32;
  return base;
}

PlanGrid SmallGrid() {
  PlanGrid grid;
  grid.tp = {1, 2};
  grid.pp = {1, 2};
  grid.vpp = {1, 2};
  grid.cp = {1};
  grid.ep = {1};
  grid.micro_batch = {1, 4};
  grid.recompute = {RecomputeKind::kNone, RecomputeKind::kSelective, RecomputeKind::kFull};
  grid.data_parallel = {DataParallelKind::kDistributedOptimizer, DataParallelKind::kDdp};
  return grid;
}

std::string Key(const PlanLayout& l) { return PlanLayoutName(l); }

// Every layout of the grid simulated with all its microbatches.
std::map<std::string, PlanEntry> BruteForce(const RunSpec& base, const PlanGrid& grid) {
  std::map<std::string, PlanEntry> all;
  for (DataParallelKind d : grid.data_parallel)
    for (int64_t tp : grid.tp)
      for (int64_t pp : grid.pp)
        for (int64_t vpp : grid.vpp)
          for (int64_t mbs : grid.micro_batch)
            for (RecomputeKind r : grid.recompute) {
              PlanLayout l;
              l.tp = tp, l.pp = pp, l.vpp = vpp, l.micro_batch = mbs, l.recompute = r;
              l.data_parallel = d;
              all[Key(l)] = SimulatePlanLayout(base, l, /*screen=*/false);
            }
  return all;
}

// The capacity sits between layouts' peaks, so that the search meets every verdict: some
// layouts fit only with recomputation, some not at all, some are ruled out by setup alone.
TEST(Plan, RankingMatchesBruteForce) {
  const GpuSpec roomy = H100();
  const PlanGrid grid = SmallGrid();
  std::vector<int64_t> none_peaks;
  for (const auto& [name, e] : BruteForce(SmallRun(&roomy), grid)) {
    if (e.verdict == PlanVerdict::kFits && e.layout.recompute == RecomputeKind::kNone) {
      none_peaks.push_back(*std::max_element(e.stage_peak_reserved_bytes.begin(),
                                             e.stage_peak_reserved_bytes.end()));
    }
  }
  ASSERT_GT(none_peaks.size(), 4u);
  std::sort(none_peaks.begin(), none_peaks.end());
  const GpuSpec gpu = SmallGpu(none_peaks[none_peaks.size() / 2]);
  const RunSpec base = SmallRun(&gpu);

  const std::map<std::string, PlanEntry> brute = BruteForce(base, grid);
  std::vector<PlanEntry> planned;
  PlanSettings settings;
  settings.progress = false;
  settings.verify = 100;  // every layout that fits is verified: times compare exactly
  ASSERT_TRUE(RunPlan(base, grid, settings, &planned).ok());
  ASSERT_EQ(planned.size(), brute.size());

  // Brute force's ranking, less the layouts a sibling with less recomputation dominates.
  auto sibling_fits = [&](const PlanLayout& l) {
    for (RecomputeKind r : grid.recompute) {
      if (r >= l.recompute) break;
      PlanLayout s = l;
      s.recompute = r;
      if (brute.at(Key(s)).verdict == PlanVerdict::kFits) return true;
    }
    return false;
  };
  std::vector<const PlanEntry*> expected;
  for (const auto& [name, e] : brute) {
    if (e.verdict == PlanVerdict::kFits && !sibling_fits(e.layout)) expected.push_back(&e);
  }
  std::sort(expected.begin(), expected.end(),
            [](const PlanEntry* a, const PlanEntry* b) { return PlanRanksBefore(*a, *b); });
  ASSERT_FALSE(expected.empty());

  std::map<PlanVerdict, int> seen;
  for (size_t i = 0; i < planned.size(); ++i) {
    const PlanEntry& p = planned[i];
    const PlanEntry& b = brute.at(Key(p.layout));
    ++seen[p.verdict];
    SCOPED_TRACE(Key(p.layout) + ": " + p.reason);
    if (i < expected.size()) {
      ASSERT_EQ(p.verdict, PlanVerdict::kFits);
      EXPECT_EQ(Key(p.layout), Key(expected[i]->layout));
      EXPECT_TRUE(p.verified);
      EXPECT_DOUBLE_EQ(p.step.total_s, expected[i]->step.total_s);
      EXPECT_EQ(p.headroom_bytes, expected[i]->headroom_bytes);
      continue;
    }
    EXPECT_NE(p.verdict, PlanVerdict::kFits);
    switch (p.verdict) {
      case PlanVerdict::kDominated:
        EXPECT_EQ(b.verdict, PlanVerdict::kFits);
        EXPECT_TRUE(sibling_fits(p.layout));
        break;
      case PlanVerdict::kPruned:
      case PlanVerdict::kOutOfMemory:
        EXPECT_EQ(b.verdict, PlanVerdict::kOutOfMemory);
        break;
      default:
        EXPECT_EQ(p.verdict, b.verdict);
    }
  }
  EXPECT_GT(seen[PlanVerdict::kFits], 0);
  EXPECT_GT(seen[PlanVerdict::kOutOfMemory], 0);
  EXPECT_GT(seen[PlanVerdict::kDominated], 0);
  EXPECT_GT(seen[PlanVerdict::kInvalid], 0);
}

// Screening (fewer microbatches) decides as the full simulation does and times each
// microbatch as it does: the step times agree without verification. The reserved peaks
// agree up to the segment a long run adds as its blocks fragment: one 2 MiB segment of the
// small pool (TP2 PP2 here, stage 0, from about 10 microbatches on), or, on the last stage,
// a segment of its own for the step's largest block, the fp32 logits (micro batch x S x
// V/tp x 4 bytes), when the cached blocks, among them the parameters' own storages the
// distributed optimizer freed, are split too finely to hold it (TP1 PP2 with full
// recomputation).
TEST(Plan, ScreeningAgreesWithFullSimulation) {
  const GpuSpec gpu = H100();
  const RunSpec base = SmallRun(&gpu);
  PlanGrid grid = SmallGrid();
  grid.recompute = {RecomputeKind::kNone, RecomputeKind::kFull};
  grid.data_parallel = {DataParallelKind::kDistributedOptimizer};
  for (int64_t tp : grid.tp)
    for (int64_t pp : grid.pp)
      for (int64_t vpp : grid.vpp)
        for (int64_t mbs : grid.micro_batch)
          for (RecomputeKind r : grid.recompute) {
            PlanLayout l;
            l.tp = tp, l.pp = pp, l.vpp = vpp, l.micro_batch = mbs, l.recompute = r;
            const PlanEntry full = SimulatePlanLayout(base, l, /*screen=*/false);
            const PlanEntry screened = SimulatePlanLayout(base, l, /*screen=*/true);
            SCOPED_TRACE(Key(l));
            ASSERT_EQ(screened.verdict, full.verdict);
            if (full.verdict != PlanVerdict::kFits) continue;
            ASSERT_EQ(screened.stage_peak_reserved_bytes.size(),
                      full.stage_peak_reserved_bytes.size());
            for (size_t stage = 0; stage < full.stage_peak_reserved_bytes.size(); ++stage) {
              const int64_t more =
                  full.stage_peak_reserved_bytes[stage] - screened.stage_peak_reserved_bytes[stage];
              const int64_t logits_bytes = mbs * base.training.seq_length * 4096 / tp * 4;
              EXPECT_TRUE(
                  more == 0 || more == CachingAllocatorModel::kSmallBuffer ||
                  (stage + 1 == full.stage_peak_reserved_bytes.size() && more == logits_bytes))
                  << stage << ": " << more;
            }
            EXPECT_NEAR(screened.step.total_s, full.step.total_s, 1e-9 * full.step.total_s);
          }
}

// ETP is searched when given: TP 2 with expert TP 1 keeps whole experts on each rank, so
// its expert weights (and peak) are larger than with expert TP = TP.
TEST(Plan, SearchesExpertTensorParallelism) {
  const GpuSpec gpu = H100();
  RunSpec base = SmallRun(&gpu);
  base.model = test::Llama(2, 512, 8, 8, 1024, 1024);
  base.model.num_experts = 4;
  base.model.moe_router_topk = 2;
  base.model.moe_ffn_hidden_size = 2048;
  PlanGrid grid;
  grid.tp = {2};
  grid.pp = {1};
  grid.vpp = {1};
  grid.cp = {1};
  grid.ep = {2};
  grid.etp = {0, 1};
  grid.micro_batch = {1};
  grid.recompute = {RecomputeKind::kNone};
  grid.data_parallel = {DataParallelKind::kDistributedOptimizer};
  std::vector<PlanEntry> planned;
  PlanSettings settings;
  settings.progress = false;
  ASSERT_TRUE(RunPlan(base, grid, settings, &planned).ok());
  ASSERT_EQ(planned.size(), 2u);
  std::map<int64_t, const PlanEntry*> by_etp;
  for (const PlanEntry& e : planned) {
    ASSERT_EQ(e.verdict, PlanVerdict::kFits) << Key(e.layout) << ": " << e.reason;
    by_etp[e.layout.etp] = &e;
  }
  EXPECT_EQ(Key(by_etp.at(1)->layout),
            "TP2 PP1 VPP1 CP1 EP2 ETP1 mbs1 recompute=none distributed-optimizer");
  EXPECT_GT(by_etp.at(1)->stage_peak_reserved_bytes[0], by_etp.at(0)->stage_peak_reserved_bytes[0]);
}

// Note [Plan's uneven stages] by hand: middle stages get ceil(L / PP), the excess comes off
// the first stage (rounded up) and the last.
TEST(Plan, UnevenStagesByHand) {
  int64_t first = 0, last = 0;
  ASSERT_TRUE(PlanUnevenStages(61, 16, &first, &last));  // 4 * 16 = 64: 3 too many
  EXPECT_EQ(first, 2);
  EXPECT_EQ(last, 3);
  ASSERT_TRUE(PlanUnevenStages(61, 2, &first, &last));  // 31 * 2 = 62: 1 too many
  EXPECT_EQ(first, 30);
  EXPECT_EQ(last, 31);
  ASSERT_TRUE(PlanUnevenStages(10, 4, &first, &last));  // 3 * 4 = 12: 2 too many
  EXPECT_EQ(first, 2);
  EXPECT_EQ(last, 2);
  EXPECT_FALSE(PlanUnevenStages(5, 4, &first, &last));    // 2 * 4 = 8: the first would hold 0
  EXPECT_FALSE(PlanUnevenStages(61, 32, &first, &last));  // 2 * 32 = 64: the first would hold 0
  EXPECT_FALSE(PlanUnevenStages(64, 16, &first, &last));  // even
  EXPECT_FALSE(PlanUnevenStages(61, 1, &first, &last));
}

// The default grid's PP values for 5 layers on 4 GPUs: 1, and 2 split 2 + 3 (4 would leave the
// first stage none); with the run's own split (the first stage's 1 layer) only 2 (1 + 4; 4
// stages cannot share the other 4 layers evenly, 1 stage cannot be uneven).
TEST(Plan, DefaultPipelineSizesFollowTheSplit) {
  const GpuSpec gpu = H100();
  RunSpec base = SmallRun(&gpu);
  base.model = test::Gpt(5, 512, 8, 4096);
  EXPECT_EQ(DefaultPlanGrid(base).pp, (std::vector<int64_t>{1, 2}));
  base.layout.first_stage_layers = 1;
  EXPECT_EQ(DefaultPlanGrid(base).pp, (std::vector<int64_t>{2}));
}

// Where PP does not divide the layers the plan runs its uneven split (5 layers on PP 2:
// 2 + 3), names it, and simulates what a run with those stage sizes gives; a run that names
// its own split keeps it; with VPP 2 the layout is invalid, as FinalizeLayout says.
TEST(Plan, ChoosesUnevenStagesWherePipelineStagesDoNotDivideTheLayers) {
  const GpuSpec gpu = H100();
  RunSpec base = SmallRun(&gpu);
  base.model = test::Gpt(5, 512, 8, 4096);
  base.layout.world_size = 2;
  PlanGrid grid = SmallGrid();
  grid.tp = {1};
  grid.pp = {2};
  grid.micro_batch = {1};
  grid.recompute = {RecomputeKind::kNone};
  grid.data_parallel = {DataParallelKind::kDistributedOptimizer};
  PlanSettings settings;
  settings.progress = false;
  std::vector<PlanEntry> planned;
  ASSERT_TRUE(RunPlan(base, grid, settings, &planned).ok());
  ASSERT_EQ(planned.size(), 2u);
  const PlanEntry& uneven = planned[0];
  ASSERT_EQ(uneven.verdict, PlanVerdict::kFits) << uneven.reason;
  EXPECT_EQ(Key(uneven.layout),
            "TP1 PP2 (first 2, last 3 layers) VPP1 CP1 EP1 mbs1 recompute=none "
            "distributed-optimizer");
  EXPECT_EQ(planned[1].verdict, PlanVerdict::kInvalid);
  EXPECT_EQ(planned[1].layout.first_stage_layers, 0);
  EXPECT_NE(planned[1].reason.find("PP*VPP=2*2 does not divide 5 layers"), std::string::npos)
      << planned[1].reason;

  PlanLayout given = uneven.layout;
  given.first_stage_layers = 1;
  given.last_stage_layers = 4;
  const PlanEntry other = SimulatePlanLayout(base, given, /*screen=*/false);
  const PlanEntry same = SimulatePlanLayout(base, uneven.layout, /*screen=*/false);
  EXPECT_EQ(same.stage_peak_reserved_bytes, uneven.stage_peak_reserved_bytes);
  EXPECT_NE(other.stage_peak_reserved_bytes, uneven.stage_peak_reserved_bytes);

  base.layout.first_stage_layers = 1;  // the run's own split
  grid.vpp = {1};
  ASSERT_TRUE(RunPlan(base, grid, settings, &planned).ok());
  ASSERT_EQ(planned.size(), 1u);
  EXPECT_EQ(planned[0].layout.first_stage_layers, 0);
  EXPECT_EQ(planned[0].stage_peak_reserved_bytes, other.stage_peak_reserved_bytes);
}

// Setup alone over the GPU: pruned without simulating a step, and truly out of memory.
TEST(Plan, PrunesWhatSetupAloneRulesOut) {
  const GpuSpec gpu = SmallGpu(int64_t{40} << 20);  // 40 MiB
  const RunSpec base = SmallRun(&gpu);
  PlanGrid grid = SmallGrid();
  grid.micro_batch = {1};
  std::vector<PlanEntry> planned;
  PlanSettings settings;
  settings.progress = false;
  ASSERT_TRUE(RunPlan(base, grid, settings, &planned).ok());
  int pruned = 0;
  for (const PlanEntry& p : planned) {
    if (p.verdict != PlanVerdict::kPruned) continue;
    ++pruned;
    EXPECT_EQ(SimulatePlanLayout(base, p.layout, /*screen=*/false).verdict,
              PlanVerdict::kOutOfMemory)
        << Key(p.layout);
  }
  EXPECT_GT(pruned, 0);
}

TEST(Plan, CommandWritesRankedReport) {
  const std::string out = ::testing::TempDir() + "/memsim_plan_cli";
  std::filesystem::remove_all(out);
  const test::CommandResult run = test::RunMemsim(
      "plan --model gpt3-1.3b --world-size 8 --seq-length 1024 --global-batch-size 16 "
      "--tp 1,2 --pp 1,2 --vpp 1 --recompute none,full --out " +
      out);
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_NE(run.out.find("| 1 | TP"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("Memory versus sequence length"), std::string::npos);
  // 2 TP x 2 PP x 2 recompute = 8 layouts, and how fast they went.
  EXPECT_TRUE(std::regex_search(
      run.out, std::regex(R"(8 layouts searched in [0-9.]+ s \([0-9.]+ layouts/s\))")))
      << run.out;
  for (const char* file : {"/plan.md", "/plan.csv", "/plan.json", "/memory_vs_sequence_length.png",
                           "/step_time.png"}) {
    EXPECT_TRUE(std::filesystem::exists(out + file)) << file;
  }
  // What the plan needs and does not default.
  EXPECT_EQ(test::RunMemsim("plan --model gpt3-1.3b --world-size 8").exit_code, 2);
  EXPECT_EQ(test::RunMemsim("plan --model gpt3-1.3b --global-batch-size 8").exit_code, 2);
  EXPECT_EQ(test::RunMemsim("plan --model gpt3-1.3b --world-size 8 --global-batch-size 8 "
                            "--tp 0")
                .exit_code,
            2);
  EXPECT_EQ(test::RunMemsim("plan --help").exit_code, 0);
  // A launch line over a range of cluster sizes: a plan per size, and their comparison.
  const std::string sizes = out + "_sizes";
  const test::CommandResult ranged = test::RunMemsim(
      "plan --gpus 2,4 --tp 1,2 --pp 1 --vpp 1 --recompute none --out " + sizes +
      " -- --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 "
      "--max-position-embeddings 128 --micro-batch-size 1 --global-batch-size 8 --vocab-size 256");
  ASSERT_EQ(ranged.exit_code, 0) << ranged.err;
  EXPECT_NE(ranged.out.find("| 4 | TP"), std::string::npos) << ranged.out;
  for (const char* file : {"/plan.md", "/gpus_2/plan.md", "/gpus_4/plan.json"}) {
    EXPECT_TRUE(std::filesystem::exists(sizes + file)) << file;
  }
  EXPECT_EQ(test::RunMemsim("plan --gpus 2,4 --world-size 4 --model gpt3-1.3b "
                            "--global-batch-size 8")
                .exit_code,
            2);
  // The figures redrawn from plan.json; a folder without one is a one-line error.
  EXPECT_EQ(test::RunMemsim("plan-figures " + out).exit_code, 0);
  const test::CommandResult bad = test::RunMemsim("plan-figures " + out + "/missing");
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.err.find("plan.json"), std::string::npos) << bad.err;
}

}  // namespace
}  // namespace memsim
