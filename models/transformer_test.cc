// The parameter inventory of transformer.h and moe.h, checked name by name and shape by
// shape: every parameter a tiny GPT, Llama (tp = 2) and MoE (ep = 2) shard creates, against
// the tables in those headers evaluated by hand for these sizes.
#include "models/transformer.h"

#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "simulator/session.h"
#include "tests/support/test_models.h"

namespace memsim {
namespace {

using Inventory = std::map<std::string, std::vector<int64_t>>;

Inventory ParametersOf(ModelConfig model, const ModelShard& shard) {
  EXPECT_TRUE(FinalizeModelConfig(&model, shard.tp).ok());
  TrainingConfig training;
  training.seq_length = 16;
  Session session;  // parameters are named after the module path the session tracks
  ActiveSession active(session);
  ParameterStore store(Precision::kBf16);
  TransformerModel transformer(model, training, shard, &store);
  Inventory inventory;
  for (const Parameter& p : store.parameters()) {
    EXPECT_EQ(inventory.count(p.name), 0u) << p.name;
    inventory[p.name] = p.data.sizes().vec();
  }
  return inventory;
}

// Prefix "decoder.layers.<l>." on each of `layer`'s entries.
void AddLayer(Inventory* inventory, int64_t l, const Inventory& layer) {
  for (const auto& [name, shape] : layer) {
    (*inventory)["decoder.layers." + std::to_string(l) + "." + name] = shape;
  }
}

// GPT: H = 8, A = G = 2, D = 4, F = 4H = 32, V = 1024 (already a multiple of 128), S = 16,
// LayerNorm with biases, linear biases, learned positions, tied embeddings (pp = 1: no
// output layer of its own).
TEST(ModelInventory, GptMatchesTheTable) {
  Inventory expected = {{"embedding.word_embeddings.weight", {1024, 8}},    // (V/tp, H)
                        {"embedding.position_embeddings.weight", {16, 8}},  // (S_max, H)
                        {"decoder.final_layernorm.weight", {8}},
                        {"decoder.final_layernorm.bias", {8}}};
  const Inventory layer = {{"input_layernorm.weight", {8}},
                           {"input_layernorm.bias", {8}},
                           {"self_attention.linear_qkv.weight", {24, 8}},  // ((A + 2G) * D / tp, H)
                           {"self_attention.linear_qkv.bias", {24}},
                           {"self_attention.linear_proj.weight", {8, 8}},  // (H, A * D / tp)
                           {"self_attention.linear_proj.bias", {8}},
                           {"pre_mlp_layernorm.weight", {8}},
                           {"pre_mlp_layernorm.bias", {8}},
                           {"mlp.linear_fc1.weight", {32, 8}},  // (F/tp, H)
                           {"mlp.linear_fc1.bias", {32}},
                           {"mlp.linear_fc2.weight", {8, 32}},  // (H, F/tp)
                           {"mlp.linear_fc2.bias", {8}}};
  AddLayer(&expected, 0, layer);
  AddLayer(&expected, 1, layer);
  const ModelConfig gpt = test::Gpt(/*layers=*/2, /*hidden=*/8, /*heads=*/2);
  EXPECT_EQ(ParametersOf(gpt, ModelShard::Whole(gpt)), expected);
}

// Llama on tp = 2: H = 16, A = 4, G = 2, D = 4, F = 24 (SwiGLU), V = 1000 padded to a
// multiple of 128 * tp = 1024; RMSNorm, no biases, RoPE (no position table), untied.
TEST(ModelInventory, LlamaTensorParallelShardMatchesTheTable) {
  Inventory expected = {{"embedding.word_embeddings.weight", {512, 16}},  // (V/tp, H)
                        {"decoder.final_layernorm.weight", {16}},
                        {"output_layer.weight", {512, 16}}};  // (V/tp, H)
  const Inventory layer = {
      {"input_layernorm.weight", {16}},
      {"self_attention.linear_qkv.weight", {16, 16}},  // ((4 + 2*2) * 4 / 2, H)
      {"self_attention.linear_proj.weight", {16, 8}},  // (H, 4 * 4 / 2)
      {"pre_mlp_layernorm.weight", {16}},
      {"mlp.linear_fc1.weight", {24, 16}},   // (2F/tp, H)
      {"mlp.linear_fc2.weight", {16, 12}}};  // (H, F/tp)
  AddLayer(&expected, 0, layer);
  AddLayer(&expected, 1, layer);
  const ModelConfig llama = test::Llama(2, 16, 4, 2, 24, 1000);
  ModelShard shard = ModelShard::Whole(llama);
  shard.tp = 2;
  EXPECT_EQ(ParametersOf(llama, shard), expected);
}

// MoE on ep = 2: the Llama above on tp = 1 with E = 4 experts of F_e = 8 from layer 1 on
// (layer 0 dense): E_local = 2 experts per rank.
TEST(ModelInventory, MixtureOfExpertsShardMatchesTheTable) {
  Inventory expected = {{"embedding.word_embeddings.weight", {1024, 16}},
                        {"decoder.final_layernorm.weight", {16}},
                        {"output_layer.weight", {1024, 16}}};
  const Inventory attention = {{"input_layernorm.weight", {16}},
                               {"self_attention.linear_qkv.weight", {32, 16}},
                               {"self_attention.linear_proj.weight", {16, 16}},
                               {"pre_mlp_layernorm.weight", {16}}};
  AddLayer(&expected, 0, attention);
  AddLayer(&expected, 0,
           {{"mlp.linear_fc1.weight", {48, 16}}, {"mlp.linear_fc2.weight", {16, 24}}});
  AddLayer(&expected, 1, attention);
  AddLayer(&expected, 1,
           {{"mlp.router.weight", {4, 16}},                 // (E, H)
            {"mlp.experts.linear_fc1.weight", {32, 16}},    // (E_local * 2F_e/etp, H)
            {"mlp.experts.linear_fc2.weight", {16, 16}}});  // (H, E_local * F_e/etp)
  ModelConfig moe = test::Llama(2, 16, 4, 2, 24, 1000);
  moe.num_experts = 4;
  moe.moe_ffn_hidden_size = 8;
  moe.moe_first_k_dense_layers = 1;
  ModelShard shard = ModelShard::Whole(moe);
  shard.ep = 2;
  EXPECT_EQ(ParametersOf(moe, shard), expected);
}

// Multi-token prediction (Note [Multi-token prediction]): the Llama above on tp = 2 with
// k = 2 depths, last of two pipeline stages (layer 1): the stage has its own word
// embedding, and each depth two norms, eh_proj (H/tp, 2H) = (8, 32), a decoder layer and
// a final norm.
TEST(ModelInventory, MultiTokenPredictionOnTheLastStage) {
  Inventory expected = {{"embedding.word_embeddings.weight", {512, 16}},  // (V/tp, H)
                        {"decoder.final_layernorm.weight", {16}},
                        {"output_layer.weight", {512, 16}}};
  const Inventory layer = {{"input_layernorm.weight", {16}},
                           {"self_attention.linear_qkv.weight", {16, 16}},
                           {"self_attention.linear_proj.weight", {16, 8}},
                           {"pre_mlp_layernorm.weight", {16}},
                           {"mlp.linear_fc1.weight", {24, 16}},
                           {"mlp.linear_fc2.weight", {16, 12}}};
  AddLayer(&expected, 1, layer);
  for (const std::string depth : {"mtp.layers.0.", "mtp.layers.1."}) {
    expected[depth + "enorm.weight"] = {16};
    expected[depth + "hnorm.weight"] = {16};
    expected[depth + "eh_proj.weight"] = {8, 32};
    expected[depth + "final_layernorm.weight"] = {16};
    for (const auto& [name, shape] : layer) expected[depth + "mtp_model_layer." + name] = shape;
  }
  ModelConfig llama = test::Llama(2, 16, 4, 2, 24, 1000);
  llama.mtp_num_layers = 2;
  ModelShard last;
  last.tp = 2;
  last.chunks = {{1, 1}};
  last.first_stage = false;
  EXPECT_EQ(ParametersOf(llama, last), expected);

  // --mtp-use-repeated-layer: the first depth's layer, run at both.
  ModelConfig repeated = llama;
  repeated.mtp_use_repeated_layer = true;
  Inventory one_layer = expected;
  for (auto it = one_layer.begin(); it != one_layer.end();) {
    it = it->first.rfind("mtp.layers.1.", 0) == 0 ? one_layer.erase(it) : std::next(it);
  }
  EXPECT_EQ(ParametersOf(repeated, last), one_layer);

  // The first stage builds none of it.
  ModelShard first = last;
  first.chunks = {{0, 1}};
  first.first_stage = true;
  first.last_stage = false;
  for (const auto& entry : ParametersOf(llama, first)) {
    EXPECT_EQ(entry.first.rfind("mtp.", 0), std::string::npos) << entry.first;
  }
}

// The depth's layer is of the last decoder layer's kind: an MoE layer after an MoE decoder.
TEST(ModelInventory, MultiTokenPredictionLayerIsLikeTheLastDecoderLayer) {
  ModelConfig moe = test::Llama(2, 16, 4, 2, 24, 1000);
  moe.num_experts = 4;
  moe.moe_ffn_hidden_size = 8;
  moe.moe_first_k_dense_layers = 1;
  moe.mtp_num_layers = 1;
  const Inventory inventory = ParametersOf(moe, ModelShard::Whole(moe));
  EXPECT_EQ(inventory.at("mtp.layers.0.mtp_model_layer.mlp.router.weight"),
            (std::vector<int64_t>{4, 16}));
  EXPECT_EQ(inventory.count("mtp.layers.0.mtp_model_layer.mlp.linear_fc1.weight"), 0u);
  // pp = 1: the depth embeds with the first stage's table, no second one.
  EXPECT_EQ(inventory.count("embedding.word_embeddings.weight"), 1u);
}

}  // namespace
}  // namespace memsim
