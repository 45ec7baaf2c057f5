// `memsim validate`: memsim against real measurements (validation/).
//
// A case (validation/cases/*.yaml) is one real run: Megatron-LM's arguments and
// environment as the run used them, its world size and GPU, the rank whose memory was
// logged, and the values logged. validation/tolerances.yaml says how far memsim may be
// from each value, and why where that is more than the default 0.5%.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "simulator/status.h"

namespace memsim {

// Note [Software of a measurement]
// A golden value was measured on the software of the day it was regenerated, not on
// today's. Megatron-LM's code is the case's commit; PyTorch is whatever the CI's dev
// container held then. One difference shows in memory: PyTorch's default cuBLAS workspace
// on Blackwell (aten/src/ATen/cuda/CublasHandlePool.cpp, parseChosenWorkspaceSize) was
// :4096:2:16:8 (8.125 MiB) until pytorch/pytorch#175344 (merged 2026-02-19) made it 32 MiB
// as on Hopper; memsim follows the latter. Megatron-LM's CI dev container moved from NGC
// PyTorch 26.02 to 26.04, which has it, on 2026-05-07 (docker/.ngc_version.dev, commit
// 5fe3f06658). Measured: the GB200 golden values regenerated before that day of runs that
// leave CUBLAS_WORKSPACE_CONFIG unset sit 47.75 MiB (two handles' workspaces,
// 2 x 23.875 MiB) below the same tests' H100 values; those regenerated from that day on do
// not. validation/import_megatron_ci.py reads each golden file's date from Megatron-LM's
// history and writes the old default into the case's `stack` for the former, so the case is
// simulated on the software it was measured on. Megatron-LM's own defaults move too: until
// 2026-07-01 (commit adfe9e11d9) Megatron-FSDP kept bf16 runs' gradients in fp32 (the
// "grandfathered" grad_reduce_in_fp32); since then auto means the parameters' dtype. The
// importer writes such defaults into `stack.args`. And Megatron-LM's code: from 5e4fc931ba
// (2026-05-21) to bf32f4415e (2026-07-06) RerunDataIterator kept each microbatch's batch on
// the data-reading rank's GPU until the next step (`stack.keeps_microbatch_batches`, written
// for values regenerated at a commit between the two): the last stage of the 7B test kept
// 4 x 67,207,168 B, exactly what its H100 values read above the same test's earlier values
// and its GB200 values. Megatron-FSDP changed twice under the values of its five cases:
// before 41f3b6f308 (2026-04-02) the final norm's hook gathered every layer again on every
// forward, not only the first (`stack.fsdp_final_norm_gathers_every_forward`), and before
// 378d81fbd3 (#4717, 2026-05-30) reset() released the non-unit buckets too
// (`stack.fsdp_reset_releases_non_unit`).
struct ValidationCase {
  std::string path;  // the file it came from, for messages
  std::string name;
  std::string source_repository, source_commit, source_config, source_golden_values;
  std::string gpu;
  int64_t world_size = 0;
  int64_t rank = 0;  // whose memory was logged
  std::map<std::string, std::string> env;
  // Note [Software of a measurement]: PyTorch's default cuBLAS workspace (a
  // CUBLAS_WORKSPACE_CONFIG value) in the software that recorded the values, where it
  // differs from the PyTorch memsim follows; empty: the same. Applies only when `env` sets
  // no CUBLAS_WORKSPACE_CONFIG.
  std::string default_cublas_workspace_config;
  // Note [Software of a measurement]: Megatron-LM arguments whose default, in the code that
  // recorded the values, differs from today's (argument -> value); applied when `args`
  // does not give the argument.
  std::map<std::string, std::string> default_args;
  // Note [Software of a measurement]: the values were recorded on Megatron-LM that kept every
  // microbatch's batch on the GPU (TrainingConfig::keeps_microbatch_batches).
  bool keeps_microbatch_batches = false;
  // Note [Software of a measurement]: Megatron-FSDP before 41f3b6f308 and before #4717
  // (TrainingConfig::fsdp_final_norm_gathers_every_forward, fsdp_reset_releases_non_unit).
  bool fsdp_final_norm_gathers_every_forward = false;
  bool fsdp_reset_releases_non_unit = false;
  // The date the golden values were last regenerated (YYYY-MM-DD); empty if unknown.
  std::string recorded;
  // The launch line, built from the case's MODEL_ARGS as Megatron-LM's functional-test
  // runner (_run_training.sh) builds it: `true` is a bare flag, a list gives its values.
  std::vector<std::string> args;
  int64_t iteration = 0;  // the step the values were logged at
  // torch.cuda.memory_stats()["allocated_bytes.all.peak"] since process start.
  int64_t max_allocated_bytes = 0;
  // torch.cuda.memory_allocated() after that step's optimizer step; absent if not logged.
  std::optional<int64_t> allocated_bytes;
  // torch.cuda.memory_stats()["reserved_bytes.all.peak"] since process start: the caching
  // allocator's segments at their most. Megatron-LM's golden values do not keep it (its
  // TensorBoard logs the current value); memsim's own measurements (validation/fake_pg) do.
  std::optional<int64_t> max_reserved_bytes;
  // Seconds per iteration (TensorBoard's iteration-time), the median of the steady steps;
  // absent if not logged. Reported beside the memory, not yet held to a tolerance.
  std::optional<double> iteration_time_s;
  // When and by which Megatron-LM commit the timings were last regenerated (they are apart
  // from the memory values: a deterministic test's whenever its container changes); empty
  // if unknown.
  std::string iteration_time_recorded;
  std::string iteration_time_commit;
};

// Reads one case file. A missing or malformed field is an error naming file and field.
Status LoadValidationCase(const std::string& path, ValidationCase* out);

// How far memsim may be from a case's values, in percent of the real value.
struct Tolerance {
  double max_allocated_pct = 0.5;
  double allocated_pct = 0.5;
  double max_reserved_pct = 0.5;
  std::string reason;            // required when any is above 0.5
  std::string expected_refusal;  // non-empty: memsim cannot yet express the case
};

// Reads validation/tolerances.yaml: case name -> Tolerance.
Status LoadTolerances(const std::string& path, std::map<std::string, Tolerance>* out);

// The command: parses argv (after "validate"), runs the cases, prints the table, writes
// the report; returns the exit code (2 when any case is outside its tolerance).
int ValidateCommand(int argc, const char* const* argv);

}  // namespace memsim
