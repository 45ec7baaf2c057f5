// Virtual ranks: every rank of a layout, grouped into classes that behave identically.
//
// Note [Rank classes]
// Ranks that differ only in their tensor-, context-, data- or expert-parallel index run
// the same ops on tensors of the same shapes (every group is symmetric: shards are equal
// in size, collectives allocate the same buffers on every member), so their memory is
// identical; only the pipeline stage changes what a rank holds (embedding on the first,
// output layer and loss on the last, a different number of in-flight microbatches on
// each). memsim simulates one rank per pipeline stage and reports that result for every
// rank of the stage: an 8,192-GPU layout with PP=16 costs 16 simulations.
#pragma once

#include <cstdint>
#include <vector>

#include "parallel/layout.h"

namespace memsim {

struct RankClass {
  int64_t pp_rank;
  int64_t representative;      // the lowest rank of the class: the one simulated
  std::vector<int64_t> ranks;  // every rank of the class, ascending
};

// One class per pipeline stage, in stage order; together they hold every rank once.
// REQUIRES: `layout` passed FinalizeLayout.
std::vector<RankClass> RankClasses(const ParallelLayout& layout);

}  // namespace memsim
