// Megatron-LM's own analytical memory estimate, for comparison with memsim's simulation.
//
// A faithful port of megatron/training/theoretical_memory_usage.py (NVIDIA/Megatron-LM at
// commit 00caa53af30912914981c86f39db123961678bbd), including its simplifications:
//   * weights and optimizer: the most-loaded rank, i.e. the first pipeline stage, which
//     holds 1/pp of the transformer block plus the input embedding (and the output layer
//     too when pp == 1 and it is untied), divided by TP; 18 bytes per parameter, or
//     6 + 12/dp with the distributed optimizer, whatever the precision. Routed experts
//     are divided by TP like everything else: EP and ETP are ignored. ZeRO-2 and FSDP
//     count as the distributed optimizer (Megatron's estimate knows no other sharding).
//   * activations: the first pipeline stage, holding pp microbatches of L/pp layers
//     (so L layers' worth), times 1 + (pp-1)/(pp*vpp) when interleaved, or
//     min(1, microbatches/pp) when not; plus the output layer and loss when pp == 1.
//     Two formulas: with sequence parallelism and selective recomputation, Korthikanti
//     et al. 2022's 34sbh-like term with the FFN width (compute_activation_memory);
//     otherwise a per-layer s*b*h*(10 + 24/tp) plus 5% (compute_activation_memory_without_sp),
//     whatever the recomputation. Neither looks at kv_channels, GQA, SwiGLU, MoE routing,
//     CP, uneven pipeline stages, flash attention or full recomputation.
// MB are 2^20 bytes, as Megatron-LM's NUM_BYTES_IN_MEGABYTE.
//
// Note [Theoretical memory per stage]
// Megatron-LM estimates the first stage only. For a later stage s memsim applies the same
// per-layer terms to what s holds: its own layers (dense and MoE), the final norm and the
// output layer on the last stage (a copy of the embedding when tied); activations for the
// microbatches its schedule keeps in flight, min(m, pp - s) in 1F1B or
// min(m, (2 (pp - s - 1) + (vpp - 1) pp + 1) / vpp) interleaved, and the output layer and
// loss on the last. Stage 0 is Megatron-LM's number exactly.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "models/model_config.h"
#include "parallel/layout.h"
#include "parallel/run_spec.h"
#include "simulator/enum_names.h"

namespace memsim {

enum class TheoreticalActivationFormula {
  kSequenceParallelSelective,  // compute_activation_memory
  kWithoutSequenceParallel,    // compute_activation_memory_without_sp
};
inline constexpr EnumName<TheoreticalActivationFormula> kTheoreticalActivationFormulaNames[] = {
    {TheoreticalActivationFormula::kSequenceParallelSelective,
     "sequence parallel + selective recomputation"},
    {TheoreticalActivationFormula::kWithoutSequenceParallel, "without sequence parallelism"}};

struct TheoreticalMemory {
  double num_parameters = 0;                       // whole model, as Megatron counts it
  double num_parameters_on_most_loaded_shard = 0;  // the stage's rank (first: most loaded)
  double weight_and_optimizer_mb = 0;
  double activation_mb = 0;
  double total_mb = 0;
  TheoreticalActivationFormula activation_formula =
      TheoreticalActivationFormula::kWithoutSequenceParallel;
};

// The estimate for pipeline stage `pp_rank` of `run` (0: Megatron-LM's own), with the
// run's microbatches per iteration.
// REQUIRES: 0 <= pp_rank < run.spec().layout.pp.
TheoreticalMemory ComputeTheoreticalMemory(const ValidatedRun& run, int64_t pp_rank = 0);

// Where the estimate is known not to cover the configuration ("MoE: experts divided by TP
// only ..."); empty when it does.
std::vector<std::string> TheoreticalMemoryCaveats(const ValidatedRun& run, int64_t pp_rank);

inline const char* TheoreticalActivationFormulaName(TheoreticalActivationFormula formula) {
  return NameOf(kTheoreticalActivationFormulaNames, formula).data();  // a literal
}

}  // namespace memsim
