// LayoutPoint: the sizes that `memsim plan` searches and `memsim sweep` walks, one point
// of either, and how a point is put into a run.
#pragma once

#include <cstdint>

#include "models/model_config.h"
#include "parallel/run_spec.h"

namespace memsim {

struct LayoutPoint {
  int64_t tp = 1, pp = 1, vpp = 1, cp = 1, ep = 1, micro_batch = 1;
  RecomputeKind recompute = RecomputeKind::kNone;
};

// `base` with the point's sizes, not yet finalized (FinalizeRunSpec).
inline RunSpec WithLayoutPoint(RunSpec base, const LayoutPoint& point) {
  base.layout.tp = point.tp;
  base.layout.pp = point.pp;
  base.layout.vpp = point.vpp;
  base.layout.cp = point.cp;
  base.layout.ep = point.ep;
  base.training.micro_batch_size = point.micro_batch;
  base.training.recompute = point.recompute;
  return base;
}

}  // namespace memsim
