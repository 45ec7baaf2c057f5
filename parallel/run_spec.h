// RunSpec: what one simulation is made of; ValidatedRun: a RunSpec that passed
// FinalizeRunSpec, the only input the engine's entry points (rank_simulation.h) take.
//
// Note [One validated spec]
// Front ends (YAML run files, Hugging Face configs, Megatron-LM arguments, plan's search)
// only translate their input into a RunSpec. FinalizeRunSpec derives every dependent
// field (padded vocabulary, data-parallel sizes, microbatches from the global batch, TE's
// attention backend) and checks every rule once, returning a ValidatedRun. Nothing else
// makes one, so an unchecked configuration (CP with eager attention, a sequence CP does
// not divide) cannot reach the engine: the rank loop (RunRankTraining), the simulation
// entry points (rank_simulation.h) and the theoretical estimate take only a ValidatedRun.
// The model itself (models/TransformerModel) sits below this layer (Note [Layers] in
// README.md), as Megatron-Core's GPTModel takes a TransformerConfig; it takes its parts
// with a REQUIRES, and outside unit tests only RunRankTraining builds one, from a
// ValidatedRun.
#pragma once

#include <optional>
#include <string>
#include <utility>

#include "models/model_config.h"
#include "parallel/layout.h"
#include "simulator/cost_model.h"
#include "simulator/status.h"

namespace memsim {

struct RunSpec {
  ModelConfig model;
  TrainingConfig training;
  ParallelLayout layout;
  // Samples per iteration over all data-parallel ranks; 0: use training.num_microbatches.
  // Otherwise num_microbatches = global_batch_size / (micro_batch_size * dp).
  int64_t global_batch_size = 0;
  // Megatron-LM's --decrease-batch-size-if-needed: a global batch that micro batch * dp
  // does not divide is rounded down to a multiple of it instead of being an error (to none
  // still is one).
  bool round_global_batch_down = false;
  const GpuSpec* gpu = nullptr;
  std::string model_source;  // preset name or file the model came from
};

class ValidatedRun {
 public:
  // Every field derived and every rule checked (Note [One validated spec]).
  const RunSpec& spec() const { return spec_; }
  // The same run stopped after its setup: parameters, gradient buffers and optimizer
  // state are created, no training step runs (iterations = 0, which no front end may ask
  // for).
  ValidatedRun SetupOnly() const {
    ValidatedRun setup = *this;
    setup.spec_.training.iterations = 0;
    return setup;
  }

 private:
  friend Status FinalizeRunSpec(const RunSpec& spec, std::optional<ValidatedRun>* run);
  explicit ValidatedRun(RunSpec spec) : spec_(std::move(spec)) {}
  RunSpec spec_;
};

// Tokens of one microbatch on a rank of a layer: S/cp (/tp with sequence parallelism) * B,
// the rows an MoE layer routes.
int64_t TokensPerRank(const RunSpec& spec);

// The most of a rank's tokens one expert takes under the capacity factor (ExpertCapacity in
// models/moe.h), or 0 for a dropless run.
int64_t ExpertCapacityPerRank(const RunSpec& spec);

// Bytes each rank holds outside PyTorch's caching allocator for the run: Transformer
// Engine's userbuffers under TP communication overlap (Note [Userbuffers] in
// ops/collectives.h), else 0. memsim's figures do not include them; the fit verdict
// measures against what is left (AllocatorCapacityBytes).
int64_t UserbufferBytes(const RunSpec& spec);

// DeepEP's buffers on each rank (DeepEpBufferBytes, or HybridEpBufferBytes for its HybridEP
// backend, in models/moe.h) when the run's MoE layers dispatch with either, else 0; outside
// the allocator, as userbuffers are.
int64_t DeepEpBufferBytes(const RunSpec& spec);

// What PyTorch's caching allocator of a rank can reserve: the GPU's usable memory less what
// the run holds outside the allocator (UserbufferBytes, DeepEpBufferBytes). The fit
// verdict, headroom and pruning measure against it.
// REQUIRES: spec.gpu is set.
int64_t AllocatorCapacityBytes(const RunSpec& spec);

// Derives everything a simulation needs and checks it all, before anything runs: model
// (vocabulary padded for tp), layout (every rule), training, and the number of
// microbatches from the global batch (global = micro * dp * microbatches). On success
// `*run` holds the result; on failure it is left empty and the Status names the first
// broken rule.
Status FinalizeRunSpec(const RunSpec& spec, std::optional<ValidatedRun>* run);

}  // namespace memsim
