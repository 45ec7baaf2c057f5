// Hugging Face config.json files of the supported families, with their published values,
// mapped onto ModelConfig; and every way a file can be rejected.
#include "tools/lib/hf_config.h"
#include "tests/support/test_models.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <regex>

#include "models/transformer.h"
#include "tools/lib/run_config.h"

namespace memsim {
namespace {

namespace fs = std::filesystem;

// Writes `text` to TempDir/memsim_hf_config_test/FOLDER/config.json; returns its path.
std::string WriteConfig(const std::string& folder, const std::string& text) {
  const fs::path dir = fs::path(::testing::TempDir()) / "memsim_hf_config_test" / folder;
  fs::create_directories(dir);
  const std::string path = (dir / "config.json").string();
  std::ofstream(path) << text;
  return path;
}

// `notes` without the last line listing the memory-neutral keys LoadHfConfig ignored.
std::vector<std::string> Approximations(const std::vector<std::string>& notes) {
  std::vector<std::string> out;
  for (const std::string& note : notes) {
    if (note.find(": ignored, as they do not change training memory: ") == std::string::npos) {
      out.push_back(note);
    }
  }
  return out;
}

// Every field but the name and the dropout probabilities (the presets keep
// ModelConfig's 0.1; these decoders train without dropout).

void ExpectLlamaArchitecture(const ModelConfig& m) {
  EXPECT_EQ(m.norm, NormKind::kRmsNorm);
  EXPECT_EQ(m.activation, ActivationKind::kSwiglu);
  EXPECT_EQ(m.position, PositionKind::kRope);
  EXPECT_FALSE(m.tie_embeddings);
  EXPECT_FALSE(m.add_bias_linear);
  EXPECT_EQ(m.max_position_embeddings, 0);  // RoPE: no position table
  EXPECT_EQ(m.hidden_dropout, 0.0);
  EXPECT_EQ(m.attention_dropout, 0.0);
}

// meta-llama/Meta-Llama-3-8B/config.json.
constexpr char kLlama3_8B[] = R"({
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 128000,
  "eos_token_id": 128001,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 14336,
  "max_position_embeddings": 8192,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": null,
  "rope_theta": 500000.0,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.40.0.dev0",
  "use_cache": true,
  "vocab_size": 128256
})";

TEST(HfConfig, Llama3_8B) {
  ModelConfig m;
  std::vector<std::string> notes;
  ASSERT_TRUE(LoadHfConfig(WriteConfig("Meta-Llama-3-8B", kLlama3_8B), &m, &notes).ok());
  EXPECT_EQ(m.name, "Meta-Llama-3-8B");
  EXPECT_EQ(m.hidden_size, 4096);
  EXPECT_EQ(m.num_layers, 32);
  EXPECT_EQ(m.num_attention_heads, 32);
  EXPECT_EQ(m.num_query_groups, 8);
  EXPECT_EQ(m.ffn_hidden_size, 14336);
  EXPECT_EQ(m.vocab_size, 128256);
  EXPECT_EQ(m.kv_channels, 0);  // no head_dim: H / A
  EXPECT_FALSE(m.add_qkv_bias);
  EXPECT_EQ(m.num_experts, 0);
  ExpectLlamaArchitecture(m);
  EXPECT_TRUE(Approximations(notes).empty());
  // The keys memsim ignored, listed in the file's order (json's: sorted).
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_EQ(notes[0], WriteConfig("Meta-Llama-3-8B", kLlama3_8B) +
                          ": ignored, as they do not change training memory: bos_token_id, "
                          "eos_token_id, initializer_range, pretraining_tp, rms_norm_eps, "
                          "rope_scaling, rope_theta, torch_dtype, transformers_version, use_cache");
  ASSERT_TRUE(FinalizeModelConfig(&m, 2).ok());
  EXPECT_EQ(m.head_dim, 128);

  ModelConfig preset;
  ASSERT_TRUE(LoadModelPreset("llama3-8b", &preset).ok());
  ASSERT_TRUE(FinalizeModelConfig(&preset, 2).ok());
  test::ExpectSameArchitecture(m, preset);
}

TEST(HfConfig, LlamaHeadDimBiasesAndTiedEmbeddings) {
  // meta-llama/Llama-3.2-1B's shape (head_dim given, tied embeddings), with both bias
  // switches on: memsim's biases then match Hugging Face's exactly.
  ModelConfig m;
  std::vector<std::string> notes;
  ASSERT_TRUE(LoadHfConfig(WriteConfig("llama-3.2-1b-biased", R"({
    "model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
    "intermediate_size": 8192, "vocab_size": 128256, "tie_word_embeddings": true,
    "attention_bias": true, "mlp_bias": true, "attention_dropout": 0.1,
    "rope_scaling": {"factor": 32.0, "rope_type": "llama3"}})"),
                           &m, &notes)
                  .ok());
  EXPECT_EQ(m.kv_channels, 64);
  EXPECT_TRUE(m.tie_embeddings);
  EXPECT_TRUE(m.add_qkv_bias);
  EXPECT_TRUE(m.add_bias_linear);
  EXPECT_EQ(m.attention_dropout, 0.1);
  EXPECT_TRUE(Approximations(notes).empty());
  EXPECT_TRUE(FinalizeModelConfig(&m).ok());

  // Only attention_bias: the output projection's bias is the one approximation.
  ASSERT_TRUE(LoadHfConfig(WriteConfig("llama-attention-bias", R"({
    "model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": null, "intermediate_size": 512,
    "vocab_size": 1000, "attention_bias": true})"),
                           &m, &notes)
                  .ok());
  EXPECT_EQ(m.num_query_groups, 0);  // null: multi-head attention
  EXPECT_TRUE(m.add_qkv_bias);
  EXPECT_FALSE(m.add_bias_linear);
  ASSERT_EQ(Approximations(notes).size(), 1u);
  EXPECT_NE(Approximations(notes)[0].find("attention_bias"), std::string::npos);
}

