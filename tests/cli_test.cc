// The memsim command line, run as a user runs it: the default example, the files it
// writes, and one-line errors with exit code 2 for bad input.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>
#include "tests/support/command_runner.h"

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

namespace memsim {
namespace {
namespace fs = std::filesystem;

using test::CommandResult;

CommandResult Memsim(const std::string& args) { return test::RunMemsim(args); }

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
  for (const char* file : {"memory_trace_rank0.json", "summary_rank0.json", "snapshot_rank0.pickle",
                           "snapshot_rank0_peak.pickle"}) {
    EXPECT_TRUE(fs::is_regular_file(out + "/" + file)) << file;
  }
  std::ifstream trace(out + "/memory_trace_rank0.json");
  const nlohmann::json j = nlohmann::json::parse(trace);
  EXPECT_TRUE(j.contains("0") && j.contains("1"));
}

// What an MoE run assumes of its routing is said, and --moe-imbalance changes it: at 1.25
// the busiest rank's experts take 1.25 times the mean load, so its peak (in forward, at
// sequence 8192) is higher.
TEST(Cli, MoeRoutingIsStatedAndImbalanceRaisesThePeak) {
  const std::string base =
      "simulate --model mixtral-8x7b --world-size 8 --ep 8 --seq-length 8192 --iterations 1 "
      "--data-parallel distributed-optimizer --json --out " +
      Temp("moe");
  auto peak = [](const CommandResult& run) {
    return nlohmann::json::parse(run.out)["rank_classes"][0]["peak_allocated_MB"].get<double>();
  };
  const CommandResult even = Memsim(base);
  const CommandResult busy = Memsim(base + " --moe-imbalance 1.25");
  ASSERT_EQ(even.exit_code, 0) << even.err;
  ASSERT_EQ(busy.exit_code, 0) << busy.err;
  EXPECT_GT(peak(busy), peak(even));
  EXPECT_EQ(nlohmann::json::parse(busy.out)["moe_routing"],
            nlohmann::json({{"capacity_factor", 0.0},
                            {"expert_capacity", 0},
                            {"pad_to_capacity", false},
                            {"imbalance", 1.25}}));
  const CommandResult text = Memsim(
      "simulate --model mixtral-8x7b --world-size 8 --ep 8 "
      "--seq-length 256 --iterations 1 --moe-imbalance 1.25 --out " +
      Temp("moe_text"));
  EXPECT_NE(text.out.find("MoE routing: dropless, busiest expert 1.25x the mean load"),
            std::string::npos)
      << text.out;
  const CommandResult bad = Memsim("simulate --model mixtral-8x7b --moe-imbalance 0.5");
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_EQ(bad.err,
            "memsim simulate: --moe-imbalance is the busiest expert's load over the mean: at least "
            "1, got 0.5 (see memsim simulate --help)\n");
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
  EXPECT_EQ(j["rank_classes"][1]["ranks"], nlohmann::json::parse("[[4, 7]]"));  // ranks 4..7
}

// The parameter counts: the model's (Mixtral-8x7B: 46,702,792,704, mistralai's config) and
// each rank's: with EP 8 a rank holds one of each layer's 8 experts, 7/8 of the experts'
// 32 * 8 * 3 * 4096 * 14336 weights fewer: 7,242,780,672.
TEST(Cli, ReportsTheModelsAndEachRanksParameters) {
  const std::string out = Temp("parameters");
  const std::string args =
      "simulate --model mixtral-8x7b --world-size 8 --ep 8 --global-batch-size 8 "
      "--seq-length 256 --iterations 1 --data-parallel distributed-optimizer --out " +
      out;
  const CommandResult json = Memsim(args + " --json");
  ASSERT_EQ(json.exit_code, 0) << json.err;
  const nlohmann::json j = nlohmann::json::parse(json.out);
  EXPECT_EQ(j["parameters_total"], int64_t{46702792704});
  EXPECT_EQ(j["rank_classes"][0]["parameters"],
            int64_t{46702792704} - int64_t{32} * 7 * 3 * 4096 * 14336);
  const CommandResult text = Memsim(args);
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_NE(text.out.find("parameters: 46.70 B in the model (Megatron's padded vocabulary); per "
                          "rank: class 0 7.24 B"),
            std::string::npos)
      << text.out;
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
  ExpectOneLineError(Memsim("simulate --sample-interval -1"), "--sample-interval");
  ExpectOneLineError(Memsim("simulate --snapshot-history all"), "--snapshot-history");
  ExpectOneLineError(Memsim("frobnicate"), "unknown command 'frobnicate'");
  ExpectOneLineError(Memsim("simulate --recompute-modules mlp"),
                     "--recompute-modules needs --recompute selective");
  ExpectOneLineError(Memsim("simulate --recompute selective --recompute-modules mlp,attn"),
                     "unknown recompute module 'attn'");
  std::ofstream(dir + "/modules.yaml")
      << "model: gpt3-1.3b\ntraining:\n  recompute: selective\n  recompute_modules: [moe_act]\n";
  ExpectOneLineError(Memsim("simulate --config " + dir + "/modules.yaml"),
                     "recompute module moe_act needs the grouped GEMM experts");
  std::ofstream(dir + "/modules2.yaml")
      << "model: gpt3-1.3b\ntraining:\n  recompute: selective\n  recompute_modules: [mlp, x]\n";
  ExpectOneLineError(Memsim("simulate --config " + dir + "/modules2.yaml"),
                     "modules2.yaml:4: recompute_modules: unknown recompute module 'x'");
  ExpectOneLineError(Memsim("simulate --cuda-graphs attn"),
                     "CUDA graphs (--cuda-graph-impl transformer_engine) need Transformer Engine");
  ExpectOneLineError(Memsim("simulate --profile transformer_engine --cuda-graphs attn,full"),
                     "unknown CUDA graph module 'full'");
  ExpectOneLineError(Memsim("simulate --offload-modules core_attn"),
                     "fine-grained activation offloading needs Transformer Engine layers");
  ExpectOneLineError(
      Memsim("simulate --profile transformer_engine --offload-modules core_attn,attn"),
      "unknown offload module 'attn'");
  std::ofstream(dir + "/offload.yaml")
      << "model: gpt3-1.3b\ntraining:\n  offload_modules: [attn_proj]\n"
      << "  profile: transformer_engine\n";
  ExpectOneLineError(Memsim("simulate --config " + dir + "/offload.yaml"),
                     "offload module attn_proj needs core_attn");
  // A pipeline layout fixes what sweep and plan vary; memsim's FSDP would not shard MTP.
  std::ofstream(dir + "/layout.yaml")
      << "model: gpt3-1.3b\nlayout:\n  world_size: 2\n  pp: 2\n  pipeline_layout: 'E(t*12|)*2L'\n";
  ExpectOneLineError(Memsim("sweep --config " + dir + "/layout.yaml --pp 2 --out " + dir + "/s"),
                     "a pipeline layout fixes PP and VPP, which a sweep varies");
  ExpectOneLineError(
      Memsim("plan --config " + dir + "/layout.yaml --world-size 2 --global-batch-size 8 --out " +
             dir + "/p"),
      "a pipeline layout fixes PP and VPP, which a plan varies");
  std::ofstream(dir + "/fsdp_mtp.yaml")
      << "model:\n  base: llama3-8b\n  num_layers: 2\n  mtp_num_layers: 1\n"
         "layout:\n  world_size: 2\n  data_parallel: fsdp\n";
  ExpectOneLineError(Memsim("simulate --config " + dir + "/fsdp_mtp.yaml"),
                     "multi-token prediction with FSDP is not modelled");
  std::ofstream(dir + "/buckets.yaml") << "layout:\n  ddp_bucket_size: 0\n";
  ExpectOneLineError(Memsim("simulate --config " + dir + "/buckets.yaml"),
                     "buckets.yaml:2: 'ddp_bucket_size' must be a positive number of elements, "
                     "got 0");
  // A file in the way of the output folder.
  std::ofstream(dir + "/file") << "x";
  ExpectOneLineError(Memsim("simulate --out " + dir + "/file"), dir + "/file");
}

// The A100 presets differ only in memory, 81,920 and 40,960 MiB as NVML reports them: the
// same run leaves exactly 40,960 MiB less headroom on the 40 GB one. The H800 is an H100
// with slower NVLink: the same memory.
TEST(Cli, GpuPresetsOfTheSameChipDifferInMemory) {
  auto usable_and_headroom = [](const std::string& gpu) {
    const CommandResult run =
        Memsim("simulate --gpu " + gpu + " --iterations 1 --json --out " + Temp("gpu_" + gpu));
    EXPECT_EQ(run.exit_code, 0) << run.err;
    const nlohmann::json r = nlohmann::json::parse(run.out)["rank_classes"][0];
    return std::make_pair(r["gpu_usable_MB"].get<double>(), r["headroom_MB"].get<double>());
  };
  const auto [usable_80, headroom_80] = usable_and_headroom("A100-80GB");
  const auto [usable_40, headroom_40] = usable_and_headroom("A100-40GB");
  EXPECT_EQ(usable_40, 40960 - 512);
  EXPECT_EQ(usable_80 - usable_40, 40960);
  EXPECT_EQ(headroom_80 - headroom_40, 40960);
  EXPECT_EQ(usable_and_headroom("H800-80GB"), usable_and_headroom("H100-80GB"));
  // H20 and B300 SXM6 AC: 97,871 and 275,040 MiB as nvidia-smi reports them.
  EXPECT_EQ(usable_and_headroom("H20").first, 97871 - 512);
  EXPECT_EQ(usable_and_headroom("B300-288GB").first, 275040 - 512);
  // --gpu-memory gives any preset another capacity: A100-80GB with 40 GiB is the 40 GB one.
  const CommandResult custom = Memsim(
      "simulate --gpu A100-80GB --gpu-memory 40 --iterations 1 "
      "--json --out " +
      Temp("gpu_memory"));
  ASSERT_EQ(custom.exit_code, 0) << custom.err;
  const nlohmann::json r = nlohmann::json::parse(custom.out);
  EXPECT_EQ(r["gpu"], "A100-80GB with 40.00 GiB");
  EXPECT_EQ(r["rank_classes"][0]["gpu_usable_MB"].get<double>(), usable_40);
  EXPECT_EQ(r["rank_classes"][0]["headroom_MB"].get<double>(), headroom_40);
  ExpectOneLineError(Memsim("simulate --gpu-memory 0.25 --out " + Temp("gpu_memory_bad")),
                     "--gpu-memory must be more than the CUDA context's 0.5 GiB and at most "
                     "1000000 GiB, got 0.25");
}

TEST(Cli, HelpHasExamples) {
  const CommandResult run = Memsim("simulate --help");
  EXPECT_EQ(run.exit_code, 0);
  EXPECT_NE(run.out.find("Examples:"), std::string::npos);
}

}  // namespace
}  // namespace memsim

