// Parameters as Megatron-LM's mixed-precision training holds them.
//
// Note [Mixed precision state]
// Every parameter is created in the training dtype (fp32, bf16 or fp16) and used by
// forward and backward in it. Its gradient never lives in param.grad: the layers'
// backward (layers.cc) accumulates weight gradients into `main_grad`, a view into a
// contiguous gradient buffer (Megatron's DDP ParamAndGradBuffer: one, or under the
// distributed optimizer one per model chunk and kind, Note [Distributed optimizer buffers]
// in parallel/ddp_buffers.h), fp32 for fp32 and bf16
// training (accumulate_allreduce_grads_in_fp32) and fp16 for fp16 training, or bf16 for
// bf16 training with --grad-reduce-in-bf16. The weight gradient reaches main_grad one of
// two ways (Note [Weight gradients]). The optimizer (optimizer.h) adds fp32 master copies
// for 16-bit parameters, and fp32 master gradients for 16-bit gradients (made in the step,
// kept until the next iteration's zero_grad). Bytes per parameter, non-distributed:
//   fp32: 4 param + 4 grad + 8 Adam                          = 16
//   bf16: 2 param + 4 grad + 4 master + 8 Adam               = 18
//   fp16, or bf16 with bf16 gradients:
//         2 param + 2 grad + 4 master + 4 master grad + 8 Adam = 20
//
// Note [Weight gradients]
// Megatron-LM's linear layers (Transformer Engine's, and its own ColumnParallelLinear /
// RowParallelLinear with TE installed) put dW into main_grad in one of two ways:
//   * gradient accumulation fusion (the default): the wgrad GEMM accumulates into
//     main_grad in place. Autograd still needs a weight gradient so that the DDP hook
//     runs on the main thread, and Megatron returns TE's cached dummy
//     (get_dummy_wgrad, transformer_engine/pytorch/module/base.py, TE 2.18): one
//     torch.empty per distinct (shape, dtype), kept for the whole run;
//   * --no-gradient-accumulation-fusion: dW is a new tensor in the parameter dtype; the
//     DDP hook (_make_backward_post_hook) adds it into main_grad and drops it.
#pragma once

#include <ATen/core/Tensor.h>

#include <deque>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "models/model_config.h"

namespace memsim {

class ParameterStore;

// The tensor dtype of a precision (fp32, bf16, fp16).
at::ScalarType ScalarTypeOf(Precision precision);

// The elements of one rank's shard when a `numel`-element parameter is split `shards` ways:
// ceil(numel / shards) (memsim shards each parameter alone; optimizer.h).
inline int64_t ShardElements(int64_t numel, int64_t shards) {
  return (numel + shards - 1) / shards;
}

// What a Transformer Engine module running in FP8 keeps for its weight (Note [FP8
// training] in fp8.h).
struct Fp8Module {
  Fp8Recipe recipe = Fp8Recipe::kNone;
  bool fp8_param = false;  // --fp8-param-gather: the parameter itself is FP8
  int64_t amax_history_len = 1;
  // TrainingConfig::fp8_gemm_any_layout: a per-tensor recipe keeps no transposes.
  bool any_layout_gemm = false;
  // The FP8 weight (data, transpose, scales: TE's cached copy, or the FP8 parameter, whose
  // 16-bit `data` then has no storage), made with the parameter; the delayed recipe's
  // scales and amax histories.
  std::vector<at::Tensor> weight;
  std::vector<at::Tensor> scaling_state;
};

// A contiguous piece of a flattened parameter: elements [offset, offset + elements).
struct ParameterSlice {
  int64_t offset = 0;
  int64_t elements = 0;  // 0: none of it
};

struct Parameter {
  std::string name;      // full module path + name, e.g. "decoder.layers.0.mlp.fc1.weight"
  at::Tensor data;       // training dtype, requires_grad (so autograd reaches the layers)
  at::Tensor main_grad;  // view into ParameterStore's gradient buffer; see the Note
  bool expert = false;   // a routed expert's weight: sharded over expert data parallelism
  // The word embedding or the output layer (Megatron's is_embedding_or_output_parameter):
  // Muon leaves them to its scalar optimizer (Note [Muon] in models/optimizer.h).
  bool embedding_or_output = false;
  int64_t unit = -1;  // the layer it belongs to (FSDP's wrapping unit); -1: root
  // ZeRO-2/FSDP: this rank's fp32 gradient shard, which the optimizer reads instead of
  // main_grad (parallel/sharded_data_parallel.h).
  at::Tensor shard_grad;
  // FSDP: this rank's persistent 1/dp of the parameter; `data` has storage only while
  // the layer is gathered.
  at::Tensor shard_data;
  ParameterStore* store = nullptr;  // the store that made it (outlives it)
  // Set when the weight's Transformer Engine module runs its GEMMs in FP8.
  Fp8Module fp8;
  // Megatron's partition_dim, which tensor-parallel linears carry whatever the TP size: the
  // dimension their weight is split along (0: column-parallel, 1: row-parallel) over the
  // tensor-parallel group (routed experts: the expert tensor-parallel one); -1: none (the
  // router, duplicated linears, norms, embeddings). Muon gathers such weights whole (Note
  // [Muon] in models/optimizer.h).
  int64_t tp_partition_dim = -1;
  // Routed experts' weights: memsim's one tensor holds this many local experts' matrices,
  // stacked along tp_partition_dim, where Megatron has a parameter per expert.
  int64_t stacked_experts = 1;
  int64_t chunk = 0;  // the model chunk (virtual pipeline stage) it belongs to
  // Under Megatron's distributed optimizer, the part of it this rank's optimizer updates,
  // as the gradient buffer's bucket ranges cut it (Note [Distributed optimizer buffers]
  // in parallel/ddp_buffers.h); unset: ceil(numel / shards) from its front.
  std::optional<ParameterSlice> optimizer_slice;
  // Megatron's shared_embedding: with PP > 1 and tied embeddings or multi-token prediction,
  // the first stage's word embedding and the last stage's copy sit alone in a DDP bucket.
  bool shared_embedding = false;
  // Megatron's `shared`: the later stage's copy of a shared embedding (set with
  // shared_embedding there), which gradient statistics skip (Note [Counting zeros in
  // gradients] in models/optimizer.h).
  bool shared = false;
};

class ParameterStore {
 public:
  // `gradient_accumulation_fusion`: how weight gradients reach main_grad (Note [Weight
  // gradients]); `grad_reduce_in_bf16`: bf16 training keeps bf16 gradients.
  explicit ParameterStore(Precision precision, bool gradient_accumulation_fusion = true,
                          bool grad_reduce_in_bf16 = false)
      : precision_(precision),
        gradient_accumulation_fusion_(gradient_accumulation_fusion),
        grad_reduce_in_bf16_(grad_reduce_in_bf16) {}
  ParameterStore(const ParameterStore&) = delete;
  ParameterStore& operator=(const ParameterStore&) = delete;