TEST(HfConfig, Mistral7B) {
  // mistralai/Mistral-7B-v0.1/config.json; the 4096-token sliding window saves nothing
  // of another size, but MistralBridge builds it (which decides the context parallelism).
  ModelConfig m;
  std::vector<std::string> notes;
  ASSERT_TRUE(LoadHfConfig(WriteConfig("Mistral-7B-v0.1", R"({
  "architectures": ["MistralForCausalLM"],
  "bos_token_id": 1,
  "eos_token_id": 2,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 14336,
  "max_position_embeddings": 32768,
  "model_type": "mistral",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-05,
  "rope_theta": 10000.0,
  "sliding_window": 4096,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.34.0.dev0",
  "use_cache": true,
  "vocab_size": 32000
})"),
                           &m, &notes)
                  .ok());
  EXPECT_EQ(m.name, "Mistral-7B-v0.1");
  EXPECT_EQ(m.hidden_size, 4096);
  EXPECT_EQ(m.num_layers, 32);
  EXPECT_EQ(m.num_attention_heads, 32);
  EXPECT_EQ(m.num_query_groups, 8);
  EXPECT_EQ(m.ffn_hidden_size, 14336);
  EXPECT_EQ(m.vocab_size, 32000);
  EXPECT_EQ(m.kv_channels, 0);
  EXPECT_FALSE(m.add_qkv_bias);
  EXPECT_EQ(m.num_experts, 0);
  EXPECT_TRUE(m.sliding_window);
  ExpectLlamaArchitecture(m);
  EXPECT_TRUE(Approximations(notes).empty());
  EXPECT_TRUE(FinalizeModelConfig(&m).ok());
}

TEST(HfConfig, Qwen2_7B) {
  // Qwen/Qwen2-7B/config.json: Qwen2's q/k/v projections have biases.
  ModelConfig m;
  ASSERT_TRUE(LoadHfConfig(WriteConfig("Qwen2-7B", R"({
  "architectures": ["Qwen2ForCausalLM"],
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "eos_token_id": 151643,
  "hidden_act": "silu",
  "hidden_size": 3584,
  "initializer_range": 0.02,
  "intermediate_size": 18944,
  "max_position_embeddings": 131072,
  "max_window_layers": 28,
  "model_type": "qwen2",
  "num_attention_heads": 28,
  "num_hidden_layers": 28,
  "num_key_value_heads": 4,
  "rms_norm_eps": 1e-06,
  "rope_theta": 1000000.0,
  "sliding_window": 131072,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.37.2",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 152064
})"),
                           &m)
                  .ok());
  EXPECT_EQ(m.name, "Qwen2-7B");
  EXPECT_EQ(m.hidden_size, 3584);
  EXPECT_EQ(m.num_layers, 28);
  EXPECT_EQ(m.num_attention_heads, 28);
  EXPECT_EQ(m.num_query_groups, 4);
  EXPECT_EQ(m.ffn_hidden_size, 18944);
  EXPECT_EQ(m.vocab_size, 152064);
  EXPECT_TRUE(m.add_qkv_bias);
  ExpectLlamaArchitecture(m);
  ASSERT_TRUE(FinalizeModelConfig(&m).ok());
  EXPECT_EQ(m.head_dim, 128);  // 3584 / 28
}

// openai/gpt-oss-20b/config.json (transformers 4.55): quick-GeGLU experts clamped at
// swiglu_limit, learned attention sinks, biases everywhere; the MXFP4 quantization of the
// released weights is not what training holds.
TEST(HfConfig, GptOss20B) {
  ModelConfig m;
  std::vector<std::string> notes;
  ASSERT_TRUE(LoadHfConfig(WriteConfig("gpt-oss-20b", R"({
  "architectures": ["GptOssForCausalLM"], "attention_bias": true, "attention_dropout": 0.0,
  "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
  "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
  "intermediate_size": 2880,
  "layer_types": [
    "sliding_attention", "full_attention", "sliding_attention", "full_attention",
    "sliding_attention", "full_attention", "sliding_attention", "full_attention",
    "sliding_attention", "full_attention", "sliding_attention", "full_attention",
    "sliding_attention", "full_attention", "sliding_attention", "full_attention",
    "sliding_attention", "full_attention", "sliding_attention", "full_attention",
    "sliding_attention", "full_attention", "sliding_attention", "full_attention"],
  "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
  "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
  "num_local_experts": 32, "output_router_logits": false, "pad_token_id": 199999,
  "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn",
    "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
  "rms_norm_eps": 1e-05,
  "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
    "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": false},
  "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
  "swiglu_limit": 7.0, "tie_word_embeddings": false, "transformers_version": "4.55.0.dev0",
  "use_cache": true, "vocab_size": 201088
})"),
                           &m, &notes)
                  .ok());
  EXPECT_EQ(m.activation, ActivationKind::kQuickGeglu);
  EXPECT_EQ(m.activation_clamp_value, 7.0);
  EXPECT_EQ(m.softmax, SoftmaxKind::kLearnable);
  EXPECT_TRUE(m.add_bias_linear);
  EXPECT_TRUE(m.add_qkv_bias);
  EXPECT_FALSE(m.tie_embeddings);
  EXPECT_EQ(m.kv_channels, 64);
  EXPECT_EQ(m.num_query_groups, 8);
  EXPECT_EQ(m.num_experts, 32);
  EXPECT_EQ(m.moe_router_topk, 4);
  EXPECT_EQ(m.moe_ffn_hidden_size, 2880);
  EXPECT_EQ(m.moe_first_k_dense_layers, 0);
  EXPECT_TRUE(m.sliding_window);                // GptOssBridge's window, from sliding_window 128
  EXPECT_EQ(Approximations(notes).size(), 2u);  // quantization, the sinks' attention backend
}