namespace memsim {
namespace {

double PeakOf(const std::string& json_out) {
  const nlohmann::json j = nlohmann::json::parse(json_out);
  double peak = 0;
  for (const auto& c : j["rank_classes"])
    peak = std::max(peak, c["peak_allocated_MB"].get<double>());
  return peak;
}

// Megatron-LM's arguments for the llama3-8b preset on TP2 PP2 over 8 GPUs, sequence 1024,
// global batch 8, with the distributed optimizer.
const std::string kLlama3_8bMegatronArgs =
    "--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
    "--group-query-attention --num-query-groups 8 --seq-length 1024 "
    "--max-position-embeddings 8192 --swiglu --normalization RMSNorm "
    "--position-embedding-type rope --untie-embeddings-and-output-weights "
    "--disable-bias-linear --attention-dropout 0.0 --hidden-dropout 0.0 --bf16 "
    "--micro-batch-size 1 --global-batch-size 8 --tensor-model-parallel-size 2 "
    "--pipeline-model-parallel-size 2 --use-distributed-optimizer --vocab-size 128256 "
    "--train-iters 1 --lr 3e-4 --use-flash-attn --transformer-impl local";

// A Llama-3-8B preset, its Hugging Face config.json and the equivalent Megatron-LM
// arguments describe the same model, so they simulate to the same peak.
TEST(Cli, EveryInputRouteGivesTheSameModel) {
  const std::string dir = Temp("routes");
  std::ofstream(dir + "/config.json") << R"({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": false,
    "hidden_act": "silu", "attention_bias": false, "torch_dtype": "bfloat16",
    "bos_token_id": 128000, "eos_token_id": 128001, "initializer_range": 0.02})";
  const std::string layout =
      "--world-size 8 --tp 2 --pp 2 --global-batch-size 8 --seq-length 1024 --iterations 1 "
      "--data-parallel distributed-optimizer --json ";
  const CommandResult preset =
      Memsim("simulate --model llama3-8b " + layout + "--out " + dir + "/a");
  ASSERT_EQ(preset.exit_code, 0) << preset.err;
  const CommandResult hf =
      Memsim("simulate --hf-config " + dir + "/config.json " + layout + "--out " + dir + "/b");
  ASSERT_EQ(hf.exit_code, 0) << hf.err;
  const CommandResult megatron = Memsim("megatron --world-size 8 --iterations 1 --json --out " +
                                        dir + "/c -- " + kLlama3_8bMegatronArgs);
  ASSERT_EQ(megatron.exit_code, 0) << megatron.err;
  EXPECT_NE(megatron.err.find("ignored (no effect on memory): --max-position-embeddings "
                              "--train-iters --lr"),
            std::string::npos)
      << megatron.err;
  const double peak = PeakOf(preset.out);
  EXPECT_GT(peak, 0);
  EXPECT_EQ(PeakOf(hf.out), peak);
  EXPECT_EQ(PeakOf(megatron.out), peak);
}

