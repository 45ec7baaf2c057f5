// memsim: GPU memory of LLM training, simulated on meta tensors.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "simulator/status.h"
#include "tools/lib/exit_codes.h"
#include "tools/lib/heap_tuning.h"
#include "tools/lib/megatron_command.h"
#include "tools/lib/plan.h"
#include "tools/lib/plots_runner.h"
#include "tools/lib/simulate.h"
#include "tools/lib/sweep.h"
#include "tools/lib/validate.h"
#include "tools/lib/version.h"

namespace {

void PrintUsage() {
  std::printf(
      "usage: memsim <command> [options]      (memsim --version: the modelled releases)\n\n"
      "commands:\n"
      "  simulate   simulate one training configuration (no options: the default example)\n"
      "  plan       which layout to run: search the layouts, rank those that fit by step time\n"
      "  sweep      simulate every valid layout over value lists; logs, tables, traces\n"
      "  merge      join the outputs of sweep shards\n"
      "  megatron   simulate a Megatron-LM launch line: memsim megatron -- <arguments>\n"
      "  validate   compare memsim with the real measurements in validation/\n"
      "  compare    plot real vs simulated memory traces, rank by rank\n"
      "  heatmap    TP x PP heatmap of a sweep's peaks\n"
      "  analyze    analyze a PyTorch memory snapshot pickle\n"
      "  report     figures and tables of a simulated run's memory\n"
      "  view       one self-contained HTML page of a simulate, sweep or plan folder\n"
      "  plan-figures  redraw memsim plan's figures from its plan.json\n\n"
      "Run 'memsim <command> --help' for a command's options and examples.\n");
}

// The plotting and analysis commands are Python (matplotlib): run tools/plots with an
// interpreter that has it (PlotsPython).
int RunPlotsCommand(int argc, char** argv) {
  const std::string python = memsim::PlotsPython();
  const std::string script = memsim::PlotsScript();
  std::vector<char*> args = {const_cast<char*>(python.c_str()), const_cast<char*>(script.c_str())};
  for (int i = 1; i < argc; ++i) args.push_back(argv[i]);
  args.push_back(nullptr);
  ::execvp(args[0], args.data());
  std::fprintf(stderr,
               "memsim %s: cannot run %s: %s; set MEMSIM_PYTHON to a Python 3 with matplotlib\n",
               argv[1], python.c_str(), std::strerror(errno));
  return memsim::kExitError;
}

}  // namespace

int main(int argc, char** argv) {
  memsim::KeepFreedMemoryMapped();  // Note [Keeping freed memory]
  if (argc < 2 || std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0) {
    PrintUsage();
    return argc < 2 ? memsim::kExitError : memsim::kExitOk;
  }
  const std::string command = argv[1];
  if (command == "--version") {
    std::printf("memsim %s\nmodels %s, %s, %s; %s\n", memsim::kMemsimVersion,
                memsim::kModelledMegatronCore, memsim::kModelledTransformerEngine,
                memsim::kModelledPyTorch, memsim::kModelledMegatronBridge);
    return memsim::kExitOk;
  }
  try {
    if (command == "simulate") return memsim::SimulateCommand(argc - 1, argv + 1);
    if (command == "plan") return memsim::PlanCommand(argc - 1, argv + 1);
    if (command == "sweep") return memsim::SweepCommand(argc - 1, argv + 1);
    if (command == "merge") return memsim::MergeCommand(argc - 1, argv + 1);
    if (command == "megatron") return memsim::MegatronCommand(argc - 1, argv + 1);
    if (command == "validate") return memsim::ValidateCommand(argc - 1, argv + 1);
    if (command == "compare" || command == "heatmap" || command == "analyze" ||
        command == "report" || command == "view" || command == "plan-figures") {
      return RunPlotsCommand(argc, argv);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "memsim %s: internal error: %s\n", memsim::EscapeControl(command).c_str(),
                 memsim::EscapeControl(e.what()).c_str());
    return memsim::kExitError;
  }
  std::fprintf(stderr, "memsim: unknown command '%s' (see memsim --help)\n",
               memsim::EscapeControl(command).c_str());
  return memsim::kExitError;
}