// zai-org/GLM-4.5-Air's config.json (transformers 4.54.1), as ms-swift's Megatron
// conversion log prints it beside the Megatron arguments it maps it to (sigmoid router
// with the expert bias, scaling 1.0, one dense layer, a 1408-wide shared expert, q/k/v
// biases, kv_channels 128): the same model here. Its multi-token-prediction layer is noted
// and left out; the model card's "106B total parameters" is the main model
// (ParameterCount.Glm45Air works it out).
TEST(HfConfig, Glm45Air) {
  ModelConfig m;
  std::vector<std::string> notes;
  ASSERT_TRUE(LoadHfConfig(WriteConfig("GLM-4.5-Air", R"({
  "architectures": ["Glm4MoeForCausalLM"], "attention_bias": true, "attention_dropout": 0.0,
  "eos_token_id": [151329, 151336, 151338], "first_k_dense_replace": 1, "head_dim": 128,
  "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
  "intermediate_size": 10944, "max_position_embeddings": 131072, "model_type": "glm4_moe",
  "moe_intermediate_size": 1408, "n_group": 1, "n_routed_experts": 128, "n_shared_experts": 1,
  "norm_topk_prob": true, "num_attention_heads": 96, "num_experts_per_tok": 8,
  "num_hidden_layers": 46, "num_key_value_heads": 8, "num_nextn_predict_layers": 1,
  "pad_token_id": 151329, "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-05,
  "rope_scaling": null, "rope_theta": 1000000, "routed_scaling_factor": 1.0,
  "tie_word_embeddings": false, "topk_group": 1, "torch_dtype": "bfloat16",
  "transformers_version": "4.54.1", "use_cache": true, "use_qk_norm": false,
  "vocab_size": 151552
})"),
                           &m, &notes)
                  .ok());
  EXPECT_EQ(m.num_layers, 46);
  EXPECT_EQ(m.hidden_size, 4096);
  EXPECT_EQ(m.num_attention_heads, 96);
  EXPECT_EQ(m.num_query_groups, 8);
  EXPECT_EQ(m.kv_channels, 128);
  EXPECT_EQ(m.ffn_hidden_size, 10944);
  EXPECT_EQ(m.vocab_size, 151552);
  EXPECT_TRUE(m.add_qkv_bias);
  EXPECT_FALSE(m.add_bias_linear);
  EXPECT_FALSE(m.qk_layernorm);
  EXPECT_FALSE(m.tie_embeddings);
  EXPECT_EQ(m.num_experts, 128);
  EXPECT_EQ(m.moe_router_topk, 8);
  EXPECT_EQ(m.moe_ffn_hidden_size, 1408);
  EXPECT_EQ(m.moe_shared_expert_size, 1408);
  EXPECT_EQ(m.moe_first_k_dense_layers, 1);
  EXPECT_EQ(m.moe_router_score_function, MoeScoreFunction::kSigmoid);
  EXPECT_TRUE(m.moe_router_expert_bias);
  EXPECT_EQ(m.moe_router_topk_scaling_factor, 1.0);
  EXPECT_EQ(m.moe_router_num_groups, 0);  // one group: no group limit
  EXPECT_EQ(m.mtp_num_layers, 0);
  ASSERT_EQ(Approximations(notes).size(), 1u);
  EXPECT_NE(Approximations(notes)[0].find("num_nextn_predict_layers 1 ignored"), std::string::npos);
}

