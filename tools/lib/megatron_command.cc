#include "tools/lib/megatron_command.h"

#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "tools/lib/exit_codes.h"
#include "tools/lib/megatron_args.h"
#include "tools/lib/simulate.h"

namespace memsim {

int MegatronCommand(int argc, const char* const* argv) {
  // memsim megatron [--world-size N] [--gpu G] [--out DIR] [--json] [--check] -- ARGS...
  ReportOptions report;
  std::string gpu_name = "H100-80GB";
  int64_t world_size = 0;
  int64_t iterations = 0;
  int i = 1;
  for (; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&](const char* name) -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "memsim megatron: %s needs a value\n", name);
        std::exit(kExitError);
      }
      return argv[++i];
    };
    if (arg == "--") {
      ++i;
      break;
    } else if (arg == "--help" || arg == "-h") {
      std::printf(
          "memsim megatron [--world-size N] [--gpu GPU] [--iterations N] [--out DIR] [--json] "
          "[--check] -- "
          "<pretrain_gpt.py arguments>\n\n"
          "Simulates a Megatron-LM launch line. World size comes from --world-size or WORLD_SIZE.\n"
          "Arguments that do not change memory are listed as ignored; one that changes memory in "
          "a\n"
          "way memsim does not model is refused.\n\nExample:\n"
          "  WORLD_SIZE=16 memsim megatron -- --num-layers 32 --hidden-size 4096 \\\n"
          "      --num-attention-heads 32 --seq-length 4096 --max-position-embeddings 4096 \\\n"
          "      --micro-batch-size 1 --global-batch-size 64 --tensor-model-parallel-size 4 \\\n"
          "      --bf16 --use-distributed-optimizer --vocab-size 50257 --lr 1e-4\n");
      return kExitOk;
    } else if (arg == "--world-size") {
      world_size = std::atoll(value("--world-size"));
    } else if (arg == "--iterations") {
      iterations = std::atoll(value("--iterations"));
    } else if (arg == "--gpu") {
      gpu_name = value("--gpu");
    } else if (arg == "--out") {
      report.out_dir = value("--out");
    } else if (arg == "--json") {
      report.json = true;
    } else if (arg == "--check") {
      report.check = true;
    } else {
      std::fprintf(stderr,
                   "memsim megatron: unknown option '%s'; put Megatron-LM's arguments after --\n",
                   arg.c_str());
      return kExitError;
    }
  }
  if (world_size == 0) {
    const char* env = std::getenv("WORLD_SIZE");
    world_size = env != nullptr ? std::atoll(env) : 0;
  }
  if (world_size <= 0) {
    std::fprintf(stderr,
                 "memsim megatron: give the number of GPUs with --world-size or WORLD_SIZE\n");
    return kExitError;
  }
  const std::vector<std::string> args(argv + i, argv + argc);
  std::map<std::string, std::string> env;
  for (const std::string& name : ModelledEnvNames()) {
    if (const char* value = std::getenv(name.c_str())) env[name] = value;
  }
  MegatronArgsResult parsed;
  Status status = ParseMegatronArgs(args, env, world_size, &parsed);
  if (status.ok()) status = ParseGpu(gpu_name, &parsed.spec.gpu);
  if (status.ok() && iterations != 0) {
    if (iterations < 0 || iterations > 1000) {
      status = Status::Error("--iterations must be in [1, 1000]");
    } else {
      parsed.spec.training.iterations = static_cast<int32_t>(iterations);
    }
  }
  if (status.ok()) status = FinalizeRunSpec(&parsed.spec);
  if (!status.ok()) {
    std::fprintf(stderr, "memsim megatron: %s\n", status.message().c_str());
    return kExitError;
  }
  if (!parsed.ignored.empty()) {
    std::string list;
    for (const std::string& a : parsed.ignored) list += (list.empty() ? "" : " ") + a;
    std::fprintf(stderr, "memsim megatron: ignored (no effect on memory): %s\n", list.c_str());
  }
  return SimulateAndReport(parsed.spec, report, "megatron");
}

}  // namespace memsim
