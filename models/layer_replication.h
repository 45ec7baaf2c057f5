// Layer replication: a run of identical decoder layers is simulated by running four of
// them and copying the events of the steady one for the rest.
//
// Note [Layer replication]
// Decoder layers of one kind (dense or MoE) inside a chunk run the same ops on tensors
// of the same shapes, so, like microbatches (Note [Microbatch replication] in
// parallel/rank_training.cc), they record the same allocations and frees. The unit
// copied is what runs as one: a layer, or under full recomputation a checkpointed group
// of layers. Of a run of n >= kMinReplicatedUnits alike units, memsim runs four for real:
//   first        pays one-off costs (global buffers, cached dummy weight gradients);
//   T = first+1  the template of the forward: its forward events are copied for each
//                unit of the gap [first+2, last-1);
//   U = last-1   the template of the backward (in backward it runs before the gap);
//   last         feeds the chunk's end, whatever follows.
// The gap's units are never built as tensors. A bridge node joins T's output to U's
// input in the autograd graph: its forward gives U a tensor standing for the last copied
// unit's output (Recorder::AdoptNextAllocation); its backward, which autograd runs right
// after U's backward, appends a copy of U's backward for each gap unit in reverse order
// and hands T a tensor standing for the last copy's input gradient. Each copy maps the
// frees of its template to its own unit: the template's forward storages shift to the
// copy's, its input to the previous unit's output, its incoming gradient to the previous
// copy's outgoing one; module paths are renamed from the template's layers to the
// copy's. U's forward is checked to record what T's did before anything is copied in
// backward.
//
// A layer may keep tensors from one forward to its next (MoE's dispatcher keeps its
// routing map and probabilities, freed when the next microbatch's forward replaces them,
// or at the end): `state(i)` names those slots. Each copied unit's slots then hold
// tensors standing for its copy's state, so that its next forward (copied or real) and
// the end of the run free them where running the layers would.
//
// The event log is what running every layer records, up to the last bits of the virtual
// clock's sums (tests compare the two for GPT in every recomputation mode, Llama, MoE
// and Megatron-LM CI launch lines). Not replicated (every layer runs): checkpointed
// groups holding MoE layers and MoE layers the moe recompute module checkpoints
// (recomputation replaces their kept state in backward), units that free their input in
// forward (an fp32 residual stream's, whose norms keep 16-bit copies: Note [FP32 residual
// stream] in transformer.h; found when the template runs), and data parallelism that wraps
// each layer (FSDP's gathers).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace memsim {

// Runs below this length gain nothing: four units run for real anyway.
inline constexpr int64_t kMinReplicatedUnits = 5;

// How RunReplicatedUnits runs and names the units of a chunk.
struct UnitRunner {
  // Runs unit i's forward for real (inside its layers' module scopes) on x.
  std::function<at::Tensor(int64_t i, const at::Tensor& x)> run;
  // The module paths of unit i's layers ("decoder.layers.7"), in order.
  std::function<std::vector<std::string>(int64_t i)> module_paths;
  // Unit i's slots for tensors its layers keep from one forward to the next.
  std::function<std::vector<at::Tensor*>(int64_t i)> state;
};

// Runs units [first, last) on `hidden` and returns the last one's output: every unit for
// real when there are fewer than kMinReplicatedUnits or no recorder is active, else as
// Note [Layer replication] says.
// REQUIRES: the units are alike (the same layers' shapes and ops, the same
// checkpointing); called in forward with grad mode on.
at::Tensor RunReplicatedUnits(int64_t first, int64_t last, const at::Tensor& hidden,
                              const UnitRunner& units);

}  // namespace memsim