// google/gemma-2-9b's config.json (transformers 4.42), as Megatron-Bridge's Gemma2Bridge
// maps it: GeGLU (fast_gelu), tied embeddings scaled by sqrt(H), norms after both
// projections, soft-capped attention (50) and final logits (30), head_dim 256 (not
// 3584 / 16), no dropout. ParameterCount.Gemma counts its parameters.
TEST(HfConfig, Gemma2_9B) {
  ModelConfig m;
  std::vector<std::string> notes;
  ASSERT_TRUE(LoadHfConfig(WriteConfig("gemma-2-9b", R"({
  "architectures": ["Gemma2ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid",
  "eos_token_id": 1, "final_logit_softcapping": 30.0, "head_dim": 256,
  "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
  "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 14336,
  "max_position_embeddings": 8192, "model_type": "gemma2", "num_attention_heads": 16,
  "num_hidden_layers": 42, "num_key_value_heads": 8, "pad_token_id": 0,
  "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
  "sliding_window": 4096, "torch_dtype": "float32", "transformers_version": "4.42.0.dev0",
  "use_cache": true, "vocab_size": 256000
})"),
                           &m, &notes)
                  .ok());
  EXPECT_EQ(m.num_layers, 42);
  EXPECT_EQ(m.hidden_size, 3584);
  EXPECT_EQ(m.num_attention_heads, 16);
  EXPECT_EQ(m.num_query_groups, 8);
  EXPECT_EQ(m.kv_channels, 256);
  EXPECT_EQ(m.ffn_hidden_size, 14336);
  EXPECT_EQ(m.vocab_size, 256000);
  EXPECT_EQ(m.norm, NormKind::kRmsNorm);
  EXPECT_EQ(m.activation, ActivationKind::kGeglu);
  EXPECT_TRUE(m.tie_embeddings);
  EXPECT_TRUE(m.scale_embeddings);
  EXPECT_TRUE(m.post_projection_norms);
  EXPECT_FALSE(m.add_bias_linear);
  EXPECT_FALSE(m.add_qkv_bias);
  EXPECT_TRUE(m.megatron_bridge);
  EXPECT_TRUE(m.flex_attention);
  EXPECT_FALSE(m.sliding_window);  // CP is refused anyway: FlexAttention has none
  EXPECT_EQ(m.final_logit_softcap, 30.0);
  EXPECT_EQ(m.hidden_dropout, 0.0);
  EXPECT_EQ(m.attention_dropout, 0.0);
  ASSERT_EQ(Approximations(notes).size(), 1u);
  EXPECT_NE(Approximations(notes)[0].find("--profile transformer_engine"), std::string::npos);

  const std::string gemma2 = R"({"model_type": "gemma2", "hidden_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 512, "vocab_size": 1024)";
  ASSERT_TRUE(LoadHfConfig(WriteConfig("gemma2-small", gemma2 + "}"), &m).ok());
  EXPECT_TRUE(m.tie_embeddings);           // Gemma2Config's default
  EXPECT_EQ(m.final_logit_softcap, 30.0);  // and its cap's
  ASSERT_TRUE(
      LoadHfConfig(WriteConfig("gemma2-null-cap", gemma2 + R"(, "final_logit_softcapping": null})"),
                   &m)
          .ok());
  EXPECT_EQ(m.final_logit_softcap, 0.0);  // None: logit_softcapping returns the logits
  ASSERT_TRUE(
      LoadHfConfig(WriteConfig("gemma2-dropout", gemma2 + R"(, "attention_dropout": 0.1})"), &m)
          .ok());
  EXPECT_EQ(m.attention_dropout, 0.0);  // the bridge sets 0 whatever the file says
  // What Gemma2Bridge sets whatever the file says, noted; attention_bias is CONFIG_MAPPING's.
  notes.clear();
  ASSERT_TRUE(
      LoadHfConfig(WriteConfig("gemma2-overridden", gemma2 + R"(, "hidden_activation": "gelu",
    "tie_word_embeddings": false, "attention_bias": true})"),
                   &m, &notes)
          .ok());
  EXPECT_EQ(m.activation, ActivationKind::kGeglu);
  EXPECT_TRUE(m.tie_embeddings);
  EXPECT_TRUE(m.add_qkv_bias);
  EXPECT_FALSE(m.add_bias_linear);
  ASSERT_EQ(Approximations(notes).size(), 3u);
  EXPECT_NE(Approximations(notes)[0].find("activation 'gelu' taken as fast_gelu"),
            std::string::npos);
  EXPECT_NE(Approximations(notes)[1].find("tie_word_embeddings false ignored"), std::string::npos);
}

// google/gemma-3-1b-pt's config.json (transformers 4.50), Gemma3ForCausalLM: Gemma-2's layer
// with q/k norms, sliding windows on five layers of six, two RoPE bases and no soft caps,
// as Megatron-Bridge's Gemma3ModelBridge maps it (ParameterCount.Gemma counts it).
TEST(HfConfig, Gemma3_1B) {
  ModelConfig m;
  std::vector<std::string> notes;
  ASSERT_TRUE(LoadHfConfig(WriteConfig("gemma-3-1b-pt", R"({
  "architectures": ["Gemma3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "attn_logit_softcapping": null, "bos_token_id": 2, "cache_implementation": "hybrid",
  "eos_token_id": 1, "final_logit_softcapping": null, "head_dim": 256,
  "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "initializer_range": 0.02,
  "intermediate_size": 6912, "max_position_embeddings": 32768, "model_type": "gemma3_text",
  "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
  "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
  "rope_local_base_freq": 10000, "rope_scaling": null, "rope_theta": 1000000,
  "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "float32",
  "transformers_version": "4.50.0.dev0", "use_cache": true, "vocab_size": 262144
})"),
                           &m, &notes)
                  .ok());
  EXPECT_EQ(m.num_layers, 26);
  EXPECT_EQ(m.hidden_size, 1152);
  EXPECT_EQ(m.num_attention_heads, 4);
  EXPECT_EQ(m.num_query_groups, 1);
  EXPECT_EQ(m.kv_channels, 256);
  EXPECT_EQ(m.ffn_hidden_size, 6912);
  EXPECT_EQ(m.vocab_size, 262144);
  EXPECT_EQ(m.activation, ActivationKind::kGeglu);
  EXPECT_TRUE(m.qk_layernorm);
  EXPECT_TRUE(m.tie_embeddings);
  EXPECT_TRUE(m.scale_embeddings);
  EXPECT_TRUE(m.post_projection_norms);
  EXPECT_TRUE(m.megatron_bridge);
  EXPECT_TRUE(m.sliding_window);
  EXPECT_FALSE(m.flex_attention);         // Transformer Engine's attention
  EXPECT_EQ(m.final_logit_softcap, 0.0);  // the bridge's Gemma-3 soft-caps nothing
  ASSERT_EQ(Approximations(notes).size(), 1u);
  EXPECT_NE(Approximations(notes)[0].find("--attention flash"), std::string::npos);
}

