#include "parallel/rank_classes.h"

#include "simulator/check.h"

namespace memsim {

std::vector<RankClass> RankClasses(const ParallelLayout& layout) {
  MEMSIM_DCHECK(layout.world_size == layout.tp * layout.cp * layout.dp * layout.pp);
  const int64_t per_stage = layout.world_size / layout.pp;
  std::vector<RankClass> classes(static_cast<size_t>(layout.pp));
  for (int64_t pp_rank = 0; pp_rank < layout.pp; ++pp_rank) {
    RankClass& c = classes[static_cast<size_t>(pp_rank)];
    c.pp_rank = pp_rank;
    c.representative = pp_rank * per_stage;
    c.num_ranks = per_stage;
    MEMSIM_DCHECK(CoordinatesOf(layout, c.representative).pp_rank == pp_rank &&
                  CoordinatesOf(layout, c.last_rank()).pp_rank == pp_rank);
  }
  return classes;
}

}  // namespace memsim
