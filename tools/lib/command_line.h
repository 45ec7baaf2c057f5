// What `memsim simulate` and `memsim sweep` share on their command lines: parsing, and the
// options that say what is trained, how and on what.
#pragma once

#include <boost/program_options.hpp>

#include <cstdint>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "tools/lib/run_config.h"

namespace memsim {

struct SpecOptions {
  std::string config, model, hf_config, gpu, precision, attention, data_parallel, profile;
  int64_t world_size = 0, seq_length = 0, global_batch_size = 0, iterations = 0;
  double moe_imbalance = 0;   // 0: not given
  double gpu_memory_gib = 0;  // --gpu-memory; 0: the preset's
  bool sequence_parallel = false;
};

// --gpu-memory into `out` (0 when not given): the GPU's memory in GiB, as nvidia-smi
// reports it, replacing the preset's (ApplyGpuMemory).
void AddGpuMemoryOption(boost::program_options::options_description* options, double* out);

// Replaces `*gpu` by the same GPU with `gib` GiB of memory (GpuWithMemory); 0 leaves it.
// A size the CUDA context would not leave room in, or beyond 1,000,000 GiB, is an error.
Status ApplyGpuMemory(double gib, const GpuSpec** gpu);

// --moe-imbalance into `out` (0 when not given): the busiest expert's load over the mean
// that MoE runs assume (model moe_imbalance_factor, models/moe.h), at least 1.
void AddMoeImbalanceOption(boost::program_options::options_description* options, double* out);

// With `seq_length_list`, --seq-length takes a list ("2048,4096") into it instead of
// one value into values->seq_length.
void AddSpecOptions(boost::program_options::options_description* options, SpecOptions* values,
                    std::string* seq_length_list = nullptr);

// A numeric option that must be positive: 0 and negatives are a one-line error naming
// the option (a value given as 0 never means "not given").
template <typename T>
boost::program_options::typed_value<T>* PositiveValue(T* out, const std::string& name) {
  return boost::program_options::value(out)->notifier([name](const T& value) {
    if (!(value > 0)) {
      throw boost::program_options::error("--" + name + " must be positive, got " +
                                          std::to_string(value));
    }
  });
}

// Parses a comma-separated list of positive integers ("1,2,4,8") given as --`name`.
Status ParseIntList(const std::string& text, const char* name, std::vector<int64_t>* out);

// Parses a comma-separated list of names ("none,full") with `parse`, which reads one.
template <typename E>
Status ParseNameList(const std::string& text, Status (*parse)(const std::string&, E*),
                     std::vector<E>* out) {
  std::stringstream stream(text);
  std::string item;
  while (std::getline(stream, item, ',')) {
    E value;
    MEMSIM_RETURN_IF_ERROR(parse(item, &value));
    out->push_back(value);
  }
  return Status::OK();
}

// A progress bar on stderr when it is a terminal: "[###...] done/total `unit`, elapsed, left".
void ShowProgress(const char* unit, size_t done, size_t total, double elapsed_s);

// Loads the base (--config run file, --model preset or --hf-config) and applies the other
// options. With none of the three, `default_run` loads the built-in default example;
// otherwise it is an error.
// Applies the options that override a loaded run (sequence length, global batch,
// iterations, MoE imbalance) where they were given; BuildRunSpec and a plan's launch line.
void ApplySpecOverrides(const SpecOptions& values, RunSpec* spec);

Status BuildRunSpec(const SpecOptions& values, bool default_run, const char* command,
                    RunSpec* spec);

// Parses argv. Returns the exit code to stop with (after --help, or a one-line error for
// bad options), or nullopt to go on.
std::optional<int> ParseCommandLine(int argc, const char* const* argv,
                                    const boost::program_options::options_description& options,
                                    const char* command, boost::program_options::variables_map* vm);

}  // namespace memsim