  // Creates a parameter on meta, recorded as a parameter of the current module.
  // The returned pointer stays valid for the store's lifetime.
  Parameter* Add(const std::string& name, std::vector<int64_t> shape, bool expert = false);
  // Parameters added from now on belong to layer `unit` (-1: outside every layer).
  void set_unit(int64_t unit) { unit_ = unit; }
  // Parameters added from now on belong to model chunk `chunk`.
  void set_chunk(int64_t chunk) { chunk_ = chunk; }
  // Parameters added from now on are not materialized (--init-model-with-meta-device under
  // Megatron-FSDP): their storages hold no memory until Megatron-FSDP lays them over its
  // buckets (Note [Megatron-FSDP] in parallel/megatron_fsdp.h).
  void set_unmaterialized(bool unmaterialized) { unmaterialized_ = unmaterialized; }
  // Allocates the contiguous gradient buffer and points every main_grad into it (every
  // parameter's, or with `root_only` those outside the layers: FSDP shards the rest).
  // REQUIRES: called once, after every Add.
  void AllocateGradBuffer(bool root_only = false);

  const std::deque<Parameter>& parameters() const { return parameters_; }
  std::deque<Parameter>& parameters() { return parameters_; }
  int64_t num_elements() const { return num_elements_; }
  Precision precision() const { return precision_; }
  at::ScalarType param_dtype() const;
  at::ScalarType grad_dtype() const;
  // The contiguous gradient buffers every main_grad is a view into (one, or Megatron's
  // DDP buffers: AdoptBuffers).
  const std::vector<at::Tensor>& grad_buffers() const { return grad_buffers_; }
  // Takes buffers made outside the store (parallel/ddp_buffers.h) that the parameters'
  // data and main_grad are now views into, and keeps them alive.
  // REQUIRES: no gradient buffer allocated yet.
  void AdoptBuffers(std::vector<at::Tensor> param_buffers, std::vector<at::Tensor> grad_buffers);
  bool gradient_accumulation_fusion() const { return gradient_accumulation_fusion_; }
  // TE's cached dummy weight gradient of `shape` in the parameter dtype, made on first use.
  const at::Tensor& DummyWgrad(at::IntArrayRef shape);

 private:
  Precision precision_;
  bool gradient_accumulation_fusion_;
  bool unmaterialized_ = false;
  bool grad_reduce_in_bf16_;
  std::map<std::vector<int64_t>, at::Tensor> dummy_wgrads_;
  std::deque<Parameter> parameters_;  // deque: pointers stay valid
  int64_t num_elements_ = 0;
  int64_t unit_ = -1;
  int64_t chunk_ = 0;
  std::vector<at::Tensor> param_buffers_;
  std::vector<at::Tensor> grad_buffers_;
};

}  // namespace memsim
