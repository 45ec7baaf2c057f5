// TestMlp (test support, not part of memsim): the smallest model that exercises the whole engine
// (forward, backward with saved tensors, an Adam step), on meta or on real CPU tensors. The model
// zoo proper is in transformer.h and moe.h; this one exists so the engine can be checked against a
// real execution.
//
// Dimensions: B batch, I input features, H hidden features, C classes.
//   fc1.weight (H, I)   fc1.bias (H)
//   fc2.weight (C, H)   fc2.bias (C)
// Forward: x (B, I) -> fc1 -> tanh -> fc2 -> cross-entropy against targets (B).
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "simulator/session.h"

namespace memsim {

// REQUIRES: batch <= classes.
struct TestMlpConfig {
  int64_t batch = 4;
  int64_t input_features = 16;
  int64_t hidden_features = 32;
  int64_t classes = 8;
  int32_t iterations = 2;
  at::Device device = at::kMeta;
};

// Runs `config.iterations` training iterations (forward, backward, fused Adam step,
// gradients set to None) with parameters and Adam state created in setup, recording
// into the thread's active session, if any. Returns the last loss (a real value on CPU).
at::Tensor RunTestMlpTraining(const TestMlpConfig& config, Session* session);

}  // namespace memsim
