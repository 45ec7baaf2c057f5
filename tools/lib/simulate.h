// `memsim simulate`: run one training configuration and report every rank's memory.
#pragma once

#include <boost/program_options/options_description.hpp>

#include <memory>
#include <string>
#include <vector>

#include "parallel/rank_classes.h"
#include "parallel/step_time.h"
#include "simulator/peak_analysis.h"
#include "simulator/session.h"
#include "simulator/status.h"
#include "simulator/timeline.h"
#include "tools/lib/run_config.h"

namespace memsim {

// Largest tensors alive at the peak that summaries list and --top may print.
inline constexpr size_t kLargestTensorsKept = 50;

// The simulation of one rank class (one pipeline stage).
struct RankResult {
  RankClass rank_class;
  std::unique_ptr<Session> session;
  Timeline timeline;
  PeakAnalysis peak;
  // The recording replayed on the GPU's usable memory: the verdict, and the headroom.
  CapacityReplay on_gpu;
  bool fits() const { return on_gpu.fits(); }
  // Usable memory minus the peak reserved on the GPU; >= 0 whenever the step fits.
  int64_t headroom_bytes(const GpuSpec& gpu) const {
    return gpu.usable_bytes() - on_gpu.peak_reserved_bytes;
  }
};

// Simulates the class of `spec` (which passed FinalizeRunSpec). User errors (a missing
// kernel, a size overflow) come back as a Status.
Status SimulateRankClass(const RunSpec& spec, const RankClass& rank_class, RankResult* result);

// "Out of memory on stage S (rank R): the first allocation that fails is ..." with its
// size, shape, op, module, phase, iteration, microbatch, and the memory at that moment.
// REQUIRES: !r.fits().
std::string DescribeOutOfMemory(const RankResult& r, const GpuSpec& gpu);

// Simulates every rank class on up to `jobs` threads; results in stage order.
Status SimulateAllClasses(const RunSpec& spec, int jobs, std::vector<RankResult>* results);

// What the virtual clock measured on each stage's last iteration (results in stage order),
// for EstimateStepTime; the stages ran `simulated_microbatches` microbatches.
std::vector<StageClock> MeasuredClocks(const std::vector<RankResult>& stages,
                                       int64_t simulated_microbatches);

// Megatron-LM's analytical estimate for pipeline stage `pp_rank` of `spec`, in MiB (Note
// [Theoretical memory per stage] in parallel/theoretical_memory.h).
double TheoreticalMemoryMB(const RunSpec& spec, int64_t pp_rank);

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
};

// The report options every simulating command takes (--jobs --out --ranks
// --sample-interval --top --json --check --advise), and their checks beyond parsing.
void AddReportOptions(boost::program_options::options_description* options, ReportOptions* report);
Status CheckReportOptions(const ReportOptions& report);

// Finalizes and simulates `unfinalized`, prints the table or JSON (and, with
// options.advise, what would cut the peak), writes the files; returns the exit code.
int SimulateAndReport(const RunSpec& unfinalized, const ReportOptions& options,
                      const char* command);

// The command: parses argv (after "simulate"), prints, writes files; returns the exit code.
int SimulateCommand(int argc, const char* const* argv);

}  // namespace memsim
