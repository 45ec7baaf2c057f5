#include "parallel/rank_classes.h"

#include "simulator/check.h"

namespace memsim {

std::vector<RankClass> RankClasses(const ParallelLayout& layout) {
  MEMSIM_DCHECK(layout.world_size == layout.tp * layout.cp * layout.dp * layout.pp);
  std::vector<RankClass> classes(static_cast<size_t>(layout.pp));
  for (int64_t pp_rank = 0; pp_rank < layout.pp; ++pp_rank) {
    classes[static_cast<size_t>(pp_rank)].pp_rank = pp_rank;
    classes[static_cast<size_t>(pp_rank)].ranks.reserve(
        static_cast<size_t>(layout.world_size / layout.pp));
  }
  for (int64_t rank = 0; rank < layout.world_size; ++rank) {
    classes[static_cast<size_t>(CoordinatesOf(layout, rank).pp_rank)].ranks.push_back(rank);
  }
  for (RankClass& c : classes) c.representative = c.ranks.front();
  return classes;
}

}  // namespace memsim
