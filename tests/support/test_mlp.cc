#include "tests/support/test_mlp.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "ops/fused_optimizers.h"
#include "ops/ops.h"

namespace memsim {

at::Tensor RunTestMlpTraining(const TestMlpConfig& config, Session* session) {
  RegisterOps();
  const auto options = at::TensorOptions().device(config.device).dtype(at::kFloat);
  auto set_phase = [&](Phase phase) {
    if (session != nullptr) session->SetPhase(phase);
  };

  std::vector<at::Tensor> params;
  std::vector<at::Tensor> exp_avgs;
  std::vector<at::Tensor> exp_avg_sqs;
  {
    CategoryScope category(Category::kParameter);
    at::manual_seed(0);
    for (auto shape :
         std::vector<std::vector<int64_t>>{{config.hidden_features, config.input_features},
                                           {config.hidden_features},
                                           {config.classes, config.hidden_features},
                                           {config.classes}}) {
      params.push_back(at::randn(shape, options).requires_grad_());
    }
  }
  {
    CategoryScope category(Category::kOptimizerState);
    for (const at::Tensor& p : params) {
      exp_avgs.push_back(at::zeros_like(p));
      exp_avg_sqs.push_back(at::zeros_like(p));
    }
  }
  const at::Tensor x = at::randn({config.batch, config.input_features}, options);
  // Class i for sample i (no scalar ops: their wrapped numbers are CPU-only artifacts).
  const at::Tensor targets = at::arange(config.batch, options.dtype(at::kLong));

  at::Tensor loss;
  for (int32_t it = 0; it < config.iterations; ++it) {
    if (session != nullptr) session->BeginIteration(it);
    set_phase(Phase::kForward);
    {
      at::Tensor h;
      {
        ModuleScope scope("fc1");
        h = at::linear(x, params[0], params[1]);
      }
      {
        ModuleScope scope("act");
        h = at::tanh(h);
      }
      {
        ModuleScope scope("fc2");
        h = at::linear(h, params[2], params[3]);
      }
      ModuleScope scope("loss");
      loss = at::cross_entropy_loss(h, targets);
    }
    set_phase(Phase::kBackward);
    loss.backward();
    set_phase(Phase::kOptimizer);
    std::vector<at::Tensor> grads;
    for (const at::Tensor& p : params) {
      if (session != nullptr) session->Retag(p.grad(), Category::kGradient);
      grads.push_back(p.grad());
    }
    {
      at::NoGradGuard no_grad;
      FusedAdamStep(params, grads, exp_avgs, exp_avg_sqs, AdamHyperparameters{}, it + 1);
    }
    grads.clear();
    for (at::Tensor& p : params) p.mutable_grad().reset();  // zero_grad(set_to_none=True)
    loss = loss.detach();
    if (session != nullptr) session->EndIteration();
  }
  return loss;
}

}  // namespace memsim
