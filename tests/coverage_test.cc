// Every model preset, attention kind and recomputation runs forward, backward and the
// optimizer step on meta tensors under a parallel layout without falling back to a
// missing kernel (the engine names the op if one does), and every phase shows up.
#include <gtest/gtest.h>

#include "parallel/rank_classes.h"
#include "simulator/peak_analysis.h"
#include "tools/lib/run_config.h"
#include "tools/lib/simulate.h"

namespace memsim {
namespace {

struct Variant {
  AttentionKind attention;
  RecomputeKind recompute;
  Precision precision;
  ProfileKind profile;
};

TEST(OpCoverage, EveryPresetAttentionAndRecomputationRuns) {
  const std::vector<std::string> presets = ModelPresetNames();
  ASSERT_GE(presets.size(), 9u);
  const Variant variants[] = {
      {AttentionKind::kFlash, RecomputeKind::kNone, Precision::kBf16, ProfileKind::kMegatronLocal},
      {AttentionKind::kEager, RecomputeKind::kSelective, Precision::kFp16,
       ProfileKind::kMegatronLocal},
      {AttentionKind::kEager, RecomputeKind::kFull, Precision::kFp32, ProfileKind::kMegatronLocal},
      {AttentionKind::kFlash, RecomputeKind::kNone, Precision::kBf16,
       ProfileKind::kTransformerEngine},
      {AttentionKind::kEager, RecomputeKind::kSelective, Precision::kBf16,
       ProfileKind::kTransformerEngine}};
  for (const std::string& name : presets) {
    for (const Variant& v : variants) {
      SCOPED_TRACE(name + " attention " + std::to_string(static_cast<int>(v.attention)) +
                   " recompute " + std::to_string(static_cast<int>(v.recompute)));
      RunSpec spec;
      spec.gpu = FindGpu("H100-80GB");
      ASSERT_TRUE(LoadModelPreset(name, &spec.model).ok());
      // Real widths, four layers (one dense first for MoE presets), short sequences.
      spec.model.num_layers = 4;
      if (spec.model.moe_first_k_dense_layers > 0) spec.model.moe_first_k_dense_layers = 1;
      spec.training.seq_length = 256;
      spec.training.num_microbatches = 4;
      spec.training.iterations = 1;
      spec.training.attention = v.attention;
      spec.training.recompute = v.recompute;
      spec.training.precision = v.precision;
      spec.training.profile = v.profile;
      spec.layout.world_size = 8;
      spec.layout.tp = 2;
      spec.layout.pp = 2;
      spec.layout.sequence_parallel = true;
      spec.layout.ep = spec.model.num_experts > 0 ? 2 : 1;
      spec.layout.data_parallel = DataParallelKind::kDistributedOptimizer;
      std::optional<ValidatedRun> run;
      ASSERT_TRUE(FinalizeRunSpec(spec, &run).ok());
      for (const RankClass& c : RankClasses(run->spec().layout)) {
        RankResult result;
        const Status status = SimulateRankClass(*run, c, &result);
        ASSERT_TRUE(status.ok()) << status.message();
        EXPECT_EQ(result.peak.phases.size(), 4u);  // setup, forward, backward, optimizer
      }
    }
  }
}

}  // namespace
}  // namespace memsim

namespace memsim {
namespace {

// Full-size models at realistic sequence lengths run in seconds on meta, with a peak per
// phase.
TEST(OpCoverage, RealisticSizesReportPeaksPerPhase) {
  for (const char* name : {"llama3-8b", "mixtral-8x7b", "gpt3-175b"}) {
    SCOPED_TRACE(name);
    RunSpec spec;
    spec.gpu = FindGpu("H100-80GB");
    ASSERT_TRUE(LoadModelPreset(name, &spec.model).ok());
    spec.training.seq_length = std::string(name) == "gpt3-175b" ? 2048 : 8192;
    spec.training.num_microbatches = 2;
    std::optional<ValidatedRun> run;
    ASSERT_TRUE(FinalizeRunSpec(spec, &run).ok());
    RankResult result;
    ASSERT_TRUE(SimulateRankClass(*run, RankClasses(run->spec().layout)[0], &result).ok());
    ASSERT_EQ(result.peak.phases.size(), 4u);
    // Forward and backward peak above setup: activations come on top of the model state.
    EXPECT_GT(result.peak.phases[1].peak_allocated_bytes,
              result.peak.phases[0].peak_allocated_bytes);
    EXPECT_GT(result.peak.phases[2].peak_allocated_bytes,
              result.peak.phases[0].peak_allocated_bytes);
  }
}

}  // namespace
}  // namespace memsim
