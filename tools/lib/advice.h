// What would cut the peak: each modelled switch the run could turn, re-simulated.
//
// Note [Advice]
// Advice is measured, not a rule of thumb: for every switch memsim models that differs
// from the run (more recomputation, sequence parallelism, the distributed optimizer, twice
// the pipeline, tensor, context or expert parallelism, half the micro batch with the global
// batch kept, the fused attention kernel), the run is simulated again with that one change and the
// fullest stage's peak reserved memory and the step time (Note [Step time]) are compared
// with the run's own. Switches the layout cannot take (PP that does not divide the layers,
// TP, CP or EP the GPUs or the experts) are left out.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tools/lib/run_config.h"
#include "tools/lib/simulate.h"

namespace memsim {

struct Advice {
  std::string change;               // as the command line says it: "--recompute selective"
  std::string effect;               // what it does: "recompute attention's core in backward"
  int64_t peak_reserved_bytes = 0;  // the fullest stage, after the change
  bool fits = false;
  double step_time_ratio = 1;  // step time after / before
};

// Re-simulates `unfinalized` (the run as given, before FinalizeRunSpec) with each switch,
// on up to `jobs` threads, and compares with `current`, the run's own stages (simulated
// from `run`, the finalized `unfinalized`). Sorted by the peak after the change, lowest
// first; a switch whose simulation fails is left out.
std::vector<Advice> AdviseOnPeak(const RunSpec& unfinalized, const ValidatedRun& run,
                                 const std::vector<RankResult>& current, int jobs);

}  // namespace memsim
