// Runs the memsim binary as a user does, for the tests of the command line.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

namespace memsim::test {

struct CommandResult {
  int exit_code;    // -1: ended by a signal
  std::string out;  // stdout
  std::string err;  // stderr
};

// `memsim ARGS` (ARGS as a shell would split them), with `env` (NAME=VALUE ...) set.
inline CommandResult RunMemsim(const std::string& args, const std::string& env = "") {
  const std::string dir = ::testing::TempDir() + "/memsim_runner";
  std::filesystem::create_directories(dir);
  // Per process: ctest runs test cases in parallel.
  const std::string err_path = dir + "/stderr." + std::to_string(::getpid()) + ".txt";
  const std::string command =
      env + " " + std::string(MEMSIM_BINARY_PATH) + " " + args + " 2>" + err_path;
  CommandResult run{};
  FILE* pipe = popen(command.c_str(), "r");
  std::array<char, 4096> buffer{};
  size_t n;
  while ((n = fread(buffer.data(), 1, buffer.size(), pipe)) > 0) run.out.append(buffer.data(), n);
  const int status = pclose(pipe);
  run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream err(err_path);
  run.err.assign(std::istreambuf_iterator<char>(err), {});
  return run;
}

}  // namespace memsim::test
