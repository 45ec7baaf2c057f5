// Parameters as Megatron-LM's mixed-precision training holds them.
//
// Note [Mixed precision state]
// Every parameter is created in the training dtype (fp32, bf16 or fp16) and used by
// forward and backward in it. Its gradient never lives in param.grad: the layers'
// backward (layers.cc) accumulates weight gradients into `main_grad`, a view into one
// contiguous gradient buffer (Megatron's DDP ParamAndGradBuffer), fp32 for fp32 and bf16
// training (accumulate_allreduce_grads_in_fp32) and fp16 for fp16 training. The
// optimizer (optimizer.h) adds fp32 master copies for 16-bit parameters, and fp32
// master gradients for fp16. Bytes per parameter, non-distributed:
//   fp32: 4 param + 4 grad + 8 Adam                          = 16
//   bf16: 2 param + 4 grad + 4 master + 8 Adam               = 18
//   fp16: 2 param + 2 grad + 4 master + 4 master grad + 8 Adam = 20
#pragma once

#include <ATen/core/Tensor.h>

#include <deque>
#include <string>
#include <vector>

#include "models/model_config.h"

namespace memsim {

struct Parameter {
  std::string name;      // full module path + name, e.g. "decoder.layers.0.mlp.fc1.weight"
  at::Tensor data;       // training dtype, requires_grad (so autograd reaches the layers)
  at::Tensor main_grad;  // view into ParameterStore's gradient buffer; see the Note
  bool expert = false;   // a routed expert's weight: sharded over expert data parallelism
  int64_t unit = -1;     // the layer it belongs to (FSDP's wrapping unit); -1: root
  // ZeRO-2/FSDP: this rank's fp32 gradient shard, which the optimizer reads instead of
  // main_grad (parallel/sharded_data_parallel.h).
  at::Tensor shard_grad;
  // FSDP: this rank's persistent 1/dp of the parameter; `data` has storage only while
  // the layer is gathered.
  at::Tensor shard_data;
};

class ParameterStore {
 public:
  explicit ParameterStore(Precision precision) : precision_(precision) {}
  ParameterStore(const ParameterStore&) = delete;
  ParameterStore& operator=(const ParameterStore&) = delete;

  // Creates a parameter on meta, recorded as a parameter of the current module.
  // The returned pointer stays valid for the store's lifetime.
  Parameter* Add(const std::string& name, std::vector<int64_t> shape, bool expert = false);
  // Parameters added from now on belong to layer `unit` (-1: outside every layer).
  void set_unit(int64_t unit) { unit_ = unit; }
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
  const at::Tensor& grad_buffer() const { return grad_buffer_; }

 private:
  Precision precision_;
  std::deque<Parameter> parameters_;  // deque: pointers stay valid
  int64_t num_elements_ = 0;
  int64_t unit_ = -1;
  at::Tensor grad_buffer_;
};

}  // namespace memsim
