// Model configurations the tests share (plain values; each test finalizes them).
#pragma once

#include "models/model_config.h"

namespace memsim::test {

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

// Mixtral 8x7B (mistralai/Mixtral-8x7B-v0.1): Mistral-7B's shape, top-2 of 8 experts.
inline ModelConfig Mixtral8x7b() {
  ModelConfig m = Llama(32, 4096, 32, 8, 14336, 32000);
  m.num_experts = 8;
  m.moe_router_topk = 2;
  return m;
}

}  // namespace memsim::test