// The real config.json files of testdata/hf_configs (SOURCES.md there) give their models'
// published parameter counts, Megatron's padding of the vocabulary to a multiple of 128
// changing none of them. DeepSeek-V3's 671B is its main model, worked out from its shapes
// (61 layers of multi-latent attention, 187,107,328 each, and two norms; 3 dense MLPs of
// 3 * 7168 * 18432; 58 MoE layers of a router, 256 routed experts and one shared expert of
// 3 * 7168 * 2048; untied embeddings of 129,280 x 7168; the final norm): its MTP layer is
// not trained by Hugging Face's model, so not counted.
TEST(HfConfig, RealConfigsHaveTheirPublishedParameterCounts) {
  struct Case {
    const char* file;
    int64_t parameters;
  };
  for (const Case& c :
       {Case{"Llama-3.1-8B-Instruct", 8030261248}, Case{"Llama-3.1-70B-Instruct", 70553706496},
        Case{"Mistral-7B-Instruct-v0.3", 7248023552}, Case{"Qwen2.5-7B-Instruct", 7615616512},
        Case{"Qwen2.5-72B-Instruct", 72706203648}, Case{"Qwen3-32B", 32762123264},
        Case{"Qwen3-30B-A3B-Thinking-2507-FP8.transformers5", 30532122624},
        Case{"phi-4", 14659507200}, Case{"Mixtral-8x7B", 46702792704},
        Case{"DeepSeek-V3", 671026404352}, Case{"gemma-2-9b", 9241705984}}) {
    const std::string path = std::string(MEMSIM_SOURCE_DIR) + "/tools/lib/testdata/hf_configs/" +
                             c.file + ".config.json";
    ModelConfig m;
    const Status loaded = LoadHfConfig(path, &m);
    ASSERT_TRUE(loaded.ok()) << loaded.message();
    ASSERT_TRUE(FinalizeModelConfig(&m).ok()) << c.file;
    TrainingConfig t;
    t.profile = ProfileKind::kTransformerEngine;
    EXPECT_EQ(ParameterCount(m, t, ModelShard::Whole(m)), c.parameters) << c.file;
  }
}

TEST(HfConfig, Qwen3_32BAndQwen3MoE) {
  // Qwen/Qwen3-32B/config.json: explicit head_dim (128, not 5120 / 64) and q/k norms.
  ModelConfig m;
  ASSERT_TRUE(LoadHfConfig(WriteConfig("Qwen3-32B", R"({
  "architectures": ["Qwen3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
  "hidden_size": 5120, "initializer_range": 0.02, "intermediate_size": 25600,
  "max_position_embeddings": 40960, "max_window_layers": 64, "model_type": "qwen3",
  "num_attention_heads": 64, "num_hidden_layers": 64, "num_key_value_heads": 8,
  "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 1000000, "sliding_window": null,
  "tie_word_embeddings": false, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
  "use_cache": true, "use_sliding_window": false, "vocab_size": 151936
})"),
                           &m)
                  .ok());
  ExpectLlamaArchitecture(m);
  EXPECT_TRUE(m.qk_layernorm);
  EXPECT_FALSE(m.add_qkv_bias);
  EXPECT_EQ(m.kv_channels, 128);
  EXPECT_EQ(m.num_query_groups, 8);
  // Qwen3-MoE (transformers 5 spelling num_local_experts): 128 experts, top 8, every layer.
  ASSERT_TRUE(LoadHfConfig(WriteConfig("Qwen3-30B-A3B", R"({
  "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": false, "decoder_sparse_step": 1,
  "dtype": "bfloat16", "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
  "intermediate_size": 6144, "max_position_embeddings": 262144, "max_window_layers": 48,
  "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
  "norm_topk_prob": true, "num_attention_heads": 32, "num_experts_per_tok": 8,
  "num_hidden_layers": 48, "num_key_value_heads": 4, "num_local_experts": 128,
  "output_router_logits": false, "rms_norm_eps": 1e-06,
  "rope_parameters": {"rope_theta": 10000000, "rope_type": "default"},
  "router_aux_loss_coef": 0.001, "tie_word_embeddings": false, "vocab_size": 151936
})"),
                           &m)
                  .ok());
  EXPECT_TRUE(m.qk_layernorm);
  EXPECT_EQ(m.num_experts, 128);
  EXPECT_EQ(m.moe_router_topk, 8);
  EXPECT_EQ(m.moe_ffn_hidden_size, 768);
  EXPECT_EQ(m.moe_first_k_dense_layers, 0);
  EXPECT_FALSE(m.moe_router_pre_softmax);  // Qwen3MoeBridge: not norm_topk_prob
  // Without norm_topk_prob (Qwen3MoeConfig's default False) the softmax runs over every expert.
  ASSERT_TRUE(LoadHfConfig(WriteConfig("Qwen3-MoE-pre-softmax", R"({
  "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
  "intermediate_size": 128, "moe_intermediate_size": 32, "num_attention_heads": 4,
  "num_hidden_layers": 4, "num_key_value_heads": 2, "num_experts": 8,
  "num_experts_per_tok": 2, "vocab_size": 256})"),
                           &m)
                  .ok());
  EXPECT_TRUE(m.moe_router_pre_softmax);
  // Dense layers in between are not modelled: refused, not approximated.
  const Status dense = LoadHfConfig(WriteConfig("Qwen3-MoE-dense-layers", R"({
  "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
  "intermediate_size": 128, "moe_intermediate_size": 32, "num_attention_heads": 4,
  "num_hidden_layers": 4, "num_key_value_heads": 2, "num_experts": 8,
  "num_experts_per_tok": 2, "vocab_size": 256, "mlp_only_layers": [1]
})"),
                                    &m);
  EXPECT_NE(dense.message().find("mlp_only_layers"), std::string::npos) << dense.message();
}

