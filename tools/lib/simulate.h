// `memsim simulate`: run one training configuration and report every rank's memory.
#pragma once

#include <boost/program_options/options_description.hpp>

#include <memory>
#include <string>
#include <vector>

#include "parallel/rank_simulation.h"
#include "simulator/status.h"
#include "tools/lib/run_config.h"

namespace memsim {

// "Out of memory on stage S (rank R): the first allocation that fails is ..." with its
// size, shape, op, module, phase, iteration, microbatch, and the memory at that moment.
// REQUIRES: !r.fits().
std::string DescribeOutOfMemory(const RankResult& r, const RunSpec& spec);

// How `simulate` reports a finalized RunSpec.
struct ReportOptions {
  std::string out_dir = "memsim_out";
  std::string ranks = "first-per-class";
  double sample_interval_s = 0;
  int64_t top_n = 10;  // 1..kLargestTensorsKept
  int jobs = 2;
  bool json = false;
  bool check = false;
  bool advise = false;        // Note [Advice] in tools/lib/advice.h
  double max_output_gib = 4;  // refuse to write more files than this
  // The snapshot's allocation history: "last-iteration" (the last step's events) or "run"
  // (every event from the first parameter on, as _record_memory_history at process start).
  std::string snapshot_history = "last-iteration";
};

// The report options every simulating command takes (--jobs --out --ranks
// --sample-interval --top --json --check --advise), and their checks beyond parsing.
void AddReportOptions(boost::program_options::options_description* options, ReportOptions* report);
Status CheckReportOptions(const ReportOptions& report);

// Finalizes and simulates `unfinalized`, prints the table or JSON (and, with
// options.advise, what would cut the peak), writes the files; returns the exit code.
int SimulateAndReport(const RunSpec& unfinalized, const ReportOptions& options,
                      const char* command);

// Writes rank `rank`'s files (memory_trace, summary and snapshots, as `simulate` writes a
// selected rank's) into options.out_dir, which must exist and be writable.
// REQUIRES: `result` is the simulated class of `rank` in `run`.
Status WriteFilesOfRank(const ValidatedRun& run, const RankResult& result, int64_t rank,
                        const ReportOptions& options);

// The command: parses argv (after "simulate"), prints, writes files; returns the exit code.
int SimulateCommand(int argc, const char* const* argv);

}  // namespace memsim
