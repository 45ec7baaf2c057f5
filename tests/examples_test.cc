// Every example a user is shown runs as written: the examples of each command's --help and
// the memsim commands in README.md's code blocks, each in a scratch folder that holds what
// they name (the repository's configs/, a Mixtral config.json, the sweep shards merge
// joins). Each must exit 0 (0 or 3 when it passes --check: 3 is its "does not fit").
// README's tools/dev.sh lines are the CI's own commands and are not rerun here.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "tests/support/command_runner.h"

namespace memsim {
namespace {
namespace fs = std::filesystem;

// The commands under "Example:"/"Examples:" in `help`, continuation lines joined and
// trailing "(comments)" dropped.
std::vector<std::string> HelpExamples(const std::string& help) {
  std::vector<std::string> examples;
  std::stringstream lines(help);
  std::string line;
  bool in_examples = false;
  std::string pending;
  while (std::getline(lines, line)) {
    if (line.rfind("Example", 0) == 0) {
      in_examples = true;
      continue;
    }
    if (!in_examples) continue;
    if (line.empty()) break;
    const size_t comment = line.find("    (");
    if (comment != std::string::npos) line.resize(comment);
    const size_t start = line.find_first_not_of(' ');
    std::string text = line.substr(start == std::string::npos ? line.size() : start);
    const bool continues = !text.empty() && text.back() == '\\';
    if (continues) text.pop_back();
    pending += text;
    if (!continues) {
      examples.push_back(pending);
      pending.clear();
    }
  }
  return examples;
}

std::vector<std::string> ReadmeCommands() {
  std::ifstream readme(std::string(MEMSIM_SOURCE_DIR) + "/README.md");
  std::vector<std::string> commands;
  std::string line;
  bool in_code = false;
  while (std::getline(readme, line)) {
    if (line.rfind("```", 0) == 0) {
      in_code = !in_code;
      continue;
    }
    if (in_code && line.rfind("build/memsim ", 0) == 0) commands.push_back(line.substr(6));
  }
  return commands;
}

void WriteFile(const fs::path& path, const std::string& text) {
  fs::create_directories(path.parent_path());
  std::ofstream(path) << text;
}

TEST(Examples, EveryHelpAndReadmeExampleRuns) {
  const fs::path scratch = fs::path(::testing::TempDir()) / "memsim_examples";
  fs::remove_all(scratch);
  fs::create_directories(scratch);
  fs::create_directory_symlink(fs::path(MEMSIM_SOURCE_DIR) / "configs", scratch / "configs");
  // mistralai/Mixtral-8x7B-v0.1's config.json (the fields memsim reads).
  WriteFile(scratch / "Mixtral-8x7B" / "config.json",
            R"({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
                "max_position_embeddings": 32768, "num_attention_heads": 32,
                "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8,
                "num_local_experts": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
                "tie_word_embeddings": false, "torch_dtype": "bfloat16", "vocab_size": 32000})");

  std::vector<std::string> examples;
  for (const char* command : {"simulate", "sweep", "merge", "megatron", "validate", "plan",
                              "compare", "heatmap", "analyze", "report"}) {
    const test::CommandResult help = test::RunMemsim(std::string(command) + " --help");
    ASSERT_EQ(help.exit_code, 0) << command << ": " << help.err;
    for (const std::string& e : HelpExamples(help.out)) {
      if (std::string(command) == "merge") {
        // The shards it joins: sweep's example wrote shard 0; the others, as it says.
        for (int k = 1; k < 4; ++k) {
          examples.push_back(
              "memsim sweep --model gpt3-1.3b --world-size 8 --global-batch-size "
              "16 --tp 1,2 --pp 1,2 --shard " +
              std::to_string(k) + "/4 --out sweep_" + std::to_string(k));
        }
      }
      examples.push_back(e);
    }
  }
  const std::vector<std::string> readme = ReadmeCommands();
  ASSERT_FALSE(readme.empty());
  examples.insert(examples.end(), readme.begin(), readme.end());
  ASSERT_GE(examples.size(), 15u);

  for (const std::string& example : examples) {
    SCOPED_TRACE(example);
    const size_t at = example.find("memsim ");
    ASSERT_NE(at, std::string::npos);
    // As a shell runs it (environment prefixes, quotes), memsim being the built binary.
    const std::string command = "cd '" + scratch.string() + "' && " + example.substr(0, at) +
                                MEMSIM_BINARY_PATH + example.substr(at + 6) +
                                " >/dev/null 2>stderr.txt";
    const int status = std::system(command.c_str());
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    std::ifstream err(scratch / "stderr.txt");
    const std::string stderr_text((std::istreambuf_iterator<char>(err)), {});
    if (example.find("--check") != std::string::npos) {
      EXPECT_TRUE(code == 0 || code == 3) << code << ": " << stderr_text;
    } else {
      EXPECT_EQ(code, 0) << stderr_text;
    }
  }
}

}  // namespace
}  // namespace memsim