TEST(HfConfig, Mixtral8x7B) {
  // mistralai/Mixtral-8x7B-v0.1/config.json: Mistral's shape, 8 experts, top-2.
  ModelConfig m;
  ASSERT_TRUE(LoadHfConfig(WriteConfig("Mixtral-8x7B-v0.1", R"({
  "architectures": ["MixtralForCausalLM"],
  "attention_dropout": 0.0,
  "bos_token_id": 1,
  "eos_token_id": 2,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 14336,
  "max_position_embeddings": 32768,
  "model_type": "mixtral",
  "num_attention_heads": 32,
  "num_experts_per_tok": 2,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "num_local_experts": 8,
  "output_router_logits": false,
  "rms_norm_eps": 1e-05,
  "rope_theta": 1000000.0,
  "router_aux_loss_coef": 0.02,
  "sliding_window": null,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.36.0.dev0",
  "use_cache": true,
  "vocab_size": 32000
})"),
                           &m)
                  .ok());
  EXPECT_EQ(m.hidden_size, 4096);
  EXPECT_EQ(m.num_layers, 32);
  EXPECT_EQ(m.num_attention_heads, 32);
  EXPECT_EQ(m.num_query_groups, 8);
  EXPECT_EQ(m.ffn_hidden_size, 14336);
  EXPECT_EQ(m.vocab_size, 32000);
  EXPECT_EQ(m.num_experts, 8);
  EXPECT_EQ(m.moe_router_topk, 2);
  EXPECT_EQ(m.moe_ffn_hidden_size, 14336);
  EXPECT_EQ(m.moe_shared_expert_size, 0);
  EXPECT_EQ(m.moe_first_k_dense_layers, 0);
  ExpectLlamaArchitecture(m);
  ASSERT_TRUE(FinalizeModelConfig(&m).ok());

  ModelConfig preset;
  ASSERT_TRUE(LoadModelPreset("mixtral-8x7b", &preset).ok());
  ASSERT_TRUE(FinalizeModelConfig(&preset).ok());
  test::ExpectSameArchitecture(m, preset);
}

// deepseek-ai/DeepSeek-V3/config.json (auto_map and rope_scaling shortened).
constexpr char kDeepseekV3[] = R"({
  "architectures": ["DeepseekV3ForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"},
  "aux_loss_alpha": 0.001,
  "bos_token_id": 0,
  "eos_token_id": 1,
  "ep_size": 1,
  "first_k_dense_replace": 3,
  "hidden_act": "silu",
  "hidden_size": 7168,
  "initializer_range": 0.02,
  "intermediate_size": 18432,
  "kv_lora_rank": 512,
  "max_position_embeddings": 163840,
  "model_type": "deepseek_v3",
  "moe_intermediate_size": 2048,
  "moe_layer_freq": 1,
  "n_group": 8,
  "n_routed_experts": 256,
  "n_shared_experts": 1,
  "norm_topk_prob": true,
  "num_attention_heads": 128,
  "num_experts_per_tok": 8,
  "num_hidden_layers": 61,
  "num_key_value_heads": 128,
  "num_nextn_predict_layers": 1,
  "pretraining_tp": 1,
  "q_lora_rank": 1536,
  "qk_nope_head_dim": 128,
  "qk_rope_head_dim": 64,
  "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                          "quant_method": "fp8", "weight_block_size": [128, 128]},
  "rms_norm_eps": 1e-06,
  "rope_scaling": {"factor": 40, "type": "yarn"},
  "rope_theta": 10000,
  "routed_scaling_factor": 2.5,
  "scoring_func": "sigmoid",
  "seq_aux": true,
  "tie_word_embeddings": false,
  "topk_group": 4,
  "topk_method": "noaux_tc",
  "torch_dtype": "bfloat16",
  "transformers_version": "4.33.1",
  "use_cache": true,
  "v_head_dim": 128,
  "vocab_size": 129280
})";

TEST(HfConfig, DeepseekV3) {
  ModelConfig m;
  std::vector<std::string> notes;
  ASSERT_TRUE(LoadHfConfig(WriteConfig("DeepSeek-V3", kDeepseekV3), &m, &notes).ok());
  EXPECT_EQ(m.hidden_size, 7168);
  EXPECT_EQ(m.num_layers, 61);
  EXPECT_EQ(m.num_attention_heads, 128);
  EXPECT_EQ(m.num_query_groups, 0);  // multi-latent attention: no groups (= heads)
  EXPECT_EQ(m.q_lora_rank, 1536);
  EXPECT_EQ(m.kv_lora_rank, 512);
  EXPECT_EQ(m.qk_head_dim, 128);
  EXPECT_EQ(m.qk_pos_emb_head_dim, 64);
  EXPECT_EQ(m.v_head_dim, 128);
  EXPECT_EQ(m.vocab_size, 129280);
  EXPECT_EQ(m.ffn_hidden_size, 18432);
  EXPECT_EQ(m.num_experts, 256);
  EXPECT_EQ(m.moe_router_topk, 8);
  EXPECT_EQ(m.moe_ffn_hidden_size, 2048);
  EXPECT_EQ(m.moe_shared_expert_size, 2048);  // 1 shared expert * 2048
  EXPECT_EQ(m.moe_first_k_dense_layers, 3);
  // The router: sigmoid scores, noaux_tc's expert bias, routed_scaling_factor, 8 groups of
  // which each token's experts come from 4.
  EXPECT_EQ(m.moe_router_score_function, MoeScoreFunction::kSigmoid);
  EXPECT_TRUE(m.moe_router_expert_bias);
  EXPECT_EQ(m.moe_router_topk_scaling_factor, 2.5);
  EXPECT_EQ(m.moe_router_num_groups, 8);
  EXPECT_EQ(m.moe_router_group_topk, 4);
  EXPECT_FALSE(m.add_qkv_bias);
  ExpectLlamaArchitecture(m);
  // The fp8 checkpoint and the MTP layer are each reported.
  ASSERT_EQ(Approximations(notes).size(), 2u);
  EXPECT_NE(Approximations(notes)[0].find("quantization_config"), std::string::npos);
  EXPECT_NE(Approximations(notes)[1].find("num_nextn_predict_layers 1"), std::string::npos);
  ASSERT_TRUE(FinalizeModelConfig(&m, 8).ok());

  ModelConfig preset;
  ASSERT_TRUE(LoadModelPreset("deepseek-v3-style", &preset).ok());
  ASSERT_TRUE(FinalizeModelConfig(&preset, 8).ok());
  test::ExpectSameArchitecture(m, preset);
}

