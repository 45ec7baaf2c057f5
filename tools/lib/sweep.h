// `memsim sweep` and `memsim merge`: every valid layout of a model on a cluster,
// simulated, with the seeds' logs and file names so existing heatmap tools read them.
//
// Output folder:
//   memory_trace_rank{R}_wd{W}_tp{T}_pp{P}_dp{D}_exp{E}_expNum{N}_l{L}_mbs{m}_nmbs{n}_gbs{g}_ts{S}.json
//       one per rank class (R its first rank) of every simulated layout; ts is the
//       sequence length (memsim's names are deterministic, so a resumed sweep writes the
//       same files);
//   successful_configs.log / failed_configs.log
//       "Config K: TP=.., PP=.., DP=.., NUM_MICBATCH=.., GLOBAL_BATCH_SIZE=.. - SUCCESS"
//       or "- FAILED (why)";
//   sweep_results.csv / sweep_results.json: every layout with its per-stage peaks;
//   .sweep/layout_tp.._pp.._vpp.._cp.._ep.._mbs.._rc...json: each finished layout's result,
//       named by the layout and tagged with the run (model, cluster, batch), written
//       atomically. A sweep into a folder that has results needs --resume, which skips
//       the layouts finished before for the same run and refuses another run's folder;
//       a layout whose traces could not be written keeps no result, so --resume redoes it.
//       merge checks every shard's results and traces before it writes anything.
#pragma once

#include <nlohmann/json.hpp>

#include <string>

#include "simulator/status.h"

namespace memsim {

// Reads one layout's record (.sweep/*.json), checking every field the reports read; an
// error names the file and says how to redo the layout.
Status LoadSweepRecord(const std::string& path, nlohmann::json* out);

int SweepCommand(int argc, const char* const* argv);
int MergeCommand(int argc, const char* const* argv);

}  // namespace memsim
