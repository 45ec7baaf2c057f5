// The order in which a pipeline stage runs its microbatches' forward and backward steps,
// as Megatron-LM's schedules do (megatron/core/pipeline_parallel/schedules.py).
//
// Note [Pipeline memory]
// A stage holds the activations of every microbatch whose forward has run and whose
// backward has not. 1F1B (forward_backward_pipelining_without_interleaving): stage r
// warms up with min(pp - r - 1, m) forwards, then alternates one forward and one
// backward, so it holds at most min(pp - r, m) microbatches. Interleaved 1F1B with vpp
// model chunks per stage and microbatches run in groups of g (--microbatch-group-size-
// per-virtual-pipeline-stage, default pp) through each chunk in turn:
// (pp - r - 1) * 2 + (vpp - 1) * g warm-up forwards, all of them when that reaches
// m * vpp (get_pp_rank_microbatches in Megatron-Core 0.20's schedules.py; the older
// rule "all warm-up when m == pp" is gone). With m >> pp the first stage holds
// 1 + (pp - 1)/(pp * vpp) times the activations of 1F1B.
//
// Note [Combined 1F1B]
// --overlap-moe-expert-parallel-comm runs each 1F1B step's forward and backward together,
// layer by layer (forward layer i of one microbatch-chunk, then backward layer L-1-i of
// another), so that one's expert all-to-all hides behind the other's computation
// (pipeline_parallel/combined_1f1b.py, models/common/model_chunk_schedule_plan.py in
// Megatron-Core 0.20). Interleaved, it warms up one more forward (get_pp_rank_microbatches),
// and mid-step a stage holds its W + 1 warm-up chunks and one layer more: the forward's
// first layers while the backward's chunk still holds its last. Without a pipeline, forward
// of microbatch k+1 and backward of k pair up the same way: one microbatch and one layer.
// memsim runs whole chunks, so it runs the backward of a steady step before its forward
// (interleaved: W + 1 chunks at most) and, without a pipeline, 1F1B's forward then
// backward: both one layer's activations under the real peak (docs/source-notes/
// combined-1f1b.md: about 93 MiB in its CI case, whose peak is the loss's, elsewhere).
// The other transients at the pairing's boundaries (the next microbatch's data and mask
// beside the previous one's loss backward, a few MiB there) are not modelled.
#pragma once

#include <cstdint>
#include <vector>

#include "simulator/status.h"

namespace memsim {

struct PipelineStep {
  bool forward;
  int64_t microbatch;
  int64_t chunk;  // model chunk on this stage (0 without interleaving)
};

// Megatron-LM's rules for the microbatch group size g of interleaving (vpp > 1):
// pp <= g <= m, and the last group (m mod g) empty or at least pp.
Status CheckMicrobatchGroup(int64_t pp, int64_t vpp, int64_t num_microbatches, int64_t group);

// The warm-up forwards of stage `pp_rank` (get_pp_rank_microbatches), clamped to every
// step when they reach it; arguments as PipelineSchedule's.
int64_t PipelineWarmup(int64_t pp, int64_t vpp, int64_t pp_rank, int64_t num_microbatches,
                       int64_t group = 0, bool combined_1f1b = false);

// `group` 0 means pp (Megatron's default); `combined_1f1b`: Note [Combined 1F1B].
// REQUIRES: 0 <= pp_rank < pp, vpp >= 1, num_microbatches >= 1, CheckMicrobatchGroup ok
// (std::invalid_argument otherwise).
std::vector<PipelineStep> PipelineSchedule(int64_t pp, int64_t vpp, int64_t pp_rank,
                                           int64_t num_microbatches, int64_t group = 0,
                                           bool combined_1f1b = false);

// The most microbatch-chunks whose forward has run and backward has not, over the schedule.
int64_t MaxInFlight(const std::vector<PipelineStep>& schedule);

}  // namespace memsim
