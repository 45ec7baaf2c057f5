// Model configurations the tests share (plain values; each test finalizes them).
#pragma once

#include <gtest/gtest.h>

#include "models/model_config.h"

namespace memsim::test {

// Eager attention, no dropout: the activations memsim's tables count by hand.
inline TrainingConfig EagerWithoutDropout(int64_t seq_length, int64_t micro_batch_size) {
  TrainingConfig t;
  t.seq_length = seq_length;
  t.micro_batch_size = micro_batch_size;
  t.attention = AttentionKind::kEager;
  t.dropout = false;
  return t;
}

// Megatron-LM's GPT: LayerNorm, GeLU, learned positions, tied embeddings, biases.
inline ModelConfig Gpt(int64_t layers, int64_t hidden, int64_t heads, int64_t vocab = 1024) {
  ModelConfig m;
  m.num_layers = layers;
  m.hidden_size = hidden;
  m.num_attention_heads = heads;
  m.vocab_size = vocab;
  return m;
}

// The Llama family: RMSNorm, SwiGLU, RoPE, untied embeddings, no biases.
inline ModelConfig Llama(int64_t layers, int64_t hidden, int64_t heads, int64_t groups, int64_t ffn,
                         int64_t vocab) {
  ModelConfig m = Gpt(layers, hidden, heads, vocab);
  m.num_query_groups = groups;
  m.ffn_hidden_size = ffn;
  m.norm = NormKind::kRmsNorm;
  m.activation = ActivationKind::kSwiglu;
  m.position = PositionKind::kRope;
  m.tie_embeddings = false;
  m.add_bias_linear = m.add_qkv_bias = false;
  return m;
}

// `m` with multi-latent attention of the given ranks and head widths.
inline ModelConfig WithLatentAttention(ModelConfig m, int64_t q_lora, int64_t kv_lora, int64_t qk,
                                       int64_t rope, int64_t v) {
  m.num_query_groups = 0;
  m.q_lora_rank = q_lora;
  m.kv_lora_rank = kv_lora;
  m.qk_head_dim = qk;
  m.qk_pos_emb_head_dim = rope;
  m.v_head_dim = v;
  return m;
}

// Mixtral 8x7B (mistralai/Mixtral-8x7B-v0.1): Mistral-7B's shape, top-2 of 8 experts.
inline ModelConfig Mixtral8x7b() {
  ModelConfig m = Llama(32, 4096, 32, 8, 14336, 32000);
  m.num_experts = 8;
  m.moe_router_topk = 2;
  return m;
}

// Every field that decides memory is equal (dropout too when `compare_dropout`: Hugging
// Face configs carry no training dropout).
inline void ExpectSameArchitecture(const ModelConfig& a, const ModelConfig& b,
                                   bool compare_dropout = false) {
  if (compare_dropout) {
    EXPECT_EQ(a.hidden_dropout, b.hidden_dropout);
    EXPECT_EQ(a.attention_dropout, b.attention_dropout);
  }
  EXPECT_EQ(a.num_layers, b.num_layers);
  EXPECT_EQ(a.hidden_size, b.hidden_size);
  EXPECT_EQ(a.num_attention_heads, b.num_attention_heads);
  EXPECT_EQ(a.num_query_groups, b.num_query_groups);
  EXPECT_EQ(a.kv_channels, b.kv_channels);
  EXPECT_EQ(a.ffn_hidden_size, b.ffn_hidden_size);
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.make_vocab_size_divisible_by, b.make_vocab_size_divisible_by);
  EXPECT_EQ(a.max_position_embeddings, b.max_position_embeddings);
  EXPECT_EQ(a.norm, b.norm);
  EXPECT_EQ(a.activation, b.activation);
  EXPECT_EQ(a.position, b.position);
  EXPECT_EQ(a.tie_embeddings, b.tie_embeddings);
  EXPECT_EQ(a.add_bias_linear, b.add_bias_linear);
  EXPECT_EQ(a.add_qkv_bias, b.add_qkv_bias);
  EXPECT_EQ(a.qk_layernorm, b.qk_layernorm);
  EXPECT_EQ(a.q_lora_rank, b.q_lora_rank);
  EXPECT_EQ(a.kv_lora_rank, b.kv_lora_rank);
  EXPECT_EQ(a.qk_head_dim, b.qk_head_dim);
  EXPECT_EQ(a.qk_pos_emb_head_dim, b.qk_pos_emb_head_dim);
  EXPECT_EQ(a.v_head_dim, b.v_head_dim);
  EXPECT_EQ(a.num_experts, b.num_experts);
  EXPECT_EQ(a.moe_router_topk, b.moe_router_topk);
  EXPECT_EQ(a.moe_ffn_hidden_size, b.moe_ffn_hidden_size);
  EXPECT_EQ(a.moe_shared_expert_size, b.moe_shared_expert_size);
  EXPECT_EQ(a.moe_first_k_dense_layers, b.moe_first_k_dense_layers);
  EXPECT_EQ(a.moe_router_score_function, b.moe_router_score_function);
  EXPECT_EQ(a.moe_router_pre_softmax, b.moe_router_pre_softmax);
  EXPECT_EQ(a.moe_router_expert_bias, b.moe_router_expert_bias);
  EXPECT_EQ(a.moe_router_topk_scaling_factor, b.moe_router_topk_scaling_factor);
  EXPECT_EQ(a.moe_router_num_groups, b.moe_router_num_groups);
  EXPECT_EQ(a.moe_router_group_topk, b.moe_router_group_topk);
  EXPECT_EQ(a.moe_router_sinkhorn, b.moe_router_sinkhorn);
  EXPECT_EQ(a.mtp_num_layers, b.mtp_num_layers);
  EXPECT_EQ(a.moe_capacity_factor, b.moe_capacity_factor);
  EXPECT_EQ(a.moe_imbalance_factor, b.moe_imbalance_factor);
  EXPECT_EQ(a.padded_vocab_size, b.padded_vocab_size);
  EXPECT_EQ(a.head_dim, b.head_dim);
}

}  // namespace memsim::test
