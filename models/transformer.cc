#include "models/transformer.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>

#include "models/fp8.h"
#include "models/layer_replication.h"
#include "parallel/regions/tensor_parallel.h"
#include "simulator/check.h"
#include "simulator/session.h"

namespace memsim {

TransformerModel::TransformerModel(const ModelConfig& model, const TrainingConfig& training,
                                   const ModelShard& shard, ParameterStore* store)
    : model_(model),
      training_(training),
      shard_(shard),
      hidden_dtype_(training.fp32_residual_connection ? at::kFloat : store->param_dtype()),
      workspace_(c10::make_intrusive<GlobalMemoryBuffer>(
          /*persistent=*/training.profile == ProfileKind::kMegatronLocal)),
      // Under TE the layers' gathers are Transformer Engine's own (transient), and
      // Megatron's persistent "mpu" buffer is the output layer's and the dispatcher's.
      mpu_buffer_(training.profile == ProfileKind::kMegatronLocal
                      ? workspace_
                      : c10::make_intrusive<GlobalMemoryBuffer>(/*persistent=*/true)) {
  const int64_t H = model.hidden_size, V = model.padded_vocab_size, tp = shard.tp;
  if (training.offload_modules != 0) offloader_ = std::make_unique<ActivationOffloader>(training_);
  if (training.cpu_offloading_num_layers > 0) {
    layer_offloader_ =
        std::make_unique<LayerCpuOffloader>(model.num_layers, training.cpu_offloading_num_layers);
  }
  // FinalizeModelConfig padded V for tp; FinalizeLayout checked that tp divides the heads.
  MEMSIM_DCHECK(tp > 0 && V > 0 && V % tp == 0 && model.num_attention_heads % tp == 0 &&
                model.head_dim > 0);
  // Multi-token prediction needs the embedding on the last stage too.
  const bool mtp = shard.last_stage && model.mtp_num_layers > 0;
  if (shard.last_stage && training.defer_embedding_wgrad) {
    deferred_wgrad_ = c10::make_intrusive<DeferredWgrad>(training.wgrad_deferral_limit);
  }
  if (shard.first_stage || mtp) {
    // The MTP stage's copy belongs to its last model chunk, where its MTP layers are.
    if (!shard.first_stage) {
      store->set_chunk(std::max<int64_t>(0, static_cast<int64_t>(shard.chunks.size()) - 1));
    }
    ModuleScope scope("embedding");
    {
      ModuleScope inner("word_embeddings");
      word_embeddings_ = store->Add("weight", {V / tp, H});
      word_embeddings_->embedding_or_output = true;
    }
    if (model.position == PositionKind::kLearned) {
      ModuleScope inner("position_embeddings");
      const int64_t positions =
          model.max_position_embeddings > 0 ? model.max_position_embeddings : training.seq_length;
      position_embeddings_ = store->Add("weight", {positions, H});
    }
  }
  {
    ModuleScope decoder("decoder");
    for (const auto& [first, count] : shard.chunks) {
      // Megatron's model chunks each own their parameters (one DDP wrapper a chunk); the
      // embedding belongs to the first, the final norm, MTP and output layer to the last.
      store->set_chunk(static_cast<int64_t>(chunks_.size()));
      std::vector<Layer>& chunk = chunks_.emplace_back();
      for (int64_t l = first; l < first + count; ++l) {
        store->set_unit(l);
        ModuleScope s("layers." + std::to_string(l));
        chunk.push_back(CreateLayer(l, store, training_.Fp8Layer(l, model_.num_layers)));
      }
      store->set_unit(-1);
    }
    if (shard.last_stage) {
      std::tie(final_norm_weight_, final_norm_bias_) = AddNorm("final_layernorm", store);
    }
  }
  if (mtp) {
    ModuleScope scope("mtp");
    // MultiTokenPredictionBlock._build_layers: with mtp_use_repeated_layer, one layer.
    const int64_t built = model.mtp_use_repeated_layer ? 1 : model.mtp_num_layers;
    for (int64_t j = 0; j < built; ++j) {
      ModuleScope s("layers." + std::to_string(j));
      mtp_layers_.push_back(CreateMtpLayer(j, store));
    }
  }
  if (shard.last_stage) {
    if (model.tie_embeddings && shard.first_stage) {
      output_weight_ = word_embeddings_;
    } else {
      // Untied, or the last stage's copy of a tied embedding (Megatron keeps both in sync
      // by all-reducing their gradients between the first and last stage).
      ModuleScope s("output_layer");
      output_weight_ = store->Add("weight", {V / tp, H});
      output_weight_->embedding_or_output = true;
    }
    // GPTModel's shared_embedding_or_output_weight: the MTP stage's embedding.
    if (model.tie_embeddings && mtp) output_weight_ = word_embeddings_;
  }
  // LanguageModule.setup_embeddings_and_output_layer: over a pipeline, with tied embeddings
  // or MTP, the first stage's embedding and the last stage's shared weight (the MTP
  // stage's embedding, else the output layer's copy) are marked shared_embedding, and the
  // latter `shared`.
  const bool pipelined = !(shard.first_stage && shard.last_stage);
  if (pipelined && (model.tie_embeddings || model.mtp_num_layers > 0)) {
    if (shard.first_stage) {
      word_embeddings_->shared_embedding = true;
    } else if (shard.last_stage) {
      Parameter* copy = mtp ? word_embeddings_ : output_weight_;
      copy->shared_embedding = true;
      copy->shared = true;
    }
  }
}

std::pair<Parameter*, Parameter*> TransformerModel::AddNorm(const std::string& name,
                                                            ParameterStore* store) {
  ModuleScope s(name);
  Parameter* weight = store->Add("weight", {model_.hidden_size});
  Parameter* bias =
      model_.norm == NormKind::kLayerNorm ? store->Add("bias", {model_.hidden_size}) : nullptr;
  return {weight, bias};
}

TransformerModel::MtpLayer TransformerModel::CreateMtpLayer(int64_t depth, ParameterStore* store) {
  const int64_t H = model_.hidden_size;
  MtpLayer mtp{};
  std::tie(mtp.enorm_weight, mtp.enorm_bias) = AddNorm("enorm", store);
  std::tie(mtp.hnorm_weight, mtp.hnorm_bias) = AddNorm("hnorm", store);
  {
    ModuleScope s("eh_proj");
    mtp.eh_proj_weight = store->Add("weight", {H / shard_.tp, 2 * H});
    mtp.eh_proj_weight->tp_partition_dim = 0;
    MakeFp8(mtp.eh_proj_weight, training_.fp8 != Fp8Recipe::kNone);
  }
  {
    // The spec of the decoder's last layer (gpt_builders.py), in FP8 whatever the
    // decoder's last layers are (MTP runs in the global FP8 context).
    ModuleScope s("mtp_model_layer");
    mtp.unit = model_.num_layers + depth;
    store->set_unit(mtp.unit);
    mtp.layer = CreateLayer(model_.num_layers - 1, store, training_.fp8 != Fp8Recipe::kNone);
    store->set_unit(-1);
    mtp.layer.skips_rope = model_.SkipsRope(depth);
  }
  std::tie(mtp.final_norm_weight, mtp.final_norm_bias) = AddNorm("final_layernorm", store);
  return mtp;
}

void TransformerModel::MakeFp8(Parameter* weight, bool fp8) const {
  if (fp8) {
    MakeFp8Weight(weight, training_);
  }
}

TransformerModel::Layer TransformerModel::CreateLayer(int64_t index, ParameterStore* store,
                                                      bool fp8) {
  const int64_t H = model_.hidden_size, A = model_.num_attention_heads;
  const int64_t G = model_.num_query_groups, D = model_.head_dim, F = model_.ffn_hidden_size;
  const int64_t tp = shard_.tp;
  const bool layer_norm = model_.norm == NormKind::kLayerNorm;
  const bool bias = model_.add_bias_linear;
  const int64_t fc1_out = model_.Fc1Width(F) / tp;
  Layer layer{};
  layer.index = index;
  layer.skips_rope = model_.SkipsRope(index);
  // Parameters are made in Megatron's __init__ order, which is named_parameters' order and
  // so the gradient buffer's (Note [Distributed optimizer buffers] in parallel/ddp_buffers.h):
  // Attention builds core_attention and linear_proj before the query/key/value projections,
  // and Transformer Engine's spec fuses the input norm into linear_qkv, after linear_proj.
  const bool norm_in_qkv =
      training_.profile == ProfileKind::kTransformerEngine && !model_.multi_latent_attention();
  if (!norm_in_qkv) {
    std::tie(layer.input_norm_weight, layer.input_norm_bias) = AddNorm("input_layernorm", store);
  }
  {
    ModuleScope s("self_attention");
    if (model_.softmax == SoftmaxKind::kLearnable) {
      ModuleScope c("core_attention");
      layer.softmax_offset = store->Add("softmax_offset", {A / tp});
    }
    ModuleScope p("linear_proj");
    const int64_t v_width = model_.multi_latent_attention() ? model_.v_head_dim : D;
    layer.proj_weight = store->Add("weight", {H, A * v_width / tp});
    layer.proj_weight->tp_partition_dim = 1;
    MakeFp8(layer.proj_weight, fp8);
    if (bias) layer.proj_bias = store->Add("bias", {H});
  }
  if (norm_in_qkv) {
    std::tie(layer.input_norm_weight, layer.input_norm_bias) = AddNorm("input_layernorm", store);
  }
  {
    ModuleScope s("self_attention");
    if (model_.multi_latent_attention()) {
      const int64_t Q = model_.q_lora_rank, R = model_.kv_lora_rank;
      if (Q > 0) {
        {
          ModuleScope q("linear_q_down_proj");
          layer.q_down_weight = store->Add("weight", {Q, H});
          MakeFp8(layer.q_down_weight, fp8);
        }
        {
          ModuleScope q("q_layernorm");
          layer.q_norm_weight = store->Add("weight", {Q});
          if (layer_norm) layer.q_norm_bias = store->Add("bias", {Q});
        }
      }
      {
        ModuleScope q(Q > 0 ? "linear_q_up_proj" : "linear_q_proj");
        layer.q_up_weight = store->Add("weight", {A * D / tp, Q > 0 ? Q : H});
        layer.q_up_weight->tp_partition_dim = 0;
        MakeFp8(layer.q_up_weight, fp8);
      }
      {
        ModuleScope kv("linear_kv_down_proj");
        layer.kv_down_weight = store->Add("weight", {R + model_.qk_pos_emb_head_dim, H});
        MakeFp8(layer.kv_down_weight, fp8);
      }
      {
        ModuleScope kv("kv_layernorm");
        layer.kv_norm_weight = store->Add("weight", {R});
        if (layer_norm) layer.kv_norm_bias = store->Add("bias", {R});
      }
      ModuleScope kv("linear_kv_up_proj");
      layer.kv_up_weight =
          store->Add("weight", {A * (model_.qk_head_dim + model_.v_head_dim) / tp, R});
      layer.kv_up_weight->tp_partition_dim = 0;
      MakeFp8(layer.kv_up_weight, fp8);
    } else {
      ModuleScope q("linear_qkv");
      const int64_t rows = (A + 2 * G + (model_.attention_output_gate ? A : 0)) * D / tp;
      layer.qkv_weight = store->Add("weight", {rows, H});
      layer.qkv_weight->tp_partition_dim = 0;
      MakeFp8(layer.qkv_weight, fp8);
      if (model_.add_qkv_bias) layer.qkv_bias = store->Add("bias", {rows});
    }
    if (model_.qk_layernorm && !model_.multi_latent_attention() && !QkL2NormApplies()) {
      {
        ModuleScope q("q_layernorm");
        layer.q_norm_weight = store->Add("weight", {D});
        if (layer_norm) layer.q_norm_bias = store->Add("bias", {D});
      }
      ModuleScope k("k_layernorm");
      layer.k_norm_weight = store->Add("weight", {D});
      if (layer_norm) layer.k_norm_bias = store->Add("bias", {D});
    }
    if (model_.post_projection_norms) {
      std::tie(layer.proj_post_norm_weight, layer.proj_post_norm_bias) =
          AddNorm("post_layernorm", store);
    }
  }
  std::tie(layer.mlp_norm_weight, layer.mlp_norm_bias) = AddNorm("pre_mlp_layernorm", store);
  ModuleScope s("mlp");
  layer.moe = model_.moe_layer(index);
  if (layer.moe) {
    std::function<void(Parameter*)> gemm_weight;
    if (fp8) gemm_weight = [this](Parameter* weight) { MakeFp8(weight, true); };
    layer.experts =
        CreateMoeParameters(model_, {shard_.ep, shard_.etp, shard_.tp}, store, gemm_weight);
    return layer;
  }
  {
    ModuleScope f("linear_fc1");
    layer.fc1_weight = store->Add("weight", {fc1_out, H});
    layer.fc1_weight->tp_partition_dim = 0;
    MakeFp8(layer.fc1_weight, fp8);
    if (bias) layer.fc1_bias = store->Add("bias", {fc1_out});
  }
  ModuleScope f("linear_fc2");
  layer.fc2_weight = store->Add("weight", {H, F / tp});
  layer.fc2_weight->tp_partition_dim = 1;
  MakeFp8(layer.fc2_weight, fp8);
  if (bias) layer.fc2_bias = store->Add("bias", {H});
  if (model_.post_projection_norms) {
    std::tie(layer.fc2_post_norm_weight, layer.fc2_post_norm_bias) =
        AddNorm("post_layernorm", store);
  }
  return layer;
}

std::vector<int64_t> TransformerModel::HiddenShape() const {
  int64_t seq = training_.seq_length / shard_.cp;
  if (shard_.sequence_parallel) seq /= shard_.tp;
  return {seq, training_.micro_batch_size, model_.hidden_size};
}

double TransformerModel::hidden_dropout() const {
  return training_.dropout ? model_.hidden_dropout : 0.0;
}

LinearParallelism TransformerModel::ColumnParallel() const {
  LinearParallelism p;
  if (shard_.sequence_parallel) {
    p.gather_input_group = shard_.tp;
    p.workspace = workspace_;
  } else {
    p.all_reduce_input_grad_group = shard_.tp;
  }
  return p;
}

LinearParallelism TransformerModel::MegatronColumnParallel() const {
  LinearParallelism p = ColumnParallel();
  if (p.workspace) p.workspace = mpu_buffer_;
  return p;
}

LinearParallelism TransformerModel::UserbufferColumnParallel() const {
  LinearParallelism p = ColumnParallel();
  if (UsesUserbuffers(training_, shard_)) {
    p.userbuffer_gather = training_.tp_comm_overlap_ag;
    p.userbuffer_bulk_dgrad = training_.tp_comm_bulk_dgrad;
    p.userbuffer_bulk_wgrad = training_.tp_comm_bulk_wgrad;
  }
  return p;
}

bool TransformerModel::QkL2NormApplies() const {
  return model_.qk_l2_norm &&
         (training_.profile == ProfileKind::kTransformerEngine || model_.num_experts > 0);
}

at::Tensor TransformerModel::Norm(const at::Tensor& x, Parameter* weight, Parameter* bias) {
  // Transformer Engine's norms, fused into a linear or not, take the fp32 residual stream
  // as a 16-bit copy, which they keep (Note [FP32 residual stream]).
  const at::Tensor input =
      x.scalar_type() == weight->data.scalar_type() ? x : x.to(weight->data.scalar_type());
  return model_.norm == NormKind::kLayerNorm ? LayerNorm(input, *weight, bias)
                                             : RmsNorm(input, *weight);
}

std::vector<at::Tensor> TransformerModel::QueryKeyValue(Layer& layer, const at::Tensor& ln_out,
                                                        at::Tensor* gate) {
  const int64_t tp = shard_.tp;
  const int64_t A = model_.num_attention_heads / tp, G = model_.num_query_groups / tp;
  const int64_t D = model_.head_dim;
  at::Tensor qkv;
  {
    ModuleScope s("linear_qkv");
    ChargeTeModuleCalls(training_);
    // Transformer Engine's LayerNormLinear: the norm's output is its own.
    qkv = Linear(ln_out, *layer.qkv_weight, layer.qkv_bias, UserbufferColumnParallel(),
                 Fp8LinearOptions::LayerNormLinear());  // [S, B, (A+2G)D], (2A+2G)D gated
  }
  const int64_t S = qkv.size(0), B = qkv.size(1);
  // SelfAttention.get_query_key_value_tensors: [S, B, G, (A/G + 2) * D] split per group
  // into query, key and value; gated, [S, B, G, (2A/G + 2) * D] into query, gate, key, value.
  const bool gated = model_.attention_output_gate;
  const at::Tensor grouped = qkv.view({S, B, G, ((gated ? 2 : 1) * A / G + 2) * D});
  qkv.reset();
  std::vector<int64_t> widths = {A / G * D, D, D};
  if (gated) widths.insert(widths.begin() + 1, A / G * D);
  auto parts = grouped.split(widths, 3);
  at::Tensor q = parts[0].reshape({S, B, A, D});  // a copy unless G is 1 or A
  const at::Tensor gate_part = gated ? parts[1] : at::Tensor();
  at::Tensor k = parts[gated ? 2 : 1];
  at::Tensor v = parts[gated ? 3 : 2];
  parts.clear();
  if (QkL2NormApplies()) {
    // SelfAttention's L2Norm in place of any q/k layernorm; its modules keep their names.
    {
      ModuleScope s("q_layernorm");
      q = L2Norm(q);
    }
    ModuleScope s("k_layernorm");
    k = L2Norm(k);
  } else if (model_.qk_layernorm) {
    // Apex's and Transformer Engine's norms save the contiguous input they normalize. The
    // local spec's RMSNorm is torch.nn.RMSNorm (WrappedTorchNorm, Apex or not), which saves
    // its input as it comes: the key, a view of linear_qkv's output, keeps that output
    // whole (an H200 run of Megatron-LM with the local spec showed it: validation/fake_pg,
    // llama_1b_local_pp4_qk_layernorm_ce_fusion).
    const bool saves_view =
        training_.profile == ProfileKind::kMegatronLocal && model_.norm == NormKind::kRmsNorm;
    auto norm_input = [saves_view](const at::Tensor& x) { return saves_view ? x : x.contiguous(); };
    {
      ModuleScope s("q_layernorm");
      ChargeTeModuleCalls(training_);
      q = Norm(norm_input(q), layer.q_norm_weight, layer.q_norm_bias);
    }
    ModuleScope s("k_layernorm");
    ChargeTeModuleCalls(training_);
    k = Norm(norm_input(k), layer.k_norm_weight, layer.k_norm_bias);
  }
  if (gated) *gate = gate_part.reshape({S, B, A, D});  // the same
  const bool rope = model_.position == PositionKind::kRope && !layer.skips_rope;
  if (rope && training_.rope_fusion) {
    q = RotaryEmbedding(q);
    k = RotaryEmbedding(k);
  } else if (rope) {
    q = UnfusedRotaryEmbedding(q, rotary_freqs_);
    k = UnfusedRotaryEmbedding(k, rotary_freqs_);
  }
  return {q, k, v};
}

std::vector<at::Tensor> TransformerModel::WithBatchMask(std::vector<at::Tensor> inputs) const {
  if (batch_attention_mask_.defined()) inputs.push_back(batch_attention_mask_);
  return inputs;
}

const at::Tensor& TransformerModel::RotaryFrequencies(int64_t chunk) {
  if (static_cast<int64_t>(rotary_cache_.size()) <= chunk) rotary_cache_.resize(chunk + 1);
  auto& [inv_freq, freqs] = rotary_cache_[static_cast<size_t>(chunk)];
  if (freqs.defined()) return freqs;
  ModuleScope s("rotary_pos_emb");
  const auto f32 = at::TensorOptions().device(at::kMeta).dtype(at::kFloat);
  const int64_t S = training_.seq_length, rot = model_.RotaryDim(), cp = shard_.cp;
  {
    PersistentScope persistent;
    inv_freq = at::empty({rot / 2}, f32);  // moved to the GPU once
  }
  at::Tensor whole;
  {
    const at::Tensor outer = at::outer(at::arange(S, f32), inv_freq);  // [S, rot/2]
    PersistentScope persistent;  // the cache keeps it unless context parallelism slices it
    whole = at::cat({outer, outer}, -1).view({S, 1, 1, rot});
  }
  if (cp == 1) {
    freqs = std::move(whole);
    return freqs;
  }
  // get_pos_emb_on_this_cp_rank: this rank's two of 2cp chunks through an int64[2] index.
  const at::Tensor index = at::zeros({2}, f32.dtype(at::kLong));
  PersistentScope persistent;
  freqs = whole.view({2 * cp, S / (2 * cp), 1, 1, rot})
              .index_select(0, index)
              .view({S / cp, 1, 1, rot});
  return freqs;
}

std::vector<at::Tensor> TransformerModel::LatentQueryKeyValue(
    Layer& layer, const at::Tensor& ln_out, CheckpointWithoutOutput* up_projection_checkpoint) {
  const int64_t tp = shard_.tp, rope = model_.qk_pos_emb_head_dim, R = model_.kv_lora_rank;
  // The down projections are Transformer Engine's "duplicated" linears: every rank holds
  // the whole weight and projects its own (sequence-parallel) slice, with no communication.
  // In FP8 the down projections keep the input norm's 16-bit output when the layernorm
  // recompute module discards it (transformer_layer.py).
  Fp8LinearOptions down_fp8;
  down_fp8.save_original_input = training_.Recomputes(RecomputeModule::kLayerNorm);
  at::Tensor q_compressed = ln_out;
  if (model_.q_lora_rank > 0) {
    {
      ModuleScope s("linear_q_down_proj");
      ChargeTeModuleCalls(training_);
      q_compressed = Linear(ln_out, *layer.q_down_weight, nullptr, {}, down_fp8);  // [S', B, Q]
    }
    ModuleScope s("q_layernorm");
    q_compressed = Norm(q_compressed, layer.q_norm_weight, layer.q_norm_bias);
  }
  at::Tensor kv_combined;
  {
    ModuleScope s("linear_kv_down_proj");
    ChargeTeModuleCalls(training_);
    kv_combined =
        Linear(ln_out, *layer.kv_down_weight, nullptr, {}, down_fp8);  // [S', B, R + rope]
  }
  auto latent = kv_combined.split({R, rope}, -1);
  at::Tensor k_pos_emb = latent[1];
  if (shard_.sequence_parallel) k_pos_emb = GatherFromSequenceParallelRegion(k_pos_emb, tp);
  at::Tensor kv_compressed;
  {
    ModuleScope s("kv_layernorm");  // its input is a view: the norm keeps a contiguous copy
    kv_compressed = Norm(latent[0].contiguous(), layer.kv_norm_weight, layer.kv_norm_bias);
  }
  latent.clear();
  std::vector<at::Tensor> out;
  if (up_projection_checkpoint == nullptr) {
    out = LatentUpProjection(layer, std::move(q_compressed), std::move(kv_compressed), k_pos_emb,
                             /*norm_outputs_owned=*/true);
  } else {
    // The checkpoint keeps the norms' outputs as its inputs.
    out = up_projection_checkpoint->Run(
        [this, &layer](const std::vector<at::Tensor>& in) {
          return LatentUpProjection(layer, in[0], in[1], in[2], /*norm_outputs_owned=*/false);
        },
        {q_compressed, kv_compressed, k_pos_emb});
  }
  out.push_back(std::move(kv_combined));
  return out;
}

std::vector<at::Tensor> TransformerModel::LatentUpProjection(Layer& layer, at::Tensor q_compressed,
                                                             at::Tensor kv_compressed,
                                                             const at::Tensor& k_pos_emb,
                                                             bool norm_outputs_owned) {
  // Transformer Engine's up projections are LayerNormLinears fusing q_layernorm and
  // kv_layernorm: in FP8 the norms' outputs live only until quantized.
  const Fp8LinearOptions fused =
      norm_outputs_owned ? Fp8LinearOptions::LayerNormLinear() : Fp8LinearOptions();
  const int64_t A = model_.num_attention_heads / shard_.tp;
  const int64_t qk = model_.qk_head_dim, rope = model_.qk_pos_emb_head_dim;
  const int64_t vd = model_.v_head_dim;
  at::Tensor q, kv;
  {
    ModuleScope s(model_.q_lora_rank > 0 ? "linear_q_up_proj" : "linear_q_proj");
    ChargeTeModuleCalls(training_);
    q = Linear(q_compressed, *layer.q_up_weight, nullptr, ColumnParallel(),
               model_.q_lora_rank > 0 ? fused : Fp8LinearOptions());
  }
  q_compressed.reset();
  {
    ModuleScope s("linear_kv_up_proj");
    ChargeTeModuleCalls(training_);
    kv = Linear(kv_compressed, *layer.kv_up_weight, nullptr, ColumnParallel(), fused);
  }
  kv_compressed.reset();
  const int64_t S = q.size(0), B = q.size(1);
  // qkv_up_proj_and_rope_apply (unfused RoPE): split, rotate the positional parts, and
  // concatenate into new query and key tensors; value is made contiguous.
  auto q_parts = q.view({S, B, A, qk + rope}).split({qk, rope}, -1);
  auto kv_parts = kv.view({S, B, A, qk + vd}).split({qk, vd}, -1);
  q.reset();
  kv.reset();
  const at::Tensor q_pos_emb = RotaryEmbedding(q_parts[1]);
  const at::Tensor k_rotated = RotaryEmbedding(k_pos_emb.unsqueeze(-2));  // [S, B, 1, rope]
  at::Tensor query = at::cat({q_parts[0], q_pos_emb}, -1);
  at::Tensor key = at::cat({kv_parts[0], k_rotated.expand({S, B, A, rope})}, -1);
  at::Tensor value = kv_parts[1].contiguous();
  return {query, key, value};
}

at::Tensor TransformerModel::Attention(Layer& layer, const at::Tensor& ln_out) {
  ModuleScope scope("self_attention");
  // mla_up_proj: the up projections' outputs go once core attention has saved them.
  std::optional<CheckpointWithoutOutput> up_projection;
  if (model_.multi_latent_attention() && training_.Recomputes(RecomputeModule::kMlaUpProj)) {
    up_projection.emplace();
  }
  std::vector<at::Tensor> qkv;
  at::Tensor gate;  // attention_output_gate's, [S, B, A, D]
  {
    // Offloading's qkv_linear region (multi_latent_attention.py): the down projections
    // both save the norm's output, which recomputing the layernorm module regenerates.
    at::Tensor hidden_states = ln_out;
    OffloadRegion offload(model_.multi_latent_attention() ? offloader_.get() : nullptr,
                          OffloadModule::kQkvLinear, &hidden_states);
    qkv = model_.multi_latent_attention()
              ? LatentQueryKeyValue(layer, hidden_states, up_projection ? &*up_projection : nullptr)
              : QueryKeyValue(layer, hidden_states, &gate);
    offload.EndSaving(qkv);
    offload.Commit(&qkv[0], {{hidden_states, /*saves=*/2,
                              /*regenerated=*/training_.Recomputes(RecomputeModule::kLayerNorm)}});
  }
  at::Tensor q = std::move(qkv[0]), k = std::move(qkv[1]), v = std::move(qkv[2]);
  // Multi-latent attention's kv down projection output, held to the end (LatentQueryKeyValue).
  const at::Tensor kv_down = qkv.size() > 3 ? std::move(qkv[3]) : at::Tensor();
  qkv.clear();
  const double attention_dropout = training_.dropout ? model_.attention_dropout : 0.0;
  // Gemma-2's own core attention, whatever the backend (Note [Gemma-2]).
  const bool flex = model_.flex_attention;
  const bool eager = !flex && training_.attention == AttentionKind::kEager;
  at::Tensor context;
  {
    ModuleScope s("core_attention");
    // Transformer Engine's unfused attention masks its scores with a mask it makes each time
    // (Note [Transformer Engine's unfused mask] in layers.h), from the batch's mask where
    // the chunk has one (what the forward saw, also when recomputed in backward).
    const bool te_unfused = eager && training_.profile == ProfileKind::kTransformerEngine;
    const int64_t mask_rows = batch_mask_rows_;
    auto core = [this, attention_dropout, flex, te_unfused,
                 mask_rows](const std::vector<at::Tensor>& qkv_parts) {
      if (flex) return FlexAttention(qkv_parts[0], qkv_parts[1], qkv_parts[2]);
      ChargeTeModuleCalls(training_);
      const at::Tensor mask =
          te_unfused ? TeUnfusedAttentionMask(qkv_parts[0].size(0), qkv_parts[1].size(0), mask_rows)
                     : at::Tensor();
      // Note [Max attention logit]: the call's maxima, then torch.max's new running maximum.
      at::Tensor max_logit;
      at::Tensor out = CoreAttention(qkv_parts[0], qkv_parts[1], qkv_parts[2], training_.attention,
                                     attention_dropout, *workspace_, shard_.cp,
                                     training_.cp_all_to_all, training_.cp_all_gather,
                                     training_.ReturnsMaxAttentionLogit() ? &max_logit : nullptr);
      if (max_logit.defined()) (void)at::empty_like(max_logit);
      return out;
    };
    // Selective recomputation checkpoints core attention (Megatron's
    // _checkpointed_attention_forward); FlashAttention keeps no S^2 tensor to save.
    if (training_.Recomputes(RecomputeModule::kCoreAttn) && eager) {
      context = Checkpoint(core, WithBatchMask({q, k, v}));
    } else {
      // Offloading's core_attn region; eager attention's probabilities are saved by the
      // softmax and by the bmm (dropout 0 returns them). The up projections' recomputation
      // regenerates query, key and value.
      at::Tensor query = q;
      OffloadRegion offload(offloader_.get(), OffloadModule::kCoreAttn, &query);
      context = core({query, k, v});
      offload.EndSaving({context}, /*largest_saved_twice=*/eager && attention_dropout == 0);
      const bool regenerated = up_projection.has_value();
      offload.Commit(&context, {{q, 1, regenerated}, {k, 1, regenerated}, {v, 1, regenerated}});
    }
    if (layer.softmax_offset != nullptr) context = AttentionSink(context, *layer.softmax_offset);
  }
  if (gate.defined()) {
    context = AttentionOutputGate(context, gate);
    gate.reset();
  }
  if (up_projection) up_projection->DiscardOutputAndRegisterRecompute(context);
  ModuleScope s("linear_proj");
  ChargeTeModuleCalls(training_);
  // Offloading's attn_proj region: the projection's input.
  OffloadRegion offload(offloader_.get(), OffloadModule::kAttnProj, &context);
  at::Tensor out = RowParallelLinear(context, *layer.proj_weight, /*save_original_input=*/true,
                                     layer.proj_post_norm_weight, layer.proj_post_norm_bias);
  offload.EndSaving({out});
  offload.Commit(&out, {{context}});
  return out;
}

void TransformerModel::KeepMaxAttentionLogits() {
  if (!training_.ReturnsMaxAttentionLogit()) return;
  // The attention's dtype: the parameters' (a float32 residual stream leaves q 16-bit).
  const auto options =
      at::TensorOptions().device(at::kMeta).dtype(ScalarTypeOf(training_.precision));
  const int64_t heads = model_.num_attention_heads / shard_.tp;
  CategoryScope category(Category::kActivation);
  auto keep = [&](const std::string& module) {
    ModuleScope scope(ModuleScope::Absolute{module});
    return at::empty({heads}, options);
  };
  for (const std::vector<Layer>& chunk : chunks_) {
    for (const Layer& layer : chunk) {
      max_attention_logits_.push_back(
          keep("decoder.layers." + std::to_string(layer.index) + ".self_attention.core_attention"));
    }
  }
  if (mtp_max_attention_logits_.empty()) {
    for (size_t j = 0; j < mtp_layers_.size(); ++j) {
      mtp_max_attention_logits_.push_back(keep("mtp.layers." + std::to_string(j) +
                                               ".mtp_model_layer.self_attention.core_attention"));
    }
  }
}

void TransformerModel::ClipQk() {
  if (!training_.ReturnsMaxAttentionLogit()) return;
  at::NoGradGuard no_grad;
  const at::ScalarType dtype = ScalarTypeOf(training_.precision);
  const auto options = at::TensorOptions().device(at::kMeta).dtype(dtype);
  const bool mla = model_.multi_latent_attention();
  const int64_t heads = model_.num_attention_heads / shard_.tp;
  // Per query group ([G/tp]); multi-latent attention clips per head.
  const int64_t groups = mla ? heads : model_.num_query_groups / shard_.tp;
  // The float32 main parameters of bf16 and fp16 training (the optimizer's copies).
  const bool main_params = training_.precision != Precision::kFp32;
  qk_clip_etas_.resize(static_cast<size_t>(model_.num_layers));
  for (const std::vector<Layer>& chunk : chunks_) {
    for (const Layer& layer : chunk) {
      ModuleScope scope(ModuleScope::Absolute{"decoder.layers." + std::to_string(layer.index) +
                                              ".self_attention"});
      (void)at::empty({}, options);  // torch.max(current_max_attn_logits).item()
      if (!training_.qk_clip) continue;
      // Attention.clip_qk / MLASelfAttention.clip_qk (Note [Max attention logit]).
      at::Tensor group_max;
      if (!mla) {  // torch.max(current.view(groups, -1), dim=1): values, and indices dropped
        group_max = at::empty({groups}, options);
        (void)at::empty({groups}, options.dtype(at::kLong));
      }
      (void)at::empty({groups}, options.dtype(at::kBool)).any();  // torch.any(max > threshold)
      QkClipEta& eta = qk_clip_etas_[static_cast<size_t>(layer.index)];
      {
        at::Tensor quotient = at::empty({groups}, options);  // threshold / max
        CategoryScope kept(Category::kOptimizerState);
        eta.eta = at::empty({groups}, options).view({groups, 1, 1});  // clamp(.., max=1)
      }
      (void)at::empty({groups}, options.dtype(at::kBool)).all();  // assert torch.all(eta <= 1)
      const std::vector<const Parameter*> weights =
          mla ? std::vector<const Parameter*>{layer.q_up_weight, layer.kv_up_weight}
              : std::vector<const Parameter*>{layer.qkv_weight};
      for (const Parameter* weight : weights) {
        for (const bool main_param : {true, false}) {
          if (main_param && !main_params) continue;
          if (!mla) {
            // eta.repeat(1, weight_q.size(1), 1), kept; torch.pow of it. _clip_linear_qkv
            // divides the whole model's query_projection_size (A*D) by this rank's groups.
            const int64_t rows = model_.num_attention_heads * model_.head_dim / groups;
            {
              CategoryScope kept(Category::kOptimizerState);
              eta.extended = at::empty({groups, rows, 1}, options);
            }
            (void)at::empty_like(eta.extended);
          }
          (void)at::empty_like(eta.eta);  // torch.pow(eta, alpha or 1 - alpha)
          // torch.cat of the scaled rows, the weight's size, copied back by copy_.
          (void)at::empty(weight->data.sizes(),
                          options.dtype(main_param ? at::kFloat : weight->data.scalar_type()));
        }
      }
    }
  }
  max_attention_logits_.clear();  // current_max_attn_logits = None
}

at::Tensor TransformerModel::RowParallelLinear(const at::Tensor& input, Parameter& weight,
                                               bool save_original_input,
                                               Parameter* post_norm_weight,
                                               Parameter* post_norm_bias) {
  Fp8LinearOptions fp8;
  fp8.save_original_input = save_original_input;
  if (shard_.sequence_parallel) fp8.reduce_scatter_output_group = shard_.tp;
  // The backward's all-gather of the output gradient may land in a userbuffer.
  LinearParallelism parallelism;
  parallelism.userbuffer_gather =
      UsesUserbuffers(training_, shard_) && training_.tp_comm_overlap_ag;
  // The bias is added in BiasDropoutAdd (skip_bias_add).
  at::Tensor out = Linear(input, weight, nullptr, parallelism, fp8);
  if (weight.fp8.recipe == Fp8Recipe::kNone || !shard_.sequence_parallel) {
    out = shard_.sequence_parallel
              ? ReduceScatterToSequenceParallelRegion(out, shard_.tp, parallelism.userbuffer_gather)
              : ReduceFromTensorParallelRegion(out, shard_.tp);
  }
  if (post_norm_weight == nullptr) return out;
  ModuleScope s("post_layernorm");
  return Norm(out, post_norm_weight, post_norm_bias);
}

at::Tensor TransformerModel::Mlp(Layer& layer, const at::Tensor& ln_out) {
  ModuleScope scope("mlp");
  if (layer.moe) {
    auto moe = [this, &layer](const std::vector<at::Tensor>& in) {
      return MoeForward(model_, training_, {shard_.ep, shard_.etp, shard_.tp}, layer.experts,
                        mpu_buffer_, in[0], ColumnParallel(), offloader_.get());
    };
    // moe: MoELayer.forward checkpoints routing, dispatch, experts and combine as one.
    return training_.Recomputes(RecomputeModule::kMoe) ? Checkpoint(moe, {ln_out}) : moe({ln_out});
  }
  // The MLP's delayed weight gradients run once its backward is done (Note [Delayed
  // weight gradients] in layers.h).
  const c10::intrusive_ptr<WeightGradStore> wgrad = NewWgradStore(training_.delay_wgrad_compute);
  DelayedWgradScope delay(wgrad);
  at::Tensor h;
  {
    ModuleScope s("linear_fc1");
    ChargeTeModuleCalls(training_);
    // Transformer Engine's LayerNormLinear: the pre-MLP norm's output is its own.
    h = Linear(wgrad ? RunOnBackward(ln_out, wgrad) : ln_out, *layer.fc1_weight, nullptr,
               UserbufferColumnParallel(), Fp8LinearOptions::LayerNormLinear());
  }
  if (layer.fc1_bias != nullptr) h = AddBias(h, *layer.fc1_bias);  // fused bias-activation
  h = Activation(model_, training_.OneKernelActivation(), h);
  ModuleScope s("linear_fc2");
  ChargeTeModuleCalls(training_);
  return RowParallelLinear(h, *layer.fc2_weight, /*save_original_input=*/false,
                           layer.fc2_post_norm_weight, layer.fc2_post_norm_bias);
}

at::Tensor TransformerModel::ChunkedMlp(Layer& layer, const at::Tensor& residual,
                                        CheckpointWithoutOutput* norm_checkpoint) {
  // _forward_mlp: pre_mlp_layernorm_output.chunk(n) (Transformer Engine's is the residual
  // itself, its norm being each chunk's linear_fc1), then one MLP call a chunk; the chunks'
  // outputs stay in its `outputs` list until torch.cat has joined them.
  const bool norm_in_fc1 = training_.profile == ProfileKind::kTransformerEngine;
  const std::vector<at::Tensor> pieces =
      (norm_in_fc1 ? residual : PreMlpNorm(layer, residual, norm_checkpoint))
          .chunk(std::min(training_.mlp_chunks_for_training, residual.size(0)), 0);
  std::vector<at::Tensor> outputs;
  for (const at::Tensor& piece : pieces) {
    outputs.push_back(Mlp(layer, norm_in_fc1 ? PreMlpNorm(layer, piece, nullptr) : piece));
  }
  return at::cat(outputs, 0);
}

at::Tensor TransformerModel::RecomputableNorm(const at::Tensor& x, Parameter* weight,
                                              Parameter* bias,
                                              CheckpointWithoutOutput* checkpoint) {
  if (checkpoint == nullptr) return Norm(x, weight, bias);
  return checkpoint->Run(
      [this, weight, bias](const std::vector<at::Tensor>& in) {
        return std::vector<at::Tensor>{Norm(in[0], weight, bias)};
      },
      {x})[0];
}

at::Tensor TransformerModel::PreMlpNorm(Layer& layer, const at::Tensor& x,
                                        CheckpointWithoutOutput* checkpoint) {
  ModuleScope s("pre_mlp_layernorm");
  // Transformer Engine's spec fuses it into linear_fc1 but in MoE layers.
  if (layer.moe) ChargeTeModuleCalls(training_);
  return RecomputableNorm(x, layer.mlp_norm_weight, layer.mlp_norm_bias, checkpoint);
}

at::Tensor TransformerModel::LayerForward(Layer& layer, const at::Tensor& hidden) {
  // Note [Recompute modules]: with Transformer Engine a norm is its own module only where
  // no linear fuses it (MLA's down projections, the MoE router and experts).
  const bool local = training_.profile == ProfileKind::kMegatronLocal;
  const bool recompute_norms = training_.Recomputes(RecomputeModule::kLayerNorm);
  std::optional<CheckpointWithoutOutput> input_norm_checkpoint, mlp_norm_checkpoint;
  if (recompute_norms && (local || model_.multi_latent_attention())) {
    input_norm_checkpoint.emplace();
  }
  if (recompute_norms && (local || layer.moe) &&
      PreMlpNormRecomputable(model_, training_, layer.moe)) {
    mlp_norm_checkpoint.emplace();
  }
  CheckpointWithoutOutput* mlp_norm = mlp_norm_checkpoint ? &*mlp_norm_checkpoint : nullptr;

  // Offloading's attn_norm and mlp_norm regions (transformer_layer.py) exist where the norm
  // is a module of its own: under Transformer Engine, multi-latent attention's input norm
  // and an MoE layer's pre-MLP norm. Each saves its input, released at its commit after the
  // bias-dropout-add.
  // CUDA graphs' attn module: the input norm, self-attention and bias-dropout-add.
  std::optional<GraphedScope> attn_graph;
  attn_graph.emplace(training_.Graphs(CudaGraphModule::kAttn));
  // The delayed weight gradients of the layer's attention and shared experts run once the
  // layer's backward is done (Note [Delayed weight gradients] in delayed_wgrad.h); the MLP's and
  // the routed experts' have stores of their own.
  const c10::intrusive_ptr<WeightGradStore> wgrad = NewWgradStore(training_.delay_wgrad_compute);
  DelayedWgradScope delay(wgrad);
  at::Tensor x = wgrad ? RunOnBackward(hidden, wgrad) : hidden;
  // _run_input_layernorm's residual.float(): a copy only where a 16-bit input meets the fp32
  // stream (a multi-token prediction layer's projected input); the pre-MLP one never copies.
  at::Tensor residual_in = training_.fp32_residual_connection ? x.to(at::kFloat) : x;
  OffloadRegion attn_norm_offload(model_.multi_latent_attention() ? offloader_.get() : nullptr,
                                  OffloadModule::kAttnNorm, &x);
  at::Tensor ln_out;
  {
    ModuleScope s("input_layernorm");
    // Transformer Engine's spec fuses it into linear_qkv but for multi-latent attention.
    if (model_.multi_latent_attention()) ChargeTeModuleCalls(training_);
    ln_out = RecomputableNorm(x, layer.input_norm_weight, layer.input_norm_bias,
                              input_norm_checkpoint ? &*input_norm_checkpoint : nullptr);
  }
  attn_norm_offload.EndSaving({ln_out});
  at::Tensor attention_out = Attention(layer, ln_out);
  ln_out.reset();
  if (input_norm_checkpoint)
    input_norm_checkpoint->DiscardOutputAndRegisterRecompute(attention_out);
  at::Tensor residual =
      BiasDropoutAdd(attention_out, layer.proj_bias, residual_in, hidden_dropout());
  attention_out.reset();
  residual_in.reset();
  attn_norm_offload.Commit(&residual, {{x}});
  x.reset();
  attn_graph.reset();
  // The mlp module: a dense layer's rest; moe_router: an MoE layer's pre-MLP norm (and, in
  // MoeForward, its router and shared experts).
  GraphedScope mlp_graph(!layer.moe && training_.Graphs(CudaGraphModule::kMlp));
  at::Tensor mlp_out;
  std::optional<OffloadRegion> mlp_norm_offload;  // the pre-MLP norm's, when it is a module
  if (!layer.moe && training_.Recomputes(RecomputeModule::kMlp)) {
    // Transformer Engine's dense MLP starts with the fused pre-MLP norm (linear_fc1 is a
    // LayerNormLinear), so its checkpoint starts at the residual.
    auto mlp = [this, &layer, local](const std::vector<at::Tensor>& in) {
      return Mlp(layer, local ? in[0] : PreMlpNorm(layer, in[0], nullptr));
    };
    mlp_out = Checkpoint(mlp, {local ? PreMlpNorm(layer, residual, mlp_norm) : residual});
  } else if (!layer.moe && training_.mlp_chunks_for_training > 1) {
    mlp_out = ChunkedMlp(layer, residual, mlp_norm);
  } else {
    mlp_norm_offload.emplace(layer.moe ? offloader_.get() : nullptr, OffloadModule::kMlpNorm,
                             &residual);
    {
      GraphedScope router_graph(layer.moe && training_.Graphs(CudaGraphModule::kMoeRouter));
      ln_out = PreMlpNorm(layer, residual, mlp_norm);
    }
    mlp_norm_offload->EndSaving({ln_out});
    mlp_out = Mlp(layer, ln_out);
    ln_out.reset();
  }
  if (mlp_norm_checkpoint) mlp_norm_checkpoint->DiscardOutputAndRegisterRecompute(mlp_out);
  at::Tensor out = BiasDropoutAdd(mlp_out, layer.fc2_bias, residual, hidden_dropout());
  if (mlp_norm_offload) mlp_norm_offload->Commit(&out, {{residual}});
  return out;
}

at::Tensor TransformerModel::Layers(int64_t chunk, const at::Tensor& input) {
  ModuleScope decoder("decoder");
  std::vector<Layer>& layers = chunks_[static_cast<size_t>(chunk)];
  const int64_t n = static_cast<int64_t>(layers.size());
  auto run_layers = [this, &layers](int64_t first, int64_t last, at::Tensor hidden) {
    for (int64_t i = first; i < last; ++i) {
      Layer& layer = layers[static_cast<size_t>(i)];
      ModuleScope s("layers." + std::to_string(layer.index));
      auto forward = [this, &layer](const at::Tensor& x) { return LayerForward(layer, x); };
      if (layer_offloader_) {  // the whole block on this stage (no pipeline)
        hidden = layer_offloader_->RunLayer(i, hidden, forward);
      } else {
        hidden =
            shard_.wrap_layer ? shard_.wrap_layer(layer.index, hidden, forward) : forward(hidden);
      }
    }
    return hidden;
  };
  // What runs as one: a layer, or a group Megatron's TransformerBlock._checkpointed_forward
  // checkpoints (uniform: every group of N layers; block: each of the first N layers).
  struct Unit {
    int64_t first, last;
    bool checkpointed;
  };
  std::vector<Unit> units;
  const int64_t group = training_.recompute_num_layers;
  for (int64_t i = 0; i < n;) {
    const bool full = training_.recompute == RecomputeKind::kFull;
    const bool uniform = training_.recompute_method == RecomputeMethod::kUniform;
    const int64_t last = full && uniform ? std::min(n, i + group) : i + 1;
    units.push_back({i, last, full && (uniform || i < group)});
    i = last;
  }
  const int64_t distribute_over = training_.distribute_saved_activations ? shard_.tp : 1;
  auto run_unit = [this, &units, run_layers, distribute_over](int64_t u, const at::Tensor& x) {
    const Unit unit = units[static_cast<size_t>(u)];
    if (!unit.checkpointed) return run_layers(unit.first, unit.last, x);
    return Checkpoint(
        [run_layers, unit](const std::vector<at::Tensor>& in) {
          return run_layers(unit.first, unit.last, in[0]);
        },
        WithBatchMask({x}), distribute_over);
  };
  const int64_t num_units = static_cast<int64_t>(units.size());
  at::Tensor hidden = input;
  if (!shard_.replicate_layers || shard_.wrap_layer) {
    for (int64_t u = 0; u < num_units; ++u) hidden = run_unit(u, hidden);
    return hidden;
  }
  const std::string decoder_path = ModuleScope::CurrentPath();
  UnitRunner runner;
  runner.run = run_unit;
  runner.module_paths = [&](int64_t u) {
    std::vector<std::string> paths;
    for (int64_t i = units[static_cast<size_t>(u)].first; i < units[static_cast<size_t>(u)].last;
         ++i) {
      paths.push_back(decoder_path + ".layers." +
                      std::to_string(layers[static_cast<size_t>(i)].index));
    }
    return paths;
  };
  runner.state = [&](int64_t u) {
    std::vector<at::Tensor*> slots;  // what the MoE dispatcher keeps
    for (int64_t i = units[static_cast<size_t>(u)].first; i < units[static_cast<size_t>(u)].last;
         ++i) {
      Layer& layer = layers[static_cast<size_t>(i)];
      if (layer.moe) {
        for (at::Tensor& kept : layer.experts.kept) slots.push_back(&kept);
      }
    }
    return slots;
  };
  // Units alike: as many layers, each of the same kind (dense, MoE; FP8 or not; with RoPE
  // or not), checkpointed alike.
  // A unit whose MoE layers are checkpointed (as a group, or by the moe recompute module)
  // is never replicated (Note [Layer replication]).
  auto kind = [&](int64_t u) {
    const Unit& unit = units[static_cast<size_t>(u)];
    std::vector<int64_t> key = {unit.last - unit.first, unit.checkpointed};
    bool moe = false;
    for (int64_t i = unit.first; i < unit.last; ++i) {
      const Layer& layer = layers[static_cast<size_t>(i)];
      moe = moe || layer.moe;
      key.push_back(layer.moe);
      key.push_back(layer.proj_weight->fp8.recipe != Fp8Recipe::kNone);
      key.push_back(layer.skips_rope);
    }
    if (moe && (unit.checkpointed || training_.Recomputes(RecomputeModule::kMoe))) {
      key.push_back(-1 - u);  // alike to no other unit
    }
    return key;
  };
  for (int64_t u = 0; u < num_units;) {
    int64_t end = u + 1;
    while (end < num_units && kind(end) == kind(u)) ++end;
    hidden = RunReplicatedUnits(u, end, hidden, runner);
    u = end;
  }
  return hidden;
}

at::Tensor TransformerModel::Embed(const at::Tensor& tokens, const at::Tensor& position_ids) {
  ModuleScope s("embedding");
  const int64_t tp = shard_.tp;
  // LanguageModelEmbedding.forward (Megatron-Core 0.20), its locals alive as Python keeps
  // them. Without a position table, under sequence parallelism, the word embeddings' tensor-
  // parallel sum is a reduce-scatter straight to this rank's [S/tp, B, H]
  // (reduce_scatter_embeddings); otherwise an all-reduce in place, then a scatter to
  // sequence parallelism that is a view of the whole [S, B, H].
  const bool reduce_scatter = shard_.sequence_parallel && tp > 1 && position_embeddings_ == nullptr;
  at::Tensor word;
  {
    ModuleScope w("word_embeddings");
    // VocabParallelEmbedding: with tp > 1 the indices outside this rank's vocabulary
    // shard are masked (a bool mask and a shifted int64 copy, which is what is saved).
    at::Tensor indices = tokens;
    at::Tensor outside;
    if (tp > 1) {
      outside = tokens.lt(0).logical_or_(tokens.ge(model_.padded_vocab_size / tp));
      indices = tokens.sub(0).masked_fill_(outside, 0);
    }
    at::Tensor output = Embedding(indices, *word_embeddings_);  // [B, S, H]
    if (tp > 1) output.masked_fill_(outside.unsqueeze(-1), 0.0);
    if (reduce_scatter) {
      output = output.transpose(0, 1).contiguous();  // [S, B, H]; [B, S, H] freed
      word = ReduceScatterToSequenceParallelRegion(output, tp, /*grad_into_userbuffer=*/false);
    } else {
      word = ReduceFromTensorParallelRegion(output, tp);
    }
  }
  // `word` and `position` stay alive until the embedding returns.
  at::Tensor position;
  at::Tensor embeddings = word;
  if (position_embeddings_ != nullptr) {
    ModuleScope p("position_embeddings");
    position = Embedding(position_ids, *position_embeddings_);
    embeddings = word + position;
  }
  if (!reduce_scatter) embeddings = embeddings.transpose(0, 1).contiguous();  // [S, B, H]
  if (model_.use_mup && model_.mup_embedding_mult != 1.0) {
    embeddings = embeddings * model_.mup_embedding_mult;
  }
  if (training_.fp32_residual_connection) embeddings = embeddings.to(at::kFloat);
  if (shard_.sequence_parallel) {
    if (!reduce_scatter) embeddings = ScatterToSequenceParallelRegion(embeddings, tp);
    // The scatter's view would keep the whole [S, B, H] alive as long as this rank's part
    // (the first layer saves it): Megatron clones it, unless told not to.
    if (training_.clone_scatter_output_in_embedding) embeddings = embeddings.clone();
  }
  embeddings = Dropout(embeddings, hidden_dropout());
  word.reset();
  position.reset();
  // EmbeddingScalingMixin: the whole embedding's output times a 0-dim host tensor (no
  // device memory; its backward saves only that factor).
  if (model_.scale_embeddings) {
    embeddings = embeddings * std::sqrt(static_cast<double>(model_.hidden_size));
  }
  return embeddings;
}

namespace {

// roll_tensor without context parallelism: torch.roll (a copy) with the last position
// zeroed, and its sum (a new scalar).
std::pair<at::Tensor, at::Tensor> RollLeft(const at::Tensor& t) {
  at::Tensor rolled = at::roll(t, {-1}, {-1});
  rolled.select(-1, -1).fill_(0);
  at::Tensor sum = rolled.sum();
  return {rolled, sum};
}

// _compute_mtp_acceptance_counts (no graph): the predicted token of every position,
// through _vocab_parallel_argmax when the logits are sharded over tp, compared with the
// labels where the mask is set. Returns nothing: only its temporaries take memory.
void MtpAcceptanceCounts(const at::Tensor& logits, const at::Tensor& labels,
                         const at::Tensor& loss_mask, int64_t tp) {
  at::Tensor predictions;
  if (tp > 1) {
    auto [local_max, local_argmax] = logits.max(-1);  // [S, B]
    std::vector<at::Tensor> maxes, argmaxes;          // all_gather's outputs, one per rank
    for (int64_t r = 0; r < tp; ++r) maxes.push_back(at::empty_like(local_max));
    for (int64_t r = 0; r < tp; ++r) argmaxes.push_back(at::empty_like(local_argmax));
    const at::Tensor stacked_max = at::stack(maxes), stacked_argmax = at::stack(argmaxes);
    const at::Tensor winning_rank = stacked_max.argmax(0);
    const at::Tensor winning_argmax =
        stacked_argmax.gather(0, winning_rank.unsqueeze(0)).squeeze(0);
    predictions = winning_rank * logits.size(-1) + winning_argmax;
  } else {
    predictions = logits.argmax(-1);
  }
  const at::Tensor labels_match = labels.transpose(0, 1).contiguous();
  const at::Tensor mask_match = loss_mask.transpose(0, 1).contiguous();
  const at::Tensor valid = mask_match.to(at::kBool);
  (void)predictions.eq(labels_match).bitwise_and(valid).sum().to(at::kFloat);
  (void)valid.sum().to(at::kFloat);
}

// MultiTokenPredictionBlock.forward's hidden-state mixing before a depth (--mtp-hsm, cp = 1's
// roll), in _mix_hidden_state_history's order: the older states of `history` stacked,
// laid out [n*B, H, S] (a copy) and rolled one token left together; one state per token
// drawn among them and the newest (randint over the `owners` sequence shards' tokens, this
// shard's slice), the newest where the draw or the rolled state is empty (gather, where).
// gather keeps the rolled states for backward, gather and where their indices and mask.
// Leaves the rolled states' views and the newest in `history`; returns the mixed input.
// REQUIRES: history->size() >= 2.
at::Tensor MixHiddenStates(std::vector<at::Tensor>* history, int64_t owners) {
  const at::Tensor newest = history->back();
  const int64_t n = static_cast<int64_t>(history->size()) - 1;
  const int64_t S = newest.size(0), B = newest.size(1), H = newest.size(2);
  at::Tensor older;
  {
    const at::Tensor flattened =
        at::stack(at::TensorList(history->data(), static_cast<size_t>(n)), 0)
            .permute({0, 2, 3, 1})
            .reshape({n * B, H, S});
    const at::Tensor rolled = at::roll(flattened, {-1}, {-1});
    rolled.select(-1, -1).fill_(0);
    older = rolled.reshape({n, B, H, S}).permute({0, 3, 1, 2});  // [n, S, B, H], a view
  }
  // torch.randint's int64 output (on meta only its memory matters).
  const at::Tensor all_indices =
      at::empty({1, owners * S, B, 1}, newest.options().dtype(at::kLong));
  const at::Tensor indices = all_indices.narrow(1, 0, S);
  const at::Tensor selected_is_newest = indices.eq(n);
  const at::Tensor older_indices = indices.clamp_max(n - 1);
  const at::Tensor invalid_locations = older.eq(0).all(-1, /*keepdim=*/true);
  const at::Tensor use_newest =
      selected_is_newest.bitwise_or(at::gather(invalid_locations, 0, older_indices));
  const at::Tensor selected_older = at::gather(older, 0, older_indices.expand({-1, -1, -1, H}));
  at::Tensor mixed =
      at::where(use_newest.expand_as(selected_older), newest.unsqueeze(0), selected_older)
          .squeeze(0);
  std::vector<at::Tensor> rolled_history = older.unbind(0);
  rolled_history.push_back(newest);
  *history = std::move(rolled_history);
  return mixed;
}

}  // namespace

at::Tensor TransformerModel::MultiTokenPrediction(const at::Tensor& decoder_output,
                                                  at::Tensor tokens, at::Tensor position_ids) {
  ModuleScope scope("mtp");
  std::vector<at::Tensor> outputs = {decoder_output};
  const bool checkpointed = training_.recompute == RecomputeKind::kFull &&
                            training_.recompute_method == RecomputeMethod::kUniform;
  std::vector<at::Tensor> history;  // hidden_state_history, with --mtp-hsm
  const int64_t sequence_owners = (shard_.sequence_parallel ? shard_.tp : 1) * shard_.cp;
  for (int64_t j = 0; j < model_.mtp_num_layers; ++j) {
    // A repeated layer (mtp_use_repeated_layer) runs at every depth.
    const int64_t layer = model_.mtp_use_repeated_layer ? 0 : j;
    ModuleScope s("layers." + std::to_string(layer));
    tokens = RollLeft(tokens).first;
    position_ids = RollLeft(position_ids).first;
    at::Tensor decoder_input = Embed(tokens, position_ids);
    at::Tensor previous = outputs.back();
    if (model_.mtp_detach_heads) {
      // The embedding's graph goes with its output; the block's input becomes a leaf that
      // requires grad (_get_embeddings, for checkpointing), so its gradient lands in its .grad,
      // kept with the graph until the microbatch's backward ends.
      decoder_input = decoder_input.detach();
      if (j == 0) previous = previous.detach().requires_grad_(true);
    }
    if (model_.mtp_hsm) {
      if (j == 0) history.push_back(previous);
      if (history.size() > 1) previous = MixHiddenStates(&history, sequence_owners);
    }
    MtpLayer& mtp = mtp_layers_[static_cast<size_t>(layer)];
    auto depth = [this, &mtp](const std::vector<at::Tensor>& in) {
      return MtpDepth(mtp, in[0], in[1]);
    };
    outputs.push_back(checkpointed ? Checkpoint(depth, {previous, decoder_input})
                                   : depth({previous, decoder_input}));
    if (model_.mtp_hsm) history.push_back(outputs.back());
  }
  return at::cat(outputs, 0);
}

at::Tensor TransformerModel::MtpDepth(MtpLayer& mtp, const at::Tensor& hidden,
                                      const at::Tensor& decoder_input) {
  const int64_t tp = shard_.tp;
  at::Tensor x;
  {
    at::Tensor embedded, previous;
    {
      ModuleScope s("enorm");
      ChargeTeModuleCalls(training_);
      embedded = Norm(decoder_input, mtp.enorm_weight, mtp.enorm_bias);
    }
    {
      ModuleScope s("hnorm");
      ChargeTeModuleCalls(training_);
      previous = Norm(hidden, mtp.hnorm_weight, mtp.hnorm_bias);
    }
    x = at::cat({embedded, previous}, -1);  // [S', B, 2H]
  }
  {
    ModuleScope s("eh_proj");
    ChargeTeModuleCalls(training_);
    x = Linear(x, *mtp.eh_proj_weight, nullptr, ColumnParallel());  // [S, B, H/tp]
  }
  x = GatherFromTensorParallelRegion(x, tp);  // [S, B, H]
  if (shard_.sequence_parallel) x = ScatterToSequenceParallelRegion(x, tp);
  {
    ModuleScope s("mtp_model_layer");
    auto forward = [this, &mtp](const at::Tensor& in) { return LayerForward(mtp.layer, in); };
    x = shard_.wrap_layer ? shard_.wrap_layer(mtp.unit, x, forward) : forward(x);
  }
  ModuleScope s("final_layernorm");
  ChargeTeModuleCalls(training_);
  return Norm(x, mtp.final_norm_weight, mtp.final_norm_bias);
}

at::Tensor TransformerModel::MtpLosses(const at::Tensor& hidden, const at::Tensor& labels,
                                       const at::Tensor& loss_mask) {
  const int64_t k = model_.mtp_num_layers;
  std::vector<at::Tensor> slices = hidden.chunk(1 + k, 0);
  at::Tensor main = slices[0];
  ModuleScope scope("mtp_loss");
  // process_mtp_loss's locals live until it returns or reassigns them, the logits of one
  // depth until the next depth's output layer has run.
  at::Tensor mtp_labels = labels.clone();
  at::Tensor mask = loss_mask;
  const at::Tensor original_num_tokens = loss_mask.sum();  // for per-token losses
  at::Tensor logits, num_tokens, loss, safe_num_tokens;
  for (int64_t j = 0; j < k; ++j) {
    // The previous depth's logits go as the output layer returns, before MuP's scaling.
    logits = OutputLogits(slices[static_cast<size_t>(1 + j)],
                          /*frozen_weight=*/model_.mtp_detach_heads);
    logits = ScaleLogits(std::move(logits));
    mtp_labels = RollLeft(mtp_labels).first;
    std::tie(mask, num_tokens) = RollLeft(mask);
    {
      ModuleScope s("output_layer");
      loss = CrossEntropy(logits, mtp_labels.transpose(0, 1).contiguous())
                 .transpose(0, 1)
                 .contiguous();  // [B, S]
    }
    loss = mask * loss;
    {
      // The logged loss and acceptance counts, with no graph.
      at::NoGradGuard no_grad;
      (void)(at::sum(loss) * num_tokens.gt(0).to(loss.scalar_type()) / num_tokens.clamp_min(1));
      MtpAcceptanceCounts(logits, mtp_labels, mask, shard_.tp);
    }
    safe_num_tokens = num_tokens.clamp_min(1);
    // Scaled by --mtp-loss-scaling-factor / k, whose value changes no memory.
    main = AttachLoss(main, loss * (0.1 / static_cast<double>(k)) / safe_num_tokens);
  }
  return main;
}

at::Tensor TransformerModel::CrossEntropy(const at::Tensor& logits, const at::Tensor& labels) {
  return training_.te_cross_entropy
             ? TeParallelCrossEntropy(logits, labels, shard_.tp)
             : VocabCrossEntropy(logits, labels, shard_.tp, training_.cross_entropy_fusion);
}

at::Tensor TransformerModel::OutputLogits(const at::Tensor& hidden, bool frozen_weight) {
  ModuleScope s("output_layer");
  LinearParallelism parallelism = MegatronColumnParallel();
  parallelism.deferred = deferred_wgrad_;
  if (training_.output_logit_dtype.has_value()) {
    parallelism.output_dtype = ScalarTypeOf(*training_.output_logit_dtype);
  }
  auto run = [&](const at::Tensor& x) {
    at::Tensor logits =  // [S, B, V/tp]
        frozen_weight ? FrozenLinear(x, *output_weight_, parallelism)
                      : Linear(x, *output_weight_, nullptr, parallelism);
    if (const double cap = model_.final_logit_softcap; cap > 0) {
      // Gemma2OutputLayer's logit_softcapping, cap * tanh(logits / cap), statement by
      // statement as Python frees: logits / cap goes once tanh has run; tanh keeps its output
      // for backward; the raw logits go when the layer returns.
      const at::Tensor capped = at::tanh(logits / cap);
      logits = capped * cap;
    }
    return logits;
  };
  return shard_.wrap_layer ? shard_.wrap_layer(ModelShard::kOutputLayerUnit, hidden, run)
                           : run(hidden);
}

at::Tensor TransformerModel::ScaleLogits(at::Tensor logits) const {
  if (!model_.use_mup || model_.mup_output_mult == 1.0) return logits;
  return logits * model_.mup_output_mult;  // the raw logits go with the argument
}

at::Tensor TransformerModel::Loss(const at::Tensor& hidden, const at::Tensor& labels,
                                  const at::Tensor& loss_mask) {
  at::Tensor loss;
  {
    at::Tensor logits = ScaleLogits(OutputLogits(hidden));
    ModuleScope s("output_layer");
    loss = CrossEntropy(logits, labels.transpose(0, 1).contiguous());  // [S, B]
  }
  // loss_func: masked mean over tokens.
  ModuleScope s("loss");
  const at::Tensor losses = loss.transpose(0, 1).contiguous().view({-1});
  const at::Tensor mask = loss_mask.view({-1});
  return at::sum(losses * mask) / mask.sum();
}

void TransformerModel::FinishDeferredWgrad() {
  if (deferred_wgrad_ == nullptr) return;
  ModuleScope s("output_layer");
  DrainDeferredWgrad(*deferred_wgrad_, *output_weight_, MegatronColumnParallel());
}

TransformerModel::Batch TransformerModel::GetBatch(bool inputs, bool targets) const {
  const int64_t S = training_.seq_length, B = training_.micro_batch_size, cp = shard_.cp;
  const auto meta = at::TensorOptions().device(at::kMeta);
  Batch batch;
  at::Tensor* const tokens = &batch.tokens;
  at::Tensor* const labels = &batch.labels;
  at::Tensor* const loss_mask = &batch.loss_mask;
  at::Tensor* const positions = &batch.position_ids;
  at::Tensor* const mask = &batch.attention_mask;
  const bool with_mask = training_.create_attention_mask && !model_.megatron_bridge;
  // Tensor-parallel rank 0 copies the data loader's batch to the GPU key by key (BATCH_KEYS,
  // alphabetical) and slices it in GPTDataset's key order; the other ranks receive
  // broadcasts into tensors made in get_batch_on_this_tp_rank's order. With tp > 1 memsim's
  // rank is one of the others (the last rank, which Megatron-LM logs, is).
  const bool loader = shard_.tp == 1;
  const std::vector<at::Tensor*> made =
      loader ? std::vector<at::Tensor*>{mask, labels, loss_mask, positions, tokens}
             : std::vector<at::Tensor*>{tokens, labels, loss_mask, positions, mask};
  for (at::Tensor* t : made) {
    if (t == mask) {
      if (with_mask) *t = at::empty({B, 1, S, S}, meta.dtype(at::kBool));
    } else {
      *t = at::empty({B, S}, meta.dtype(t == loss_mask ? at::kFloat : at::kLong));
    }
  }
  if (!targets) {
    labels->reset();
    loss_mask->reset();
  }
  if (!inputs) {
    tokens->reset();
    positions->reset();
  }
  if (cp == 1) return batch;
  // _get_batch_on_this_cp_rank_per_sequence_balancing: each tensor's sequence dimension in
  // 2cp chunks, this rank's two picked by index_select through a new int64[2] index.
  const std::vector<at::Tensor*> sliced =
      loader ? std::vector<at::Tensor*>{tokens, labels, mask, loss_mask, positions}
             : std::vector<at::Tensor*>{tokens, labels, loss_mask, positions, mask};
  for (at::Tensor* t : sliced) {
    if (!t->defined()) continue;
    const int64_t dim = t == mask ? 2 : 1;
    std::vector<int64_t> chunks = t->sizes().vec();
    chunks[static_cast<size_t>(dim)] = 2 * cp;
    chunks.insert(chunks.begin() + dim + 1, S / (2 * cp));
    std::vector<int64_t> mine = t->sizes().vec();
    mine[static_cast<size_t>(dim)] = S / cp;
    const at::Tensor index = at::zeros({2}, meta.dtype(at::kLong));
    *t = t->view(chunks).index_select(dim, index).view(mine);
  }
  return batch;
}

at::Tensor TransformerModel::ForwardChunk(int64_t chunk, const at::Tensor& input) {
  const bool embed = ChunkHasEmbedding(chunk), loss = ChunkHasLoss(chunk);
  const bool mtp = loss && !mtp_layers_.empty();
  Batch batch;
  if (embed || loss) {
    ModuleScope s("batch");  // get_batch: this microbatch's data on the GPU
    batch = GetBatch(/*inputs=*/embed || mtp, /*targets=*/loss);
    // The data-reading rank's copies stay in the iterator's dict (keeps_microbatch_batches).
    if (training_.keeps_microbatch_batches && shard_.tp == 1) {
      for (const at::Tensor* t : {&batch.tokens, &batch.labels, &batch.loss_mask,
                                  &batch.position_ids, &batch.attention_mask}) {
        if (t->defined()) kept_batches_.push_back(*t);
      }
    }
  }
  at::Tensor hidden = embed ? Embed(batch.tokens, batch.position_ids) : input;
  batch_mask_rows_ = batch.attention_mask.defined() ? batch.attention_mask.size(0) : 0;
  if (model_.position == PositionKind::kRope && !model_.multi_latent_attention()) {
    rotary_freqs_ = RotaryFrequencies(chunk);
  }
  batch_attention_mask_ = batch.attention_mask;
  hidden = Layers(chunk, hidden);
  batch_attention_mask_.reset();
  if (!loss) return hidden;
  if (shard_.before_final_norm) shard_.before_final_norm();
  {
    ModuleScope decoder("decoder");
    ModuleScope s("final_layernorm");
    ChargeTeModuleCalls(training_);
    hidden = Norm(hidden, final_norm_weight_, final_norm_bias_);
  }
  if (mtp) {
    hidden = MtpLosses(MultiTokenPrediction(hidden, batch.tokens, batch.position_ids), batch.labels,
                       batch.loss_mask);
  }
  return Loss(hidden, batch.labels, batch.loss_mask);
}

int64_t ParameterCount(const ModelConfig& model, const TrainingConfig& training,
                       const ModelShard& shard) {
  Session session;
  ActiveSession active(session, /*attribute_ops=*/false);
  ParameterStore store(training.precision);
  TransformerModel transformer(model, training, shard, &store);
  return store.num_elements();
}

}  // namespace memsim
