// One rank's training iterations, as Megatron-LM's train_step runs them without
// pipeline parallelism: zero the gradient buffer and the optimizer's master gradients,
// run forward and backward for every microbatch (gradients accumulate in main_grad),
// then the optimizer step.
#pragma once

#include "models/model_config.h"
#include "simulator/session.h"
#include "simulator/status.h"

namespace memsim {

// Records setup and `training.iterations` iterations into `session`, which must be
// active on this thread. A UserError from the engine (a missing kernel) propagates.
// REQUIRES: `model` passed FinalizeModelConfig and `training` ValidateTrainingConfig.
void RunTraining(const ModelConfig& model, const TrainingConfig& training, Session& session);

}  // namespace memsim
