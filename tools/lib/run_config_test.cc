// Run-file keys read into the model and training configs.
#include "tools/lib/run_config.h"

#include <gtest/gtest.h>
#include <yaml-cpp/yaml.h>

#include <string>
#include <vector>

namespace memsim {
namespace {

// The model config `yaml` makes; the test fails if the run file refuses it.
ModelConfig ModelFrom(const std::string& yaml) {
  ModelConfig m;
  const Status status = ApplyModelYaml(YAML::Load(yaml), "run.yaml", &m);
  EXPECT_TRUE(status.ok()) << yaml << ": " << status.message();
  return m;
}

// The training config `yaml` makes, or the error it gets ("" when accepted).
TrainingConfig TrainingFrom(const std::string& yaml, std::string* error = nullptr) {
  TrainingConfig t;
  int64_t global_batch_size = 0;
  const Status status = ApplyTrainingYaml(YAML::Load(yaml), "run.yaml", &t, &global_batch_size);
  if (error != nullptr) {
    *error = status.ok() ? "" : status.message();
  } else {
    EXPECT_TRUE(status.ok()) << yaml << ": " << status.message();
  }
  return t;
}

// The keys of Megatron switches added 2026-11-28 (their Megatron-LM arguments are read in
// megatron_args.cc): each sets its field, and a value of the wrong type is an error naming
// the key.
TEST(RunConfig, KeysOfTheSwitchesAdded20261128) {
  EXPECT_TRUE(ModelFrom("moe_shared_expert_gate: true").moe_shared_expert_gate);
  EXPECT_TRUE(ModelFrom("attention_output_gate: true").attention_output_gate);
  EXPECT_EQ(ModelFrom("no_rope_freq: 4").no_rope_freq, 4);
  EXPECT_EQ(ModelFrom("no_rope_layers: [0, 1]").no_rope_layers, (std::vector<int64_t>{0, 1}));
  EXPECT_TRUE(ModelFrom("moe_router_force_load_balancing: true").moe_router_force_load_balancing);
  EXPECT_FALSE(ModelFrom("{}").moe_router_force_biased.has_value());
  EXPECT_EQ(ModelFrom("moe_router_force_biased: -0.5").moe_router_force_biased, -0.5);
  EXPECT_FALSE(ModelFrom("{}").moe_input_jitter_eps.has_value());
  EXPECT_EQ(ModelFrom("moe_input_jitter_eps: 0.01").moe_input_jitter_eps, 0.01);
  {
    ModelConfig m;
    const Status bad = ApplyModelYaml(YAML::Load("moe_router_force_biased: [1]"), "run.yaml", &m);
    EXPECT_NE(bad.message().find("moe_router_force_biased"), std::string::npos) << bad.message();
  }
  EXPECT_FALSE(
      TrainingFrom("clone_scatter_output_in_embedding: false").clone_scatter_output_in_embedding);
  EXPECT_TRUE(TrainingFrom("te_activation_func: true").te_activation_func);
  EXPECT_TRUE(TrainingFrom("fused_weighted_squared_relu: true").fused_weighted_squared_relu);
  EXPECT_TRUE(TrainingFrom("log_max_attention_logit: true").log_max_attention_logit);
  EXPECT_TRUE(TrainingFrom("qk_clip: true").qk_clip);
  EXPECT_EQ(TrainingFrom("mlp_chunks_for_training: 4").mlp_chunks_for_training, 4);
  EXPECT_TRUE(TrainingFrom("log_num_zeros_in_grad: true").log_num_zeros_in_grad);
  EXPECT_FALSE(TrainingFrom("{}").output_logit_dtype.has_value());
  EXPECT_EQ(TrainingFrom("output_logit_dtype: fp32").output_logit_dtype, Precision::kFp32);
  for (const std::string key :
       {"clone_scatter_output_in_embedding", "te_activation_func", "output_logit_dtype",
        "fused_weighted_squared_relu", "log_max_attention_logit", "qk_clip",
        "mlp_chunks_for_training", "log_num_zeros_in_grad"}) {
    std::string error;
    TrainingFrom(key + ": [3]", &error);
    EXPECT_NE(error.find(key), std::string::npos) << key << ": " << error;
  }
}

// MuP's keys; a multiplier without use_mup is an error rather than a silent no-op.
TEST(RunConfig, MupKeys) {
  const ModelConfig m = ModelFrom(
      "{use_mup: true, mup_base_hidden_size: 1024, mup_embedding_mult: 2.5, mup_output_mult: "
      "0.5}");
  EXPECT_TRUE(m.use_mup);
  EXPECT_EQ(m.mup_base_hidden_size, 1024);
  EXPECT_EQ(m.mup_embedding_mult, 2.5);
  EXPECT_EQ(m.mup_output_mult, 0.5);
  ModelConfig off = ModelFrom("mup_output_mult: 0.5");
  const Status status = FinalizeModelConfig(&off);
  EXPECT_FALSE(status.ok());
  EXPECT_NE(status.message().find("use_mup"), std::string::npos) << status.message();
}

}  // namespace
}  // namespace memsim
