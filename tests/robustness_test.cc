// Bad input of every kind ends as one line on stderr and exit code 2, never a signal, a
// hang or a partial file: one test per defect found from outside (issue 16, D1-D15),
// run through the memsim binary as a user runs it.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tests/support/command_runner.h"

#include <filesystem>
#include <fstream>
#include <string>

namespace memsim {
namespace {
namespace fs = std::filesystem;

using CommandRun = test::CommandResult;

std::string Dir(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "/memsim_robust_" + name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

CommandRun Memsim(const std::string& args, const std::string& env = "") {
  return test::RunMemsim(args, env);
}

// Exit 2 with exactly one line on stderr that contains `expected`.
void ExpectOneLineError(const CommandRun& run, const std::string& expected) {
  EXPECT_EQ(run.exit_code, 2) << run.err;
  EXPECT_NE(run.err.find(expected), std::string::npos) << run.err;
  EXPECT_EQ(std::count(run.err.begin(), run.err.end(), '\n'), 1) << run.err;
}

// A config folder holding only `models/NAME.yaml` files with the given texts.
std::string ConfigDir(const std::string& name,
                      const std::vector<std::pair<std::string, std::string>>& presets) {
  const std::string dir = Dir(name);
  fs::create_directories(dir + "/models");
  for (const auto& [preset, text] : presets)
    std::ofstream(dir + "/models/" + preset + ".yaml") << text;
  return dir;
}

// Found by fuzzing run files: a preset name longer than the OS allows in a path made the
// file lookup throw.
TEST(Robustness, PresetNameTooLongForAPath) {
  ExpectOneLineError(Memsim("simulate --model " + std::string(5000, 'h')), "unknown model preset");
}

// D1: a preset whose base is itself, or a longer cycle.
TEST(Robustness, PresetBaseCycles) {
  const std::string dir =
      ConfigDir("cycle", {{"loop", "base: loop\n"}, {"a", "base: b\n"}, {"b", "base: a\n"}});
  ExpectOneLineError(Memsim("simulate --model loop", "MEMSIM_CONFIG_DIR=" + dir),
                     "its base chain is a cycle (loop -> loop)");
  ExpectOneLineError(Memsim("simulate --model a", "MEMSIM_CONFIG_DIR=" + dir),
                     "its base chain is a cycle (a -> b -> a)");
}

// D2, D12: pp x vpp and other products that used to wrap.
TEST(Robustness, LayoutProductsDoNotWrap) {
  ExpectOneLineError(Memsim("simulate --model gpt3-1.3b --world-size 65536 --pp 65536 "
                            "--vpp 281474976710656"),
                     "VPP=281474976710656 is more virtual stages than the 24 layers");
  ExpectOneLineError(Memsim("simulate --model gpt3-1.3b --world-size 64 --pp 128"),
                     "PP=128 is larger than the world size 64");
  ExpectOneLineError(Memsim("simulate --model gpt3-1.3b --micro-batch-size 3037000500"),
                     "a layer's largest tensor would take");
  ExpectOneLineError(Memsim("simulate --model gpt3-1.3b --world-size 8589934592"),
                     "world size 8589934592 is above memsim's limit of 4294967296 GPUs");
  const std::string dir = ConfigDir("huge", {{"huge",
                                              "architecture: gpt\nnum_layers: 4611686018427387904\n"
                                              "hidden_size: 64\nnum_attention_heads: 4\n"}});
  ExpectOneLineError(Memsim("simulate --model huge", "MEMSIM_CONFIG_DIR=" + dir),
                     "num_layers 4611686018427387904 is above memsim's limit of 10000");
}

// D3: a Hugging Face config nested 200,000 deep in a key memsim reads.
TEST(Robustness, DeeplyNestedJson) {
  const std::string dir = Dir("deep_json");
  {
    std::ofstream f(dir + "/config.json");
    f << "{\"model_type\":\"llama\",\"hidden_size\":";
    for (int i = 0; i < 200000; ++i) f << '[';
    for (int i = 0; i < 200000; ++i) f << ']';
    f << "}";
  }
  ExpectOneLineError(Memsim("simulate --hf-config " + dir + "/config.json"),
                     "JSON nested deeper than 64 levels");
  // Found by fuzzing the sweep-record reader: a number beyond a double's range.
  std::ofstream(dir + "/huge.json") << "{\"hidden_size\": 2e22222222222}";
  ExpectOneLineError(Memsim("simulate --hf-config " + dir + "/huge.json"),
                     "unusable JSON: number overflow parsing");
}

// D5: a --moe-layer-freq list of 12,000 entries (std::regex recursed on it).
TEST(Robustness, LongMoeLayerFreqList) {
  std::string list = "[";
  for (int i = 0; i < 12000; ++i) list += i ? ",1" : "1";
  list += "]";
  ExpectOneLineError(
      Memsim("megatron --world-size 8 -- --num-layers 4 --hidden-size 64 --num-attention-heads 4 "
             "--seq-length 8 --micro-batch-size 1 --vocab-size 100 --num-experts 4 "
             "--moe-layer-freq " +
             list),
      "describes 12000 layers, not --num-layers 4");
}

// D4, D6, D11: sweep records that are corrupt, incomplete or deeply nested; merge checks
// every shard before it writes anything and names the shard's file.
TEST(Robustness, BadSweepRecordsAndMerge) {
  const std::string sweep = Dir("sweep_records");
  ASSERT_EQ(Memsim("sweep --model gpt3-1.3b --world-size 4 --tp 1,2 --pp 1 --seq-length 256 "
                   "--out " +
                   sweep)
                .exit_code,
            0);
  std::string record;
  for (const auto& entry : fs::directory_iterator(sweep + "/.sweep")) record = entry.path();
  std::ofstream(record) << "{\"config\": 1}";
  ExpectOneLineError(Memsim("sweep --model gpt3-1.3b --world-size 4 --tp 1,2 --pp 1 "
                            "--seq-length 256 --resume --out " +
                            sweep),
                     "missing or non-integer 'tp'");
  {
    std::ofstream f(record);
    for (int i = 0; i < 100000; ++i) f << '[';
  }
  const std::string merged = Dir("merged") + "/out";
  ExpectOneLineError(Memsim("merge " + merged + " " + sweep), record);
  EXPECT_FALSE(fs::exists(merged));  // nothing written
}

// D7: --jobs far beyond the work and the cores.
TEST(Robustness, HugeJobCount) {
  const std::string out = Dir("jobs");
  const CommandRun run = Memsim(
      "sweep --model gpt3-1.3b --world-size 4 --tp 1,2 --pp 1 --seq-length "
      "256 --jobs 100000 --out " +
      out);
  EXPECT_EQ(run.exit_code, 0) << run.err;
}

// D10: a second sweep into a used folder, and --resume of another run.
TEST(Robustness, SweepFolderIntegrity) {
  const std::string out = Dir("integrity");
  const std::string args = "sweep --model gpt3-1.3b --world-size 4 --tp 1,2 --pp 1 --out " + out;
  ASSERT_EQ(Memsim(args + " --seq-length 256").exit_code, 0);
  ExpectOneLineError(Memsim(args + " --seq-length 256"),
                     "already holds 2 layouts of a sweep; continue it with --resume");
  // Another precision is another run (a sequence length is a layout's, --seq-length lists).
  ExpectOneLineError(Memsim(args + " --seq-length 256 --precision fp16 --resume"),
                     "holds a sweep of another run");
  // Resuming the same run over a larger grid simulates only the new layout.
  const CommandRun more = Memsim("sweep --model gpt3-1.3b --world-size 4 --tp 1,2,4 --pp 1 --out " +
                                 out + " --seq-length 256 --resume");
  EXPECT_EQ(more.exit_code, 0) << more.err;
  EXPECT_NE(more.out.find("1 layout simulated (3 in all"), std::string::npos) << more.out;
}

// D13: zero, negative and non-numeric values of numeric options.
TEST(Robustness, NumericOptionsRejectZeroAndNegatives) {
  for (const char* option :
       {"--seq-length", "--micro-batch-size", "--world-size", "--num-microbatches", "--iterations",
        "--global-batch-size", "--tp", "--jobs", "--top"}) {
    for (const char* value : {"0", "-8"}) {
      ExpectOneLineError(Memsim(std::string("simulate --model gpt3-1.3b ") + option + " " + value),
                         std::string(option) + " must be positive, got " + value);
    }
  }
  ExpectOneLineError(Memsim("simulate --model gpt3-1.3b --tp 8x"), "is invalid");
  ExpectOneLineError(Memsim("sweep --model gpt3-1.3b --microbatches-per-pp -1"),
                     "--microbatches-per-pp must be positive, got -1");
  ExpectOneLineError(Memsim("megatron --world-size 8x -- --num-layers 2"), "is invalid");
  ExpectOneLineError(Memsim("megatron -- --num-layers 2", "WORLD_SIZE=8x"),
                     "give the number of GPUs with --world-size or WORLD_SIZE");
}

// D14, D15: YAML that yaml-cpp accepts but memsim must not: complex keys, a bare scalar,
// duplicate keys; control characters echoed back.
TEST(Robustness, YamlShapesAndEchoedInput) {
  const std::string dir = ConfigDir(
      "yaml", {{"complex", "? [a, b]\n: 1\n"},
               {"scalar", "just a string\n"},
               {"dup", "architecture: gpt\nnum_layers: 2\nhidden_size: 64\nnum_layers: 4\n"}});
  const std::string env = "MEMSIM_CONFIG_DIR=" + dir;
  ExpectOneLineError(Memsim("simulate --model complex", env), "must be plain names");
  ExpectOneLineError(Memsim("simulate --model scalar", env), "a model must be a mapping");
  ExpectOneLineError(Memsim("simulate --model dup", env),
                     "dup.yaml:4: 'num_layers' given twice in");
  {
    std::ofstream deep(dir + "/deep.yaml");
    deep << "model: " << std::string(100000, '[') << std::string(100000, ']') << "\n";
  }
  ExpectOneLineError(Memsim("simulate --config " + dir + "/deep.yaml"), "levels deep");
  const CommandRun echoed = Memsim("simulate --model $'bad\\x1b[31mname'");
  EXPECT_EQ(echoed.exit_code, 2);
  EXPECT_EQ(echoed.err.find('\x1b'), std::string::npos) << echoed.err;
  EXPECT_NE(echoed.err.find("\\x1b"), std::string::npos) << echoed.err;
}

}  // namespace
}  // namespace memsim

namespace memsim {
namespace {

// D9: --ranks all on a large cluster is refused with the size, before any file is written.
TEST(Robustness, RanksAllEstimatesOutputFirst) {
  const std::string out = Dir("ranks_all");
  const CommandRun run = Memsim(
      "simulate --model gpt3-1.3b --world-size 65536 --tp 8 --pp 4 "
      "--ranks all --max-output 1 --out " +
      out);
  ExpectOneLineError(run, "the files of 65536 ranks would take");
  EXPECT_TRUE(fs::is_empty(out));
}

// D9: 2^31 GPUs used to exhaust memory with per-rank lists. A rank class is a range
// (Note [Rank classes]): stage 3 of PP 4 is ranks 3 * 2^29 .. 2^31 - 1.
TEST(Robustness, TwoBillionGpusAreFourRankClasses) {
  const CommandRun run = Memsim(
      "simulate --model gpt3-1.3b --world-size 2147483648 --tp 8 --pp 4 --iterations 1 "
      "--json --out " +
      Dir("two_billion"));
  ASSERT_EQ(run.exit_code, 0) << run.err;
  const nlohmann::json j = nlohmann::json::parse(run.out);
  ASSERT_EQ(j["rank_classes"].size(), 4u);
  EXPECT_EQ(j["rank_classes"][3]["ranks"], nlohmann::json::parse("[[1610612736, 2147483647]]"));
}

}  // namespace
}  // namespace memsim
