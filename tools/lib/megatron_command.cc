#include "tools/lib/megatron_command.h"

#include <boost/program_options.hpp>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "tools/lib/command_line.h"
#include "tools/lib/exit_codes.h"
#include "tools/lib/megatron_arg_table.h"
#include "tools/lib/megatron_args.h"
#include "tools/lib/simulate.h"

namespace memsim {
namespace po = boost::program_options;

int LaunchLineSeparator(int argc, const char* const* argv) {
  int separator = 1;
  while (separator < argc && std::string(argv[separator]) != "--") ++separator;
  return separator;
}

Status ReadLaunchLine(const std::vector<std::string>& args, int64_t world_size,
                      MegatronArgsResult* parsed) {
  if (world_size == 0) {
    const char* env = std::getenv("WORLD_SIZE");
    char* end = nullptr;
    world_size = env != nullptr ? std::strtoll(env, &end, 10) : 0;
    if (env == nullptr || *env == '\0' || *end != '\0' || world_size <= 0) {
      return Status::Error(
          "give the number of GPUs with --world-size or WORLD_SIZE (a positive integer)");
    }
  }
  std::map<std::string, std::string> env;
  for (const std::string& name : ModelledEnvNames()) {
    if (const char* value = std::getenv(name.c_str())) env[name] = value;
  }
  return ParseMegatronArgs(args, env, world_size, parsed);
}

int MegatronCommand(int argc, const char* const* argv) {
  // memsim's own options come before "--", Megatron-LM's arguments after it.
  const int separator = LaunchLineSeparator(argc, argv);
  po::options_description options(
      "memsim megatron [options] -- <pretrain_gpt.py arguments>\n\n"
      "Simulates a Megatron-LM launch line. The world size comes from --world-size or\n"
      "WORLD_SIZE; CUBLAS_WORKSPACE_CONFIG, NVTE_FLASH_ATTN, NVTE_FUSED_ATTN, NVTE_UNFUSED_ATTN,\n"
      "NVTE_ALLOW_NONDETERMINISTIC_ALGO and PYTORCH_CUDA_ALLOC_CONF are read from the\n"
      "environment. Arguments that do not change memory are listed as ignored; one that\n"
      "changes memory in a way memsim does not model is refused.\n\n"
      "Examples:\n"
      "  WORLD_SIZE=16 memsim megatron -- --num-layers 32 --hidden-size 4096 \\\n"
      "      --num-attention-heads 32 --seq-length 4096 --max-position-embeddings 4096 \\\n"
      "      --micro-batch-size 1 --global-batch-size 64 --tensor-model-parallel-size 4 \\\n"
      "      --bf16 --use-distributed-optimizer --vocab-size 50257 --lr 1e-4\n"
      "  memsim megatron --refused    (the arguments memsim refuses, and why)\n\n"
      "Options");
  int64_t world_size = 0, iterations = 0;
  double moe_imbalance = 0, gpu_memory_gib = 0;
  std::string gpu_name = "H100-80GB";
  ReportOptions report;
  bool list_refused = false;
  options.add_options()("help,h", "show this help")(
      "refused", po::bool_switch(&list_refused),
      "list the Megatron-LM arguments memsim refuses, with what each changes, and exit")(
      "world-size", PositiveValue(&world_size, "world-size"), "number of GPUs")(
      "gpu", po::value(&gpu_name), ("GPU preset: " + GpuPresetNames()).c_str())(
      "iterations", PositiveValue(&iterations, "iterations"), "training iterations to record");
  AddMoeImbalanceOption(&options, &moe_imbalance);
  AddGpuMemoryOption(&options, &gpu_memory_gib);
  AddReportOptions(&options, &report);
  po::variables_map vm;
  if (auto exit_code = ParseCommandLine(separator, argv, options, "megatron", &vm)) {
    return *exit_code;
  }
  if (list_refused) {
    for (const auto& [name, what] : UnmodelledMegatronArgs()) {
      std::printf("%-48s %s\n", name.c_str(), what.c_str());
    }
    return kExitOk;
  }
  Status status = CheckReportOptions(report);
  if (status.ok() && iterations > 1000) status = Status::Error("--iterations must be in [1, 1000]");
  MegatronArgsResult parsed;
  const std::vector<std::string> args(argv + std::min(separator + 1, argc), argv + argc);
  if (status.ok()) status = ReadLaunchLine(args, world_size, &parsed);
  if (status.ok()) status = ParseGpu(gpu_name, &parsed.spec.gpu);
  if (status.ok()) status = ApplyGpuMemory(gpu_memory_gib, &parsed.spec.gpu);
  if (status.ok() && iterations != 0) {
    parsed.spec.training.iterations = static_cast<int32_t>(iterations);
  }
  if (moe_imbalance != 0) parsed.spec.model.moe_imbalance_factor = moe_imbalance;
  if (status.ok()) {
    std::optional<ValidatedRun> checked;
    status = FinalizeRunSpec(parsed.spec, &checked);
  }
  if (!status.ok()) {
    std::fprintf(stderr, "memsim megatron: %s\n", status.message().c_str());
    return kExitError;
  }
  if (!parsed.ignored.empty()) {
    std::string list;
    for (const std::string& a : parsed.ignored) list += (list.empty() ? "" : " ") + a;
    std::fprintf(stderr, "memsim megatron: ignored (no effect on memory): %s\n",
                 EscapeControl(list).c_str());
  }
  for (const std::string& note : parsed.notes) {
    std::fprintf(stderr, "memsim megatron: %s\n", EscapeControl(note).c_str());
  }
  return SimulateAndReport(parsed.spec, report, "megatron");
}

}  // namespace memsim
