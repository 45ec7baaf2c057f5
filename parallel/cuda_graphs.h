// Transformer Engine's CUDA graphs of decoder layers (--cuda-graph-impl transformer_engine):
// the static buffers they keep and how many of them a stage needs.
//
// Note [CUDA graphs]
// Megatron-Core 0.20 with Transformer Engine 2.18 (training.py, transformer/cuda_graphs.py,
// TE graph.py; the reading, with file and line for each rule, is docs/source-notes/
// cuda-graphs.md) captures, after --cuda-graph-warmup-steps eager iterations, one forward
// and one backward graph per graphed layer and microbatch, in the pipeline schedule's order,
// all in one private memory pool. What PyTorch's allocated_bytes (the measured metric) sees:
//   - eager iterations: everything, as without graphs;
//   - the capture: only the graphed modules' allocations (nothing else runs), whose saved
//     activations stay counted from a graph's forward capture to its backward capture, so
//     the in-flight layers of the schedule add up; captured in the order the schedule runs;
//     the buffers and workspaces ungraphed modules make on first use do not exist yet when
//     no eager step came first (Note [State made during the capture] in
//     simulator/recorder.h);
//   - replays: none of the graphed modules' allocations (replaying allocates nothing; their
//     outputs are views of pool memory, which counts as reserved, not allocated);
//   - from the capture on: the static inputs of the graphed callables, one set per graphed
//     layer in flight at once (a hidden-state buffer, and with the attn module the
//     [b, 1, s/cp, s] byte mask), one RoPE frequency tensor shared by every layer
//     (non-MLA RoPE), and one output-gradient and one input-gradient buffer.
// memsim follows it: the simulated iterations before CudaGraphCaptureIteration() are eager
// (the first iteration and the steady state stand for all warm-up steps); before that
// iteration (between two iterations: the run's peak includes it, the per-iteration
// summaries do not) a capture pass runs the schedule's forward and backward steps with the
// recorder counting only the graphed scopes (Recorder::GraphMode::kCapture, GraphedScope
// in simulator/session.h); the iterations from it on count only what is not graphed
// (kReplay); the static buffers are allocated when the capture starts and kept. With
// graphs, a run simulates at least one replayed iteration.
// Not modelled: moe_preprocess (the dispatcher's index work, counted as eager), whole-layer
// graphs of MoE layers (refused), --cuda-graph-retain-backward-graph (refused), TE's
// per-callable warm-up before the capture (one layer's activations at a time, below the
// capture's peak), and the pool's reserved memory.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "models/model_config.h"
#include "parallel/pipeline_schedule.h"

namespace memsim {

// The most graphed (layer, microbatch) forwards in flight at once over `schedule`, chunk c
// holding graphed_layers[c] graphed layers: how many static input sets TE keeps.
// REQUIRES: every step's chunk indexes `graphed_layers`.
int64_t GraphedLayersInFlight(const std::vector<PipelineStep>& schedule,
                              const std::vector<int64_t>& graphed_layers);

// Allocates the static buffers of Note [CUDA graphs] for `in_flight` graphed layers whose
// hidden states have `hidden_shape` in `dtype`; the caller keeps them for the run.
std::vector<at::Tensor> AllocateCudaGraphStaticBuffers(const ModelConfig& model,
                                                       const TrainingConfig& training,
                                                       at::IntArrayRef hidden_shape,
                                                       at::ScalarType dtype, int64_t cp,
                                                       int64_t in_flight);

}  // namespace memsim
