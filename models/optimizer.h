// The optimizer's memory as Megatron-LM's mixed-precision optimizer has it
// (megatron/core/optimizer/optimizer.py Float16OptimizerWithFloat16Params, FP32Optimizer)
// over a fused Adam (apex/TE FusedAdam) or SGD with momentum.
//
//   setup:       fp32 master copy of every 16-bit parameter (param.detach().clone().float())
//   zero_grad:   fp16 only: frees the fp32 master gradients (set_to_none)
//   step:        fp16: master grad = main_grad.float() (new fp32 tensor per parameter);
//                bf16/fp32: the master grad is main_grad itself (fp32 already);
//                first step only: Adam's exp_avg and exp_avg_sq (fp32, zeros_like master),
//                SGD's momentum buffer; one fused multi-tensor update in place; 16-bit
//                parameters copied back from the masters in place.
//
// With Megatron's distributed optimizer (ZeRO-1) the masters, master gradients and Adam
// state cover only this data-parallel rank's 1/dp of every parameter: 6 + 12/dp bytes
// per parameter for bf16, 4 + 16/dp for fp16, 8 + 8/dp for fp32. (Megatron shards one
// contiguous range of the gradient buffer per rank; memsim gives each parameter a
// ceil(numel/dp) shard instead: the same bytes, split over more, smaller tensors.)
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "models/model_config.h"
#include "models/parameters.h"

namespace memsim {

class MixedPrecisionOptimizer {
 public:
  // Allocates the master parameters (in the setup phase, as optimizer construction does).
  // `shards`: the data-parallel size with a distributed optimizer, else 1;
  // `expert_shards` the same for routed experts' parameters (expert data parallelism).
  MixedPrecisionOptimizer(ParameterStore* store, OptimizerKind kind, int64_t shards = 1,
                          int64_t expert_shards = 1);
  MixedPrecisionOptimizer(const MixedPrecisionOptimizer&) = delete;
  MixedPrecisionOptimizer& operator=(const MixedPrecisionOptimizer&) = delete;

  void ZeroGrad();
  void Step();

 private:
  ParameterStore* store_;
  OptimizerKind kind_;
  int64_t shards_;
  int64_t expert_shards_;
  int64_t step_ = 0;
  std::vector<at::Tensor> masters_;       // fp32; the parameters themselves for fp32
  std::vector<at::Tensor> master_grads_;  // fp16 training: owned copies; else main_grad
  std::vector<at::Tensor> exp_avgs_;      // Adam m (or SGD momentum)
  std::vector<at::Tensor> exp_avg_sqs_;   // Adam v
};

}  // namespace memsim
