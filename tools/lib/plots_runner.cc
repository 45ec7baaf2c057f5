#include "tools/lib/plots_runner.h"

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

extern char** environ;

namespace memsim {

std::string PlotsPython() {
  if (const char* configured = std::getenv("MEMSIM_PYTHON")) return configured;
  return ::access("/usr/bin/python3", X_OK) == 0 ? "/usr/bin/python3" : "python3";
}

std::string PlotsScript() {
  return std::string(MEMSIM_SOURCE_DIR) + "/tools/plots/memsim_plots.py";
}

int RunPlotsChild(const std::string& command, const std::vector<std::string>& args,
                  std::string* error) {
  std::vector<std::string> words = {PlotsPython(), PlotsScript(), command};
  words.insert(words.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& w : words) argv.push_back(w.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  const int spawned = ::posix_spawnp(&pid, argv[0], nullptr, nullptr, argv.data(), environ);
  if (spawned != 0) {
    *error = "cannot run " + words[0] + ": " + std::strerror(spawned) +
             "; set MEMSIM_PYTHON to a Python 3 with matplotlib";
    return -1;
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) {
      *error = std::string("waiting for the plotting tool: ") + std::strerror(errno);
      return -1;
    }
  }
  if (!WIFEXITED(status)) {
    *error = "the plotting tool was killed";
    return -1;
  }
  return WEXITSTATUS(status);
}

}  // namespace memsim
