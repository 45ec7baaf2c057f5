// Run-file keys read into the model and training configs.
#include "tools/lib/run_config.h"

#include <gtest/gtest.h>
#include <yaml-cpp/yaml.h>

namespace memsim {
namespace {

// The keys of Megatron switches added 2026-11-28 (their Megatron-LM arguments are read in
// megatron_args.cc): each sets its field, and a value of the wrong type is an error naming
// the key.
TEST(RunConfig, SharedExpertGateAndEmbeddingCloneKeys) {
  ModelConfig m;
  ASSERT_TRUE(ApplyModelYaml(YAML::Load("moe_shared_expert_gate: true"), "run.yaml", &m).ok());
  EXPECT_TRUE(m.moe_shared_expert_gate);
  TrainingConfig t;
  int64_t global_batch_size = 0;
  ASSERT_TRUE(ApplyTrainingYaml(YAML::Load("clone_scatter_output_in_embedding: false"), "run.yaml",
                                &t, &global_batch_size)
                  .ok());
  EXPECT_FALSE(t.clone_scatter_output_in_embedding);
  const Status bad = ApplyTrainingYaml(YAML::Load("clone_scatter_output_in_embedding: 3"),
                                       "run.yaml", &t, &global_batch_size);
  EXPECT_FALSE(bad.ok());
  EXPECT_NE(bad.message().find("clone_scatter_output_in_embedding"), std::string::npos)
      << bad.message();
}

// MuP's keys; a multiplier without use_mup is an error rather than a silent no-op.
TEST(RunConfig, MupKeys) {
  ModelConfig m;
  ASSERT_TRUE(ApplyModelYaml(YAML::Load("{use_mup: true, mup_base_hidden_size: 1024, "
                                        "mup_embedding_mult: 2.5, mup_output_mult: 0.5}"),
                             "run.yaml", &m)
                  .ok());
  EXPECT_TRUE(m.use_mup);
  EXPECT_EQ(m.mup_base_hidden_size, 1024);
  EXPECT_EQ(m.mup_embedding_mult, 2.5);
  EXPECT_EQ(m.mup_output_mult, 0.5);
  ModelConfig off;
  ASSERT_TRUE(ApplyModelYaml(YAML::Load("mup_output_mult: 0.5"), "run.yaml", &off).ok());
  const Status status = FinalizeModelConfig(&off);
  EXPECT_FALSE(status.ok());
  EXPECT_NE(status.message().find("use_mup"), std::string::npos) << status.message();
}

TEST(RunConfig, AttentionOutputGateAndLogitDtypeKeys) {
  ModelConfig m;
  ASSERT_TRUE(ApplyModelYaml(YAML::Load("attention_output_gate: true"), "run.yaml", &m).ok());
  EXPECT_TRUE(m.attention_output_gate);
  TrainingConfig t;
  int64_t global_batch_size = 0;
  EXPECT_FALSE(t.output_logit_dtype.has_value());
  ASSERT_TRUE(
      ApplyTrainingYaml(YAML::Load("output_logit_dtype: fp32"), "run.yaml", &t, &global_batch_size)
          .ok());
  EXPECT_EQ(t.output_logit_dtype, Precision::kFp32);
  const Status bad =
      ApplyTrainingYaml(YAML::Load("output_logit_dtype: fp64"), "run.yaml", &t, &global_batch_size);
  EXPECT_FALSE(bad.ok());
  EXPECT_NE(bad.message().find("output_logit_dtype"), std::string::npos) << bad.message();
}

}  // namespace
}  // namespace memsim
