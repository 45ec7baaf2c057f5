// `memsim simulate`: run one training configuration and report every rank's memory.
#pragma once

#include <memory>
#include <string>

#include "simulator/peak_analysis.h"
#include "simulator/session.h"
#include "simulator/status.h"
#include "simulator/timeline.h"
#include "tools/lib/run_config.h"

namespace memsim {

// The simulation of one rank class.
struct RankResult {
  std::unique_ptr<Session> session;
  Timeline timeline;
  PeakAnalysis peak;
  int64_t oom_event = -1;  // first allocation that fails on the GPU's usable memory
  bool fits() const { return oom_event < 0; }
};

// Finalizes and checks `spec`, then simulates it. User errors (bad shapes, a missing
// kernel) come back as a Status.
Status SimulateRank(RunSpec spec, RankResult* result);

// The command: parses argv (after "simulate"), prints, writes files; returns the exit code.
int SimulateCommand(int argc, const char* const* argv);

}  // namespace memsim
