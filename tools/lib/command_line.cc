#include "tools/lib/command_line.h"

#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <vector>

#include "simulator/custom_gpu.h"
#include "simulator/format.h"
#include "tools/lib/exit_codes.h"
#include "tools/lib/hf_config.h"

namespace memsim {
namespace po = boost::program_options;

void AddSpecOptions(po::options_description* options, SpecOptions* v,
                    std::string* seq_length_list) {
  options->add_options()("config", po::value(&v->config), "YAML run file")(
      "model", po::value(&v->model),
      "model preset name (configs/models), overriding the run file's")(
      "hf-config", po::value(&v->hf_config),
      "a Hugging Face config.json (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral, DeepSeek-V3, "
      "GLM-4.5, Phi-3, gpt-oss)")("gpu", po::value(&v->gpu),
                                  ("GPU preset: " + GpuPresetNames()).c_str())(
      "world-size", PositiveValue(&v->world_size, "world-size"), "number of GPUs")(
      "global-batch-size", PositiveValue(&v->global_batch_size, "global-batch-size"),
      "sequences per iteration over all data-parallel ranks")("precision", po::value(&v->precision),
                                                              "fp32, bf16 or fp16")(
      "attention", po::value(&v->attention), "flash or eager")(
      "profile", po::value(&v->profile),
      "kernels mirrored: local (Megatron-Core) or transformer_engine")(
      "data-parallel", po::value(&v->data_parallel),
      "ddp, distributed-optimizer (ZeRO-1), zero2 or fsdp")(
      "sp", po::bool_switch(&v->sequence_parallel), "sequence parallelism")(
      "iterations", PositiveValue(&v->iterations, "iterations"), "training iterations to record");
  AddMoeImbalanceOption(options, &v->moe_imbalance);
  AddGpuMemoryOption(options, &v->gpu_memory_gib);
  if (seq_length_list != nullptr) {
    options->add_options()("seq-length", po::value(seq_length_list),
                           "sequence lengths, a list like 2048,4096");
  } else {
    options->add_options()("seq-length", PositiveValue(&v->seq_length, "seq-length"),
                           "sequence length");
  }
}

namespace {

// 0 would read as "not given": refused here; FinalizeModelConfig checks the rest.
void CheckMoeImbalance(double value) {
  if (!(value >= 1)) {
    throw po::error("--moe-imbalance is the busiest expert's load over the mean: at least 1, got " +
                    FormatNumber(value));
  }
}

}  // namespace

void AddMoeImbalanceOption(po::options_description* options, double* out) {
  options->add_options()("moe-imbalance", po::value(out)->notifier(&CheckMoeImbalance),
                         "MoE: the busiest expert's load over the mean (default 1: even routing)");
}

void AddGpuMemoryOption(po::options_description* options, double* out) {
  options->add_options()("gpu-memory", po::value(out),
                         "the GPU's memory in GiB as nvidia-smi reports it, replacing the "
                         "preset's (its rates and links stay the preset's)");
}

Status ApplyGpuMemory(double gib, const GpuSpec** gpu) {
  if (gib == 0) return Status::OK();
  const double context_gib = static_cast<double>((*gpu)->context_bytes) / (1 << 30);
  if (!(gib > context_gib && gib <= 1e6)) {
    return Status::Error("--gpu-memory must be more than the CUDA context's " +
                         FormatNumber(context_gib) + " GiB and at most 1000000 GiB, got " +
                         FormatNumber(gib));
  }
  *gpu = GpuWithMemory(**gpu, static_cast<int64_t>(std::llround(gib * (1 << 30))));
  return Status::OK();
}

Status ParseIntList(const std::string& text, const char* name, std::vector<int64_t>* out) {
  out->clear();
  std::stringstream stream(text);
  std::string item;
  while (std::getline(stream, item, ',')) {
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || v <= 0 || errno == ERANGE) {
      return Status::Error(std::string("--") + name + ": '" + EscapeControl(item) +
                           "' is not a positive integer; give a list like 1,2,4,8");
    }
    out->push_back(v);
  }
  if (out->empty()) return Status::Error(std::string("--") + name + " is empty");
  return Status::OK();
}

