// Fused optimizer steps as custom ops (namespace memsim), with the memory profile of the
// multi-tensor CUDA kernels real training uses (apex/Transformer Engine multi_tensor_adam,
// torch.optim.Adam(fused=True)): every state update happens in place and no per-parameter
// temporary is allocated. (torch::optim::AdamW updates one parameter at a time with
// temporaries, which no GPU run does.)
//
//   memsim::fused_adam_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs,
//                       Tensor(c!)[] exp_avg_sqs, float lr, float beta1, float beta2,
//                       float eps, float weight_decay, int step, bool adamw) -> ()
//   memsim::fused_sgd_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers,
//                      float lr, float momentum, float weight_decay) -> ()
//
// Meta kernels do nothing (in place, no allocation); CPU kernels compute the real update
// element by element, also without allocating, so a CPU run checks the meta profile.
#pragma once

#include <ATen/core/Tensor.h>

namespace memsim {

void RegisterFusedOptimizers();

struct AdamHyperparameters {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool adamw = true;  // decoupled weight decay
};

// Calls memsim::fused_adam_ through the dispatcher (so the interceptor sees it).
void FusedAdamStep(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                   at::TensorList exp_avg_sqs, const AdamHyperparameters& hp, int64_t step);
void FusedSgdStep(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                  double lr, double momentum, double weight_decay);

}  // namespace memsim
