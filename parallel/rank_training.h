// One rank's training iterations under a parallel layout, as Megatron-LM's train_step
// runs them: zero the gradient buffer and the optimizer's master gradients, run the
// pipeline schedule (receiving and sending activations and gradients between stages),
// then the optimizer step.
#pragma once

#include <cstdint>

#include "models/model_config.h"
#include "parallel/layout.h"
#include "parallel/run_spec.h"
#include "simulator/session.h"

namespace memsim {

// The model shard of pipeline rank `pp_rank` (layers of each virtual chunk, first/last).
struct ModelShard;
ModelShard ShardFor(const ParallelLayout& layout, const ModelConfig& model, int64_t pp_rank);

// What is copied instead of run; the event log is the same either way (tests compare).
struct Replication {
  // The steady state's events for microbatches after the second (Note [Microbatch
  // replication] in rank_training.cc).
  bool microbatches = true;
  // The steady layer's events for identical layers (Note [Layer replication] in
  // models/layer_replication.h).
  bool layers = true;
};

// Records setup and `training.iterations` iterations of pipeline stage `pp_rank` of `run`
// into `session`, which must be active on this thread. Every rank of a stage behaves alike
// (Note [Rank classes] in rank_classes.h). A UserError from the engine propagates.
// Returns the parameters (elements) of the stage's model shard.
// REQUIRES: 0 <= pp_rank < run.spec().layout.pp.
int64_t RunRankTraining(const ValidatedRun& run, int64_t pp_rank, Session& session,
                        Replication replication = {});

}  // namespace memsim
