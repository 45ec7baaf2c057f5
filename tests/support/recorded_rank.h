// One rank's training steps recorded on meta tensors, as tests read them.
#pragma once

#include <cstdint>
#include <memory>

#include "parallel/rank_training.h"
#include "parallel/run_spec.h"
#include "simulator/session.h"

namespace memsim::test {

// Runs stage `pp_rank` of `run` in a new session on `gpu` (none: no GPU's workspaces) and
// returns the session holding its recording.
inline std::unique_ptr<Session> RecordRank(const ValidatedRun& run, int64_t pp_rank = 0,
                                           const GpuSpec* gpu = nullptr) {
  auto session = std::make_unique<Session>(gpu);
  {
    ActiveSession active(*session);
    RunRankTraining(run, pp_rank, *session);
  }
  return session;
}

}  // namespace memsim::test
