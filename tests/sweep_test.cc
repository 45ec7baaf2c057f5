// memsim sweep: the seeds' logs and file names, every layout accounted for, and a sweep
// interrupted (here: only one shard run) and resumed equals one run straight through.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
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

// Lists of sequence lengths and micro batches: every combination is its own layout, with
// its own record and traces (ts and mbs in the seeds' names), and memory grows with both.
TEST(Sweep, SequenceLengthAndMicroBatchLists) {
  const std::string out = Dir("seq");
  ASSERT_EQ(Memsim("sweep --model gpt3-1.3b --world-size 2 --tp 2 --pp 1 --precision bf16 "
                   "--global-batch-size 4 --seq-length 256,512 --micro-batch-size 1,2 --out " +
                   out),
            0);
  const nlohmann::json table = nlohmann::json::parse(Read(out + "/sweep_results.json"));
  ASSERT_EQ(table.size(), 4u);
  std::map<std::pair<int64_t, int64_t>, double> peak;  // (mbs, seq) -> MiB
  for (const nlohmann::json& r : table) {
    ASSERT_EQ(r["status"], "success") << r.dump();
    peak[{r["micro_batch_size"].get<int64_t>(), r["seq_length"].get<int64_t>()}] =
        r["max_peak_reserved_MB"].get<double>();
  }
  EXPECT_LT(peak.at({1, 256}), peak.at({1, 512}));
  EXPECT_LT(peak.at({1, 256}), peak.at({2, 256}));
  EXPECT_LT(peak.at({2, 256}), peak.at({2, 512}));
  // TP=2 on 2 GPUs: DP 1; global batch 4 = micro batch x microbatches.
  for (const char* name : {"mbs1_nmbs4_gbs4_ts256", "mbs1_nmbs4_gbs4_ts512",
                           "mbs2_nmbs2_gbs4_ts256", "mbs2_nmbs2_gbs4_ts512"}) {
    EXPECT_TRUE(fs::is_regular_file(
        out + "/memory_trace_rank0_wd2_tp2_pp1_dp1_exp1_expNumNone_l24_" + name + ".json"))
        << name;
  }
  EXPECT_EQ(
      Memsim("sweep --model gpt3-1.3b --world-size 2 --seq-length 256,0 --out " + out + "_bad"), 2);
  // --sample-interval thins the traces as simulate's does; the peak stays.
  const std::string thin = Dir("seq_thin");
  ASSERT_EQ(Memsim("sweep --model gpt3-1.3b --world-size 2 --tp 2 --pp 1 --precision bf16 "
                   "--global-batch-size 4 --seq-length 256 --micro-batch-size 1 "
                   "--sample-interval 0.05 --out " +
                   thin),
            0);
  const std::string name =
      "/memory_trace_rank0_wd2_tp2_pp1_dp1_exp1_expNumNone_l24_mbs1_nmbs4_gbs4_ts256.json";
  const nlohmann::json full = nlohmann::json::parse(Read(out + name));
  const nlohmann::json thinned = nlohmann::json::parse(Read(thin + name));
  for (const auto& [iteration, data] : full.items()) {
    EXPECT_LT(thinned[iteration]["samples"].size(), data["samples"].size()) << iteration;
    EXPECT_EQ(thinned[iteration]["peak_allocated_MB"], data["peak_allocated_MB"]) << iteration;
  }
  EXPECT_EQ(
      Memsim("sweep --model gpt3-1.3b --world-size 2 --sample-interval -1 --out " + out + "_bad2"),
      2);
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

// Layouts that differ only in recomputation get their own trace files (the seeds' names
// gain a suffix only when it is not the default).
TEST(Sweep, RecomputationVariantsDoNotOverwriteEachOther) {
  const std::string out = Dir("recompute");
  ASSERT_EQ(Memsim("sweep --model gpt3-1.3b --world-size 4 --seq-length 256 --tp 2 --pp 2 "
                   "--recompute none,full --microbatches-per-pp 2 --out " +
                   out),
            0);
  const std::string base =
      out + "/memory_trace_rank0_wd4_tp2_pp2_dp1_exp1_expNumNone_l24_mbs1_nmbs4_gbs4_ts256";
  EXPECT_TRUE(fs::is_regular_file(base + ".json"));
  EXPECT_TRUE(fs::is_regular_file(base + "_rcfull.json"));
  EXPECT_NE(Read(base + ".json"), Read(base + "_rcfull.json"));
}

// The seeds' sweep: the 485B GPT on 8,192 GPUs, TP {1,2,4,8} x PP {2..64}, sequence 2048,
// micro batch 1, 6 x PP microbatches, fp16, distributed optimizer. All 24 layouts get a
// line; a run killed midway and resumed ends with the same files; the heatmap reads them.
TEST(Sweep, SeedsSweepKilledAndResumedMatchesAndPlots) {
  const std::string args =
      "sweep --model gpt-485b --world-size 8192 --precision fp16 --seq-length 2048 "
      "--tp 1,2,4,8 --pp 2,4,8,16,32,64 --microbatches-per-pp 6 "
      "--data-parallel distributed-optimizer --jobs 2 ";
  const std::string full = Dir("seeds_full");
  ASSERT_EQ(Memsim(args + "--out " + full), 0);
  int lines = 0;
  for (const char* log : {"/successful_configs.log", "/failed_configs.log"}) {
    std::stringstream stream(Read(full + log));
    std::string line;
    while (std::getline(stream, line)) ++lines;
  }
  EXPECT_EQ(lines, 24);
  // 96 layers do not split over 64 stages: those four layouts fail as invalid.
  EXPECT_NE(Read(full + "/failed_configs.log")
                .find("Config 24: TP=8, PP=64, DP=16, NUM_MICBATCH=384, GLOBAL_BATCH_SIZE=6144 - "
                      "FAILED (invalid layout: PP*VPP=64*1 does not divide 96 layers"),
            std::string::npos);

  // Kill a run after its first results land, then resume it.
  const std::string killed = Dir("seeds_killed");
  const std::string command = std::string(MEMSIM_BINARY_PATH) + " " + args + "--out " + killed +
                              " >/dev/null 2>&1 & pid=$!; "
                              "until ls " +
                              killed +
                              "/.sweep/layout_*.json >/dev/null 2>&1; do sleep 0.05; done; "
                              "kill -9 $pid; wait $pid 2>/dev/null; true";
  ASSERT_EQ(std::system(("bash -c '" + command + "'").c_str()), 0);
  ASSERT_EQ(Memsim(args + "--resume --out " + killed), 0);
  for (const char* file : {"successful_configs.log", "failed_configs.log", "sweep_results.csv"}) {
    EXPECT_EQ(Read(full + "/" + file), Read(killed + "/" + file)) << file;
  }
  // No temporary file survives the kill.
  for (const auto& entry : fs::recursive_directory_iterator(killed)) {
    EXPECT_EQ(entry.path().string().find(".tmp."), std::string::npos) << entry.path();
  }
  const std::string heatmap = full + "/heatmap";
  ASSERT_EQ(Memsim("heatmap --memory-dir " + full + " --log-dir " + full + " --output " + heatmap +
                   " --dpi 40"),
            0);
  EXPECT_TRUE(fs::is_regular_file(heatmap + ".png"));
  EXPECT_TRUE(fs::is_regular_file(heatmap + ".pdf"));
}

// Verdicts over a sweep whose layouts straddle the GPU's capacity (Llama-3-8B at sequence
// 8192 on 8 A100-80GB, TP 1-8, micro batch 1 or 4): every layout that fits has
// non-negative headroom and a peak reserved on the GPU within its usable memory, every one
// that does not names the allocation that fails; and the sweep's verdict and peak for a
// layout are simulate's for the same layout.
TEST(Sweep, VerdictsAreConsistentAndAgreeWithSimulate) {
  const std::string out = Dir("verdicts");
  const std::string common =
      "--model llama3-8b --world-size 8 --seq-length 8192 --gpu A100-80GB "
      "--data-parallel distributed-optimizer ";
  ASSERT_EQ(Memsim("sweep " + common + "--tp 1,2,4,8 --pp 1 --micro-batch-size 1,4 --out " + out),
            0);
  const nlohmann::json sweep = nlohmann::json::parse(Read(out + "/sweep_results.json"));
  int fitting = 0, failing = 0;
  for (const nlohmann::json& layout : sweep) {
    const std::string json_path = out + "/simulate.json";
    const std::string args = "simulate " + common + "--tp " + layout["tp"].dump() + " --pp 1 " +
                             "--micro-batch-size " + layout["micro_batch_size"].dump() +
                             " --json --out " + out + "/sim > " + json_path;
    ASSERT_EQ(std::system((std::string(MEMSIM_BINARY_PATH) + " " + args + " 2>/dev/null").c_str()),
              0);
    const nlohmann::json simulated = nlohmann::json::parse(Read(json_path));
    for (const nlohmann::json& rank_class : simulated["rank_classes"]) {
      if (rank_class["fits"].get<bool>()) {
        ++fitting;
        EXPECT_GE(rank_class["headroom_MB"].get<double>(), 0.0);
        EXPECT_LE(rank_class["peak_reserved_on_gpu_MB"].get<double>(),
                  rank_class["gpu_usable_MB"].get<double>());
      } else {
        ++failing;
        EXPECT_FALSE(rank_class.contains("headroom_MB"));
        EXPECT_NE(
            rank_class["out_of_memory"].get<std::string>().find("first allocation that fails"),
            std::string::npos);
      }
    }
    // Sweep and simulate: the same verdict and the same peak for the layout.
    EXPECT_EQ(layout["status"] == "success", simulated["fits"].get<bool>()) << layout.dump();
    EXPECT_EQ(layout["stages"][0]["peak_allocated_MB"],
              simulated["rank_classes"][0]["peak_allocated_MB"])
        << layout.dump();
  }
  // The grid straddles the capacity.
  EXPECT_GT(fitting, 0);
  EXPECT_GT(failing, 0);
}

// --prune rules out only layouts that cannot fit (their setup alone exceeds the GPU),
// says so, and leaves every other layout's record as a full sweep writes it. Llama-3-70B
// on 16 H100s: TP1 (PP 1 and 2) holds 220+ GB of weights and optimizer state per GPU
// (pruned); TP8 PP1 fits its setup but not its step (simulated, out of memory); TP8 PP2
// fits.
TEST(Sweep, PruneRulesOutOnlyLayoutsWhoseSetupExceedsTheGpu) {
  const std::string common =
      "sweep --model llama3-70b --world-size 16 --seq-length 256 --tp 1,8 --pp 1,2 "
      "--microbatches-per-pp 1 --data-parallel distributed-optimizer --gpu H100-80GB --out ";
  const std::string pruned_dir = Dir("pruned"), full_dir = Dir("unpruned");
  ASSERT_EQ(Memsim(common + pruned_dir + " --prune"), 0);
  ASSERT_EQ(Memsim(common + full_dir), 0);
  const nlohmann::json pruned = nlohmann::json::parse(Read(pruned_dir + "/sweep_results.json"));
  const nlohmann::json full = nlohmann::json::parse(Read(full_dir + "/sweep_results.json"));
  ASSERT_EQ(pruned.size(), 4u);
  ASSERT_EQ(full.size(), 4u);
  std::map<std::string, int> statuses;
  for (size_t i = 0; i < pruned.size(); ++i) {
    const nlohmann::json& p = pruned[i];
    EXPECT_EQ(p["status"], full[i]["status"]) << p.dump();  // the same verdict, always
    if (p.value("pruned", false)) {
      ++statuses["pruned"];
      EXPECT_EQ(p["tp"], 1);
      EXPECT_FALSE(p.contains("stages"));
      EXPECT_EQ(p["reason"].get<std::string>().rfind("pruned (not simulated): parameters, "
                                                     "gradient buffers and master weights alone "
                                                     "take ",
                                                     0),
                0u)
          << p["reason"];
      // The setup alone is not above the full simulation's peak, which may be the setup's
      // when the distributed optimizer's parameter buffer briefly doubles the parameters
      // (Note [Distributed optimizer buffers]); the reason rounds to whole MB.
      EXPECT_LE(std::stod(p["reason"].get<std::string>().substr(83)),
                full[i]["stages"][0]["peak_allocated_MB"].get<double>() + 0.5);
    } else {
      ++statuses[p["status"].get<std::string>()];
      EXPECT_EQ(p, full[i]);
    }
  }
  EXPECT_EQ(statuses, (std::map<std::string, int>{{"oom", 1}, {"pruned", 2}, {"success", 1}}));
  EXPECT_NE(Read(pruned_dir + "/failed_configs.log").find("FAILED (pruned (not simulated)"),
            std::string::npos);
}

}  // namespace
}  // namespace memsim