// A DeepSeek-V3 config without its routing keys routes as DeepseekV3Config's defaults do:
// sigmoid scores chosen with the expert bias (noaux_tc), scaling 2.5, 4 of 8 groups.
TEST(HfConfig, DeepseekV3RouterDefaults) {
  std::string config = kDeepseekV3;
  for (const char* key :
       {"n_group", "topk_group", "routed_scaling_factor", "topk_method", "scoring_func"}) {
    config = std::regex_replace(config, std::regex(std::string("\"") + key + "\": [^,]*,"), "");
  }
  ASSERT_EQ(config.find("n_group"), std::string::npos);
  ModelConfig m;
  ASSERT_TRUE(LoadHfConfig(WriteConfig("DeepSeek-V3-defaults", config), &m).ok());
  EXPECT_EQ(m.moe_router_score_function, MoeScoreFunction::kSigmoid);
  EXPECT_TRUE(m.moe_router_expert_bias);
  EXPECT_EQ(m.moe_router_topk_scaling_factor, 2.5);
  EXPECT_EQ(m.moe_router_num_groups, 8);
  EXPECT_EQ(m.moe_router_group_topk, 4);
}

// microsoft/Phi-3-mini-4k-instruct/config.json: Llama's layer with fused projections, a
// 32064-token vocabulary, untied; Phi-4-mini's partial RoPE and tied embeddings, and a
// residual dropout that differs from the embedding's, are read or noted.
TEST(HfConfig, Phi3) {
  ModelConfig m;
  std::vector<std::string> notes;
  ASSERT_TRUE(LoadHfConfig(WriteConfig("Phi-3-mini-4k-instruct", R"({
  "_name_or_path": "Phi-3-mini-4k-instruct", "architectures": ["Phi3ForCausalLM"],
  "attention_dropout": 0.0, "auto_map": {"AutoConfig": "configuration_phi3.Phi3Config"},
  "bos_token_id": 1, "embd_pdrop": 0.0, "eos_token_id": 32000, "hidden_act": "silu",
  "hidden_size": 3072, "initializer_range": 0.02, "intermediate_size": 8192,
  "max_position_embeddings": 4096, "model_type": "phi3", "num_attention_heads": 32,
  "num_hidden_layers": 32, "num_key_value_heads": 32, "original_max_position_embeddings": 4096,
  "pad_token_id": 32000, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05, "rope_scaling": null,
  "rope_theta": 10000.0, "sliding_window": 2047, "tie_word_embeddings": false,
  "torch_dtype": "bfloat16", "transformers_version": "4.40.2", "use_cache": true,
  "vocab_size": 32064
})"),
                           &m, &notes)
                  .ok());
  ExpectLlamaArchitecture(m);
  EXPECT_EQ(m.hidden_size, 3072);
  EXPECT_EQ(m.num_layers, 32);
  EXPECT_EQ(m.num_query_groups, 32);
  EXPECT_EQ(m.ffn_hidden_size, 8192);
  EXPECT_EQ(m.vocab_size, 32064);
  EXPECT_EQ(m.hidden_dropout, 0.0);
  EXPECT_TRUE(Approximations(notes).empty());
  const std::string phi4_mini = R"({
  "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 3072,
  "intermediate_size": 8192, "num_attention_heads": 24, "num_hidden_layers": 32,
  "num_key_value_heads": 8, "partial_rotary_factor": 0.75, "tie_word_embeddings": true,
  "resid_pdrop": 0.1, "embd_pdrop": 0.0, "attention_bias": false, "vocab_size": 200064
})";
  ASSERT_TRUE(LoadHfConfig(WriteConfig("Phi-4-mini", phi4_mini), &m, &notes).ok());
  EXPECT_TRUE(m.tie_embeddings);
  EXPECT_EQ(m.num_query_groups, 8);
  EXPECT_EQ(m.hidden_dropout, 0.1);
  ASSERT_EQ(Approximations(notes).size(), 1u);
  EXPECT_NE(Approximations(notes)[0].find("embd_pdrop"), std::string::npos);
}

TEST(HfConfig, NameFromHuggingFaceCacheOrModelType) {
  ModelConfig m;
  const fs::path cache = fs::path(::testing::TempDir()) / "memsim_hf_config_test" / "hub" /
                         "models--meta-llama--Meta-Llama-3-8B" / "snapshots" / "62bd457b";
  fs::create_directories(cache);
  std::ofstream((cache / "config.json").string()) << kLlama3_8B;
  ASSERT_TRUE(LoadHfConfig((cache / "config.json").string(), &m).ok());
  EXPECT_EQ(m.name, "Meta-Llama-3-8B");

  // A bare file name has no folder to name it.
  const fs::path old_cwd = fs::current_path();
  fs::current_path(cache);
  ASSERT_TRUE(LoadHfConfig("config.json", &m).ok());
  fs::current_path(old_cwd);
  EXPECT_EQ(m.name, "llama");
}

