// How long one training step of a layout takes: the virtual clock's per-stage times
// composed by the pipeline schedule, plus the communication the clock does not see.
// `memsim plan` ranks layouts by it.
//
// Note [Step time]
//   step = pipeline + data-parallel communication + optimizer, where
//   pipeline = m * max_s(t_s) + (sum_s(t_s) - max_s(t_s)) / v
//     t_s: stage s's forward and backward of one microbatch (all its virtual chunks, with
//          its recomputation) from the virtual clock, plus its exposed tensor- and
//          expert-parallel communication; m microbatches; v virtual stages per rank.
//     The slowest stage runs all m microbatches; the others' fill and drain is the bubble,
//     cut by v when interleaved. For equal stages this is Narayanan et al. 2021's
//     (m + (p - 1) / v) * t, a bubble fraction of (p - 1) / (v * m).
//   data-parallel communication: the gradient reduction after the last backward, and the
//     distributed optimizer's parameter all-gather after the step, not overlapped (as
//     Megatron-LM runs without --overlap-grad-reduce / --overlap-param-gather);
//   optimizer: the slowest stage's step from the clock.
// It ranks layouts. As a prediction it is rough: the clock's kernel efficiencies are
// typical values and its fitted constants, the host's time per op (per platform) and per
// Transformer Engine module call (Note [Virtual clock] in simulator/cost_model.h), put
// Megatron-LM's functional tests at a median |error| of 3-7% per platform (VALIDATION.md;
// single-node GB200 runs, 73%, and two slow regenerations of H100 timings say more about
// their environment), and context parallelism's key/value exchange and the pipeline's
// sends are taken as overlapped with compute.
//
// Note [Communication time]
// A ring collective over n GPUs moves, per GPU, 2(n-1)/n of the buffer for an all-reduce
// and (n-1)/n of the full (gathered) buffer for an all-gather, a reduce-scatter or an
// all-to-all, at the link's bandwidth times link_efficiency. The link is NVLink when the
// group lies inside one node, else the network adapter. Megatron-LM orders ranks
// tp-cp-ep-dp-pp (fastest first), so a group of n GPUs whose members are `stride` ranks
// apart spans stride * n consecutive ranks: inside a node when that is at most
// gpus_per_node.
#pragma once

#include <cstdint>
#include <vector>

#include "models/model_config.h"
#include "parallel/layout.h"
#include "simulator/cost_model.h"

namespace memsim {

enum class CollectiveKind { kAllReduce, kAllGather, kReduceScatter, kAllToAll };

// Seconds for a collective over `group` GPUs `stride` ranks apart on a buffer of
// `bytes` (for all-gather and reduce-scatter: the full, gathered size). 0 when group <= 1.
double CollectiveSeconds(const GpuSpec& gpu, CollectiveKind kind, double bytes, int64_t group,
                         int64_t stride);

// The pipeline term of Note [Step time]. REQUIRES: stage_s non-empty, m >= 1, v >= 1.
double PipelineSeconds(const std::vector<double>& stage_s, int64_t microbatches,
                       int64_t virtual_stages);

// What the clock measured on one pipeline stage.
struct StageClock {
  double compute_s = 0;      // forward and backward of the simulated microbatches
  int64_t microbatches = 1;  // how many were simulated (>= 1)
  double optimizer_s = 0;    // the optimizer step
  // What the rank holds at the end of the step (for ZeRO-2 and FSDP, its shards):
  int64_t gradient_bytes = 0;   // gradients reduced over data parallel (main grads)
  int64_t parameter_bytes = 0;  // parameters (gathered after a distributed optimizer's step)
};

// total = compute + model-parallel communication + bubble + data-parallel + optimizer.
struct StepTime {
  double total_s = 0;
  double compute_s = 0;              // m microbatches on the slowest stage, from the clock
  double model_parallel_comm_s = 0;  // its exposed TP/EP communication over m microbatches
  double bubble_s = 0;               // the other stages' fill and drain
  double data_parallel_comm_s = 0;   // after the last backward, on the stage that ends last
  double optimizer_s = 0;            // that stage's optimizer step
  double tokens_per_s_per_gpu = 0;
};

// Note [Step time] for `layout`, whose stages the clock measured (stage_clocks[s] is
// pipeline stage s). REQUIRES: `model`, `training`, `layout` finalized together (the
// RunSpec passed FinalizeRunSpec); stage_clocks.size() == layout.pp.
StepTime EstimateStepTime(const ModelConfig& model, const TrainingConfig& training,
                          const ParallelLayout& layout, const GpuSpec& gpu,
                          const std::vector<StageClock>& stage_clocks);

}  // namespace memsim
