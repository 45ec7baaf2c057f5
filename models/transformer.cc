#include "models/transformer.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <string>

#include "simulator/session.h"

namespace memsim {

TransformerModel::TransformerModel(const ModelConfig& model, const TrainingConfig& training,
                                   ParameterStore* store)
    : model_(model), training_(training) {
  const int64_t H = model.hidden_size, A = model.num_attention_heads, G = model.num_query_groups;
  const int64_t D = model.head_dim, F = model.ffn_hidden_size, V = model.padded_vocab_size;
  const bool layer_norm = model.norm == NormKind::kLayerNorm;
  const bool bias = model.add_bias_linear;
  const int64_t fc1_out = model.activation == ActivationKind::kSwiglu ? 2 * F : F;
  {
    ModuleScope scope("embedding");
    {
      ModuleScope inner("word_embeddings");
      word_embeddings_ = store->Add("weight", {V, H});
    }
    if (model.position == PositionKind::kLearned) {
      ModuleScope inner("position_embeddings");
      const int64_t positions =
          model.max_position_embeddings > 0 ? model.max_position_embeddings : training.seq_length;
      position_embeddings_ = store->Add("weight", {positions, H});
    }
  }
  ModuleScope decoder("decoder");
  for (int64_t l = 0; l < model.num_layers; ++l) {
    ModuleScope layer_scope("layers." + std::to_string(l));
    Layer layer{};
    {
      ModuleScope s("input_layernorm");
      layer.input_norm_weight = store->Add("weight", {H});
      if (layer_norm) layer.input_norm_bias = store->Add("bias", {H});
    }
    {
      ModuleScope s("self_attention");
      {
        ModuleScope q("linear_qkv");
        layer.qkv_weight = store->Add("weight", {(A + 2 * G) * D, H});
        if (model.add_qkv_bias) layer.qkv_bias = store->Add("bias", {(A + 2 * G) * D});
      }
      ModuleScope p("linear_proj");
      layer.proj_weight = store->Add("weight", {H, A * D});
      if (bias) layer.proj_bias = store->Add("bias", {H});
    }
    {
      ModuleScope s("pre_mlp_layernorm");
      layer.mlp_norm_weight = store->Add("weight", {H});
      if (layer_norm) layer.mlp_norm_bias = store->Add("bias", {H});
    }
    {
      ModuleScope s("mlp");
      {
        ModuleScope f("linear_fc1");
        layer.fc1_weight = store->Add("weight", {fc1_out, H});
        if (bias) layer.fc1_bias = store->Add("bias", {fc1_out});
      }
      ModuleScope f("linear_fc2");
      layer.fc2_weight = store->Add("weight", {H, F});
      if (bias) layer.fc2_bias = store->Add("bias", {H});
    }
    layers_.push_back(layer);
  }
  {
    ModuleScope s("final_layernorm");
    final_norm_weight_ = store->Add("weight", {H});
    if (layer_norm) final_norm_bias_ = store->Add("bias", {H});
  }
  if (model.tie_embeddings) {
    output_weight_ = word_embeddings_;
  } else {
    ModuleScope s("output_layer");
    output_weight_ = store->Add("weight", {V, H});
  }
}

double TransformerModel::hidden_dropout() const {
  return training_.dropout ? model_.hidden_dropout : 0.0;
}

at::Tensor TransformerModel::Norm(const at::Tensor& x, Parameter* weight, Parameter* bias) {
  return model_.norm == NormKind::kLayerNorm ? LayerNorm(x, *weight, bias) : RmsNorm(x, *weight);
}

at::Tensor TransformerModel::Attention(Layer& layer, const at::Tensor& ln_out) {
  ModuleScope scope("self_attention");
  const int64_t S = ln_out.size(0), B = ln_out.size(1);
  const int64_t A = model_.num_attention_heads, G = model_.num_query_groups, D = model_.head_dim;
  at::Tensor qkv;
  {
    ModuleScope s("linear_qkv");
    qkv = Linear(ln_out, *layer.qkv_weight, layer.qkv_bias);  // [S, B, (A + 2G) * D]
  }
  // SelfAttention.get_query_key_value_tensors: [S, B, G, (A/G + 2) * D] split per group.
  const at::Tensor grouped = qkv.view({S, B, G, (A / G + 2) * D});
  qkv.reset();
  auto parts = grouped.split({A / G * D, D, D}, 3);
  at::Tensor q = parts[0].reshape({S, B, A, D});  // a copy unless G == A
  at::Tensor k = parts[1];
  at::Tensor v = parts[2];
  parts.clear();
  if (model_.position == PositionKind::kRope) {
    q = RotaryEmbedding(q);
    k = RotaryEmbedding(k);
  }
  const double attention_dropout = training_.dropout ? model_.attention_dropout : 0.0;
  at::Tensor context;
  {
    ModuleScope s("core_attention");
    auto core = [this, attention_dropout](const std::vector<at::Tensor>& qkv_parts) {
      return CoreAttention(qkv_parts[0], qkv_parts[1], qkv_parts[2], training_.attention,
                           attention_dropout, workspace_);
    };
    // Selective recomputation checkpoints core attention (Megatron's
    // _checkpointed_attention_forward); FlashAttention keeps no S^2 tensor to save.
    if (training_.recompute == RecomputeKind::kSelective &&
        training_.attention == AttentionKind::kEager) {
      context = Checkpoint(core, {q, k, v});
    } else {
      context = core({q, k, v});
    }
  }
  ModuleScope s("linear_proj");
  return Linear(context, *layer.proj_weight, nullptr);  // bias added in BiasDropoutAdd
}

at::Tensor TransformerModel::Mlp(Layer& layer, const at::Tensor& ln_out) {
  ModuleScope scope("mlp");
  at::Tensor h;
  {
    ModuleScope s("linear_fc1");
    h = Linear(ln_out, *layer.fc1_weight, nullptr);
  }
  if (layer.fc1_bias != nullptr) h = AddBias(h, *layer.fc1_bias);  // fused bias-activation
  h = model_.activation == ActivationKind::kGelu ? at::gelu(h) : Swiglu(h);
  ModuleScope s("linear_fc2");
  return Linear(h, *layer.fc2_weight, nullptr);
}

at::Tensor TransformerModel::LayerForward(Layer& layer, const at::Tensor& hidden) {
  at::Tensor ln_out;
  {
    ModuleScope s("input_layernorm");
    ln_out = Norm(hidden, layer.input_norm_weight, layer.input_norm_bias);
  }
  at::Tensor attention_out = Attention(layer, ln_out);
  ln_out.reset();
  at::Tensor residual = BiasDropoutAdd(attention_out, layer.proj_bias, hidden, hidden_dropout());
  attention_out.reset();
  {
    ModuleScope s("pre_mlp_layernorm");
    ln_out = Norm(residual, layer.mlp_norm_weight, layer.mlp_norm_bias);
  }
  at::Tensor mlp_out = Mlp(layer, ln_out);
  ln_out.reset();
  return BiasDropoutAdd(mlp_out, layer.fc2_bias, residual, hidden_dropout());
}

at::Tensor TransformerModel::Decoder(const at::Tensor& input) {
  ModuleScope decoder("decoder");
  const int64_t L = model_.num_layers;
  const int64_t N = training_.recompute_num_layers;
  auto run_layers = [this](int64_t first, int64_t last, at::Tensor hidden) {
    for (int64_t l = first; l < last; ++l) {
      ModuleScope s("layers." + std::to_string(l));
      hidden = LayerForward(layers_[static_cast<size_t>(l)], hidden);
    }
    return hidden;
  };
  at::Tensor hidden = input;
  if (training_.recompute != RecomputeKind::kFull) {
    hidden = run_layers(0, L, hidden);
  } else if (training_.recompute_method == RecomputeMethod::kUniform) {
    // Megatron's _checkpointed_forward, uniform: checkpoint every chunk of N layers.
    for (int64_t l = 0; l < L; l += N) {
      const int64_t last = std::min(L, l + N);
      hidden =
          Checkpoint([run_layers, l, last](
                         const std::vector<at::Tensor>& in) { return run_layers(l, last, in[0]); },
                     {hidden});
    }
  } else {
    // block: checkpoint each of the first N layers; run the rest normally.
    for (int64_t l = 0; l < L; ++l) {
      if (l < N) {
        hidden = Checkpoint(
            [run_layers, l](const std::vector<at::Tensor>& in) {
              return run_layers(l, l + 1, in[0]);
            },
            {hidden});
      } else {
        hidden = run_layers(l, l + 1, hidden);
      }
    }
  }
  ModuleScope s("final_layernorm");
  return Norm(hidden, final_norm_weight_, final_norm_bias_);
}

at::Tensor TransformerModel::Forward() {
  const int64_t S = training_.seq_length, B = training_.micro_batch_size;
  const auto meta = at::TensorOptions().device(at::kMeta);
  at::Tensor tokens, labels, loss_mask, attention_mask, position_ids;
  {
    ModuleScope s("batch");  // get_batch: the microbatch on the GPU
    tokens = at::empty({B, S}, meta.dtype(at::kLong));
    labels = at::empty({B, S}, meta.dtype(at::kLong));
    loss_mask = at::empty({B, S}, meta.dtype(at::kFloat));
    attention_mask = at::empty({B, 1, S, S}, meta.dtype(at::kBool));
    position_ids = at::empty({B, S}, meta.dtype(at::kLong));
  }
  at::Tensor hidden;
  {
    ModuleScope s("embedding");
    at::Tensor embeddings;
    {
      ModuleScope w("word_embeddings");
      embeddings = Embedding(tokens, *word_embeddings_);  // [B, S, H]
    }
    if (position_embeddings_ != nullptr) {
      ModuleScope p("position_embeddings");
      embeddings = embeddings + Embedding(position_ids, *position_embeddings_);
    }
    hidden = Dropout(embeddings.transpose(0, 1).contiguous(), hidden_dropout());  // [S, B, H]
  }
  hidden = Decoder(hidden);
  at::Tensor loss;
  {
    ModuleScope s("output_layer");
    at::Tensor logits = Linear(hidden, *output_weight_, nullptr);  // [S, B, V]
    hidden.reset();
    loss = VocabCrossEntropy(logits, labels.transpose(0, 1).contiguous());  // [S, B] fp32
  }
  // loss_func: masked mean over tokens.
  ModuleScope s("loss");
  const at::Tensor losses = loss.transpose(0, 1).contiguous().view({-1});
  const at::Tensor mask = loss_mask.view({-1});
  return at::sum(losses * mask) / mask.sum();
}

}  // namespace memsim
