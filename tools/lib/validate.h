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

struct ValidationCase {
  std::string path;  // the file it came from, for messages
  std::string name;
  std::string source_repository, source_commit, source_config, source_golden_values;
  std::string gpu;
  int64_t world_size = 0;
  int64_t rank = 0;  // whose memory was logged
  std::map<std::string, std::string> env;
  // The launch line, built from the case's MODEL_ARGS as Megatron-LM's functional-test
  // runner (_run_training.sh) builds it: `true` is a bare flag, a list gives its values.
  std::vector<std::string> args;
  int64_t iteration = 0;  // the step the values were logged at
  // torch.cuda.memory_stats()["allocated_bytes.all.peak"] since process start.
  int64_t max_allocated_bytes = 0;
  // torch.cuda.memory_allocated() after that step's optimizer step; absent if not logged.
  std::optional<int64_t> allocated_bytes;
  // Seconds per iteration (TensorBoard's iteration-time), the median of the steady steps;
  // absent if not logged. Reported beside the memory, not yet held to a tolerance.
  std::optional<double> iteration_time_s;
};

// Reads one case file. A missing or malformed field is an error naming file and field.
Status LoadValidationCase(const std::string& path, ValidationCase* out);

// How far memsim may be from a case's values, in percent of the real value.
struct Tolerance {
  double max_allocated_pct = 0.5;
  double allocated_pct = 0.5;
  std::string reason;            // required when either is above 0.5
  std::string expected_refusal;  // non-empty: memsim cannot yet express the case
};

// Reads validation/tolerances.yaml: case name -> Tolerance.
Status LoadTolerances(const std::string& path, std::map<std::string, Tolerance>* out);

// The command: parses argv (after "validate"), runs the cases, prints the table, writes
// the report; returns the exit code (2 when any case is outside its tolerance).
int ValidateCommand(int argc, const char* const* argv);

}  // namespace memsim
