#include "models/training.h"

#include <ATen/ATen.h>

#include "models/optimizer.h"
#include "models/parameters.h"
#include "models/transformer.h"

namespace memsim {

void RunTraining(const ModelConfig& model_config, const TrainingConfig& training,
                 Session& session) {
  session.SetPhase(Phase::kSetup);
  ParameterStore store(training.precision);
  TransformerModel model(model_config, training, &store);
  store.AllocateGradBuffer();
  MixedPrecisionOptimizer optimizer(&store, training.optimizer);

  for (int32_t it = 0; it < training.iterations; ++it) {
    {
      at::NoGradGuard no_grad;
      store.grad_buffer().zero_();  // model.zero_grad_buffer()
    }
    optimizer.ZeroGrad();
    session.BeginIteration(it);
    for (int64_t mb = 0; mb < training.num_microbatches; ++mb) {
      session.SetMicrobatch(static_cast<int32_t>(mb));
      session.SetPhase(Phase::kForward);
      at::Tensor loss = model.Forward();
      session.SetPhase(Phase::kBackward);
      loss.backward();
    }
    session.SetPhase(Phase::kOptimizer);
    optimizer.Step();
    session.EndIteration();
  }
}

}  // namespace memsim
