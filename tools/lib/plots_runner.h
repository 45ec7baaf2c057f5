// Running the Python plotting tools (tools/plots/memsim_plots.py, matplotlib) from memsim.
#pragma once

#include <string>
#include <vector>

namespace memsim {

// The interpreter: $MEMSIM_PYTHON, else Debian's /usr/bin/python3, else python3 on PATH.
std::string PlotsPython();
// tools/plots/memsim_plots.py in the source tree.
std::string PlotsScript();

// Runs `memsim_plots.py command args...` as a child process and waits for it; returns its
// exit code, or -1 when it could not be started or did not exit normally (`error` says
// why). Its stdout and stderr are this process's.
int RunPlotsChild(const std::string& command, const std::vector<std::string>& args,
                  std::string* error);

}  // namespace memsim
