// Tests build runs by hand and pass them through FinalizeRunSpec, as every front end does
// (Note [One validated spec] in parallel/run_spec.h).
#pragma once

#include <gtest/gtest.h>

#include <optional>
#include <stdexcept>

#include "parallel/run_spec.h"

namespace memsim::test {

// `spec` finalized. A test whose configuration breaks a rule fails with the rule's
// message (the exception ends the test; gtest reports it).
inline ValidatedRun Validated(const RunSpec& spec) {
  std::optional<ValidatedRun> run;
  const Status status = FinalizeRunSpec(spec, &run);
  if (!status.ok()) {
    ADD_FAILURE() << "FinalizeRunSpec: " << status.message();
    throw std::invalid_argument(status.message());
  }
  return *run;
}

// The run of `model`, `training` and `layout` (the whole model on one GPU by default),
// on no particular GPU.
inline ValidatedRun Validated(const ModelConfig& model, const TrainingConfig& training,
                              const ParallelLayout& layout = {}) {
  RunSpec spec;
  spec.model = model;
  spec.training = training;
  spec.layout = layout;
  return Validated(spec);
}

}  // namespace memsim::test