// gpt-oss from its Hugging Face config.json, a run file and Megatron-LM's arguments (as its
// examples/gptoss launch line spells the activation and the sinks) is one model: quick-GeGLU
// experts with biases, clamped, learnable softmax offsets; the same peak every way.
TEST(Cli, GptOssFromEveryInputRouteIsTheSameModel) {
  const std::string dir = Temp("gpt_oss_routes");
  std::ofstream(dir + "/config.json") << R"({
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": true,
    "head_dim": 32, "hidden_act": "silu", "hidden_size": 256, "intermediate_size": 256,
    "num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 2,
    "num_local_experts": 4, "num_experts_per_tok": 2, "experts_per_token": 2,
    "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 128,
    "max_position_embeddings": 4096, "rope_theta": 150000, "swiglu_limit": 7.0,
    "tie_word_embeddings": false, "vocab_size": 1024})";
  std::ofstream(dir + "/run.yaml")
      << "model:\n  architecture: llama\n  num_layers: 2\n  hidden_size: 256\n"
         "  num_attention_heads: 8\n  num_query_groups: 2\n  kv_channels: 32\n"
         "  ffn_hidden_size: 256\n  vocab_size: 1024\n  add_bias_linear: true\n"
         "  add_qkv_bias: true\n  activation: quick_geglu\n  activation_clamp_value: 7\n"
         "  softmax: learnable\n  num_experts: 4\n  moe_router_topk: 2\n"
         "  moe_ffn_hidden_size: 256\n  hidden_dropout: 0\n  attention_dropout: 0\n"
         "training:\n  profile: transformer_engine\n  attention: fused\n";
  const std::string layout =
      "--world-size 2 --ep 2 --global-batch-size 4 --seq-length 512 --iterations 1 "
      "--data-parallel distributed-optimizer --json ";
  const CommandResult hf =
      Memsim("simulate --hf-config " + dir + "/config.json " + layout +
             "--profile transformer_engine --attention fused --out " + dir + "/a");
  ASSERT_EQ(hf.exit_code, 0) << hf.err;
  const CommandResult yaml =
      Memsim("simulate --config " + dir + "/run.yaml " + layout + "--out " + dir + "/b");
  ASSERT_EQ(yaml.exit_code, 0) << yaml.err;
  const CommandResult megatron = Memsim(
      "megatron --world-size 2 --iterations 1 --json --out " + dir +
      "/c -- --num-layers 2 --hidden-size 256 --num-attention-heads 8 --group-query-attention "
      "--num-query-groups 2 --kv-channels 32 --ffn-hidden-size 256 --num-experts 4 "
      "--moe-router-topk 2 --moe-ffn-hidden-size 256 --expert-model-parallel-size 2 "
      "--quick-geglu --glu-linear-offset 1.0 --activation-func-clamp-value 7.0 "
      "--softmax-type learnable --normalization RMSNorm --position-embedding-type rope "
      "--untie-embeddings-and-output-weights --attention-dropout 0.0 --hidden-dropout 0.0 "
      "--bf16 --seq-length 512 --micro-batch-size 1 --global-batch-size 4 "
      "--use-distributed-optimizer --vocab-size 1024 --make-vocab-size-divisible-by 128");
  ASSERT_EQ(megatron.exit_code, 0) << megatron.err;
  const double peak = PeakOf(hf.out);
  EXPECT_GT(peak, 0);
  EXPECT_EQ(PeakOf(yaml.out), peak);
  EXPECT_EQ(PeakOf(megatron.out), peak);
}

