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

}  // namespace
}  // namespace memsim
