// `memsim plan`: which layout to run. Searches the layouts of a model on a cluster for a
// training target (sequence length, global batch), ranks the ones that fit by step time
// (Note [Step time] in parallel/step_time.h) and says why the others do not.
//
// Note [Plan search]
// Every layout of the grid is accounted for, with the cheapest work that decides it:
//   1. invalid: FinalizeRunSpec refuses it; the rule it breaks is kept.
//   2. pruned: its setup alone (parameters, gradient buffers and the optimizer's master
//      copies, all alive through the whole step) allocates more than the GPU's usable
//      memory on some stage, so the step cannot fit; only the setup is simulated.
//   3. dominated: layouts that differ only in recomputation are tried with the least
//      recomputation first; once one fits, those recomputing more are not simulated (they
//      only add work on the clock, so they are never faster).
//   4. screened: the rest are simulated with min(m, k) microbatches, k = pp + 1 (2 * pp
//      interleaved): past k the schedule holds no more microbatches in flight, and every
//      stage has run a forward after a backward whose gradients the schedule still keeps
//      (Note [Tensors the schedule keeps] in parallel/rank_training.cc), so the allocated
//      memory does not grow with m; the reserved memory may, by the segment fragmentation
//      adds late in a long run: one 2 MiB segment of the allocator's small pool, or a
//      segment of its own for a large block when the cached ones (among them the
//      parameters' own storages the distributed optimizer freed) are split too finely to
//      hold it (plan_test: the fp32 logits); a layout screened to fit with less headroom
//      than that is one to verify. The step time scales the
//      measured per-microbatch times to m (Note [Step time]).
//   5. verified: the best `verify` layouts are simulated again with all m microbatches,
//      and that simulation's verdict and times are the ones reported; a layout whose
//      verdict changes is reported so, never ranked on the screened one.
// Sequence parallelism is on whenever TP > 1 (it only saves memory; Megatron-LM requires it
// for MoE with TP).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "parallel/step_time.h"
#include "simulator/enum_names.h"
#include "simulator/status.h"
#include "tools/lib/layout_point.h"
#include "tools/lib/run_config.h"

namespace memsim {

// The values searched; every combination is one layout.
struct PlanGrid {
  std::vector<int64_t> tp, pp, vpp, cp, ep, micro_batch;
  std::vector<int64_t> etp = {0};        // expert tensor parallel; 0: = TP
  std::vector<RecomputeKind> recompute;  // least recomputation first
  std::vector<DataParallelKind> data_parallel;
};

// The grid a user gets without giving lists: TP up to a node, PP dividing the GPUs (to 64)
// that divides the layers or gets a plan's uneven split (Note [Plan's uneven stages]), VPP 1
// and 2, CP 1 and 2 from sequence 8192 on, EP dividing the experts up to 64, micro batch 1,
// every recomputation, the distributed optimizer.
PlanGrid DefaultPlanGrid(const RunSpec& base);

// Note [Plan's uneven stages]
// Where PP does not divide the layers (DeepSeek-V3's 61 on PP 16), Megatron-LM runs need
// uneven first and last stages (--decoder-first/last-pipeline-num-layers). The plan gives the
// middle stages m = ceil(L / PP) layers each and takes the e = PP * m - L layers too many off
// the ends, ceil(e / 2) off the first stage (the one that holds the most microbatches in
// flight) and the rest off the last (which holds the output layer and the loss): 61 on PP 16
// is 2 + 14 x 4 + 3. Only without virtual stages, and only where the run gives no split of its
// own (first/last stage layers or a pipeline layout). False, leaving the outputs as they
// were, where there is no such split (PP < 2, PP divides L, or an end would hold no layer).
bool PlanUnevenStages(int64_t layers, int64_t pp, int64_t* first_stage_layers,
                      int64_t* last_stage_layers);

// A point of the plan's search; sequence parallelism is on whenever TP > 1.
struct PlanLayout : LayoutPoint {
  int64_t etp = 0;  // 0: = tp
  DataParallelKind data_parallel = DataParallelKind::kDistributedOptimizer;
  // Uneven stages the plan chose (Note [Plan's uneven stages]); 0: the base run's split.
  int64_t first_stage_layers = 0, last_stage_layers = 0;
};
// "TP4 PP2 VPP1 CP1 EP1 mbs1 recompute=none distributed-optimizer" (and "ETP1" after EP when
// the expert tensor parallelism is not TP's; "PP16 (first 2, last 3 layers)" when uneven)
std::string PlanLayoutName(const PlanLayout& layout);

enum class PlanVerdict { kFits, kOutOfMemory, kPruned, kDominated, kInvalid, kError };
inline constexpr EnumName<PlanVerdict> kPlanVerdictNames[] = {
    {PlanVerdict::kFits, "fits"},       {PlanVerdict::kOutOfMemory, "out_of_memory"},
    {PlanVerdict::kPruned, "pruned"},   {PlanVerdict::kDominated, "dominated"},
    {PlanVerdict::kInvalid, "invalid"}, {PlanVerdict::kError, "error"}};
inline const char* PlanVerdictName(PlanVerdict verdict) {
  return NameOf(kPlanVerdictNames, verdict).data();  // a literal: null-terminated
}

struct PlanEntry {
  PlanLayout layout;
  PlanVerdict verdict = PlanVerdict::kInvalid;
  std::string reason;  // every verdict but kFits: why
  int64_t dp = 0, microbatches = 0;
  StepTime step;  // kFits
  // kFits: the smallest headroom over the stages; kOutOfMemory: the first stage that runs
  // out and by how much its unlimited peak reserved exceeds the usable memory.
  int64_t headroom_bytes = 0;
  int64_t oom_stage = -1;
  int64_t over_bytes = 0;
  std::vector<int64_t> stage_peak_reserved_bytes;  // simulated verdicts, per stage
  bool verified = false;  // simulated with every microbatch (Note [Plan search] 5)
};

// The ranking of layouts that fit: faster first; on a tie (the clock times the distributed
// optimizer's reduce-scatter and all-gather like DDP's all-reduce) more headroom first, then
// by name.
bool PlanRanksBefore(const PlanEntry& a, const PlanEntry& b);

struct PlanSettings {
  int jobs = 2;
  int64_t verify = 3;  // layouts verified with every microbatch
  bool progress = true;
};

// Searches `grid` for `base` (its model, GPU, world size, sequence and global batch; its
// layout's other fields apply to every layout). Entries come ranked: the layouts that fit
// by step time (fastest first, verified ones before screened ones), then the others.
// REQUIRES: base.global_batch_size > 0, base.gpu set.
Status RunPlan(const RunSpec& base, const PlanGrid& grid, const PlanSettings& settings,
               std::vector<PlanEntry>* entries);

// Simulates one layout of `base` (with all its microbatches unless `screen`), returning its
// entry (verdict kFits, kOutOfMemory, kInvalid or kError).
PlanEntry SimulatePlanLayout(const RunSpec& base, const PlanLayout& layout, bool screen);

int PlanCommand(int argc, const char* const* argv);

}  // namespace memsim