void ShowProgress(const char* unit, size_t done, size_t total, double elapsed_s) {
  if (!::isatty(STDERR_FILENO) || total == 0) return;
  const int width = 30;
  const int filled = static_cast<int>(width * done / total);
  const double eta =
      done > 0 ? elapsed_s / static_cast<double>(done) * static_cast<double>(total - done) : 0;
  std::fprintf(stderr, "\r[%s%s] %zu/%zu %s, %.0f s elapsed, ~%.0f s left ",
               std::string(static_cast<size_t>(filled), '#').c_str(),
               std::string(static_cast<size_t>(width - filled), '.').c_str(), done, total, unit,
               elapsed_s, eta);
  if (done == total) std::fprintf(stderr, "\n");
}

void ApplySpecOverrides(const SpecOptions& v, RunSpec* spec) {
  if (v.seq_length) spec->training.seq_length = v.seq_length;
  if (v.global_batch_size) spec->global_batch_size = v.global_batch_size;
  if (v.iterations) spec->training.iterations = static_cast<int32_t>(v.iterations);
  if (v.moe_imbalance) spec->model.moe_imbalance_factor = v.moe_imbalance;
}

Status BuildRunSpec(const SpecOptions& v, bool default_run, const char* command, RunSpec* spec) {
  spec->gpu = FindGpu("H100-80GB");
  Status status;
  if (!v.config.empty()) {
    status = LoadRunFile(v.config, spec);
  } else if (v.model.empty() && v.hf_config.empty()) {
    status = default_run ? LoadDefaultRun(spec)
                         : Status::Error("name a model with --model, --hf-config or --config");
  }
  if (status.ok() && !v.model.empty()) {
    spec->model_source = v.model;
    status = LoadModelPreset(v.model, &spec->model);
  }
  if (status.ok() && !v.hf_config.empty()) {
    spec->model_source = v.hf_config;
    std::vector<std::string> approximations;
    status = LoadHfConfig(v.hf_config, &spec->model, &approximations);
    for (const std::string& note : approximations) {
      std::fprintf(stderr, "memsim %s: note: %s\n", command, note.c_str());
    }
  }
  if (status.ok() && !v.gpu.empty()) status = ParseGpu(v.gpu, &spec->gpu);
  if (status.ok()) status = ApplyGpuMemory(v.gpu_memory_gib, &spec->gpu);
  if (status.ok() && !v.precision.empty())
    status = ParsePrecision(v.precision, &spec->training.precision);
  if (status.ok() && !v.attention.empty())
    status = ParseAttention(v.attention, &spec->training.attention);
  if (status.ok() && !v.profile.empty()) status = ParseProfile(v.profile, &spec->training.profile);
  if (status.ok() && !v.data_parallel.empty()) {
    status = ParseDataParallel(v.data_parallel, &spec->layout.data_parallel);
  }
  if (status.ok() && (v.iterations < 0 || v.iterations > 1000)) {
    status = Status::Error("--iterations must be in [1, 1000]");
  }
  if (v.world_size) spec->layout.world_size = v.world_size;
  if (v.sequence_parallel) spec->layout.sequence_parallel = true;
  ApplySpecOverrides(v, spec);
  return status;
}

std::optional<int> ParseCommandLine(int argc, const char* const* argv,
                                    const po::options_description& options, const char* command,
                                    po::variables_map* vm) {
  try {
    po::store(po::command_line_parser(argc, argv).options(options).run(), *vm);
    po::notify(*vm);
  } catch (const po::error& e) {
    std::fprintf(stderr, "memsim %s: %s (see memsim %s --help)\n", command,
                 EscapeControl(e.what()).c_str(), command);
    return kExitError;
  }
  if (vm->count("help")) {
    std::cout << options << "\n";
    return kExitOk;
  }
  return std::nullopt;
}

}  // namespace memsim
