// memsim: GPU memory of LLM training, simulated on meta tensors.
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

#include "tools/lib/exit_codes.h"
#include "tools/lib/simulate.h"
#include "tools/lib/sweep.h"

namespace {

void PrintUsage() {
  std::printf(
      "usage: memsim <command> [options]\n\n"
      "commands:\n"
      "  simulate   simulate one training configuration (no options: the default example)\n"
      "  sweep      simulate every valid layout over value lists; logs, tables, traces\n"
      "  merge      join the outputs of sweep shards\n\n"
      "Run 'memsim <command> --help' for a command's options and examples.\n");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0) {
    PrintUsage();
    return argc < 2 ? memsim::kExitError : memsim::kExitOk;
  }
  const std::string command = argv[1];
  try {
    if (command == "simulate") return memsim::SimulateCommand(argc - 1, argv + 1);
    if (command == "sweep") return memsim::SweepCommand(argc - 1, argv + 1);
    if (command == "merge") return memsim::MergeCommand(argc - 1, argv + 1);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "memsim %s: internal error: %s\n", command.c_str(), e.what());
    return memsim::kExitError;
  }
  std::fprintf(stderr, "memsim: unknown command '%s' (see memsim --help)\n", command.c_str());
  return memsim::kExitError;
}