// FP8 training set on the command line and in a run file is the same run; the header
// says which recipe.
TEST(Cli, Fp8FromFlagsAndYamlIsTheSameRun) {
  const std::string dir = Temp("fp8");
  std::ofstream(dir + "/run.yaml") << "model: gpt3-1.3b\n"
                                      "training:\n"
                                      "  profile: transformer_engine\n"
                                      "  fp8: tensorwise\n"
                                      "  fp8_param_gather: true\n"
                                      "layout:\n"
                                      "  world_size: 2\n"
                                      "  data_parallel: distributed-optimizer\n";
  const CommandResult yaml =
      Memsim("simulate --config " + dir + "/run.yaml --iterations 1 --json --out " + dir + "/a");
  ASSERT_EQ(yaml.exit_code, 0) << yaml.err;
  const std::string flags =
      "simulate --model gpt3-1.3b --world-size 2 --profile transformer_engine "
      "--data-parallel distributed-optimizer --iterations 1 ";
  const CommandResult cli =
      Memsim(flags + "--fp8 tensorwise --fp8-param-gather --json --out " + dir + "/b");
  ASSERT_EQ(cli.exit_code, 0) << cli.err;
  EXPECT_EQ(PeakOf(cli.out), PeakOf(yaml.out));
  const CommandResult bf16 = Memsim(flags + "--json --out " + dir + "/c");
  EXPECT_NE(PeakOf(bf16.out), PeakOf(cli.out));
  const CommandResult text = Memsim(flags + "--fp8 delayed --out " + dir + "/d");
  EXPECT_NE(text.out.find(", bf16 with FP8 (delayed), seq 2048"), std::string::npos) << text.out;
}

// Note [Distributed optimizer buffers]: the bucket options reach the layout from the run
// file and from Megatron-LM's arguments alike. Buckets cut the first stage's gradient
// buffer only (stages after the first have one bucket whatever the options), so stage 0's
// peak moves and stage 1's does not.
TEST(Cli, DdpBucketsFromFlagsAndYamlAreTheSameRun) {
  const std::string dir = Temp("buckets");
  std::ofstream(dir + "/run.yaml")
      << "layout:\n  overlap_grad_reduce: true\n  ddp_bucket_size: 5000000\n";
  const std::string layout =
      "--world-size 8 --tp 2 --pp 2 --global-batch-size 8 --seq-length 1024 --iterations 1 "
      "--data-parallel distributed-optimizer --json ";
  auto peaks = [](const CommandResult& run) {
    EXPECT_EQ(run.exit_code, 0) << run.err;
    const nlohmann::json j = nlohmann::json::parse(run.out);
    std::vector<double> out;
    for (const auto& c : j["rank_classes"]) out.push_back(c["peak_allocated_MB"].get<double>());
    return out;
  };
  const std::vector<double> yaml =
      peaks(Memsim("simulate --config " + dir + "/run.yaml --model llama3-8b " + layout + "--out " +
                   dir + "/a"));
  const std::vector<double> one_bucket =
      peaks(Memsim("simulate --model llama3-8b " + layout + "--out " + dir + "/b"));
  const std::vector<double> megatron =
      peaks(Memsim("megatron --world-size 8 --iterations 1 --json --out " + dir + "/c -- " +
                   kLlama3_8bMegatronArgs + " --overlap-grad-reduce --ddp-bucket-size 5000000"));
  ASSERT_EQ(yaml.size(), 2u);
  const CommandResult bad = Memsim(
      "megatron --world-size 8 --out " + dir +
      "/d -- --num-layers 2 --hidden-size 64 "
      "--num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 "
      "--micro-batch-size 1 --vocab-size 1000 --use-distributed-optimizer --ddp-num-buckets 0");
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_EQ(bad.err, "memsim megatron: --ddp-num-buckets must be positive, got 0\n");
  EXPECT_EQ(megatron, yaml);
  EXPECT_NE(one_bucket[0], yaml[0]);
  EXPECT_EQ(one_bucket[1], yaml[1]);
}

