#include "ops/fused_optimizers.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cmath>
#include <mutex>

namespace memsim {
namespace {

void CheckSameLength(at::TensorList a, at::TensorList b, const char* what) {
  TORCH_CHECK(a.size() == b.size(), "memsim fused optimizer: ", what, " has ", b.size(),
              " tensors for ", a.size(), " parameters");
}

void FusedAdamMeta(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                   at::TensorList exp_avg_sqs, double, double, double, double, double, int64_t,
                   bool) {
  CheckSameLength(params, grads, "grads");
  CheckSameLength(params, exp_avgs, "exp_avgs");
  CheckSameLength(params, exp_avg_sqs, "exp_avg_sqs");
}

// Adam (Kingma & Ba) with bias correction; AdamW decays weights before the update.
void FusedAdamCpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                  at::TensorList exp_avg_sqs, double lr, double beta1, double beta2, double eps,
                  double weight_decay, int64_t step, bool adamw) {
  FusedAdamMeta(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step,
                adamw);
  const double bias1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bias2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK(params[i].scalar_type() == at::kFloat && params[i].is_contiguous(),
                "memsim fused_adam_ on CPU takes contiguous float32 tensors");
    float* p = params[i].data_ptr<float>();
    const float* g = grads[i].data_ptr<float>();
    float* m = exp_avgs[i].data_ptr<float>();
    float* v = exp_avg_sqs[i].data_ptr<float>();
    for (int64_t j = 0; j < params[i].numel(); ++j) {
      double grad = g[j];
      if (adamw) {
        p[j] = static_cast<float>(p[j] * (1.0 - lr * weight_decay));
      } else {
        grad += weight_decay * p[j];
      }
      m[j] = static_cast<float>(beta1 * m[j] + (1.0 - beta1) * grad);
      v[j] = static_cast<float>(beta2 * v[j] + (1.0 - beta2) * grad * grad);
      const double denom = std::sqrt(v[j] / bias2) + eps;
      p[j] = static_cast<float>(p[j] - lr * (m[j] / bias1) / denom);
    }
  }
}

void FusedSgdMeta(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                  double, double, double) {
  CheckSameLength(params, grads, "grads");
  CheckSameLength(params, momentum_buffers, "momentum_buffers");
}

void FusedSgdCpu(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                 double lr, double momentum, double weight_decay) {
  FusedSgdMeta(params, grads, momentum_buffers, lr, momentum, weight_decay);
  for (size_t i = 0; i < params.size(); ++i) {
    float* p = params[i].data_ptr<float>();
    const float* g = grads[i].data_ptr<float>();
    float* b = momentum_buffers[i].data_ptr<float>();
    for (int64_t j = 0; j < params[i].numel(); ++j) {
      const double grad = g[j] + weight_decay * p[j];
      b[j] = static_cast<float>(momentum * b[j] + grad);
      p[j] = static_cast<float>(p[j] - lr * b[j]);
    }
  }
}

}  // namespace

void RegisterFusedOptimizers() {
  static std::once_flag once;
  std::call_once(once, [] {
    static auto* def =
        new torch::Library(torch::Library::FRAGMENT, "memsim", c10::nullopt, __FILE__, __LINE__);
    def->def(
        "fused_adam_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
        "Tensor(c!)[] exp_avg_sqs, float lr, float beta1, float beta2, float eps, "
        "float weight_decay, int step, bool adamw) -> ()");
    def->def(
        "fused_sgd_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, "
        "float lr, float momentum, float weight_decay) -> ()");
    static auto* meta = new torch::Library(torch::Library::IMPL, "memsim", c10::DispatchKey::Meta,
                                           __FILE__, __LINE__);
    meta->impl("fused_adam_", TORCH_FN(FusedAdamMeta));
    meta->impl("fused_sgd_", TORCH_FN(FusedSgdMeta));
    static auto* cpu = new torch::Library(torch::Library::IMPL, "memsim", c10::DispatchKey::CPU,
                                          __FILE__, __LINE__);
    cpu->impl("fused_adam_", TORCH_FN(FusedAdamCpu));
    cpu->impl("fused_sgd_", TORCH_FN(FusedSgdCpu));
    // Optimizer steps run under no_grad: autograd has nothing to record for them.
    static auto* autograd = new torch::Library(torch::Library::IMPL, "memsim",
                                               c10::DispatchKey::Autograd, __FILE__, __LINE__);
    autograd->impl("fused_adam_", torch::CppFunction::makeFallthrough());
    autograd->impl("fused_sgd_", torch::CppFunction::makeFallthrough());
  });
}

void FusedAdamStep(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                   at::TensorList exp_avg_sqs, const AdamHyperparameters& hp, int64_t step) {
  RegisterFusedOptimizers();
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("memsim::fused_adam_", "")
          .typed<void(at::TensorList, at::TensorList, at::TensorList, at::TensorList, double,
                      double, double, double, double, int64_t, bool)>();
  op.call(params, grads, exp_avgs, exp_avg_sqs, hp.lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay,
          step, hp.adamw);
}

void FusedSgdStep(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                  double lr, double momentum, double weight_decay) {
  RegisterFusedOptimizers();
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("memsim::fused_sgd_", "")
          .typed<void(at::TensorList, at::TensorList, at::TensorList, double, double, double)>();
  op.call(params, grads, momentum_buffers, lr, momentum, weight_decay);
}

}  // namespace memsim
