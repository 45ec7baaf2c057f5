// memsim sweep: the seeds' logs and file names, every layout accounted for, and a sweep
// interrupted (here: only one shard run) and resumed equals one run straight through.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <string>

namespace memsim {
namespace {
namespace fs = std::filesystem;

int Memsim(const std::string& args) {
  const std::string command = std::string(MEMSIM_BINARY_PATH) + " " + args + " >/dev/null 2>&1";
  return WEXITSTATUS(std::system(command.c_str()));
}

std::string Read(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::string Dir(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "/memsim_sweep_" + name;
  fs::remove_all(dir);
  return dir;
}

const char* kSweep =
    "sweep --model gpt3-1.3b --world-size 16 --seq-length 256 --precision fp16 --tp 1,2,3 "
    "--pp 1,2,4 --microbatches-per-pp 2 --data-parallel distributed-optimizer --gpu H100-80GB ";

TEST(Sweep, WritesSeedsLogsAndNames) {
  const std::string out = Dir("full");
  ASSERT_EQ(Memsim(std::string(kSweep) + "--out " + out), 0);
  const std::string success = Read(out + "/successful_configs.log");
  const std::string failed = Read(out + "/failed_configs.log");
  // 3 TP x 3 PP = 9 layouts; TP=3 does not divide 16 GPUs: 3 invalid (DP 0).
  const std::regex line(
      R"(Config \d+: TP=\d+, PP=\d+, DP=\d+, NUM_MICBATCH=\d+, GLOBAL_BATCH_SIZE=\d+ - (SUCCESS|FAILED \(.+\)))");
  int lines = 0;
  for (const std::string* log : {&success, &failed}) {
    std::stringstream stream(*log);
    std::string l;
    while (std::getline(stream, l)) {
      EXPECT_TRUE(std::regex_match(l, line)) << l;
      ++lines;
    }
  }
  EXPECT_EQ(lines, 9);
  EXPECT_NE(
      failed.find("Config 7: TP=3, PP=1, DP=0, NUM_MICBATCH=2, GLOBAL_BATCH_SIZE=0 - FAILED "
                  "(invalid layout: world size 16 is not a multiple of TP*PP*CP = 3*1*1 = 3)"),
      std::string::npos)
      << failed;
  // TP=2, PP=4: DP = 16 / 8 = 2, 2*4 = 8 microbatches, global batch 8 * 1 * 2 = 16; one
  // trace per stage, named as the seeds name them.
  EXPECT_NE(
      success.find("Config 6: TP=2, PP=4, DP=2, NUM_MICBATCH=8, GLOBAL_BATCH_SIZE=16 - SUCCESS"),
      std::string::npos)
      << success;
  for (int rank : {0, 4, 8, 12}) {
    const std::string name = out + "/memory_trace_rank" + std::to_string(rank) +
                             "_wd16_tp2_pp4_dp2_exp1_expNumNone_l24_mbs1_nmbs8_gbs16_ts256.json";
    EXPECT_TRUE(fs::is_regular_file(name)) << name;
  }
  const nlohmann::json table = nlohmann::json::parse(Read(out + "/sweep_results.json"));
  EXPECT_EQ(table.size(), 9u);
  EXPECT_NE(Read(out + "/sweep_results.csv").find("config,tp,pp"), std::string::npos);
}

TEST(Sweep, ResumedShardsEqualOneRun) {
  const std::string full = Dir("straight");
  ASSERT_EQ(Memsim(std::string(kSweep) + "--out " + full), 0);
  const std::string resumed = Dir("resumed");
  ASSERT_EQ(Memsim(std::string(kSweep) + "--shard 0/3 --out " + resumed), 0);  // "killed"
  ASSERT_EQ(Memsim(std::string(kSweep) + "--resume --out " + resumed), 0);
  for (const char* file :
       {"successful_configs.log", "failed_configs.log", "sweep_results.csv", "sweep_results.json",
        "memory_trace_rank4_wd16_tp2_pp4_dp2_exp1_expNumNone_l24_mbs1_nmbs8_gbs16_ts256.json"}) {
    EXPECT_EQ(Read(full + "/" + file), Read(resumed + "/" + file)) << file;
  }
  // Shards run apart and merged also equal it.
  const std::string a = Dir("shard_a"), b = Dir("shard_b"), merged = Dir("merged");
  ASSERT_EQ(Memsim(std::string(kSweep) + "--shard 0/2 --out " + a), 0);
  ASSERT_EQ(Memsim(std::string(kSweep) + "--shard 1/2 --out " + b), 0);
  ASSERT_EQ(Memsim("merge " + merged + " " + a + " " + b), 0);
  EXPECT_EQ(Read(full + "/sweep_results.csv"), Read(merged + "/sweep_results.csv"));
  EXPECT_NE(Memsim("sweep --model gpt3-1.3b --shard 3/2 --out " + Dir("bad")), 0);
}

}  // namespace
}  // namespace memsim
