// The memsim command line, run as a user runs it: the default example, the files it
// writes, and one-line errors with exit code 2 for bad input.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

namespace memsim {
namespace {
namespace fs = std::filesystem;

struct CommandResult {
  int exit_code;
  std::string out;  // stdout
  std::string err;  // stderr
};

std::string Binary() {
  const char* path = std::getenv("MEMSIM_BINARY");
  return path != nullptr ? path : "build/memsim";
}

CommandResult Memsim(const std::string& args) {
  const std::string dir = ::testing::TempDir() + "/memsim_cli";
  fs::create_directories(dir);
  const std::string err_path = dir + "/stderr.txt";
  const std::string command = Binary() + " " + args + " 2>" + err_path;
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

std::string Temp(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "/memsim_cli_" + name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

int Lines(const std::string& text) {
  int lines = 0;
  for (char c : text) lines += c == '\n';
  return lines;
}

TEST(Cli, DefaultExamplePrintsPerRankPeakAndWritesFiles) {
  const std::string out = Temp("default");
  const CommandResult run = Memsim("simulate --out " + out);
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_NE(run.out.find("peak alloc"), std::string::npos);
  EXPECT_NE(run.out.find("gpt3-1.3b"), std::string::npos);
  for (const char* file :
       {"memory_trace_rank0.json", "summary_rank0.json", "snapshot_rank0.pickle"}) {
    EXPECT_TRUE(fs::is_regular_file(out + "/" + file)) << file;
  }
  std::ifstream trace(out + "/memory_trace_rank0.json");
  const nlohmann::json j = nlohmann::json::parse(trace);
  EXPECT_TRUE(j.contains("0") && j.contains("1"));
}

TEST(Cli, JsonListsEveryRankClass) {
  const std::string out = Temp("json");
  const CommandResult run = Memsim(
      "simulate --model gpt3-1.3b --world-size 8 --tp 2 --pp 2 --global-batch-size 8 "
      "--seq-length 512 --iterations 1 --json --out " +
      out);
  ASSERT_EQ(run.exit_code, 0) << run.err;
  const nlohmann::json j = nlohmann::json::parse(run.out);
  ASSERT_EQ(j["rank_classes"].size(), 2u);
  EXPECT_EQ(j["rank_classes"][1]["pp_stage"], 1);
  EXPECT_EQ(j["rank_classes"][1]["ranks"], nlohmann::json({4, 5, 6, 7}));
}

TEST(Cli, CheckExitsThreeWhenARankDoesNotFit) {
  const CommandResult run = Memsim(
      "simulate --model gpt3-175b --seq-length 2048 --iterations 1 --check --out " + Temp("check"));
  EXPECT_EQ(run.exit_code, 3) << run.err;
  EXPECT_NE(run.out.find("NO (out of memory)"), std::string::npos);
}

void ExpectOneLineError(const CommandResult& run, const std::string& needle) {
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_EQ(Lines(run.err), 1) << run.err;
  EXPECT_NE(run.err.find(needle), std::string::npos) << run.err;
}

TEST(Cli, BadInputIsOneLineAndExitTwo) {
  const std::string dir = Temp("bad");
  ExpectOneLineError(Memsim("simulate --model no-such-model"),
                     "unknown model preset 'no-such-model'");
  ExpectOneLineError(Memsim("simulate --config " + dir + "/missing.yaml"), "no such file");
  std::ofstream(dir + "/malformed.yaml") << "model: gpt3-1.3b\ntraining: [1, 2\n";
  ExpectOneLineError(Memsim("simulate --config " + dir + "/malformed.yaml"), "malformed YAML");
  std::ofstream(dir + "/unknown.yaml") << "model: gpt3-1.3b\ntraining:\n  seq_lenght: 4096\n";
  ExpectOneLineError(Memsim("simulate --config " + dir + "/unknown.yaml"),
                     "unknown.yaml:3: unknown key 'seq_lenght' in training");
  std::ofstream(dir + "/type.yaml") << "model: gpt3-1.3b\ntraining:\n  seq_length: long\n";
  ExpectOneLineError(Memsim("simulate --config " + dir + "/type.yaml"),
                     "type.yaml:3: 'seq_length' has a value of the wrong type");
  ExpectOneLineError(Memsim("simulate --model llama3-8b --world-size 3 --tp 3"),
                     "TP=3 does not divide 32 attention heads");
  ExpectOneLineError(Memsim("simulate --gpu V100"), "unknown GPU 'V100'");
  ExpectOneLineError(Memsim("simulate --out /proc/memsim_not_writable"),
                     "/proc/memsim_not_writable");
  ExpectOneLineError(Memsim("simulate --no-such-flag"), "no-such-flag");
  ExpectOneLineError(Memsim("frobnicate"), "unknown command 'frobnicate'");
  // A file in the way of the output folder.
  std::ofstream(dir + "/file") << "x";
  ExpectOneLineError(Memsim("simulate --out " + dir + "/file"), dir + "/file");
}

TEST(Cli, HelpHasExamples) {
  const CommandResult run = Memsim("simulate --help");
  EXPECT_EQ(run.exit_code, 0);
  EXPECT_NE(run.out.find("Examples:"), std::string::npos);
}

}  // namespace
}  // namespace memsim