// The error of loading `text`, with the file's path replaced by "FILE".
std::string ErrorOf(const std::string& text) {
  const std::string path = WriteConfig("bad", text);
  ModelConfig m;
  m.name = "unchanged";
  const Status s = LoadHfConfig(path, &m);
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(m.name, "unchanged");  // a failed load leaves the model alone
  std::string message = s.message();
  const size_t at = message.find(path);
  if (at != std::string::npos) message.replace(at, path.size(), "FILE");
  EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  return message;
}

// A minimal valid Llama with `extra` spliced into the object.
std::string Llama(const std::string& extra) {
  return R"({"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 4, "intermediate_size": 512, "vocab_size": 1000)" +
         extra + "}";
}

TEST(HfConfig, Errors) {
  ModelConfig m;
  EXPECT_EQ(LoadHfConfig("/nonexistent/config.json", &m).message(),
            "cannot read '/nonexistent/config.json': no such file");
  EXPECT_TRUE(LoadHfConfig(WriteConfig("good", Llama("")), &m).ok());

  const std::string malformed = ErrorOf("{\n  \"model_type\": \"llama\",\n  \"hidden_size\": }");
  // The stray '}' is byte 45: 2 bytes on line 1, 25 on line 2, the 18th of line 3.
  EXPECT_EQ(
      malformed.rfind("FILE: malformed JSON at byte 45: parse error at line 3, column 18: ", 0), 0u)
      << malformed;
  EXPECT_EQ(ErrorOf("[1, 2]"), "FILE: the top level must be a JSON object");

  EXPECT_EQ(ErrorOf(R"({"hidden_size": 256})"), "FILE: missing required key 'model_type'");
  EXPECT_EQ(ErrorOf(R"({"model_type": "llama", "hidden_size": 256})"),
            "FILE: missing required key 'num_hidden_layers'");
  EXPECT_EQ(ErrorOf(R"({"model_type": "mistral", "hidden_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 4, "intermediate_size": 512, "vocab_size": 1000})"),
            "FILE: missing required key 'num_key_value_heads'");
  EXPECT_EQ(ErrorOf(R"({"model_type": "mixtral", "hidden_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 512,
    "vocab_size": 1000, "num_experts_per_tok": 2})"),
            "FILE: missing required key 'num_local_experts'");

  EXPECT_EQ(ErrorOf(R"({"model_type": "llama", "hidden_size": "256"})"),
            "FILE: 'hidden_size' must be an integer, got \"256\"");
  EXPECT_EQ(ErrorOf(Llama(R"(, "num_key_value_heads": 2.5)")),
            "FILE: 'num_key_value_heads' must be an integer, got 2.5");
  EXPECT_EQ(ErrorOf(Llama(R"(, "tie_word_embeddings": 1)")),
            "FILE: 'tie_word_embeddings' must be true or false, got 1");
  EXPECT_EQ(ErrorOf(Llama(R"(, "vocab_size": 18446744073709551615)")),
            "FILE: 'vocab_size' is 18446744073709551615, out of range");
  EXPECT_EQ(ErrorOf(R"({"model_type": 7})"), "FILE: 'model_type' must be a string, got 7");

  EXPECT_EQ(ErrorOf(R"({"model_type": "gemma3"})"),
            "FILE: model_type 'gemma3' is not modelled: Gemma-3's vision tower is not modelled; "
            "its text model is (the file's text_config, model_type gemma3_text, as a "
            "config.json of its own)");
  EXPECT_EQ(ErrorOf(R"({"model_type": "gpt2"})"),
            "FILE: unsupported model_type 'gpt2' (supported: llama, mistral, qwen2, qwen3, "
            "qwen3_moe, mixtral, deepseek_v3, glm4_moe, phi3, gpt_oss, gemma2, gemma3_text)");
  EXPECT_EQ(ErrorOf(Llama(R"(, "architectures": ["LlamaForSequenceClassification"])")),
            "FILE: unsupported architecture \"LlamaForSequenceClassification\" for model_type "
            "llama (memsim builds LlamaForCausalLM)");
  EXPECT_EQ(ErrorOf(Llama(R"(, "architectures": "LlamaForCausalLM")")),
            "FILE: 'architectures' must be a list of strings, got \"LlamaForCausalLM\"");

  // Settings that change memory in ways memsim does not model.
  EXPECT_EQ(ErrorOf(Llama(R"(, "hidden_act": "gelu")")),
            "FILE: hidden_act 'gelu' is not modelled (memsim's gated MLP is SwiGLU: hidden_act "
            "silu)");
  EXPECT_EQ(ErrorOf(R"({"model_type": "qwen2", "hidden_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 512,
    "vocab_size": 1000, "num_experts": 60})"),
            "FILE: unknown key 'num_experts' for model_type qwen2; memsim does not know whether "
            "it changes memory (if it does not, remove it from a copy of the file)");
  std::string deepseek = kDeepseekV3;
  deepseek.replace(deepseek.find("\"moe_layer_freq\": 1"), 19, "\"moe_layer_freq\": 2");
  EXPECT_EQ(ErrorOf(deepseek),
            "FILE: moe_layer_freq 2 is not modelled (memsim's MoE layers are every layer after "
            "first_k_dense_replace: moe_layer_freq 1)");
  // A key of another family is unknown here: Mistral has no attention_bias.
  EXPECT_EQ(ErrorOf(R"({"model_type": "mistral", "hidden_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 512,
    "vocab_size": 1000, "attention_bias": true})"),
            "FILE: unknown key 'attention_bias' for model_type mistral; memsim does not know "
            "whether it changes memory (if it does not, remove it from a copy of the file)");
}

}  // namespace
}  // namespace memsim
