// Layer replication: a run of identical decoder layers is simulated by running four of
// them and copying the events of the steady one for the rest.
//
// Note [Layer replication]
// Decoder layers of one kind (dense or MoE) inside a chunk run the same ops on tensors
// of the same shapes, so, like microbatches (Note [Microbatch replication] in
// parallel/rank_training.cc), they record the same allocations and frees. Of a run of
// n >= kMinReplicatedLayers such layers, memsim runs four for real:
//   first        pays one-off costs (global buffers, cached dummy weight gradients);
//   T = first+1  the template of the forward: its forward events are copied for each
//                layer of the gap [first+2, last-1);
//   U = last-1   the template of the backward (in backward it runs before the gap);
//   last         feeds the chunk's end, whatever follows.
// The gap's layers are never built as tensors. A bridge node joins T's output to U's
// input in the autograd graph: its forward gives U a tensor standing for the last copied
// layer's output (Recorder::AdoptNextAllocation); its backward, which autograd runs
// right after U's backward, appends a copy of U's backward for each gap layer in reverse
// order and hands T a tensor standing for the last copy's input gradient. Each copy maps
// the frees of its template to its own layer: the template's forward storages shift to
// the copy's, its input to the previous layer's output, its incoming gradient to the
// previous copy's outgoing one; module paths are renamed from the template's layer to
// the copy's. U's forward is checked to record what T's did before anything is copied
// in backward. The event log is what running every layer would record (tests compare
// the two for GPT, Llama, MoE and every recomputation mode that uses it).
//
// Not replicated (every layer runs): full recomputation (checkpointed groups span
// layers), and data parallelism that wraps each layer (FSDP's gathers).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace memsim {

// Runs below this length gain nothing: four layers run for real anyway.
inline constexpr int64_t kMinReplicatedLayers = 5;

// How RunReplicatedLayers runs and names the layers of a chunk.
struct LayerRunner {
  // Runs layer i's forward for real (inside its module scope) on x.
  std::function<at::Tensor(int64_t i, const at::Tensor& x)> run;
  // Layer i's module path ("decoder.layers.7").
  std::function<std::string(int64_t i)> module_path;
  // Layer i's slots for tensors it keeps from one forward to the next.
  std::function<std::vector<at::Tensor*>(int64_t i)> state;
};

// Runs layers [first, last) on `hidden` and returns the last one's output: every layer
// for real when there are fewer than kMinReplicatedLayers or no recorder is active, else
// as Note [Layer replication] says.
// REQUIRES: the layers are of one kind (identical shapes and ops); called in forward
// with grad mode on.
at::Tensor RunReplicatedLayers(int64_t first, int64_t last, const at::Tensor& hidden,
                               const LayerRunner& layers);

}  // namespace memsim