// TP communication overlap's userbuffers sit outside PyTorch's allocator: reported per
// rank, S*B*H*24 bytes in 16 bits (2048 * 2048 * 24) plus 3,354,880 of control memory, and
// left out of what the allocator can reserve: headroom = usable - userbuffers - peak
// reserved on the GPU.
TEST(Cli, UserbuffersAreReportedBesideTheFigures) {
  const std::string dir = Temp("userbuffers");
  const CommandResult r = Memsim(
      "simulate --model gpt3-1.3b --world-size 2 --tp 2 --sp --profile transformer_engine "
      "--tp-comm-overlap --iterations 1 --json --out " +
      dir);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  const double expected_mib = (2048.0 * 2048 * 24 + 3354880) / (1 << 20);
  for (const auto& c : j["rank_classes"]) {
    EXPECT_DOUBLE_EQ(c["userbuffers_outside_allocator_MB"].get<double>(), expected_mib);
    EXPECT_NEAR(c["headroom_MB"].get<double>(),
                c["gpu_usable_MB"].get<double>() - expected_mib -
                    c["peak_reserved_on_gpu_MB"].get<double>(),
                1e-6);
  }
}

TEST(Cli, MegatronRefusesWhatMemsimDoesNotModel) {
  const CommandResult unknown = Memsim("megatron --world-size 8 -- --num-layers 2 --frobnicate 3");
  EXPECT_EQ(unknown.exit_code, 2);
  EXPECT_NE(unknown.err.find("--frobnicate"), std::string::npos) << unknown.err;
  const CommandResult fp4 = Memsim("megatron --world-size 8 -- --num-layers 2 --fp4-format e2m1");
  EXPECT_EQ(fp4.exit_code, 2);
  EXPECT_NE(fp4.err.find("--fp4-format"), std::string::npos) << fp4.err;
  const CommandResult no_world = Memsim("megatron -- --num-layers 2");
  EXPECT_NE(no_world.err.find("WORLD_SIZE"), std::string::npos) << no_world.err;
  // The list of refusals says what each changes; what is modelled is not on it.
  const CommandResult refused = Memsim("megatron --refused");
  EXPECT_EQ(refused.exit_code, 0);
  EXPECT_NE(refused.out.find("--fp4-format"), std::string::npos) << refused.out;
  EXPECT_NE(refused.out.find("FP4 training"), std::string::npos) << refused.out;
  EXPECT_EQ(refused.out.find("--fp8-format"), std::string::npos) << refused.out;
  EXPECT_EQ(refused.out.find("--qk-layernorm "), std::string::npos) << refused.out;
  EXPECT_EQ(refused.out.find("--defer-embedding-wgrad-compute"), std::string::npos);
}

}  // namespace
}  // namespace memsim

