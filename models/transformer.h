// The decoder-only transformer that GPT and the Llama family share, as Megatron-Core's
// GPTModel builds it (megatron/core/models/gpt/gpt_model.py) at tp = pp = 1.
//
// Parameters (legend in model_config.h), created in this order:
//   embedding.word_embeddings.weight        (V, H)
//   embedding.position_embeddings.weight    (S_max, H)          GPT (learned) only
//   per layer l in [0, L), prefix decoder.layers.l:
//     input_layernorm.weight                 (H)
//     input_layernorm.bias                   (H)                 LayerNorm only
//     self_attention.linear_qkv.weight       ((A + 2G) * D, H)
//     self_attention.linear_qkv.bias         ((A + 2G) * D)      if add_qkv_bias
//     self_attention.linear_proj.weight      (H, A * D)
//     self_attention.linear_proj.bias        (H)                 if add_bias_linear
//     pre_mlp_layernorm.weight / .bias       (H)
//     mlp.linear_fc1.weight                  (F, H) GeLU; (2F, H) SwiGLU
//     mlp.linear_fc1.bias                    (F or 2F)           if add_bias_linear
//     mlp.linear_fc2.weight                  (H, F)
//     mlp.linear_fc2.bias                    (H)                 if add_bias_linear
//   decoder.final_layernorm.weight / .bias   (H)
//   output_layer.weight                      (V, H)              untied only
//
// Parameter count (GPT, tied): V*H + S*H + L*(12*H^2 + 13*H) + 2*H.
//
// Activations a layer saves for backward, 16-bit, eager attention, dropout on, no
// recomputation (Korthikanti et al. 2022, Table 2), in bytes:
//   input_layernorm input 2SBH + ln output 2SBH + QKV 6SBH + softmax 2AS^2B +
//   dropout mask AS^2B + dropout output 2AS^2B + projection input 2SBH + mask SBH +
//   pre_mlp_layernorm input 2SBH + ln output 2SBH + fc1 output 8SBH + GeLU output 8SBH +
//   mask SBH = SBH(34 + 5AS/H); plus what the paper leaves out: each LayerNorm's float32
//   mean and rstd (2 * 2 * 4SB = 16SB).
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "models/layers.h"
#include "models/model_config.h"
#include "models/parameters.h"

namespace memsim {

class TransformerModel {
 public:
  // Creates every parameter in `store`, recorded under its module path.
  // REQUIRES: `model` passed FinalizeModelConfig, `training` ValidateTrainingConfig.
  TransformerModel(const ModelConfig& model, const TrainingConfig& training, ParameterStore* store);

  // One microbatch's forward through the loss: allocates the batch (tokens, labels,
  // loss mask, attention mask, position ids, as Megatron's get_batch puts them on the
  // GPU) and returns the scalar loss, ready for backward().
  at::Tensor Forward();

 private:
  struct Layer {
    Parameter* input_norm_weight;
    Parameter* input_norm_bias;  // null for RMSNorm
    Parameter* qkv_weight;
    Parameter* qkv_bias;
    Parameter* proj_weight;
    Parameter* proj_bias;
    Parameter* mlp_norm_weight;
    Parameter* mlp_norm_bias;
    Parameter* fc1_weight;
    Parameter* fc1_bias;
    Parameter* fc2_weight;
    Parameter* fc2_bias;
  };

  at::Tensor Norm(const at::Tensor& x, Parameter* weight, Parameter* bias);
  at::Tensor LayerForward(Layer& layer, const at::Tensor& hidden);
  at::Tensor Attention(Layer& layer, const at::Tensor& ln_out);
  at::Tensor Mlp(Layer& layer, const at::Tensor& ln_out);
  at::Tensor Decoder(const at::Tensor& hidden);
  double hidden_dropout() const;

  ModelConfig model_;
  TrainingConfig training_;
  Parameter* word_embeddings_ = nullptr;
  Parameter* position_embeddings_ = nullptr;
  std::vector<Layer> layers_;
  Parameter* final_norm_weight_ = nullptr;
  Parameter* final_norm_bias_ = nullptr;
  Parameter* output_weight_ = nullptr;  // == word_embeddings_ when tied
  GlobalMemoryBuffer workspace_;
};

}  // namespace memsim
