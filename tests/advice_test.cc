// memsim simulate --advise: each switch's numbers are those of simulating the run with that
// switch (Note [Advice]), so a user can take the advice and get the number it promised.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <string>

#include "tests/support/command_runner.h"

namespace memsim {
namespace {

const char* kRun =
    "simulate --model gpt3-1.3b --world-size 4 --tp 2 --pp 2 --seq-length 512 "
    "--global-batch-size 8 --data-parallel ddp --json ";

nlohmann::json Simulate(const std::string& extra) {
  const std::string out = ::testing::TempDir() + "/memsim_advice";
  // The run's micro batch is 2 unless the switch changes it.
  const std::string micro_batch =
      extra.find("--micro-batch-size") == std::string::npos ? "--micro-batch-size 2 " : "";
  const test::CommandResult run =
      test::RunMemsim(std::string(kRun) + micro_batch + "--out " + out + " " + extra);
  EXPECT_EQ(run.exit_code, 0) << extra << ": " << run.err;
  return nlohmann::json::parse(run.out);
}

double FullestStageMiB(const nlohmann::json& result) {
  double mib = 0;
  for (const auto& c : result["rank_classes"])
    mib = std::max(mib, c["peak_reserved_MB"].get<double>());
  return mib;
}

TEST(Advice, EachSwitchIsTheRunSimulatedWithIt) {
  const nlohmann::json advised = Simulate("--advise");
  const nlohmann::json& advice = advised["advice"];
  // Off in this run and possible on its 4 GPUs: selective and full recomputation, SP,
  // micro batch 1. Left out: the distributed optimizer (DP 1 has nothing to shard), PP 4,
  // TP 4 and CP 2 (8 GPUs with the other dimensions).
  std::vector<std::string> changes;
  for (const auto& a : advice) changes.push_back(a["change"]);
  std::sort(changes.begin(), changes.end());
  EXPECT_EQ(changes, (std::vector<std::string>{"--micro-batch-size 1", "--recompute full",
                                               "--recompute selective", "--sp"}))
      << advice.dump();
  for (const auto& a : advice) {
    SCOPED_TRACE(a.dump());
    const nlohmann::json direct = Simulate(a["change"].get<std::string>());
    EXPECT_DOUBLE_EQ(a["peak_reserved_MB"].get<double>(), FullestStageMiB(direct));
    EXPECT_EQ(a["fits"].get<bool>(), direct["fits"].get<bool>());
  }
  // Sorted by the peak after the change, lowest first.
  for (size_t i = 1; i < advice.size(); ++i) {
    EXPECT_LE(advice[i - 1]["peak_reserved_MB"].get<double>(),
              advice[i]["peak_reserved_MB"].get<double>());
  }
  EXPECT_LT(advice[0]["peak_reserved_MB"].get<double>(), FullestStageMiB(advised));
}

// `change` advised for `run` (a simulate command line), with the numbers of `run` simulated
// with it, and a lower peak than `run`'s own.
void ExpectAdvisedAsSimulated(const std::string& run, const std::string& change) {
  const std::string out = " --json --out " + ::testing::TempDir() + "/memsim_advice_switch ";
  const test::CommandResult advised = test::RunMemsim(run + out + "--advise");
  ASSERT_EQ(advised.exit_code, 0) << advised.err;
  const nlohmann::json result = nlohmann::json::parse(advised.out);
  const test::CommandResult direct = test::RunMemsim(run + out + change);
  ASSERT_EQ(direct.exit_code, 0) << direct.err;
  bool found = false;
  for (const auto& a : result["advice"]) {
    if (a["change"] != change) continue;
    found = true;
    const double changed_mib = FullestStageMiB(nlohmann::json::parse(direct.out));
    EXPECT_DOUBLE_EQ(a["peak_reserved_MB"].get<double>(), changed_mib);
    EXPECT_LT(changed_mib, FullestStageMiB(result));
  }
  EXPECT_TRUE(found) << change << " not in " << result["advice"].dump();
}

// With GPUs to spare for it, twice the context parallelism is advised, and its numbers are
// those of the run with --cp 2 (the sequence split over two GPUs: less activation memory).
TEST(Advice, ContextParallelismWhereTheGpusAllowIt) {
  ExpectAdvisedAsSimulated(
      "simulate --model gpt3-1.3b --world-size 2 --seq-length 2048 --micro-batch-size 1 "
      "--global-batch-size 8",
      "--cp 2");
}

// For a mixture of experts, twice the expert parallelism (fewer experts' weights, gradients
// and optimizer states per GPU).
TEST(Advice, ExpertParallelismForAMixtureOfExperts) {
  ExpectAdvisedAsSimulated(
      "simulate --model mixtral-8x7b --world-size 16 --tp 2 --pp 4 --sp --seq-length 1024 "
      "--micro-batch-size 1 --global-batch-size 8 --data-parallel distributed-optimizer",
      "--ep 2");
}

}  // namespace
}  // namespace memsim
