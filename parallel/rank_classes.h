// Virtual ranks: every rank of a layout, grouped into classes that behave identically.
//
// Note [Rank classes]
// Ranks that differ only in their tensor-, context-, data- or expert-parallel index run
// the same ops on tensors of the same shapes (every group is symmetric: shards are equal
// in size, collectives allocate the same buffers on every member), so their memory is
// identical; only the pipeline stage changes what a rank holds (embedding on the first,
// output layer and loss on the last, a different number of in-flight microbatches on
// each). memsim simulates one rank per pipeline stage and reports that result for every
// rank of the stage: an 8,192-GPU layout with PP=16 costs 16 simulations. One exception:
// Megatron's layer-wise optimizer gives data-parallel ranks different parameters to own;
// the simulated rank is then the one holding the most optimizer state (Note [Layer-wise
// optimizer] in models/optimizer.h), an upper bound for the rest of its class.
//
// In Megatron-LM's rank order (tp-cp-dp-pp, pipeline outermost) the ranks of a stage are
// one contiguous range, so a class is its first rank and a count: nothing memsim keeps
// grows with the world size.
#pragma once

#include <cstdint>
#include <vector>

#include "parallel/layout.h"

namespace memsim {

struct RankClass {
  int64_t pp_rank = 0;
  int64_t representative = 0;  // the lowest rank of the class: the one simulated
  int64_t num_ranks = 0;       // its ranks are representative .. representative + num_ranks - 1

  int64_t last_rank() const { return representative + num_ranks - 1; }
  bool Contains(int64_t rank) const { return representative <= rank && rank <= last_rank(); }
};

// One class per pipeline stage, in stage order; together they hold every rank once.
// REQUIRES: `layout` passed FinalizeLayout.
std::vector<RankClass> RankClasses(const ParallelLayout& layout);

}  // namespace memsim