namespace memsim {
namespace {

// A validation case as validation/import_megatron_ci.py writes one, minus `drop`.
std::string ValidationCaseYaml(const std::string& name, const std::string& extra_arg,
                               const std::string& drop) {
  std::string yaml = "name: " + name +
                     "\n"
                     "source: {repository: NVIDIA/Megatron-LM, commit: abc, config: c.yaml, "
                     "golden_values: g.json}\n"
                     "gpu: H100-80GB\nworld_size: 1\nrank: 0\n"
                     "env: {CUBLAS_WORKSPACE_CONFIG: ':4096:8'}\n"
                     "args:\n  --num-layers: 2\n  --hidden-size: 256\n  --num-attention-heads: 4\n"
                     "  --seq-length: 128\n  --micro-batch-size: 1\n  --vocab-size: 1000\n"
                     "  --bf16: true\n" +
                     extra_arg +
                     "measured: {iteration: 2, max_allocated_bytes: 100000000, "
                     "allocated_bytes: 50000000}\n";
  if (!drop.empty()) {
    const size_t at = yaml.find(drop + ":");
    yaml.erase(at, yaml.find('\n', at) - at + 1);
  }
  return yaml;
}

TEST(Cli, ValidateReportsEveryBadCaseAndStillRunsTheOthers) {
  const std::string dir = Temp("validate");
  fs::create_directories(dir + "/cases");
  std::ofstream(dir + "/cases/a_good.yaml") << ValidationCaseYaml("good", "", "");
  std::ofstream(dir + "/cases/b_missing.yaml") << ValidationCaseYaml("missing", "", "gpu");
  std::ofstream(dir + "/cases/c_unknown.yaml")
      << ValidationCaseYaml("unknown", "  --no-such-flag: true\n", "");
  std::ofstream(dir + "/tolerances.yaml") << "{}\n";
  const CommandResult run = Memsim("validate --cases " + dir + "/cases --tolerances " + dir +
                                   "/tolerances.yaml --json " + dir + "/out.json");
  EXPECT_EQ(run.exit_code, 2);
  // The file with a missing field is named with the field, on one line.
  EXPECT_NE(run.err.find("b_missing.yaml: missing field 'gpu'"), std::string::npos) << run.err;
  // Both loadable cases ran and are in the table: the good one with numbers (far from the
  // made-up measurement, so outside the default 0.5%), the unknown argument refused.
  EXPECT_NE(run.out.find("good"), std::string::npos);
  EXPECT_NE(run.out.find("OUTSIDE"), std::string::npos);
  EXPECT_NE(run.out.find("REFUSED: unknown Megatron-LM argument '--no-such-flag'"),
            std::string::npos)
      << run.out;
  const nlohmann::json result = nlohmann::json::parse(std::ifstream(dir + "/out.json"));
  EXPECT_EQ(result["cases"].size(), 2u);
}

// Note [Software of a measurement]: a GB200 case measured on a PyTorch whose default cuBLAS
// workspace on Blackwell was :4096:2:16:8 is simulated with that default; the case's own
// CUBLAS_WORKSPACE_CONFIG still wins. The step makes two PyTorch cuBLAS workspaces (the
// output layer's GEMMs on the forward thread and on autograd's), each 32 MiB on today's
// Blackwell default and 4096 KiB * 2 + 16 KiB * 8 on the old one, so what stays allocated
// after the step differs by 2 * (33,554,432 - 8,519,680) bytes.
TEST(Cli, ValidateSimulatesACaseOnTheSoftwareItWasMeasuredOn) {
  const std::string dir = Temp("validate_stack");
  fs::create_directories(dir + "/cases");
  auto gb200_case = [](const std::string& name, const std::string& env, const std::string& stack) {
    std::string yaml = ValidationCaseYaml(name, "", "");
    yaml.replace(yaml.find("gpu: H100-80GB"), 14, "gpu: GB200-186GB");
    const size_t env_at = yaml.find("env: {");
    yaml.replace(env_at, yaml.find('\n', env_at) - env_at, "env: {" + env + "}" + stack);
    return yaml;
  };
  const std::string old_default = "\nstack: {default_cublas_workspace_config: ':4096:2:16:8'}";
  std::ofstream(dir + "/cases/a.yaml") << gb200_case("today", "", "");
  std::ofstream(dir + "/cases/b.yaml") << gb200_case("old_pytorch", "", old_default);
  std::ofstream(dir + "/cases/c.yaml")
      << gb200_case("old_pytorch_configured", "CUBLAS_WORKSPACE_CONFIG: ':4096:8'", old_default);
  std::ofstream(dir + "/tolerances.yaml") << "{}\n";
  const CommandResult run = Memsim("validate --cases " + dir + "/cases --tolerances " + dir +
                                   "/tolerances.yaml --json " + dir + "/out.json");
  EXPECT_EQ(run.exit_code, 2) << run.err;  // the made-up measurements are far off
  const nlohmann::json result = nlohmann::json::parse(std::ifstream(dir + "/out.json"));
  ASSERT_EQ(result["cases"].size(), 3u);
  auto after_step = [&](size_t i) {
    EXPECT_EQ(result["cases"][i]["metrics"][1]["metric"], "allocated after step");
    return result["cases"][i]["metrics"][1]["memsim_bytes"].get<int64_t>();
  };
  EXPECT_EQ(after_step(0) - after_step(1), 2 * (33554432 - 8519680));
  EXPECT_EQ(after_step(2), after_step(0));
}

// A case that logged its iteration time gets memsim's step time beside it (no tolerance
// yet); one that did not gets none; a time that is not a positive number is refused.
TEST(Cli, ValidateReportsIterationTimeBesideMemory) {
  const std::string dir = Temp("validate_time");
  fs::create_directories(dir + "/cases");
  std::string timed = ValidationCaseYaml("timed", "", "");
  timed.replace(timed.find("allocated_bytes: 50000000}"), 26,
                "allocated_bytes: 50000000, iteration_time_s: 0.25, iteration_time_recorded: "
                "'2026-05-07', iteration_time_commit: 5fe3f06658}");
  std::ofstream(dir + "/cases/a_timed.yaml") << timed;
  std::ofstream(dir + "/cases/b_untimed.yaml") << ValidationCaseYaml("untimed", "", "");
  std::ofstream(dir + "/tolerances.yaml") << "{}\n";
  const CommandResult run =
      Memsim("validate --cases " + dir + "/cases --tolerances " + dir + "/tolerances.yaml --json " +
             dir + "/out.json --report " + dir + "/report.md");
  EXPECT_EQ(run.exit_code, 2);  // the made-up memory is outside; the time never fails a case
  const nlohmann::json result = nlohmann::json::parse(std::ifstream(dir + "/out.json"));
  ASSERT_EQ(result["cases"].size(), 2u);
  const nlohmann::json& time = result["cases"][0]["iteration_time"];
  EXPECT_EQ(time["real_s"].get<double>(), 0.25);
  const double memsim_s = time["memsim_s"].get<double>();
  EXPECT_GT(memsim_s, 0);
  EXPECT_DOUBLE_EQ(time["error_pct"].get<double>(), (memsim_s - 0.25) / 0.25 * 100);
  EXPECT_EQ(time["recorded"], "2026-05-07");
  EXPECT_EQ(time["commit"], "5fe3f06658");
  EXPECT_FALSE(result["cases"][1].contains("iteration_time"));
  EXPECT_NE(run.out.find("iteration time: 1 cases compared"), std::string::npos) << run.out;
  std::ifstream report(dir + "/report.md");
  const std::string md((std::istreambuf_iterator<char>(report)), {});
  EXPECT_NE(md.find("| timed | H100-80GB | 2026-05-07 5fe3f06658 | 0.250 | "), std::string::npos)
      << md;
  // Grouped by the commit that recorded the timings: one case, within 25% or not.
  EXPECT_NE(md.find("| H100-80GB | 2026-05-07 | 5fe3f06658 | 1 | "), std::string::npos) << md;

  timed.replace(timed.find("iteration_time_s: 0.25"), 22, "iteration_time_s: -1");
  std::ofstream(dir + "/cases/a_timed.yaml") << timed;
  const CommandResult bad =
      Memsim("validate --cases " + dir + "/cases --tolerances " + dir + "/tolerances.yaml");
  EXPECT_NE(bad.err.find("a_timed.yaml: measured.iteration_time_s must be a positive number"),
            std::string::npos)
      << bad.err;
}

// A case that measured its peak reserved memory (reserved_bytes.all.peak) is compared with
// memsim's peak reserved on the GPU for the same launch line, as `memsim megatron --json`
// reports it, and held to its own tolerance; the headline median and worst stay those of
// the allocated values. A reserved peak below the allocated one cannot be, and is refused.
TEST(Cli, ValidateComparesPeakReservedWhereMeasured) {
  const std::string dir = Temp("validate_reserved");
  fs::create_directories(dir + "/cases");
  const CommandResult megatron = test::RunMemsim(
      "megatron --json --gpu H100-80GB --out " + dir +
          "/megatron -- --num-layers 2 --hidden-size 256 "
          "--num-attention-heads 4 --seq-length 128 --micro-batch-size 1 --vocab-size 1000 --bf16",
      "WORLD_SIZE=1 CUBLAS_WORKSPACE_CONFIG=:4096:8");
  ASSERT_EQ(megatron.exit_code, 0) << megatron.err;
  const nlohmann::json simulated = nlohmann::json::parse(megatron.out)["rank_classes"][0];
  const auto peak_reserved_bytes =
      static_cast<int64_t>(simulated["peak_reserved_on_gpu_MB"].get<double>() * (1 << 20));
  const auto peak_allocated_bytes =
      static_cast<int64_t>(simulated["peak_allocated_MB"].get<double>() * (1 << 20));
  auto with_reserved = [](const std::string& name, int64_t max_allocated, int64_t reserved) {
    std::string yaml = ValidationCaseYaml(name, "", "");
    const std::string measured = "max_allocated_bytes: 100000000, allocated_bytes: 50000000";
    yaml.replace(yaml.find(measured), measured.size(),
                 "max_allocated_bytes: " + std::to_string(max_allocated) +
                     ", max_reserved_bytes: " + std::to_string(reserved));
    return yaml;
  };
  // Real reserved 1% below memsim's: outside the default 0.5%, inside a 1.5% with a reason.
  const int64_t real_reserved = peak_reserved_bytes * 100 / 101;
  std::ofstream(dir + "/cases/a.yaml") << with_reserved("a", peak_allocated_bytes, real_reserved);
  auto validate = [&](const std::string& tolerances) {
    std::ofstream(dir + "/tolerances.yaml") << tolerances;
    return Memsim("validate --cases " + dir + "/cases --tolerances " + dir +
                  "/tolerances.yaml --json " + dir + "/out.json");
  };
  const CommandResult outside = validate("{}\n");
  EXPECT_EQ(outside.exit_code, 2) << outside.out;
  EXPECT_NE(outside.out.find("max reserved: 1 cases compared"), std::string::npos) << outside.out;
  const nlohmann::json result = nlohmann::json::parse(std::ifstream(dir + "/out.json"));
  const nlohmann::json& metrics = result["cases"][0]["metrics"];
  ASSERT_EQ(metrics.size(), 2u);
  EXPECT_EQ(metrics[0]["metric"], "max allocated");
  EXPECT_EQ(metrics[1]["metric"], "max reserved");
  EXPECT_EQ(metrics[1]["real_bytes"].get<int64_t>(), real_reserved);
  EXPECT_EQ(metrics[1]["memsim_bytes"].get<int64_t>(), peak_reserved_bytes);
  EXPECT_FALSE(metrics[1]["within"].get<bool>());
  // The headline is the allocated value's (memsim's own peak: 0%), not the reserved 1%.
  EXPECT_LT(std::fabs(result["worst_error_pct"].get<double>()), 0.001);
  EXPECT_EQ(result["max_reserved"]["compared"], 1);
  EXPECT_EQ(result["max_reserved"]["worst_case"], "a");

  EXPECT_EQ(validate("a: {max_reserved_pct: 1.5}\n").exit_code, 2);  // no reason
  const CommandResult within =
      validate("a: {max_reserved_pct: 1.5, reason: 'segments laid out otherwise'}\n");
  EXPECT_EQ(within.exit_code, 0) << within.out << within.err;

  std::ofstream(dir + "/cases/a.yaml")
      << with_reserved("a", peak_allocated_bytes, peak_allocated_bytes - 1);
  const CommandResult impossible = validate("{}\n");
  EXPECT_EQ(impossible.exit_code, 2);
  EXPECT_NE(impossible.err.find("a.yaml: measured.max_reserved_bytes " +
                                std::to_string(peak_allocated_bytes - 1) +
                                " is below max_allocated_bytes"),
            std::string::npos)
      << impossible.err;
  EXPECT_EQ(Lines(impossible.err), 1);
}

// `validate --out` writes a case's simulated files of its measured rank, which `memsim
// compare` plots beside the real run: here a real trace (Megatron-LM on one H200, the case's
// rank alone through its fake process group, in Megatron's memory-tracer schema;
// validation/fake_pg). Compare's real peak is the real trace's largest sample of its last
// iteration, its simulated peak that of the last iteration memsim's summary reports.
TEST(Cli, ValidateOutFeedsCompareWithARealTrace) {
  const std::string dir = Temp("validate_out");
  const std::string name = "llama_1b_local_pp4_qk_layernorm_ce_fusion@fake_pg_h200";
  const CommandResult validate = Memsim("validate --filter '^" + name + "$' --out " + dir + "/sim");
  ASSERT_EQ(validate.exit_code, 0) << validate.out << validate.err;
  const std::string sim = dir + "/sim/" + name;
  for (const char* file : {"memory_trace_rank7.json", "summary_rank7.json", "snapshot_rank7.pickle",
                           "snapshot_rank7_peak.pickle"}) {
    EXPECT_TRUE(fs::exists(sim + "/" + file)) << file;
  }
  fs::create_directories(dir + "/real");
  const std::string real_trace = dir + "/real/memory_trace_rank7.json";
  ASSERT_EQ(std::system(("gunzip -c " + std::string(MEMSIM_SOURCE_DIR) +
                         "/validation/fake_pg/memory_traces/"
                         "memory_trace_rank7_llama_1b_local_pp4_qk_layernorm_ce_fusion.json.gz > " +
                         real_trace)
                            .c_str()),
            0);
  const nlohmann::json real = nlohmann::json::parse(std::ifstream(real_trace));
  std::string last = real.begin().key();
  for (const auto& [iteration, _] : real.items()) {
    if (std::stoi(iteration) > std::stoi(last)) last = iteration;
  }
  double real_peak_mb = 0;
  for (const nlohmann::json& sample : real[last]["samples"]) {
    real_peak_mb = std::max(real_peak_mb, sample["allocated_memory_MB"].get<double>());
  }
  const double sim_peak_mb =
      nlohmann::json::parse(std::ifstream(sim + "/summary_rank7.json"))["iterations"]
          .back()["peak_allocated_MB"]
          .get<double>();

  const CommandResult compare =
      Memsim("compare -r " + dir + "/real -s '" + sim + "' -o " + dir + "/plots");
  ASSERT_EQ(compare.exit_code, 0) << compare.out << compare.err;
  EXPECT_TRUE(fs::exists(dir + "/plots/memory_comparison_rank_7.png"));
  std::ifstream csv(dir + "/plots/comparison_summary.csv");
  std::string header, row;
  std::getline(csv, header);
  std::getline(csv, row);
  EXPECT_EQ(header.rfind("rank,real_peak_MB,sim_peak_MB,", 0), 0u) << header;
  std::stringstream fields(row);
  std::string rank, real_peak, sim_peak;
  std::getline(fields, rank, ',');
  std::getline(fields, real_peak, ',');
  std::getline(fields, sim_peak, ',');
  EXPECT_EQ(rank, "7");
  EXPECT_DOUBLE_EQ(std::stod(real_peak), real_peak_mb);
  EXPECT_DOUBLE_EQ(std::stod(sim_peak), sim_peak_mb);

  // A folder that cannot be made is refused before anything runs, in one line.
  std::ofstream(dir + "/a_file") << "x";
  const CommandResult bad =
      Memsim("validate --filter '^" + name + "$' --out " + dir + "/a_file/sim");
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_EQ(Lines(bad.err), 1) << bad.err;
  EXPECT_NE(bad.err.find("a_file/sim"), std::string::npos) << bad.err;
  EXPECT_EQ(bad.out, "");
}

TEST(Cli, ValidateToleranceAboveHalfAPercentNeedsAReason) {
  const std::string dir = Temp("validate_tolerance");
  fs::create_directories(dir + "/cases");
  std::ofstream(dir + "/cases/a.yaml") << ValidationCaseYaml("a", "", "");
  std::ofstream(dir + "/tolerances.yaml") << "a: {max_allocated_pct: 3}\n";
  const CommandResult run =
      Memsim("validate --cases " + dir + "/cases --tolerances " + dir + "/tolerances.yaml");
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_NE(run.err.find("needs a 'reason'"), std::string::npos) << run.err;
  EXPECT_EQ(Lines(run.err), 1);
}

}  // namespace
}  // namespace memsim
