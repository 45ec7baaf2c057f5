// Megatron-LM launch lines mapped onto RunSpec: the model against memsim's presets, the
// layout, batch and training switches, the memory-neutral arguments, and the errors.
#include "tools/lib/megatron_args.h"
#include "parallel/run_spec.h"
#include "simulator/cost_model.h"
#include "tests/support/test_models.h"
#include "tests/support/validated_run.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <optional>
#include <sstream>

namespace memsim {
namespace {

std::vector<std::string> Split(const std::string& line) {
  std::istringstream in(line);
  std::vector<std::string> out;
  for (std::string token; in >> token;) out.push_back(token);
  return out;
}

// A two-layer GPT small enough for any layout the tests give it, as a launch line prefix.
constexpr char kTinyGpt[] =
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 8 "
    "--micro-batch-size 1 --global-batch-size 8 --vocab-size 100 ";

MegatronArgsResult Parse(const std::string& line, int64_t world_size) {
  MegatronArgsResult result;
  const Status s = ParseMegatronArgs(Split(line), {}, world_size, &result);
  EXPECT_TRUE(s.ok()) << s.message();
  return result;
}

// The first error of the launch line as `memsim megatron` reports it: reading the
// arguments, then FinalizeRunSpec on the whole run.
std::string ErrorOf(const std::string& line, int64_t world_size = 8) {
  MegatronArgsResult result;
  Status s = ParseMegatronArgs(Split(line), {}, world_size, &result);
  if (s.ok()) {
    std::optional<ValidatedRun> run;
    s = FinalizeRunSpec(result.spec, &run);
  }
  EXPECT_FALSE(s.ok()) << line;
  EXPECT_EQ(s.message().find('\n'), std::string::npos);
  return s.message();
}

// Every field but the name.

// Llama 3 8B as Megatron-LM's examples/llama scripts launch it (bf16 in place of fp8),
// with the usual memory-neutral arguments.
constexpr char kLlama3_8B[] =
    "--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
    "--group-query-attention --num-query-groups 8 --kv-channels 128 "
    "--seq-length 8192 --max-position-embeddings 8192 --position-embedding-type rope "
    "--rotary-base 500000 --rotary-percent 1.0 --use-rope-scaling "
    "--swiglu --normalization RMSNorm --norm-epsilon 1e-05 "
    "--untie-embeddings-and-output-weights --disable-bias-linear --bf16 "
    "--attention-dropout 0.0 --hidden-dropout 0.0 "
    "--micro-batch-size 1 --global-batch-size 128 "
    "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --sequence-parallel "
    "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather "
    "--transformer-impl transformer_engine --attention-backend fused "
    "--vocab-size 128256 --tokenizer-type HuggingFaceTokenizer "
    "--tokenizer-model meta-llama/Meta-Llama-3-8B "
    "--lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2000 "
    "--weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95 "
    "--init-method-std 0.008 --train-iters 1000 "
    "--data-path 0.5 /data/a_text_document 0.5 /data/b_text_document --split 99,1,0 "
    "--save /ckpt --load /ckpt --save-interval 500 --ckpt-format torch_dist "
    "--log-interval 10 --log-throughput --tensorboard-dir /tb --eval-iters 10 "
    "--eval-interval 1000 --seed 1234 --distributed-backend nccl";

TEST(MegatronArgs, Llama3_8BMatchesThePreset) {
  MegatronArgsResult r = Parse(kLlama3_8B, 16);
  EXPECT_EQ(r.spec.model.name, "megatron");
  ModelConfig preset;
  ASSERT_TRUE(LoadModelPreset("llama3-8b", &preset).ok());
  ASSERT_TRUE(FinalizeModelConfig(&preset, 2).ok());
  ASSERT_TRUE(FinalizeModelConfig(&r.spec.model, 2).ok());
  test::ExpectSameArchitecture(r.spec.model, preset, /*compare_dropout=*/true);

  const TrainingConfig& t = r.spec.training;
  EXPECT_EQ(t.seq_length, 8192);
  EXPECT_EQ(t.micro_batch_size, 1);
  // 128 / (1 * dp 8), dp = 16 / (TP 2 * PP 1 * CP 1)
  EXPECT_EQ(test::Validated(r.spec).spec().training.num_microbatches, 16);
  EXPECT_EQ(t.precision, Precision::kBf16);
  EXPECT_EQ(t.attention, AttentionKind::kFlash);
  EXPECT_EQ(t.profile, ProfileKind::kTransformerEngine);
  EXPECT_EQ(t.recompute, RecomputeKind::kNone);
  EXPECT_EQ(t.optimizer, OptimizerKind::kAdam);
  EXPECT_EQ(r.spec.global_batch_size, 128);

  ParallelLayout& l = r.spec.layout;
  EXPECT_EQ(l.world_size, 16);
  EXPECT_EQ(l.tp, 2);
  EXPECT_EQ(l.pp, 1);
  EXPECT_EQ(l.vpp, 1);
  EXPECT_EQ(l.cp, 1);
  EXPECT_EQ(l.ep, 1);
  EXPECT_TRUE(l.sequence_parallel);
  EXPECT_EQ(l.data_parallel, DataParallelKind::kDistributedOptimizer);
  ASSERT_TRUE(FinalizeLayout(&l, r.spec.model).ok());
  EXPECT_EQ(l.dp, 8);

  const std::vector<std::string> ignored = {"--max-position-embeddings",  // RoPE: no position table
                                            "--rotary-base",
                                            "--use-rope-scaling",
                                            "--norm-epsilon",
                                            "--overlap-param-gather",
                                            "--tokenizer-type",
                                            "--tokenizer-model",
                                            "--lr",
                                            "--min-lr",
                                            "--lr-decay-style",
                                            "--lr-warmup-iters",
                                            "--weight-decay",
                                            "--clip-grad",
                                            "--adam-beta1",
                                            "--adam-beta2",
                                            "--init-method-std",
                                            "--train-iters",
                                            "--data-path",
                                            "--split",
                                            "--save",
                                            "--load",
                                            "--save-interval",
                                            "--ckpt-format",
                                            "--log-interval",
                                            "--log-throughput",
                                            "--tensorboard-dir",
                                            "--eval-iters",
                                            "--eval-interval",
                                            "--seed",
                                            "--distributed-backend"};
  EXPECT_EQ(r.ignored, ignored);
  // Read: it buckets the distributed optimizer's shards (Note [Distributed optimizer buffers]).
  EXPECT_TRUE(r.spec.layout.ddp_buckets.overlap_grad_reduce);
}

TEST(MegatronArgs, Gpt3WithInterleavedPipelineAndFullRecompute) {
  // GPT-3 175B as in Narayanan et al. 2021 (learned positions, GeLU, biases, tied),
  // local kernels in fp16, 96 layers on 8 stages of 3 chunks.
  MegatronArgsResult r = Parse(
      "--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048 "
      "--max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 1536 "
      "--tensor-model-parallel-size 8 --pipeline-model-parallel-size 8 "
      "--num-layers-per-virtual-pipeline-stage 4 --fp16 --transformer-impl local "
      "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 "
      "--vocab-size 50257 --hidden-dropout 0.0 --attention-dropout 0.0",
      1024);
  const ModelConfig& m = r.spec.model;
  const ValidatedRun run = test::Validated(r.spec);
  EXPECT_EQ(run.spec().model.ffn_hidden_size, 4 * 12288);
  EXPECT_EQ(m.num_query_groups, 0);  // multi-head attention
  EXPECT_EQ(m.kv_channels, 0);       // H / A
  EXPECT_EQ(m.norm, NormKind::kLayerNorm);
  EXPECT_EQ(m.activation, ActivationKind::kGelu);
  EXPECT_EQ(m.position, PositionKind::kLearned);
  EXPECT_EQ(m.max_position_embeddings, 2048);
  EXPECT_TRUE(m.tie_embeddings);
  EXPECT_TRUE(m.add_bias_linear);
  EXPECT_TRUE(m.add_qkv_bias);
  EXPECT_EQ(m.hidden_dropout, 0.0);
  EXPECT_EQ(m.attention_dropout, 0.0);
  EXPECT_EQ(m.make_vocab_size_divisible_by, 128);
  EXPECT_EQ(r.spec.layout.vpp, 3);                      // 96 / 8 stages / 4 layers per chunk
  EXPECT_EQ(run.spec().training.num_microbatches, 96);  // 1536 / (1 * dp 16)
  EXPECT_EQ(r.spec.training.precision, Precision::kFp16);
  EXPECT_EQ(r.spec.training.profile, ProfileKind::kMegatronLocal);
  EXPECT_EQ(r.spec.training.attention, AttentionKind::kEager);  // local, no --use-flash-attn
  EXPECT_EQ(r.spec.training.recompute, RecomputeKind::kFull);
  EXPECT_EQ(r.spec.training.recompute_method, RecomputeMethod::kUniform);
  EXPECT_EQ(r.spec.training.recompute_num_layers, 1);
  EXPECT_EQ(r.spec.layout.data_parallel, DataParallelKind::kDdp);
  EXPECT_TRUE(r.ignored.empty());
  ModelConfig model = m;
  ASSERT_TRUE(FinalizeModelConfig(&model, 8).ok());
  EXPECT_EQ(model.padded_vocab_size, 51200);  // a multiple of 128 * 8
  EXPECT_TRUE(FinalizeLayout(&r.spec.layout, model).ok());
}

TEST(MegatronArgs, MegatronDefaults) {
  // SwiGLU's default FFN is int(4H * 2/3 / 64) * 64 = 10880 for H = 4096; GQA without
  // --num-query-groups is one group; no --global-batch-size means one microbatch;
  // neither --bf16 nor --fp16 is fp32; --recompute-activations is selective.
  MegatronArgsResult r = Parse(
      "--num-layers 2 --hidden-size 4096 --num-attention-heads 32 --swiglu "
      "--group-query-attention --seq-length 1024 --micro-batch-size 2 --vocab-size 32000 "
      "--recompute-activations --transformer-impl local --use-flash-attn",
      4);
  const ValidatedRun run = test::Validated(r.spec);
  EXPECT_EQ(run.spec().model.ffn_hidden_size, 10880);
  EXPECT_EQ(r.spec.model.num_query_groups, 1);
  EXPECT_EQ(r.spec.model.hidden_dropout, 0.1);
  EXPECT_EQ(r.spec.model.attention_dropout, 0.1);
  EXPECT_EQ(r.spec.global_batch_size, 0);  // Megatron-LM's default: micro 2 * dp 4
  EXPECT_EQ(run.spec().training.num_microbatches, 1);
  EXPECT_EQ(r.spec.training.precision, Precision::kFp32);
  EXPECT_EQ(r.spec.training.recompute, RecomputeKind::kSelective);
  EXPECT_EQ(r.spec.training.attention, AttentionKind::kFlash);
  EXPECT_EQ(r.spec.training.profile, ProfileKind::kMegatronLocal);

  // Without --group-query-attention Megatron-LM reads no --num-query-groups; the
  // `=` spelling works everywhere; a dense model ignores the MoE arguments.
  r = Parse(
      "--num-layers=2 --hidden-size=1024 --num-attention-heads=16 --num-query-groups=4 "
      "--seq-length=512 --micro-batch-size=1 --global-batch-size=16 --vocab-size=1000 "
      "--moe-router-topk=4 --use-flash-attn --padded-vocab-size=1024 --bf16",
      2);
  EXPECT_EQ(r.spec.model.num_query_groups, 0);
  EXPECT_EQ(r.spec.model.vocab_size, 1024);  // --padded-vocab-size is taken as is
  EXPECT_EQ(r.spec.model.make_vocab_size_divisible_by, 1);
  EXPECT_EQ(test::Validated(r.spec).spec().training.num_microbatches, 8);  // 16 / (1 * dp 2)
  EXPECT_EQ(r.ignored, (std::vector<std::string>{"--num-query-groups", "--vocab-size",
                                                 "--moe-router-topk", "--use-flash-attn"}));
}

TEST(MegatronArgs, TokenizerVocabularyAndLaunchEnvironment) {
  const std::string base =
      "--num-layers 2 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 "
      "--micro-batch-size 4 --bf16 ";
  // pretrain_gpt.py's default tokenizer is GPT2BPETokenizer, whose vocab.json holds 50,257
  // tokens; --vocab-size wins where given.
  MegatronArgsResult r = Parse(base, 8);
  EXPECT_EQ(r.spec.model.vocab_size, 50257);
  EXPECT_EQ(Parse(base + "--vocab-size 1000", 8).spec.model.vocab_size, 1000);

  // Transformer Engine (the default) picks the attention backend per GPU once the run is
  // finalized; --attention-backend narrows the choice; local is unfused.
  EXPECT_TRUE(r.spec.training.te_attention.has_value());
  EXPECT_FALSE(r.spec.training.te_attention->deterministic);
  EXPECT_FALSE(r.spec.training.deterministic_algorithms);
  EXPECT_TRUE(r.spec.training.gradient_accumulation_fusion);
  EXPECT_EQ(r.spec.training.cublas_workspace_bytes, -1);
  r = Parse(base +
                "--attention-backend unfused --deterministic-mode "
                "--no-gradient-accumulation-fusion",
            8);
  ASSERT_TRUE(r.spec.training.te_attention.has_value());
  EXPECT_FALSE(r.spec.training.te_attention->flash);
  EXPECT_FALSE(r.spec.training.te_attention->fused);
  EXPECT_TRUE(r.spec.training.te_attention->unfused);
  EXPECT_TRUE(r.spec.training.te_attention->deterministic);
  EXPECT_TRUE(r.spec.training.deterministic_algorithms);  // torch.use_deterministic_algorithms
  EXPECT_FALSE(r.spec.training.gradient_accumulation_fusion);
  // --deterministic-mode sets CUBLAS_WORKSPACE_CONFIG=:4096:8: 8 x 4096 KiB.
  EXPECT_EQ(r.spec.training.cublas_workspace_bytes, 32 * 1024 * 1024);
  EXPECT_FALSE(Parse(base + "--attention-backend local", 8).spec.training.te_attention);

  // The environment: modelled variables change the spec, neutral ones are listed as
  // ignored, unknown ones are refused.
  MegatronArgsResult e;
  ASSERT_TRUE(ParseMegatronArgs(Split(base),
                                {{"CUBLAS_WORKSPACE_CONFIG", ":4096:2:16:8"},
                                 {"NVTE_FUSED_ATTN", "0"},
                                 {"NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0"},
                                 {"NCCL_ALGO", "Ring"}},
                                8, &e)
                  .ok());
  EXPECT_EQ(e.spec.training.cublas_workspace_bytes, 4096 * 1024 * 2 + 16 * 1024 * 8);
  EXPECT_FALSE(e.spec.training.te_attention->fused);
  EXPECT_TRUE(e.spec.training.te_attention->flash);
  EXPECT_TRUE(e.spec.training.te_attention->deterministic);
  EXPECT_FALSE(e.spec.training.deterministic_algorithms);  // TE's switch alone
  EXPECT_NE(std::find(e.ignored.begin(), e.ignored.end(), "NCCL_ALGO"), e.ignored.end());
  Status s = ParseMegatronArgs(Split(base), {{"MY_SETTING", "1"}}, 8, &e);
  EXPECT_EQ(s.message(),
            "unknown environment variable MY_SETTING; if it does not change memory, leave it "
            "out of the environment given to memsim");
  s = ParseMegatronArgs(Split(base), {{"CUBLAS_WORKSPACE_CONFIG", "4096"}}, 8, &e);
  EXPECT_EQ(s.message(),
            "CUBLAS_WORKSPACE_CONFIG '4096' has no :SIZE_KIB:COUNT pair (e.g. :4096:8)");
  // PYTORCH_CUDA_ALLOC_CONF: max_split_size_mb and expandable_segments are modelled,
  // garbage_collection_threshold noted as inert.
  ASSERT_TRUE(
      ParseMegatronArgs(Split(base), {{"PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128"}}, 8, &e)
          .ok());
  EXPECT_EQ(e.spec.training.allocator_settings.max_split_size_bytes, int64_t{128} << 20);
  ASSERT_TRUE(ParseMegatronArgs(Split(base),
                                {{"PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"}}, 8, &e)
                  .ok());
  EXPECT_EQ(e.spec.training.allocator_settings.max_split_size_bytes, 0);
  EXPECT_TRUE(e.spec.training.allocator_settings.expandable_segments);
  EXPECT_EQ(std::find(e.ignored.begin(), e.ignored.end(), "PYTORCH_CUDA_ALLOC_CONF"),
            e.ignored.end());
  ASSERT_TRUE(
      ParseMegatronArgs(Split(base), {{"PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb: 20,"}}, 8, &e)
          .ok());
  EXPECT_EQ(e.spec.training.allocator_settings.max_split_size_bytes, int64_t{20} << 20);
  ASSERT_TRUE(
      ParseMegatronArgs(Split(base), {{"PYTORCH_ALLOC_CONF", "max_split_size_mb:64"}}, 8, &e).ok());
  EXPECT_EQ(e.spec.training.allocator_settings.max_split_size_bytes, int64_t{64} << 20);
  s = ParseMegatronArgs(Split(base), {{"PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:19"}}, 8, &e);
  EXPECT_EQ(s.message(),
            "PYTORCH_CUDA_ALLOC_CONF max_split_size_mb must be a whole number of MiB, at least "
            "20, not '19'");
  ASSERT_TRUE(ParseMegatronArgs(Split(base),
                                {{"PYTORCH_CUDA_ALLOC_CONF",
                                  "expandable_segments:True,garbage_collection_threshold:0.8"}},
                                8, &e)
                  .ok());
  EXPECT_TRUE(e.spec.training.allocator_settings.expandable_segments);
  EXPECT_NE(std::find(e.notes.begin(), e.notes.end(),
                      "PYTORCH_CUDA_ALLOC_CONF garbage_collection_threshold:0.8 has no effect: "
                      "PyTorch applies it only under torch.cuda.set_per_process_memory_fraction, "
                      "which Megatron-LM never calls"),
            e.notes.end());
  s = ParseMegatronArgs(Split(base),
                        {{"PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:1.5"}}, 8, &e);
  EXPECT_EQ(s.message(),
            "PYTORCH_CUDA_ALLOC_CONF garbage_collection_threshold must be between 0 and 1 "
            "(exclusive), not '1.5'");
  s = ParseMegatronArgs(
      Split(base),
      {{"PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64,pinned_use_cuda_host_register:True"}}, 8,
      &e);
  EXPECT_EQ(s.message(),
            "PYTORCH_CUDA_ALLOC_CONF 'pinned_use_cuda_host_register:True' is not modelled "
            "(memsim models max_split_size_mb, max_non_split_rounding_mb, "
            "roundup_power2_divisions, expandable_segments and garbage_collection_threshold); "
            "drop it to simulate without it");
  // roundup_power2_divisions as PyTorch's AllocatorConfig reads it: one number for every
  // interval, or a list by interval in MiB where the first entry also sets the intervals
  // below it and '>' the ones above the last named.
  ASSERT_TRUE(ParseMegatronArgs(Split(base),
                                {{"PYTORCH_CUDA_ALLOC_CONF", "roundup_power2_divisions:4"}}, 8, &e)
                  .ok());
  EXPECT_EQ(e.spec.training.allocator_settings.roundup_power2_divisions,
            (std::array<int64_t, 16>{4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4}));
  ASSERT_TRUE(ParseMegatronArgs(Split(base),
                                {{"PYTORCH_CUDA_ALLOC_CONF",
                                  "roundup_power2_divisions:[256:1,512:2, 1024:4,>:8],"
                                  "max_split_size_mb:128,max_non_split_rounding_mb:512"}},
                                8, &e)
                  .ok());
  EXPECT_EQ(e.spec.training.allocator_settings.roundup_power2_divisions,
            (std::array<int64_t, 16>{1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 4, 8, 8, 8, 8, 8}));
  EXPECT_EQ(e.spec.training.allocator_settings.max_non_split_rounding_bytes, int64_t{512} << 20);
  s = ParseMegatronArgs(Split(base),
                        {{"PYTORCH_CUDA_ALLOC_CONF", "roundup_power2_divisions:[300:2]"}}, 8, &e);
  EXPECT_EQ(s.message(),
            "PYTORCH_CUDA_ALLOC_CONF roundup_power2_divisions list entries must be "
            "SIZE_MIB:DIVISIONS with powers of two, not '300'");
  // A leading '>' sets the intervals above the first, as PyTorch's last_index + 1 does.
  ASSERT_TRUE(ParseMegatronArgs(Split(base),
                                {{"PYTORCH_CUDA_ALLOC_CONF", "roundup_power2_divisions:[>:8]"}}, 8,
                                &e)
                  .ok());
  EXPECT_EQ(e.spec.training.allocator_settings.roundup_power2_divisions,
            (std::array<int64_t, 16>{0, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8}));
  s = ParseMegatronArgs(Split(base), {{"PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:true"}}, 8,
                        &e);
  EXPECT_EQ(s.message(),
            "PYTORCH_CUDA_ALLOC_CONF expandable_segments must be True or False, not 'true'");
  for (const char* divisions : {"3", "2147483648"}) {
    s = ParseMegatronArgs(
        Split(base),
        {{"PYTORCH_CUDA_ALLOC_CONF", std::string("roundup_power2_divisions:") + divisions}}, 8, &e);
    EXPECT_EQ(s.message(),
              "PYTORCH_CUDA_ALLOC_CONF roundup_power2_divisions must be a power of two up to 2^30 "
              "or a [MiB:divisions,...] list, not '" +
                  std::string(divisions) + "'");
  }
  s = ParseMegatronArgs(Split(base),
                        {{"PYTORCH_CUDA_ALLOC_CONF", "roundup_power2_divisions:[256:2"}}, 8, &e);
  EXPECT_EQ(s.message(),
            "PYTORCH_CUDA_ALLOC_CONF roundup_power2_divisions list has no closing ']'");
  s = ParseMegatronArgs(
      Split(base), {{"PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,max_split_size_mb:64"}},
      8, &e);
  EXPECT_FALSE(s.ok());

  // Interleaving's microbatch group size is read, and checked against Megatron's rules.
  r = Parse(
      "--num-layers 8 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 "
      "--micro-batch-size 1 --global-batch-size 12 --pipeline-model-parallel-size 2 "
      "--num-layers-per-virtual-pipeline-stage 2 "
      "--microbatch-group-size-per-virtual-pipeline-stage 3",
      2);
  EXPECT_EQ(r.spec.layout.microbatch_group_size, 3);
  EXPECT_EQ(r.spec.layout.vpp, 2);
  EXPECT_TRUE(r.spec.layout.overlap_p2p_comm);

  // Interleaving without p2p overlap: Megatron-LM asserts PP > 2.
  const std::string interleaved =
      "--num-layers 8 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 "
      "--micro-batch-size 1 --global-batch-size 16 --num-layers-per-virtual-pipeline-stage 1 "
      "--no-overlap-p2p-communication ";
  EXPECT_FALSE(
      Parse(interleaved + "--pipeline-model-parallel-size 4", 4).spec.layout.overlap_p2p_comm);
  EXPECT_EQ(ErrorOf(interleaved + "--pipeline-model-parallel-size 2", 2),
            "interleaving without p2p overlap needs PP > 2 (Megatron-LM asserts it: two sends "
            "between the same ranks in one batch), got PP=2; drop --no-overlap-p2p-communication "
            "or raise PP");
}

TEST(AttentionBackend, ChosenAsTransformerEngineChooses) {
  TrainingConfig bf16;
  bf16.precision = Precision::kBf16;
  TrainingConfig fp32 = bf16;
  fp32.precision = Precision::kFp32;
  const TeAttentionChoice all;
  TeAttentionChoice deterministic;
  deterministic.deterministic = true;
  TeAttentionChoice no_fused;
  no_fused.fused = false;
  TeAttentionChoice unfused_only;
  unfused_only.flash = unfused_only.fused = false;
  TeAttentionChoice none = unfused_only;
  none.unfused = false;
  struct Case {
    TeAttentionChoice choice;
    const TrainingConfig* training;
    int cc;
    AttentionKind expected;
  };
  const Case cases[] = {
      {all, &bf16, 90, AttentionKind::kFused},            // Hopper: cuDNN before flash
      {all, &bf16, 80, AttentionKind::kFlash},            // Ampere: FlashAttention-2 first
      {deterministic, &bf16, 90, AttentionKind::kFused},  // Hopper keeps fused
      {no_fused, &bf16, 90, AttentionKind::kFlash},
      {unfused_only, &bf16, 90, AttentionKind::kEager},
      {all, &fp32, 90, AttentionKind::kEager},  // no fused kernel takes fp32
      // Blackwell: cuDNN trains deterministically only without dropout (ModelConfig's
      // default attention dropout is 0.1), so deterministic runs take FlashAttention.
      {all, &bf16, 100, AttentionKind::kFused},
      {deterministic, &bf16, 100, AttentionKind::kFlash},
  };
  const ModelConfig vanilla;
  for (const Case& c : cases) {
    AttentionKind got = AttentionKind::kFlash;
    ASSERT_TRUE(SelectTeAttention(c.choice, *c.training, vanilla, c.cc, &got).ok());
    EXPECT_EQ(got, c.expected) << c.cc << " " << AttentionName(c.expected);
  }
  // Ampere, deterministic, flash disabled: fused is not deterministic there either.
  TeAttentionChoice ampere = deterministic;
  ampere.flash = false;
  AttentionKind got;
  ASSERT_TRUE(SelectTeAttention(ampere, bf16, vanilla, 80, &got).ok());
  EXPECT_EQ(got, AttentionKind::kEager);
  EXPECT_FALSE(SelectTeAttention(none, bf16, vanilla, 90, &got).ok());
  ModelConfig no_dropout;
  no_dropout.attention_dropout = 0;
  ASSERT_TRUE(SelectTeAttention(deterministic, bf16, no_dropout, 100, &got).ok());
  EXPECT_EQ(got, AttentionKind::kFused);
  // Attention sinks (get_attention_backend's softmax filter): no FlashAttention, so Ampere
  // takes fused attention; deterministic runs lose fused attention too.
  ModelConfig sinks;
  sinks.softmax = SoftmaxKind::kLearnable;
  ASSERT_TRUE(SelectTeAttention(all, bf16, sinks, 80, &got).ok());
  EXPECT_EQ(got, AttentionKind::kFused);
  ASSERT_TRUE(SelectTeAttention(deterministic, bf16, sinks, 90, &got).ok());
  EXPECT_EQ(got, AttentionKind::kEager);
}

// --flash-attention-version pins Transformer Engine's FlashAttention: 2 is memsim's
// FlashAttention-2; 3 runs on 9.0 only and 4 on 9.0 and later, so Ampere falls back to fused
// attention, and where 3 or 4 would run memsim refuses (their saves are not modelled).
TEST(MegatronArgs, FlashAttentionVersion) {
  TrainingConfig bf16;
  bf16.precision = Precision::kBf16;
  const ModelConfig vanilla;
  TeAttentionChoice pinned;
  AttentionKind got = AttentionKind::kEager;
  pinned.flash_version = 2;
  ASSERT_TRUE(SelectTeAttention(pinned, bf16, vanilla, 80, &got).ok());
  EXPECT_EQ(got, AttentionKind::kFlash);
  pinned.flash_version = 3;
  ASSERT_TRUE(SelectTeAttention(pinned, bf16, vanilla, 80, &got).ok());
  EXPECT_EQ(got, AttentionKind::kFused);
  ASSERT_TRUE(SelectTeAttention(pinned, bf16, vanilla, 90, &got).ok());
  EXPECT_EQ(got, AttentionKind::kFused);  // Hopper prefers cuDNN anyway
  pinned.fused = false;
  EXPECT_NE(SelectTeAttention(pinned, bf16, vanilla, 90, &got).message().find("FlashAttention 3"),
            std::string::npos);
  pinned.flash_version = 4;
  ASSERT_TRUE(SelectTeAttention(pinned, bf16, vanilla, 80, &got).ok());
  EXPECT_EQ(got, AttentionKind::kEager);
  EXPECT_EQ(Parse(std::string(kTinyGpt) + "--flash-attention-version 3", 1)
                .spec.training.te_attention->flash_version,
            3);
  EXPECT_NE(ErrorOf(std::string(kTinyGpt) + "--flash-attention-version 1", 1)
                .find("must be 2, 3 or 4, got 1"),
            std::string::npos);
  EXPECT_EQ(Parse(std::string(kTinyGpt) + "--transformer-impl local --flash-attention-version 3", 1)
                .ignored,
            std::vector<std::string>{"--flash-attention-version"});
}

TEST(MegatronArgs, MixtureOfExperts) {
  // Mixtral 8x7B's shape matches the preset.
  MegatronArgsResult r = Parse(
      "--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
      "--group-query-attention --num-query-groups 8 --seq-length 4096 "
      "--position-embedding-type rope --swiglu --normalization RMSNorm "
      "--untie-embeddings-and-output-weights --disable-bias-linear --vocab-size 32000 "
      "--attention-dropout 0.0 --hidden-dropout 0.0 "
      "--num-experts 8 --moe-router-topk 2 --moe-token-dispatcher-type alltoall "
      "--moe-grouped-gemm --moe-aux-loss-coeff 1e-2 --moe-router-load-balancing-type aux_loss "
      "--expert-model-parallel-size 8 --micro-batch-size 1 --global-batch-size 256 --bf16",
      64);
  ModelConfig preset;
  ASSERT_TRUE(LoadModelPreset("mixtral-8x7b", &preset).ok());
  ASSERT_TRUE(FinalizeModelConfig(&preset).ok());
  ASSERT_TRUE(FinalizeModelConfig(&r.spec.model).ok());
  test::ExpectSameArchitecture(r.spec.model, preset, /*compare_dropout=*/true);
  EXPECT_EQ(r.spec.layout.ep, 8);
  EXPECT_EQ(r.spec.layout.etp, 0);                // = TP
  EXPECT_TRUE(r.spec.training.moe_grouped_gemm);  // TE's grouped-GEMM workspaces
  EXPECT_EQ(r.spec.training.moe_dispatcher, MoeDispatcher::kAllToAll);
  EXPECT_EQ(r.spec.model.moe_aux_loss_coeff, 1e-2);  // the loss keeps [T, E] fp32 scores
  EXPECT_TRUE(r.ignored.empty());  // the load-balancing kind is read (Note [MoE routing])

  // DeepSeek-V3's layer pattern: 3 dense layers, then 58 with 256 experts and a shared one.
  r = Parse(
      "--num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128 "
      "--kv-channels 128 --seq-length 4096 --position-embedding-type rope --swiglu "
      "--normalization RMSNorm --untie-embeddings-and-output-weights --disable-bias-linear "
      "--vocab-size 129280 --num-experts 256 --moe-router-topk 8 --moe-ffn-hidden-size 2048 "
      "--moe-shared-expert-intermediate-size 2048 --moe-layer-freq ([0]*3+[1]*58) "
      "--moe-expert-capacity-factor 1.5 --expert-tensor-parallel-size 1 "
      "--micro-batch-size 1 --bf16",
      8);
  const ModelConfig& m = r.spec.model;
  EXPECT_EQ(m.num_experts, 256);
  EXPECT_EQ(m.moe_router_topk, 8);
  EXPECT_EQ(m.moe_ffn_hidden_size, 2048);
  EXPECT_EQ(m.moe_shared_expert_size, 2048);
  EXPECT_EQ(m.moe_first_k_dense_layers, 3);
  EXPECT_EQ(m.moe_capacity_factor, 1.5);
  EXPECT_EQ(r.spec.layout.etp, 1);

  // The other spellings of the same pattern.
  for (const char* freq : {"[0]*3+[1]*58", "1", "[1]*61"}) {
    r = Parse(
        std::string("--num-layers 61 --hidden-size 64 --num-attention-heads 4 --seq-length 8 "
                    "--micro-batch-size 1 --vocab-size 100 --num-experts 4 --moe-layer-freq ") +
            freq,
        1);
    EXPECT_EQ(r.spec.model.moe_first_k_dense_layers, freq[1] == '0' ? 3 : 0) << freq;
  }
  r = Parse(
      "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 8 "
      "--micro-batch-size 1 --vocab-size 100 --num-experts 4 --moe-layer-freq [0,0,1,1]",
      1);
  EXPECT_EQ(r.spec.model.moe_first_k_dense_layers, 2);
}

// Token dropping: --moe-pad-expert-input-to-capacity and --moe-token-drop-policy are read
// with a capacity factor (a negative one is Megatron's None: dropless); padding without one
// is refused, as Megatron refuses it; without a capacity the policy changes nothing.
TEST(MegatronArgs, ExpertCapacity) {
  const std::string moe = std::string(kTinyGpt) +
                          "--num-experts 4 --moe-router-topk 2 --moe-token-dispatcher-type "
                          "alltoall ";
  MegatronArgsResult r = Parse(moe +
                                   "--moe-expert-capacity-factor 1.25 "
                                   "--moe-pad-expert-input-to-capacity "
                                   "--moe-token-drop-policy position",
                               1);
  EXPECT_EQ(r.spec.model.moe_capacity_factor, 1.25);
  EXPECT_TRUE(r.spec.model.moe_pad_to_capacity);
  EXPECT_TRUE(r.spec.model.moe_drop_by_position);
  r = Parse(moe + "--moe-expert-capacity-factor -1 --moe-token-drop-policy probs", 1);
  EXPECT_EQ(r.spec.model.moe_capacity_factor, 0);
  EXPECT_EQ(r.ignored, (std::vector<std::string>{"--moe-token-drop-policy"}));
  EXPECT_EQ(ErrorOf(moe + "--moe-pad-expert-input-to-capacity", 1),
            "padding expert inputs to capacity needs a capacity factor (Megatron-LM: "
            "--moe-pad-expert-input-to-capacity requires --moe-expert-capacity-factor)");
}

// The router's arguments (Note [MoE routing]): score function, pre-softmax, expert bias,
// scaling, fusion, and the load-balancing kind, which decides whether an aux loss exists.
TEST(MegatronArgs, RouterArguments) {
  const std::string moe = std::string(kTinyGpt) + "--num-experts 4 --moe-router-topk 2 ";
  ModelConfig m = Parse(moe, 1).spec.model;
  EXPECT_EQ(m.moe_router_score_function, MoeScoreFunction::kSoftmax);
  EXPECT_FALSE(m.moe_router_pre_softmax || m.moe_router_expert_bias || m.moe_router_sinkhorn);
  MegatronArgsResult r = Parse(moe +
                                   "--moe-router-score-function sigmoid "
                                   "--moe-router-enable-expert-bias --moe-router-pre-softmax "
                                   "--moe-router-topk-scaling-factor 2.5 --moe-router-fusion "
                                   "--moe-router-load-balancing-type seq_aux_loss "
                                   "--moe-aux-loss-coeff 1e-4",
                               1);
  m = r.spec.model;
  EXPECT_EQ(m.moe_router_score_function, MoeScoreFunction::kSigmoid);
  EXPECT_TRUE(m.moe_router_pre_softmax);
  EXPECT_TRUE(m.moe_router_expert_bias);
  EXPECT_EQ(m.moe_router_topk_scaling_factor, 2.5);
  EXPECT_EQ(m.moe_aux_loss_coeff, 1e-4);
  EXPECT_TRUE(r.spec.training.moe_router_fusion);
  EXPECT_FALSE(m.moe_router_force_load_balancing);
  EXPECT_FALSE(m.moe_router_force_biased.has_value());
  // The benchmarking knobs: random logits, and a shared random bias of that deviation.
  m = Parse(moe + "--moe-router-force-load-balancing --moe-router-force-biased -0.5", 1).spec.model;
  EXPECT_TRUE(m.moe_router_force_load_balancing);
  EXPECT_EQ(m.moe_router_force_biased, -0.5);
  EXPECT_FALSE(m.moe_input_jitter_eps.has_value());
  EXPECT_EQ(Parse(moe + "--moe-input-jitter-eps 0.01", 1).spec.model.moe_input_jitter_eps, 0.01);
  // none computes no aux loss, whatever the coefficient; Sinkhorn refuses one, as
  // Megatron-Core asserts.
  r = Parse(moe + "--moe-router-load-balancing-type none --moe-aux-loss-coeff 0.01", 1);
  EXPECT_EQ(r.spec.model.moe_aux_loss_coeff, 0);
  EXPECT_EQ(r.ignored, (std::vector<std::string>{"--moe-aux-loss-coeff"}));
  EXPECT_TRUE(
      Parse(moe + "--moe-router-load-balancing-type sinkhorn", 1).spec.model.moe_router_sinkhorn);
  EXPECT_EQ(ErrorOf(moe + "--moe-router-load-balancing-type sinkhorn --moe-aux-loss-coeff 0.01", 1),
            "Sinkhorn routing has no auxiliary loss: set the aux loss coefficient to 0 "
            "(Megatron-Core asserts the same)");
  EXPECT_EQ(ErrorOf(moe + "--moe-router-group-topk 2", 1),
            "group-limited routing needs a number of groups that divides the 4 experts and is "
            "at least the groups each token picks (2), got 0 (Megatron-LM: "
            "--moe-router-num-groups with --moe-router-group-topk)");
  EXPECT_EQ(ErrorOf(moe + "--moe-router-load-balancing-type quantile_balancing", 1),
            "--moe-router-load-balancing-type 'quantile_balancing' is not modelled (memsim "
            "supports aux_loss, seq_aux_loss, global_aux_loss, sinkhorn, none)");
  EXPECT_EQ(ErrorOf(moe + "--moe-router-enable-expert-bias", 1),
            "the router's expert bias (aux-loss-free routing) needs the sigmoid or sqrtsoftplus "
            "score function (Megatron-LM: --moe-router-score-function sigmoid)");
  EXPECT_EQ(ErrorOf(moe + "--moe-router-score-function cosine", 1),
            "unknown --moe-router-score-function 'cosine' (use one of: sigmoid, softmax, "
            "sqrtsoftplus)");
}

// --overlap-moe-expert-parallel-comm: the combined 1F1B schedule, with Megatron-Core's rules.
TEST(MegatronArgs, ExpertParallelCommunicationOverlap) {
  const std::string moe = std::string(kTinyGpt) +
                          "--num-experts 4 --moe-token-dispatcher-type alltoall --bf16 "
                          "--expert-model-parallel-size 2 --overlap-moe-expert-parallel-comm ";
  EXPECT_TRUE(Parse(moe, 2).spec.layout.combined_1f1b);
  const std::string prefix =
      "overlapping expert-parallel communication (the combined 1F1B schedule): ";
  EXPECT_EQ(ErrorOf(moe + "--moe-shared-expert-overlap", 2),
            prefix +
                "it excludes overlapping the shared experts (--moe-shared-expert-overlap), as "
                "Megatron-Core asserts");
  EXPECT_EQ(ErrorOf(moe + "--pipeline-model-parallel-size 2", 4),
            prefix + "with PP > 1 it needs virtual pipeline stages, as Megatron-Core asserts");
  EXPECT_EQ(ErrorOf(moe + "--recompute-granularity full --recompute-method uniform "
                          "--recompute-num-layers 1",
                    2),
            prefix + "it excludes full recomputation, as Megatron-Core asserts");
  EXPECT_EQ(ErrorOf(std::string(kTinyGpt) + "--num-experts 4 --moe-token-dispatcher-type "
                                            "alltoall --expert-model-parallel-size 2 "
                                            "--overlap-moe-expert-parallel-comm",
                    2),
            prefix + "it needs bf16 or fp16, as Megatron-Core asserts");
  EXPECT_EQ(ErrorOf(std::string(kTinyGpt) + "--num-experts 4 --expert-model-parallel-size 2 "
                                            "--overlap-moe-expert-parallel-comm --bf16",
                    2),
            prefix + "it needs the alltoall or flex token dispatcher, as Megatron-Core asserts");
  EXPECT_EQ(ErrorOf(std::string(kTinyGpt) + "--num-experts 4 --moe-token-dispatcher-type "
                                            "alltoall --overlap-moe-expert-parallel-comm --bf16",
                    2),
            prefix + "it needs expert parallelism (EP > 1), as Megatron-Core asserts");
}

// --moe-token-dispatcher-type flex (Note [DeepEP dispatch] in models/moe.h): DeepEP, its
// default backend and what --moe-enable-deepep asks for, and HybridEP (Note [HybridEP
// dispatch]) are modelled; NCCL-EP is refused by name.
TEST(MegatronArgs, FlexDispatcherWithDeepEp) {
  const std::string moe = std::string(kTinyGpt) +
                          "--num-experts 4 --moe-token-dispatcher-type flex --bf16 "
                          "--expert-model-parallel-size 2 ";
  EXPECT_EQ(Parse(moe, 2).spec.training.moe_dispatcher, MoeDispatcher::kDeepEp);
  EXPECT_EQ(Parse(moe + "--moe-enable-deepep --moe-flex-dispatcher-num-sms 24", 2)
                .spec.training.deepep_num_sms,
            24);
  MegatronArgsResult hybrid = Parse(moe + "--moe-flex-dispatcher-backend hybridep", 2);
  EXPECT_EQ(hybrid.spec.training.moe_dispatcher, MoeDispatcher::kHybridEp);
  EXPECT_TRUE(hybrid.ignored.empty());
  EXPECT_EQ(ErrorOf(moe + "--moe-flex-dispatcher-backend ncclep", 2),
            "--moe-flex-dispatcher-backend ncclep is not modelled (memsim models DeepEP's and "
            "HybridEP's); use deepep or hybridep, or alltoall, to estimate the run");
  EXPECT_EQ(ErrorOf(std::string(kTinyGpt) +
                        "--num-experts 4 --expert-model-parallel-size 2 --moe-enable-deepep",
                    2),
            "--moe-enable-deepep needs --moe-token-dispatcher-type flex and no other backend "
            "(Megatron-Core raises it)");
  EXPECT_EQ(ErrorOf(std::string(kTinyGpt) + "--num-experts 4 --moe-token-dispatcher-type flex", 1),
            "the flex dispatcher with DeepEP: it needs expert or expert-tensor parallelism "
            "(EP*ETP > 1)");
  EXPECT_EQ(ErrorOf(moe + "--moe-expert-capacity-factor 1.0", 2),
            "the flex dispatcher with DeepEP: with a capacity factor it is not modelled; drop it "
            "to simulate a dropless run");
}

// --cp-comm-type a2a and a2a+p2p (Note [All-to-all context parallelism]): heads are
// exchanged, so each tensor-parallel rank's heads must divide by the all-to-all group.
TEST(MegatronArgs, AllToAllContextParallelism) {
  const std::string cp = std::string(kTinyGpt) +
                         "--context-parallel-size 2 --cp-comm-type a2a --transformer-impl "
                         "transformer_engine --attention-backend fused ";
  EXPECT_EQ(Parse(cp, 2).spec.training.cp_all_to_all, 2);
  EXPECT_EQ(
      Parse(std::string(kTinyGpt) + "--context-parallel-size 2", 2).spec.training.cp_all_to_all, 1);
  EXPECT_EQ(ErrorOf(cp + "--group-query-attention --num-query-groups 1", 2),
            "all-to-all context parallelism needs the attention heads (4) and key-value heads "
            "(1) of a tensor-parallel rank divisible by its group size 2 (Transformer Engine "
            "asserts it)");
  // a2a+p2p: heads exchanged over the first size, a ring over the second.
  const std::string hierarchical = std::string(kTinyGpt) +
                                   "--context-parallel-size 4 --cp-comm-type a2a+p2p "
                                   "--transformer-impl transformer_engine --attention-backend "
                                   "fused --seq-length 16 ";
  EXPECT_EQ(Parse(hierarchical + "--hierarchical-context-parallel-sizes 2 2", 4)
                .spec.training.cp_all_to_all,
            2);
  EXPECT_EQ(ErrorOf(hierarchical, 4),
            "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes with the "
            "all-to-all and the ring group sizes (Megatron-LM asserts it)");
  EXPECT_EQ(ErrorOf(hierarchical + "--hierarchical-context-parallel-sizes 2 4", 4),
            "--hierarchical-context-parallel-sizes must multiply to --context-parallel-size 4 "
            "(Megatron-LM asserts it)");
}

// --window-size: full windows ((-1, 0) and (-1, -1), as Transformer Engine reads them) are
// no sliding window; a sliding one needs a2a or all-gather context parallelism, as
// Transformer Engine asserts.
// Note [Router padding]: read under either name, only where Megatron-Core runs it.
TEST(MegatronArgs, RouterPaddingForQuantization) {
  const std::string moe = std::string(kTinyGpt) +
                          "--transformer-impl transformer_engine --num-experts 4 "
                          "--expert-model-parallel-size 2 --moe-grouped-gemm ";
  const std::string alltoall = moe + "--moe-token-dispatcher-type alltoall --fp8-format e4m3 ";
  for (const char* flag :
       {"--moe-router-padding-for-quantization", "--moe-router-padding-for-fp8"}) {
    const MegatronArgsResult r = Parse(alltoall + flag, 2);
    EXPECT_TRUE(r.spec.training.moe_router_padding) << flag;
    std::optional<ValidatedRun> run;
    const Status s = FinalizeRunSpec(r.spec, &run);
    EXPECT_TRUE(s.ok()) << flag << ": " << s.message();
  }
  EXPECT_FALSE(Parse(alltoall, 2).spec.training.moe_router_padding);
  EXPECT_TRUE(Parse(alltoall + "--enable-experimental", 2).spec.training.experimental);
  EXPECT_EQ(ErrorOf(moe + "--moe-token-dispatcher-type alltoall "
                          "--moe-router-padding-for-quantization",
                    2),
            "padding the routing map for quantization: it needs FP8 training (--fp8-format), as "
            "Megatron-Core asserts");
  EXPECT_EQ(ErrorOf(moe + "--fp8-format e4m3 --moe-router-padding-for-quantization", 2),
            "padding the routing map for quantization: the allgather dispatcher does not support "
            "it (Megatron-Core asserts it); use alltoall or flex");
}

TEST(MegatronArgs, SlidingWindowContextParallelism) {
  const std::string gpt = std::string(kTinyGpt) + "--transformer-impl transformer_engine ";
  EXPECT_FALSE(Parse(gpt, 1).spec.model.sliding_window);
  EXPECT_FALSE(Parse(gpt + "--window-size -1,0", 1).spec.model.sliding_window);
  EXPECT_FALSE(Parse(gpt + "--window-size (-1,-1)", 1).spec.model.sliding_window);
  EXPECT_TRUE(Parse(gpt + "--window-size (4,0)", 1).spec.model.sliding_window);
  EXPECT_EQ(ErrorOf(gpt + "--window-size abc", 1),
            "--window-size must be integers separated by commas (e.g. 4095,0), got abc");
  const std::string window = gpt + "--window-size 4,0 --context-parallel-size 2 ";
  EXPECT_EQ(ErrorOf(window, 2),
            "context parallelism over sliding-window attention needs the a2a or allgather "
            "communication (Transformer Engine asserts it; Megatron-LM: --cp-comm-type a2a or "
            "allgather)");
  for (const char* type : {"a2a", "allgather"}) {
    std::optional<ValidatedRun> run;
    const Status s = FinalizeRunSpec(Parse(window + "--cp-comm-type " + type, 2).spec, &run);
    EXPECT_TRUE(s.ok()) << type << ": " << s.message();
  }
  // --window-attn-skip-freq: layer l (from 1) keeps its window when l % N != 0, or when
  // the list's l-th entry is 1; with no windowed layer left, p2p is fine.
  for (const char* full : {"1", "([0]*2)", "[0,0]"}) {
    const MegatronArgsResult r = Parse(window + "--window-attn-skip-freq " + full, 2);
    EXPECT_FALSE(r.spec.model.sliding_window) << full;
    std::optional<ValidatedRun> run;
    const Status s = FinalizeRunSpec(r.spec, &run);
    EXPECT_TRUE(s.ok()) << full << ": " << s.message();
  }
  for (const char* windowed : {"2", "([1]*1+[0]*1)", "[0,1]"}) {
    EXPECT_TRUE(Parse(gpt + "--window-size 4,0 --window-attn-skip-freq " + windowed, 1)
                    .spec.model.sliding_window)
        << windowed;
  }
  EXPECT_EQ(ErrorOf(gpt + "--window-size 4,0 --window-attn-skip-freq 0", 1),
            "--window-attn-skip-freq 0 divides by zero in Megatron-LM; give N >= 1 (every N-th "
            "layer attends to the whole sequence) or a list");
  EXPECT_EQ(ErrorOf(gpt + "--window-size 4,0 --window-attn-skip-freq every", 1),
            "--window-attn-skip-freq 'every' is neither N nor a list of 0/1 per layer (e.g. "
            "'([1]*3+[0]*1)*8')");
  // Attention sinks (gpt-oss's learnable softmax) need a2a alone.
  const std::string sinks = gpt + "--softmax-type learnable --context-parallel-size 2 ";
  EXPECT_EQ(ErrorOf(sinks, 2),
            "context parallelism with attention sinks (a softmax other than vanilla) needs the "
            "a2a communication alone (Transformer Engine asserts it; Megatron-LM: --cp-comm-type "
            "a2a)");
  EXPECT_EQ(ErrorOf(sinks + "--cp-comm-type allgather", 2),
            "context parallelism with attention sinks (a softmax other than vanilla) needs the "
            "a2a communication alone (Transformer Engine asserts it; Megatron-LM: --cp-comm-type "
            "a2a)");
}

// --no-create-attention-mask-in-dataloader: get_batch makes no [B, 1, S, S] mask.
TEST(MegatronArgs, AttentionMaskInTheDataloader) {
  EXPECT_TRUE(Parse(kTinyGpt, 1).spec.training.create_attention_mask);
  EXPECT_FALSE(Parse(std::string(kTinyGpt) + "--no-create-attention-mask-in-dataloader", 1)
                   .spec.training.create_attention_mask);
}

// --cp-comm-type allgather (Note [All-gather context parallelism]): Transformer Engine's, for
// every layer; with CP 1 it changes nothing.
TEST(MegatronArgs, AllGatherContextParallelism) {
  const std::string cp = std::string(kTinyGpt) + "--cp-comm-type allgather ";
  EXPECT_TRUE(Parse(cp + "--context-parallel-size 2 --transformer-impl transformer_engine", 2)
                  .spec.training.cp_all_gather);
  EXPECT_FALSE(Parse(cp, 1).spec.training.cp_all_gather);
  EXPECT_EQ(ErrorOf(cp + "--context-parallel-size 2 --transformer-impl local", 2),
            "all-gather context parallelism is Transformer Engine's (profile "
            "transformer_engine), alone for every layer");
}

// --delay-wgrad-compute (Note [Delayed weight gradients] in models/delayed_wgrad.h): only with the
// combined 1F1B schedule and Transformer Engine, as Megatron-LM asserts.
TEST(MegatronArgs, DelayedWeightGradients) {
  const std::string moe = std::string(kTinyGpt) +
                          "--num-experts 4 --moe-token-dispatcher-type alltoall --bf16 "
                          "--expert-model-parallel-size 2 --delay-wgrad-compute ";
  EXPECT_TRUE(
      Parse(moe + "--overlap-moe-expert-parallel-comm", 2).spec.training.delay_wgrad_compute);
  EXPECT_FALSE(Parse(std::string(kTinyGpt), 1).spec.training.delay_wgrad_compute);
  EXPECT_EQ(ErrorOf(moe, 2),
            "--delay-wgrad-compute: it needs --overlap-moe-expert-parallel-comm, as Megatron-Core "
            "asserts");
  EXPECT_EQ(ErrorOf(moe + "--overlap-moe-expert-parallel-comm --transformer-impl local", 2),
            "--delay-wgrad-compute: it needs --transformer-impl transformer_engine, as Megatron-LM "
            "asserts");
}

TEST(MegatronArgs, UnevenPipelineStages) {
  // Only the first stage named: the other 3 stages share 27 layers, 9 each.
  MegatronArgsResult r = Parse(
      "--num-layers 30 --hidden-size 64 --num-attention-heads 4 --seq-length 8 "
      "--micro-batch-size 1 --global-batch-size 8 --vocab-size 100 "
      "--pipeline-model-parallel-size 4 --decoder-first-pipeline-num-layers 3",
      8);
  EXPECT_EQ(test::Validated(r.spec).spec().training.num_microbatches, 4);  // 8 / (1 * dp 2)
  ModelConfig model = r.spec.model;
  ASSERT_TRUE(FinalizeModelConfig(&model).ok());
  ASSERT_TRUE(FinalizeLayout(&r.spec.layout, model).ok());
  EXPECT_EQ(r.spec.layout.first_stage_layers, 3);
  EXPECT_EQ(r.spec.layout.last_stage_layers, 9);

  // With virtual stages (Megatron-LM wants --num-virtual-stages-per-pipeline-rank then):
  // 30 - 6 = 24 layers on the other 3 stages, 8 each, 4 a chunk; the first stage's 3 a chunk.
  r = Parse(
      "--num-layers 30 --hidden-size 64 --num-attention-heads 4 --seq-length 8 "
      "--micro-batch-size 1 --global-batch-size 8 --vocab-size 100 "
      "--pipeline-model-parallel-size 4 --decoder-first-pipeline-num-layers 6 "
      "--num-virtual-stages-per-pipeline-rank 2",
      8);
  ASSERT_TRUE(FinalizeLayout(&r.spec.layout, model).ok());
  EXPECT_EQ(r.spec.layout.vpp, 2);
  EXPECT_EQ(LayersOnStage(r.spec.layout, model, 0, 1), 3);
  EXPECT_EQ(LayersOnStage(r.spec.layout, model, 3, 1), 4);
  EXPECT_EQ(ErrorOf("--num-layers 30 --hidden-size 64 --num-attention-heads 4 --seq-length 8 "
                    "--micro-batch-size 1 --vocab-size 100 --pipeline-model-parallel-size 4 "
                    "--decoder-last-pipeline-num-layers 0",
                    4),
            "--decoder-last-pipeline-num-layers must be larger than 0, got 0 (Megatron-Core "
            "raises it too)");

  r = Parse(
      "--num-layers 30 --hidden-size 64 --num-attention-heads 4 --seq-length 8 "
      "--micro-batch-size 1 --vocab-size 100 --pipeline-model-parallel-size 4 "
      "--decoder-first-pipeline-num-layers 6 --decoder-last-pipeline-num-layers 8",
      4);
  EXPECT_EQ(r.spec.layout.first_stage_layers, 6);
  EXPECT_EQ(r.spec.layout.last_stage_layers, 8);
}

TEST(MegatronArgs, EmbeddingAndLossInPipelineSplit) {
  // Megatron-LM derives VPP from the layers with the embedding and the loss counted:
  // (6 + 2) / PP 4 / 1 layer per virtual stage = 2.
  const MegatronArgsResult r = Parse(
      "--num-layers 6 --hidden-size 64 --num-attention-heads 4 --seq-length 8 "
      "--micro-batch-size 1 --global-batch-size 8 --vocab-size 100 "
      "--pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 1 "
      "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split",
      4);
  EXPECT_TRUE(r.spec.layout.embedding_in_split);
  EXPECT_TRUE(r.spec.layout.loss_in_split);
  EXPECT_EQ(r.spec.layout.vpp, 2);
}

// --output-logit-dtype: Megatron-LM's two choices; unset, the logits take the input's dtype.
TEST(MegatronArgs, OutputLogitDtype) {
  EXPECT_FALSE(Parse(kTinyGpt, 1).spec.training.output_logit_dtype.has_value());
  EXPECT_EQ(Parse(std::string(kTinyGpt) + "--output-logit-dtype fp32", 1)
                .spec.training.output_logit_dtype,
            Precision::kFp32);
  EXPECT_EQ(Parse(std::string(kTinyGpt) + "--output-logit-dtype bf16", 1)
                .spec.training.output_logit_dtype,
            Precision::kBf16);
  EXPECT_NE(
      ErrorOf(std::string(kTinyGpt) + "--output-logit-dtype fp16", 1).find("--output-logit-dtype"),
      std::string::npos);
}

// MuP: the multipliers count only with --use-mup; the output multiplier left at 1 becomes
// 1/width (TransformerConfig.__post_init__): hidden 64 on a base of 16 gives 0.25.
TEST(MegatronArgs, Mup) {
  const MegatronArgsResult r = Parse(
      std::string(kTinyGpt) + "--use-mup --mup-base-hidden-size 16 --mup-embedding-mult 10", 1);
  ModelConfig m = r.spec.model;
  EXPECT_TRUE(m.use_mup);
  ASSERT_TRUE(FinalizeModelConfig(&m).ok());
  EXPECT_EQ(m.mup_embedding_mult, 10.0);
  EXPECT_EQ(m.mup_output_mult, 0.25);
  const MegatronArgsResult off = Parse(std::string(kTinyGpt) + "--mup-output-mult 3", 1);
  EXPECT_FALSE(off.spec.model.use_mup);
  EXPECT_EQ(off.spec.model.mup_output_mult, 1.0);
  EXPECT_NE(std::find(off.ignored.begin(), off.ignored.end(), "--mup-output-mult"),
            off.ignored.end());
  EXPECT_EQ(ErrorOf(std::string(kTinyGpt) + "--use-mup --mup-base-hidden-size 0", 1),
            "--mup-base-hidden-size must be positive, got 0");
}

// --use-te-activation-func is read; Megatron-Core's refusal of it beside the fusion is
// memsim's too.
TEST(MegatronArgs, TransformerEngineActivationFunc) {
  const std::string te = std::string(kTinyGpt) + "--swiglu --transformer-impl transformer_engine ";
  EXPECT_TRUE(Parse(te + "--use-te-activation-func --no-bias-swiglu-fusion", 1)
                  .spec.training.te_activation_func);
  EXPECT_NE(ErrorOf(te + "--use-te-activation-func", 1).find("--no-bias-swiglu-fusion"),
            std::string::npos);
}

// --use-fused-weighted-squared-relu is read with squared ReLU (experts.py reads it for that
// activation only) and reported as ignored with any other.
TEST(MegatronArgs, FusedWeightedSquaredRelu) {
  const std::string relu2 =
      std::string(kTinyGpt) +
      "--squared-relu --no-bias-gelu-fusion --use-fused-weighted-squared-relu";
  const MegatronArgsResult r = Parse(relu2, 1);
  EXPECT_TRUE(r.spec.training.fused_weighted_squared_relu);
  EXPECT_TRUE(r.ignored.empty());
  const MegatronArgsResult gelu =
      Parse(std::string(kTinyGpt) + "--use-fused-weighted-squared-relu", 1);
  EXPECT_FALSE(gelu.spec.training.fused_weighted_squared_relu);
  EXPECT_EQ(gelu.ignored, std::vector<std::string>{"--use-fused-weighted-squared-relu"});
}

// --fused-residual-rmsnorm is memory-neutral with RMSNorm and refused, as Megatron-Core
// refuses it, with LayerNorm.
TEST(MegatronArgs, FusedResidualRmsNorm) {
  const MegatronArgsResult r =
      Parse(std::string(kTinyGpt) + "--normalization RMSNorm --fused-residual-rmsnorm", 1);
  EXPECT_EQ(r.ignored, std::vector<std::string>{"--fused-residual-rmsnorm"});
  EXPECT_NE(ErrorOf(std::string(kTinyGpt) + "--fused-residual-rmsnorm", 1)
                .find("needs --normalization RMSNorm"),
            std::string::npos);
}

// --mlp-chunks-for-training is read; Megatron-Core's dense MLPs run in that many chunks
// (none for 1 or less).
TEST(MegatronArgs, MlpChunksForTraining) {
  EXPECT_EQ(Parse(std::string(kTinyGpt) + "--mlp-chunks-for-training 4", 1)
                .spec.training.mlp_chunks_for_training,
            4);
  EXPECT_EQ(Parse(std::string(kTinyGpt) + "--mlp-chunks-for-training 0", 1)
                .spec.training.mlp_chunks_for_training,
            0);  // no chunks, as in Megatron-Core
}

// --log-num-zeros-in-grad is read (Note [Counting zeros in gradients]); off without it.
TEST(MegatronArgs, LogNumZerosInGrad) {
  EXPECT_TRUE(Parse(std::string(kTinyGpt) + "--log-num-zeros-in-grad", 1)
                  .spec.training.log_num_zeros_in_grad);
  EXPECT_FALSE(Parse(kTinyGpt, 1).spec.training.log_num_zeros_in_grad);
}

// The tensor dumps that copy to the host only are neutral; FP8 parameters and
// Megatron-FSDP's gradients are refused, and so are the activation and input-gradient dumps.
TEST(MegatronArgs, TensorDumps) {
  const MegatronArgsResult r = Parse(std::string(kTinyGpt) +
                                         "--save-params-interval 100 --save-wgrads-interval 100 "
                                         "--save-tokens-per-expert-interval 10",
                                     1);
  EXPECT_EQ(r.ignored, (std::vector<std::string>{"--save-params-interval", "--save-wgrads-interval",
                                                 "--save-tokens-per-expert-interval"}));
  EXPECT_NE(ErrorOf(std::string(kTinyGpt) + "--save-params-interval 0", 1).find("must be positive"),
            std::string::npos);
  EXPECT_NE(ErrorOf(std::string(kTinyGpt) + "--save-activations-interval 10", 1)
                .find("--save-activations-interval changes memory"),
            std::string::npos);
}

// --log-max-attention-logit and --qk-clip are read (Note [Max attention logit]), --qk-clip's
// settings checked as arguments.py asserts; with context parallelism the maxima are refused,
// naming the argument, and QK-clip with the distributed optimizer.
TEST(MegatronArgs, LogMaxAttentionLogit) {
  EXPECT_TRUE(Parse(std::string(kTinyGpt) + "--log-max-attention-logit", 1)
                  .spec.training.log_max_attention_logit);
  const MegatronArgsResult clip =
      Parse(std::string(kTinyGpt) + "--qk-clip --qk-clip-alpha 0.25 --qk-clip-threshold 50", 1);
  EXPECT_TRUE(clip.spec.training.qk_clip);
  EXPECT_FALSE(clip.spec.training.log_max_attention_logit);
  EXPECT_NE(ErrorOf(std::string(kTinyGpt) + "--qk-clip --qk-clip-alpha 1", 1)
                .find("--qk-clip-alpha must be between 0 and 1, got 1"),
            std::string::npos);
  EXPECT_NE(ErrorOf(std::string(kTinyGpt) + "--qk-clip --attention-backend local", 1)
                .find("returns no max attention logit"),
            std::string::npos);
  EXPECT_NE(ErrorOf(std::string(kTinyGpt) + "--qk-clip --use-distributed-optimizer", 2)
                .find("plain DDP only"),
            std::string::npos);
  EXPECT_NE(
      ErrorOf(std::string(kTinyGpt) + "--log-max-attention-logit --context-parallel-size 2", 2)
          .find("--log-max-attention-logit"),
      std::string::npos);
}

// --no-rope-freq: an integer or Megatron's Python list expression, one entry per layer.
TEST(MegatronArgs, NoRopeFreq) {
  const std::string rope = std::string(kTinyGpt) + "--position-embedding-type rope ";
  EXPECT_EQ(Parse(rope + "--no-rope-freq ([0]*1+[1]*1)*1", 1).spec.model.no_rope_layers,
            (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(Parse(rope + "--no-rope-freq 2", 1).spec.model.no_rope_freq, 2);
  EXPECT_NE(ErrorOf(rope + "--no-rope-freq [0]*3", 1).find("3 entries for 2 layers"),
            std::string::npos);
  EXPECT_NE(ErrorOf(rope + "--no-rope-freq [0]+x", 1).find("--no-rope-freq: pattern"),
            std::string::npos);
}

TEST(MegatronArgs, QkLayernorm) {
  const MegatronArgsResult r = Parse(std::string(kTinyGpt) + "--qk-layernorm --test-mode", 1);
  EXPECT_TRUE(r.spec.model.qk_layernorm);
  EXPECT_FALSE(r.spec.model.qk_l2_norm);
  EXPECT_TRUE(Parse(std::string(kTinyGpt) + "--qk-l2-norm", 1).spec.model.qk_l2_norm);
  EXPECT_FALSE(r.spec.model.attention_output_gate);
  EXPECT_TRUE(
      Parse(std::string(kTinyGpt) + "--attention-output-gate", 1).spec.model.attention_output_gate);
  EXPECT_NE(std::find(r.ignored.begin(), r.ignored.end(), "--test-mode"), r.ignored.end());
}

// Fine-grained activation offloading: the regions of --offload-modules and the threshold;
// the policies that keep more groups on the device only at their defaults; Megatron-Core's
// own rules (a non-empty list, attn_proj with core_attn, Transformer Engine layers).
TEST(MegatronArgs, FineGrainedActivationOffloading) {
  const std::string base = std::string(kTinyGpt) + "--fine-grained-activation-offloading ";
  const MegatronArgsResult r =
      Parse(base +
                "--offload-modules core_attn attn_proj --min-offloaded-tensor-size 4096 "
                "--activation-offload-fraction 1.0 --delta-offload-bytes-across-pp-ranks 0",
            1);
  EXPECT_EQ(r.spec.training.offload_modules, OffloadModuleBit(OffloadModule::kCoreAttn) |
                                                 OffloadModuleBit(OffloadModule::kAttnProj));
  EXPECT_EQ(r.spec.training.min_offloaded_tensor_elements, 4096);
  EXPECT_EQ(r.spec.training.max_inflight_offloads, -1);
  std::optional<ValidatedRun> run;
  EXPECT_TRUE(FinalizeRunSpec(r.spec, &run).ok());
  const std::string core_attn = base + "--offload-modules core_attn ";
  EXPECT_EQ(Parse(core_attn + "--fine-grained-offloading-max-inflight-offloads 2", 1)
                .spec.training.max_inflight_offloads,
            2);
  EXPECT_EQ(ErrorOf(core_attn + "--fine-grained-offloading-max-inflight-offloads -1", 1),
            "--fine-grained-offloading-max-inflight-offloads must be >= 0, got -1");
  // Without the switch the list is read by no one.
  EXPECT_EQ(
      Parse(std::string(kTinyGpt) + "--offload-modules core_attn", 1).spec.training.offload_modules,
      0u);
  EXPECT_EQ(ErrorOf(base, 1),
            "--fine-grained-activation-offloading needs --offload-modules (Megatron-Core "
            "requires a non-empty list)");
  EXPECT_EQ(ErrorOf(base + "--offload-modules core_attn --activation-offload-fraction 0.5", 1),
            "--activation-offload-fraction changes memory in a way memsim does not model "
            "(offloading a fraction of the groups); drop it to simulate the run without it");
  EXPECT_EQ(ErrorOf(base + "--offload-modules fused_group_mlp", 1),
            "--offload-modules fused_group_mlp changes memory in a way memsim does not model "
            "(offloading the op fuser's grouped MLP or gated delta networks); drop it to "
            "simulate the run without it");
  EXPECT_EQ(ErrorOf(base + "--offload-modules attn", 1).rfind("--offload-modules: ", 0), 0u);
  EXPECT_EQ(ErrorOf(base + "--offload-modules attn_proj", 1),
            "offload module attn_proj needs core_attn, as Megatron-Core requires");
  EXPECT_EQ(ErrorOf(std::string(kTinyGpt) +
                        "--transformer-impl local --fine-grained-activation-offloading "
                        "--offload-modules core_attn",
                    1),
            "fine-grained activation offloading needs Transformer Engine layers "
            "(--transformer-impl transformer_engine), as Megatron-LM requires");
}

// Transformer Engine's CUDA graphs: the modules (--cuda-graph-scope is their deprecated
// spelling) and the warm-up steps; other implementations and retained backward graphs are
// refused, and so are whole-layer graphs of MoE layers.
TEST(MegatronArgs, CudaGraphs) {
  const std::string base = std::string(kTinyGpt) + "--cuda-graph-impl transformer_engine ";
  const MegatronArgsResult r =
      Parse(base + "--cuda-graph-modules attn mlp --cuda-graph-warmup-steps 0", 1);
  EXPECT_TRUE(r.spec.training.cuda_graphs);
  EXPECT_EQ(r.spec.training.cuda_graph_modules,
            CudaGraphModuleBit(CudaGraphModule::kAttn) | CudaGraphModuleBit(CudaGraphModule::kMlp));
  EXPECT_EQ(r.spec.training.cuda_graph_warmup_steps, 0);
  std::optional<ValidatedRun> run;
  ASSERT_TRUE(FinalizeRunSpec(r.spec, &run).ok());
  EXPECT_EQ(run->spec().training.iterations, 2);  // captured before the first
  const MegatronArgsResult later = Parse(base + "--cuda-graph-scope attn", 1);
  EXPECT_EQ(later.spec.training.cuda_graph_modules, CudaGraphModuleBit(CudaGraphModule::kAttn));
  ASSERT_TRUE(FinalizeRunSpec(later.spec, &run).ok());
  EXPECT_EQ(run->spec().training.iterations, 3);  // two eager, then a replayed one
  EXPECT_EQ(Parse(std::string(kTinyGpt) + "--cuda-graph-impl none --cuda-graph-modules attn", 1)
                .spec.training.cuda_graphs,
            false);
  EXPECT_EQ(ErrorOf(std::string(kTinyGpt) + "--cuda-graph-impl local", 1),
            "--cuda-graph-impl local changes memory in a way memsim does not model (CUDA graphs "
            "other than Transformer Engine's per-layer ones); drop it to simulate the run "
            "without it");
  // The deprecated switches (arguments.py): --external-cuda-graph is --cuda-graph-impl
  // transformer_engine, --enable-cuda-graph --cuda-graph-impl local.
  const MegatronArgsResult external =
      Parse(std::string(kTinyGpt) + "--external-cuda-graph --cuda-graph-modules attn", 1);
  EXPECT_TRUE(external.spec.training.cuda_graphs);
  EXPECT_EQ(external.spec.training.cuda_graph_modules, CudaGraphModuleBit(CudaGraphModule::kAttn));
  EXPECT_EQ(ErrorOf(std::string(kTinyGpt) + "--enable-cuda-graph", 1),
            "--enable-cuda-graph (--cuda-graph-impl local) changes memory in a way memsim does "
            "not model (CUDA graphs other than Transformer Engine's per-layer ones); drop it to "
            "simulate the run without it");
  EXPECT_EQ(ErrorOf(base + "--external-cuda-graph", 1),
            "do not use --enable-cuda-graph or --external-cuda-graph with --cuda-graph-impl "
            "(Megatron-LM asserts it)");
  EXPECT_EQ(ErrorOf(std::string(kTinyGpt) + "--enable-cuda-graph --external-cuda-graph", 1),
            "--enable-cuda-graph and --external-cuda-graph cannot be enabled at the same time "
            "(Megatron-LM asserts it)");
  EXPECT_EQ(ErrorOf(base + "--cuda-graph-retain-backward-graph", 1),
            "--cuda-graph-retain-backward-graph changes memory in a way memsim does not model "
            "(graphs that keep their saved activations between replays); drop it to simulate "
            "the run without it");
  EXPECT_EQ(ErrorOf(base + "--num-experts 4 --moe-grouped-gemm", 1),
            "whole-layer CUDA graphs of MoE layers are not modelled; name the modules "
            "(--cuda-graph-modules attn moe_router)");
}

// --optimizer-cpu-offload: the fraction defaults to 1; Megatron-LM asserts the
// precision-aware optimizer.
TEST(MegatronArgs, OptimizerCpuOffload) {
  const std::string base = std::string(kTinyGpt) + "--bf16 --use-distributed-optimizer ";
  EXPECT_EQ(Parse(base + "--use-precision-aware-optimizer --optimizer-cpu-offload", 1)
                .spec.training.optimizer_offload_fraction,
            1.0);
  EXPECT_EQ(Parse(base + "--use-precision-aware-optimizer --optimizer-cpu-offload "
                         "--optimizer-offload-fraction 0.25 --overlap-cpu-optimizer-d2h-h2d",
                  1)
                .spec.training.optimizer_offload_fraction,
            0.25);
  EXPECT_EQ(
      Parse(base + "--optimizer-offload-fraction 0.25", 1).spec.training.optimizer_offload_fraction,
      0.0);  // read only with the switch
  EXPECT_EQ(ErrorOf(base + "--optimizer-cpu-offload", 1),
            "optimizer CPU offload needs the precision-aware optimizer "
            "(--use-precision-aware-optimizer), as Megatron-LM asserts");
  EXPECT_EQ(ErrorOf(base + "--use-precision-aware-optimizer --optimizer-cpu-offload "
                           "--optimizer-offload-fraction 1.5",
                    1),
            "the optimizer offload fraction must be in [0, 1], got 1.500000");
}

// ModelOpt's options act only with modelopt_enabled: a ModelOpt checkpoint, or a distillation
// teacher, which is refused for what it adds (the distillation functional test's arguments).
TEST(MegatronArgs, DistillationIsRefusedForItsTeacher) {
  const std::string modelopt = std::string(kTinyGpt) +
                               "--export-te-mcore-model --export-kd-cfg distill_config.yaml "
                               "--export-kd-teacher-ckpt-format torch_dist ";
  EXPECT_EQ(Parse(modelopt, 1).ignored,
            (std::vector<std::string>{"--export-te-mcore-model", "--export-kd-cfg",
                                      "--export-kd-teacher-ckpt-format"}));
  EXPECT_EQ(ErrorOf(modelopt + "--export-kd-teacher-load /ckpt/teacher", 1),
            "--export-kd-teacher-load changes memory in a way memsim does not model (ModelOpt "
            "knowledge distillation: a frozen teacher model, whose architecture is in its "
            "checkpoint, on ModelOpt's layer spec, and the distillation loss); drop it to "
            "simulate the run without it");
}

// --fp32-residual-connection (Note [FP32 residual stream]) needs 16-bit training, as
// Megatron-LM asserts, and Transformer Engine's layers, the ones memsim models it with.
// --fp16-lm-cross-entropy changes nothing in Megatron-Core's GPTModel (stored, never read),
// but Megatron-LM asserts --fp16 with it.
TEST(MegatronArgs, Fp32ResidualStreamAndFp16CrossEntropy) {
  const std::string base = std::string(kTinyGpt) + "--fp32-residual-connection ";
  EXPECT_TRUE(Parse(base + "--bf16", 1).spec.training.fp32_residual_connection);
  EXPECT_FALSE(Parse(std::string(kTinyGpt) + "--bf16", 1).spec.training.fp32_residual_connection);
  EXPECT_EQ(ErrorOf(base),
            "an fp32 residual stream needs 16-bit training (Megatron-LM asserts --fp16 or --bf16 "
            "with --fp32-residual-connection)");
  EXPECT_EQ(ErrorOf(base + "--bf16 --transformer-impl local"),
            "an fp32 residual stream is modelled with Transformer Engine's layers only; use "
            "profile transformer_engine (Megatron-LM: --transformer-impl transformer_engine)");
  EXPECT_EQ(Parse(std::string(kTinyGpt) + "--fp16 --fp16-lm-cross-entropy", 1).ignored,
            std::vector<std::string>{"--fp16-lm-cross-entropy"});
  EXPECT_EQ(ErrorOf(std::string(kTinyGpt) + "--bf16 --fp16-lm-cross-entropy"),
            "--fp16-lm-cross-entropy needs --fp16 (Megatron-LM asserts it: \"lm cross entropy in "
            "fp16 only support in fp16 mode\")");
}

// --mtp-use-repeated-layer: read with --mtp-num-layers, ignored without (Megatron-Core builds
// no MTP block then).
TEST(MegatronArgs, RepeatedMultiTokenPredictionLayer) {
  const std::string base =
      std::string(kTinyGpt) + "--position-embedding-type rope --mtp-use-repeated-layer --bf16 ";
  const MegatronArgsResult with = Parse(base + "--mtp-num-layers 2", 1);
  EXPECT_TRUE(with.spec.model.mtp_use_repeated_layer);
  EXPECT_EQ(with.spec.model.mtp_num_layers, 2);
  EXPECT_EQ(Parse(base, 1).ignored, std::vector<std::string>{"--mtp-use-repeated-layer"});
}

// --mtp-detach-heads: read with --mtp-num-layers, ignored without; Megatron-Core's frozen-weight
// output layer asserts no deferred embedding gradients.
TEST(MegatronArgs, DetachedMultiTokenPredictionHeads) {
  const std::string base =
      std::string(kTinyGpt) + "--position-embedding-type rope --mtp-detach-heads --bf16 ";
  EXPECT_TRUE(Parse(base + "--mtp-num-layers 1", 1).spec.model.mtp_detach_heads);
  EXPECT_EQ(Parse(base, 1).ignored, std::vector<std::string>{"--mtp-detach-heads"});
  EXPECT_EQ(ErrorOf(base + "--mtp-num-layers 1 --pipeline-model-parallel-size 2 "
                           "--defer-embedding-wgrad-compute",
                    2),
            "detached MTP heads exclude deferring the embedding weight gradients: Megatron-Core's "
            "linear_with_frozen_weight asserts it gets no gradient buffer (drop "
            "--defer-embedding-wgrad-compute or --mtp-detach-heads)");
}

// --mtp-hsm: read; fewer than two depths is an error, as Megatron-Core raises.
TEST(MegatronArgs, MultiTokenPredictionHiddenStateMixing) {
  const std::string base = std::string(kTinyGpt) + "--position-embedding-type rope --mtp-hsm ";
  EXPECT_TRUE(Parse(base + "--mtp-num-layers 2", 1).spec.model.mtp_hsm);
  EXPECT_EQ(ErrorOf(base, 1),
            "MTP hidden-state mixing needs mtp_num_layers >= 2, got 0 (Megatron-Core raises "
            "ValueError)");
}

// --squared-relu: fc1 F wide, F = 4H by default (the SwiGLU rule is --swiglu's); Megatron
// refuses it with the default fused bias-GeLU and with --swiglu.
TEST(MegatronArgs, SquaredRelu) {
  const std::string base = std::string(kTinyGpt) + "--squared-relu ";
  const MegatronArgsResult r = Parse(base + "--disable-bias-linear", 1);
  EXPECT_EQ(r.spec.model.activation, ActivationKind::kSquaredRelu);
  std::optional<ValidatedRun> run;
  ASSERT_TRUE(FinalizeRunSpec(r.spec, &run).ok());
  EXPECT_EQ(run->spec().model.ffn_hidden_size, 4 * 64);
  EXPECT_EQ(Parse(base + "--no-bias-gelu-fusion", 1).spec.model.activation,
            ActivationKind::kSquaredRelu);
  EXPECT_EQ(ErrorOf(base),
            "--squared-relu needs --no-bias-gelu-fusion or --disable-bias-linear: Megatron-LM "
            "fuses the bias into GeLU, SwiGLU and quick-GeGLU only and raises ValueError "
            "otherwise");
  EXPECT_EQ(ErrorOf(base + "--swiglu --disable-bias-linear"), "--squared-relu excludes --swiglu");
}

// RoPE's arguments (Note [RoPE frequencies]): --no-rope-fusion picks the unfused path,
// --rotary-percent the rotated width; a share outside (0, 1] is refused.
TEST(MegatronArgs, RopeFusionAndRotaryPercent) {
  const std::string rope = std::string(kTinyGpt) + "--position-embedding-type rope ";
  EXPECT_TRUE(Parse(rope, 1).spec.training.rope_fusion);
  EXPECT_FALSE(Parse(rope + "--no-rope-fusion", 1).spec.training.rope_fusion);
  EXPECT_EQ(Parse(rope + "--rotary-percent 0.5", 1).spec.model.rotary_percent, 0.5);
  EXPECT_EQ(ErrorOf(rope + "--rotary-percent 1.5", 1),
            "rotary percent 1.5 is outside (0, 1]: RoPE rotates that share of each head");
}

// Which fusion Megatron-LM's arguments give the activation: SwiGLU follows
// --no-bias-swiglu-fusion alone; the others --no-bias-gelu-fusion and --disable-bias-linear.
TEST(MegatronArgs, BiasActivationFusion) {
  const std::string tiny = kTinyGpt;
  EXPECT_TRUE(Parse(tiny, 1).spec.training.bias_activation_fusion);
  EXPECT_FALSE(Parse(tiny + "--no-bias-gelu-fusion", 1).spec.training.bias_activation_fusion);
  EXPECT_FALSE(Parse(tiny + "--disable-bias-linear", 1).spec.training.bias_activation_fusion);
  EXPECT_TRUE(Parse(tiny + "--swiglu --disable-bias-linear --no-bias-gelu-fusion", 1)
                  .spec.training.bias_activation_fusion);
  EXPECT_FALSE(
      Parse(tiny + "--swiglu --no-bias-swiglu-fusion", 1).spec.training.bias_activation_fusion);
}

// NVIDIA's gpt-oss example (Megatron-LM examples/gptoss/02_train.sh at Megatron-Core 0.20,
// its MODEL_ARGS, MOE_ARGS, training and parallel arguments): quick-GeGLU experts, clamped,
// with offset 1; learnable softmax offsets; sliding windows on every other layer. The
// script sets PP to the world size, which on its default 8 GPUs does not divide its 12
// layers (TransformerConfig raises, as memsim does): PP 4 here.
constexpr char kGptOssExample[] =
    "--no-masked-softmax-fusion --transformer-impl transformer_engine --disable-bias-linear "
    "--untie-embeddings-and-output-weights --no-rope-fusion --normalization RMSNorm "
    "--num-layers 12 --hidden-size 512 --ffn-hidden-size 2048 --num-attention-heads 64 "
    "--group-query-attention --num-query-groups 8 --seq-length 8192 "
    "--max-position-embeddings 8192 --use-mcore-models --rotary-percent 1.0 --rope-type rope "
    "--position-embedding-type rope --rotary-base 10000 --no-bias-gelu-fusion "
    "--export-force-local-attention --no-bias-dropout-fusion --quick-geglu "
    "--glu-linear-offset 1.0 --softmax-type learnable --window-attn-skip-freq 2 "
    "--activation-func-clamp-value 7.0 --window-size 127,0 --enable-gpt-oss "
    "--num-experts 4 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss "
    "--moe-aux-loss-coeff 1e-3 --moe-grouped-gemm --moe-token-dispatcher-type alltoall "
    "--overlap-param-gather --overlap-grad-reduce --moe-ffn-hidden-size 2048 "
    "--moe-router-dtype fp32 --moe-z-loss-coeff 1e-3 --moe-permute-fusion "
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 128256 "
    "--micro-batch-size 1 --global-batch-size 128 --bf16 --use-flash-attn "
    "--attention-softmax-in-fp32 --accumulate-allreduce-grads-in-fp32 "
    "--recompute-activations --tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 "
    "--expert-model-parallel-size 1 --sequence-parallel --context-parallel-size 1 "
    "--use-distributed-optimizer ";

TEST(MegatronArgs, GptOssExample) {
  MegatronArgsResult r = Parse(kGptOssExample, 8);
  r.spec.gpu = FindGpu("A100-80GB");  // where TE would take FlashAttention-2 without sinks
  const ModelConfig& m = r.spec.model;
  EXPECT_EQ(m.activation, ActivationKind::kQuickGeglu);
  EXPECT_EQ(m.activation_clamp_value, 7.0);
  EXPECT_EQ(m.softmax, SoftmaxKind::kLearnable);
  EXPECT_FALSE(r.spec.training.bias_activation_fusion);
  EXPECT_TRUE(m.sliding_window);  // --window-size 127,0
  for (const char* neutral : {"--enable-gpt-oss", "--export-force-local-attention"}) {
    EXPECT_NE(std::find(r.ignored.begin(), r.ignored.end(), neutral), r.ignored.end()) << neutral;
  }
  std::optional<ValidatedRun> run;
  const Status s = FinalizeRunSpec(r.spec, &run);
  ASSERT_TRUE(s.ok()) << s.message();
  EXPECT_EQ(run->spec().training.attention, AttentionKind::kFused);  // sinks: no flash
  EXPECT_EQ(run->spec().model.Fc1Width(2048), 4096);

  // The bias-activation fusion is on without --no-bias-gelu-fusion and --disable-bias-linear:
  // Megatron-Core fuses quick-GeGLU in its experts but raises in a dense MLP.
  const std::string dense = std::string(kTinyGpt) + "--quick-geglu ";
  EXPECT_EQ(ErrorOf(dense),
            "a fused quick-GeGLU runs in MoE experts only: Megatron-Core's dense MLP raises "
            "ValueError (\"Only support fusion of gelu and swiglu\"); turn the fusion off "
            "(Megatron-LM: --no-bias-gelu-fusion)");
  EXPECT_EQ(ErrorOf(dense + "--swiglu"), "--quick-geglu excludes --swiglu");
  EXPECT_EQ(ErrorOf(std::string(kTinyGpt) + "--glu-linear-offset 1"),
            "--glu-linear-offset needs --quick-geglu when the bias-activation fusion is on "
            "(TransformerConfig raises ValueError)");
  EXPECT_EQ(ErrorOf(std::string(kTinyGpt) + "--swiglu --activation-func-clamp-value 7"),
            "a clamped SwiGLU needs MoE layers (Megatron-Core: activation_func_clamp_value for "
            "SwiGLU is only supported with MoE)");
  EXPECT_EQ(ErrorOf(std::string(kTinyGpt) + "--softmax-type off-by-one"),
            "--softmax-type off-by-one changes memory in a way memsim does not model "
            "(Transformer Engine's zero offsets, a float32 tensor outside the parameters); drop "
            "it to simulate the run without it");
  EXPECT_TRUE(Parse(std::string(kTinyGpt) + "--softmax-type learnable", 8).spec.model.softmax ==
              SoftmaxKind::kLearnable);
  EXPECT_EQ(ErrorOf(std::string(kTinyGpt) + "--softmax-type learnable --transformer-impl local"),
            "the learnable softmax (attention sinks) is modelled with Transformer Engine's cuDNN "
            "fused attention only: FlashAttention has no sinks, and the unfused and local paths' "
            "extra softmax tensors are not modelled");
}

// Batch sizes that change during training: Megatron-Core 0.20 ignores --rampup-batch-size;
// of a --step-batch-size-schedule memsim simulates the largest batch, and says so;
// --decrease-batch-size-if-needed rounds the batch down to a multiple of micro batch * dp.
TEST(MegatronArgs, BatchSizeSchedules) {
  const std::string tiny =
      "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 8 "
      "--micro-batch-size 1 --vocab-size 100 ";
  const MegatronArgsResult ramp =
      Parse(tiny + "--global-batch-size 8 --rampup-batch-size 2 2 100", 2);
  EXPECT_EQ(ramp.spec.global_batch_size, 8);
  EXPECT_EQ(ramp.ignored, (std::vector<std::string>{"--rampup-batch-size"}));

  const MegatronArgsResult steps =
      Parse(tiny + "--step-batch-size-schedule 0:4,1.5K:16,2M:0.012K", 2);
  EXPECT_EQ(steps.spec.global_batch_size, 16);
  EXPECT_EQ(steps.notes,
            (std::vector<std::string>{
                "--step-batch-size-schedule: memsim simulates the largest global "
                "batch of the schedule, 16 (memory grows with the batch, if at all)"}));
  std::optional<ValidatedRun> run;
  ASSERT_TRUE(FinalizeRunSpec(steps.spec, &run).ok());
  EXPECT_EQ(run->spec().training.num_microbatches, 8);  // 16 / (1 * dp 2)

  // 9 samples on dp 2: 4 microbatches (8 samples); 1 sample rounds down to none, which
  // Megatron-Core's calculator asserts against.
  const MegatronArgsResult down =
      Parse(tiny + "--decrease-batch-size-if-needed --global-batch-size 9", 2);
  ASSERT_TRUE(FinalizeRunSpec(down.spec, &run).ok());
  EXPECT_EQ(run->spec().training.num_microbatches, 4);
  EXPECT_EQ(ErrorOf(tiny + "--decrease-batch-size-if-needed --global-batch-size 1", 2),
            "global batch size 1 rounds down to no microbatch of micro batch size 1 x "
            "data-parallel size 2 = 2; raise the global batch");
  EXPECT_EQ(ErrorOf(tiny + "--global-batch-size 9", 2),
            "global batch size 9 is not a multiple of micro batch size 1 x data-parallel size 2 "
            "= 2");
  EXPECT_EQ(ErrorOf(tiny + "--global-batch-size 8 --step-batch-size-schedule 0:8", 2),
            "Cannot specify both --step-batch-size-schedule and --global-batch-size (Megatron-LM "
            "refuses it)");
  EXPECT_EQ(ErrorOf(tiny + "--step-batch-size-schedule 0:8 --decrease-batch-size-if-needed", 2),
            "Cannot specify both --step-batch-size-schedule and --decrease-batch-size-if-needed "
            "(Megatron-LM refuses it)");
  EXPECT_EQ(
      ErrorOf(tiny + "--step-batch-size-schedule 0-8", 2),
      "--step-batch-size-schedule '0-8': invalid entry '0-8' (expected \"THRESHOLD:BATCH_SIZE "
      "...\", e.g. \"0:768 250B:1536\")");
  const std::string expected = " (expected \"THRESHOLD:BATCH_SIZE ...\", e.g. \"0:768 250B:1536\")";
  EXPECT_EQ(
      ErrorOf(tiny + "--step-batch-size-schedule 0:3e9", 2),
      "--step-batch-size-schedule '0:3e9': batch size 3e9 is not in [1, 2147483647]" + expected);
  EXPECT_EQ(ErrorOf(tiny + "--step-batch-size-schedule 0:1e300", 2),
            "--step-batch-size-schedule '0:1e300': invalid entry '0:1e300'" + expected);
  // Thresholds are tokens, 8 a sample here: the first must be 0 samples, the rest distinct.
  EXPECT_EQ(ErrorOf(tiny + "--step-batch-size-schedule 8:16", 2),
            "--step-batch-size-schedule '8:16': the first threshold must be 0" + expected);
  EXPECT_EQ(ErrorOf(tiny + "--step-batch-size-schedule 0:8,4:16", 2),
            "--step-batch-size-schedule '0:8,4:16': thresholds must be distinct in samples of "
            "--seq-length 8" +
                expected);
}

// --mtp-num-layers is read (FinalizeModelConfig checks Megatron-LM's own rule, MTP needs
// RoPE: ModelConfig.RejectsImpossibleShapes).
TEST(MegatronArgs, MultiTokenPrediction) {
  const std::string base = std::string(kTinyGpt);
  const MegatronArgsResult r = Parse(
      base + "--position-embedding-type rope --mtp-num-layers 2 --mtp-loss-scaling-factor 0.3", 1);
  EXPECT_EQ(r.spec.model.mtp_num_layers, 2);
  EXPECT_EQ(Parse(base, 1).spec.model.mtp_num_layers, 0);
}

// --recompute-modules as TransformerConfig reads it: only under selective granularity
// (default core_attn); --moe-layer-recompute makes it selective and adds moe.
TEST(MegatronArgs, RecomputeModules) {
  const std::string base = std::string(kTinyGpt);
  auto bit = [](RecomputeModule m) { return RecomputeModuleBit(m); };
  const TrainingConfig selective =
      Parse(base + "--recompute-granularity selective", 1).spec.training;
  EXPECT_EQ(selective.recompute_modules, bit(RecomputeModule::kCoreAttn));
  const TrainingConfig modules =
      Parse(base + "--recompute-granularity selective --recompute-modules layernorm mlp", 1)
          .spec.training;
  EXPECT_EQ(modules.recompute, RecomputeKind::kSelective);
  EXPECT_EQ(modules.recompute_modules,
            bit(RecomputeModule::kLayerNorm) | bit(RecomputeModule::kMlp));
  EXPECT_FALSE(modules.Recomputes(RecomputeModule::kCoreAttn));
  const TrainingConfig moe = Parse(base + "--moe-layer-recompute", 1).spec.training;
  EXPECT_EQ(moe.recompute, RecomputeKind::kSelective);
  EXPECT_EQ(moe.recompute_modules, bit(RecomputeModule::kCoreAttn) | bit(RecomputeModule::kMoe));
  // Megatron-LM ignores the modules without selective granularity.
  const MegatronArgsResult none = Parse(base + "--recompute-modules mlp", 1);
  EXPECT_FALSE(none.spec.training.Recomputes(RecomputeModule::kMlp));
  EXPECT_EQ(std::count(none.ignored.begin(), none.ignored.end(), "--recompute-modules"), 1);

  EXPECT_EQ(ErrorOf(base + "--recompute-granularity selective --recompute-modules core_attn mpl"),
            "--recompute-modules: unknown recompute module 'mpl' (use one of: core_attn, "
            "layernorm, mla_up_proj, mlp, moe, moe_act, shared_experts)");
  EXPECT_EQ(ErrorOf(base + "--recompute-granularity selective --recompute-modules mhc"),
            "--recompute-modules mhc changes memory in a way memsim does not model (gated delta "
            "networks and hyper-connections); drop it to simulate the run without it");
  EXPECT_EQ(ErrorOf(base + "--recompute-granularity full --recompute-method uniform "
                           "--recompute-num-layers 1 --moe-layer-recompute"),
            "--moe-layer-recompute cannot be used with --recompute-granularity full "
            "(Megatron-Core rejects it)");
  const std::string overlap = base +
                              "--num-experts 4 --moe-shared-expert-intermediate-size 64 "
                              "--moe-shared-expert-overlap ";
  EXPECT_EQ(ErrorOf(overlap + "--moe-token-dispatcher-type alltoall --recompute-granularity "
                              "selective --recompute-modules shared_experts"),
            "the shared_experts recompute module cannot be used with moe_shared_expert_overlap "
            "(--moe-shared-expert-overlap), as Megatron-Core asserts");
  EXPECT_EQ(ErrorOf(overlap),
            "moe_shared_expert_overlap (--moe-shared-expert-overlap) only works with the alltoall "
            "or flex token dispatcher, as Megatron-Core asserts");
}

// --distribute-saved-activations: full recomputation only (Megatron-LM asserts it; the
// run spec checks TP > 1 without sequence parallelism).
TEST(MegatronArgs, DistributeSavedActivations) {
  const std::string base = std::string(kTinyGpt) + "--tensor-model-parallel-size 2 ";
  const std::string full =
      "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 ";
  EXPECT_TRUE(Parse(base + full + "--distribute-saved-activations", 2)
                  .spec.training.distribute_saved_activations);
  EXPECT_FALSE(Parse(base + full, 2).spec.training.distribute_saved_activations);
  std::optional<ValidatedRun> run;
  EXPECT_EQ(FinalizeRunSpec(Parse(base + "--distribute-saved-activations", 2).spec, &run).message(),
            "distributing saved activations needs full recomputation (as Megatron-LM asserts)");
  MegatronArgsResult sp =
      Parse(base + full + "--distribute-saved-activations --sequence-parallel", 2);
  EXPECT_EQ(FinalizeRunSpec(sp.spec, &run).message(),
            "distributing saved activations needs TP > 1 without sequence parallelism (as "
            "Megatron-LM asserts)");
}

// --grad-reduce-in-bf16 counts in bf16 training only, as Megatron-LM reads it.
TEST(MegatronArgs, GradReduceInBf16) {
  const std::string base = std::string(kTinyGpt) + "--grad-reduce-in-bf16 ";
  const MegatronArgsResult bf16 = Parse(base + "--bf16 --accumulate-allreduce-grads-in-fp32", 1);
  EXPECT_TRUE(bf16.spec.training.grad_reduce_in_bf16);
  EXPECT_EQ(std::count(bf16.ignored.begin(), bf16.ignored.end(), "--grad-reduce-in-bf16"), 0);
  const MegatronArgsResult fp16 = Parse(base + "--fp16", 1);
  EXPECT_FALSE(fp16.spec.training.grad_reduce_in_bf16);
  EXPECT_EQ(std::count(fp16.ignored.begin(), fp16.ignored.end(), "--grad-reduce-in-bf16"), 1);
  EXPECT_FALSE(Parse(base, 1).spec.training.grad_reduce_in_bf16);
}

// --use-precision-aware-optimizer with its dtypes (Note [Precision-aware optimizer]); fp16
// and fp8 states and fp16 masters are refused; the dtypes need the optimizer, and it the
// distributed optimizer, as Megatron-Core asserts.
TEST(MegatronArgs, PrecisionAwareOptimizer) {
  const std::string base = std::string(kTinyGpt) + "--bf16 ";
  const std::string aware = "--use-distributed-optimizer --use-precision-aware-optimizer ";
  const MegatronArgsResult r = Parse(
      base + aware + "--main-grads-dtype bf16 --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16", 1);
  EXPECT_TRUE(r.spec.training.precision_aware_optimizer);
  EXPECT_EQ(r.spec.training.main_grads_dtype, Precision::kBf16);
  EXPECT_EQ(r.spec.training.exp_avg_dtype, Precision::kBf16);
  EXPECT_EQ(r.spec.training.exp_avg_sq_dtype, Precision::kBf16);
  std::optional<ValidatedRun> run;
  EXPECT_TRUE(FinalizeRunSpec(r.spec, &run).ok());
  EXPECT_EQ(FinalizeRunSpec(Parse(base + aware + "--exp-avg-dtype bf16", 1).spec, &run).message(),
            "the precision-aware optimizer is modelled with exp_avg and exp_avg_sq of one dtype "
            "(fp32 or bf16 both)");
  EXPECT_EQ(ErrorOf(base + aware + "--main-grads-dtype bf16 --accumulate-allreduce-grads-in-fp32"),
            "--main-grads-dtype can only be fp32 with --accumulate-allreduce-grads-in-fp32 (as "
            "Megatron-LM asserts)");
  EXPECT_EQ(ErrorOf(base + "--use-precision-aware-optimizer --exp-avg-dtype fp8"),
            "--exp-avg-dtype fp8 changes memory in a way memsim does not model (scaled optimizer "
            "states (their fp32 copies in the step)); drop it to simulate the run without it");
  EXPECT_EQ(FinalizeRunSpec(Parse(base + "--exp-avg-dtype bf16", 1).spec, &run).message(),
            "main_grads_dtype, exp_avg_dtype and exp_avg_sq_dtype other than fp32 need the "
            "precision-aware optimizer (as Megatron-Core asserts)");
  EXPECT_EQ(
      FinalizeRunSpec(Parse(base + "--use-precision-aware-optimizer", 1).spec, &run).message(),
      "the precision-aware optimizer needs the distributed optimizer (as Megatron-Core "
      "asserts)");
}

// --cross-entropy-loss-fusion with the native implementation (the default) or Transformer
// Engine's kernel.
TEST(MegatronArgs, CrossEntropyFusion) {
  const std::string base = std::string(kTinyGpt) + "--cross-entropy-loss-fusion ";
  const MegatronArgsResult native = Parse(base, 1);
  EXPECT_TRUE(native.spec.training.cross_entropy_fusion);
  EXPECT_FALSE(native.spec.training.te_cross_entropy);
  const MegatronArgsResult te = Parse(base + "--cross-entropy-fusion-impl te", 1);
  EXPECT_TRUE(te.spec.training.cross_entropy_fusion);
  EXPECT_TRUE(te.spec.training.te_cross_entropy);
  EXPECT_FALSE(Parse(std::string(kTinyGpt), 1).spec.training.cross_entropy_fusion);
}

// FP8 training (Note [FP8 training]): --fp8-format turns it on with --fp8-recipe's scaling
// (delayed by default); its settings are ignored without it; 16-bit wgrad GEMMs and MXFP8
// parameters are refused; the FP8 rules are checked when the run is finalized.
TEST(MegatronArgs, Fp8Training) {
  const std::string base = std::string(kTinyGpt) + "--bf16 --transformer-impl transformer_engine ";
  const MegatronArgsResult r =
      Parse(base +
                "--fp8-format hybrid --fp8-recipe tensorwise --fp8-param-gather "
                "--use-distributed-optimizer --fp8-amax-history-len 16 --fp8-margin 0",
            1);
  EXPECT_EQ(r.spec.training.fp8, Fp8Recipe::kTensorwise);
  EXPECT_TRUE(r.spec.training.fp8_param_gather);
  // The amax history only sizes the delayed recipe's state; the margin changes no bytes.
  EXPECT_EQ(r.ignored, (std::vector<std::string>{"--fp8-amax-history-len", "--fp8-margin"}));
  std::optional<ValidatedRun> run;
  EXPECT_TRUE(FinalizeRunSpec(r.spec, &run).ok());

  const MegatronArgsResult delayed = Parse(base + "--fp8-format e4m3 --fp8-amax-history-len 16", 1);
  EXPECT_EQ(delayed.spec.training.fp8, Fp8Recipe::kDelayed);
  EXPECT_EQ(delayed.spec.training.fp8_amax_history_len, 16);
  EXPECT_TRUE(delayed.ignored.empty());

  const MegatronArgsResult bf16_layers =
      Parse(base +
                "--fp8-format hybrid --fp8-recipe blockwise --first-last-layers-bf16 "
                "--num-layers-at-end-in-bf16 0",
            1);
  EXPECT_EQ(bf16_layers.spec.training.fp8_bf16_layers_at_start, 1);
  EXPECT_EQ(bf16_layers.spec.training.fp8_bf16_layers_at_end, 0);
  EXPECT_FALSE(bf16_layers.spec.training.Fp8Layer(0, 2));
  EXPECT_TRUE(bf16_layers.spec.training.Fp8Layer(1, 2));

  const MegatronArgsResult off = Parse(base + "--fp8-recipe tensorwise --fp8-param-gather", 1);
  EXPECT_EQ(off.spec.training.fp8, Fp8Recipe::kNone);
  EXPECT_EQ(off.ignored, (std::vector<std::string>{"--fp8-recipe", "--fp8-param-gather"}));
  // What a run file could set without FP8.
  RunSpec no_fp8 = off.spec;
  no_fp8.training.fp8_param_gather = true;
  no_fp8.layout.data_parallel = DataParallelKind::kDistributedOptimizer;
  EXPECT_EQ(FinalizeRunSpec(no_fp8, &run).message(),
            "FP8 parameters (fp8_param_gather) need FP8 training (fp8)");
  // Transformer Engine's FP8 GEMM shapes.
  EXPECT_EQ(
      FinalizeRunSpec(Parse(base + "--fp8-format hybrid --hidden-size 72", 1).spec, &run).message(),
      "FP8 GEMMs need the hidden size (72) to be a multiple of 16 (as Transformer Engine "
      "asserts)");
  EXPECT_EQ(
      FinalizeRunSpec(Parse(base + "--fp8-format hybrid --seq-length 4", 1).spec, &run).message(),
      "FP8 GEMMs need the tokens per rank (sequence / CP * micro batch = 4) to be a "
      "multiple of 8 (as Transformer Engine asserts)");

  // MXFP8: Blackwell only, every quantized dimension a multiple of 32, no FP8 parameters.
  const std::string mxfp8 = base + "--fp8-format e4m3 --fp8-recipe mxfp8 ";
  RunSpec blackwell = Parse(mxfp8 + "--seq-length 32", 1).spec;
  EXPECT_EQ(blackwell.training.fp8, Fp8Recipe::kMxfp8);
  EXPECT_TRUE(FinalizeRunSpec(blackwell, &run).ok());
  blackwell.gpu = FindGpu("H100-80GB");
  EXPECT_EQ(FinalizeRunSpec(blackwell, &run).message(),
            "MXFP8 needs a Blackwell GPU of compute capability 10.0 to 11.x (B200, GB200); "
            "H100-80GB has 9.0: choose another --fp8-recipe or --gpu");
  blackwell.gpu = FindGpu("GB200-186GB");
  EXPECT_TRUE(FinalizeRunSpec(blackwell, &run).ok());
  EXPECT_EQ(ErrorOf(mxfp8 + "--seq-length 16"),
            "FP8 GEMMs need the tokens per rank (sequence / CP * micro batch = 16) to be a "
            "multiple of 32 (as Transformer Engine's MXFP8 quantizer asserts)");
  EXPECT_EQ(ErrorOf(mxfp8 + "--seq-length 32 --hidden-size 80 --num-attention-heads 5"),
            "FP8 GEMMs need the hidden size (80) to be a multiple of 32 (as Transformer "
            "Engine's MXFP8 quantizer asserts)");
  EXPECT_EQ(ErrorOf(mxfp8 + "--seq-length 32 --multi-latent-attention --q-lora-rank 48 "
                            "--kv-lora-rank 64 --qk-head-dim 16 --qk-pos-emb-head-dim 16 "
                            "--v-head-dim 16"),
            "FP8 GEMMs need the q_lora_rank (48) to be a multiple of 32 (as Transformer "
            "Engine's MXFP8 quantizer asserts)");
  EXPECT_EQ(ErrorOf(mxfp8 + "--seq-length 32 --fp8-param-gather --use-distributed-optimizer"),
            "MXFP8 parameters (fp8_param_gather with the mxfp8 recipe) are not modelled "
            "(Megatron-Core gathers them in bf16 through the gradient buffer, "
            "--reuse-grad-buf-for-mxfp8-param-ag); drop fp8_param_gather to simulate TE's "
            "cached MXFP8 weights instead");
  EXPECT_EQ(ErrorOf(mxfp8 + "--seq-length 32 --reuse-grad-buf-for-mxfp8-param-ag"),
            "--reuse-grad-buf-for-mxfp8-param-ag changes memory in a way memsim does not model "
            "(MXFP8 parameters gathered in bf16 through the gradient buffer); drop it to "
            "simulate the run without it");
  EXPECT_EQ(ErrorOf(base + "--fp8-format hybrid --no-fp8-wgrad"),
            "--no-fp8-wgrad changes memory in a way memsim does not model (16-bit "
            "weight-gradient GEMMs in FP8 training); drop it to simulate the run without it");
  EXPECT_EQ(FinalizeRunSpec(Parse(base + "--fp8-format hybrid --fp8-recipe tensorwise "
                                         "--first-last-layers-bf16 --num-layers-at-start-in-bf16 2",
                                  1)
                                .spec,
                            &run)
                .message(),
            "the bf16 layers at the start (2) and end (1) must be >= 0 and together at most the "
            "model's 2 layers");
  EXPECT_EQ(FinalizeRunSpec(Parse(base + "--fp8-format hybrid --fp8-param-gather", 1).spec, &run)
                .message(),
            "FP8 parameters (--fp8-param-gather) need the distributed optimizer (as Megatron-LM "
            "asserts)");
  EXPECT_EQ(FinalizeRunSpec(Parse(std::string(kTinyGpt) + "--bf16 --transformer-impl local "
                                                          "--fp8-format hybrid",
                                  1)
                                .spec,
                            &run)
                .message(),
            "FP8 training needs Transformer Engine layers (profile transformer_engine; "
            "Megatron-LM: --transformer-impl transformer_engine)");
  EXPECT_EQ(
      FinalizeRunSpec(Parse(base + "--fp8-format hybrid --first-last-layers-bf16", 1).spec, &run)
          .message(),
      "first and last layers in bf16 do not work with the delayed FP8 recipe (as "
      "Megatron-Core asserts)");
  EXPECT_EQ(FinalizeRunSpec(Parse(base + "--fp8-format hybrid --num-experts 4 --moe-grouped-gemm "
                                         "--recompute-granularity selective "
                                         "--recompute-modules moe_act",
                                  1)
                                .spec,
                            &run)
                .message(),
            "moe_act recomputation does not work with the delayed FP8 recipe (as Megatron-Core "
            "asserts)");
}

// --tp-comm-overlap (Note [Userbuffers]): its all-gather and bulk overlaps, each on by
// default; --tp-comm-overlap-rs-dgrad replaces both bulk ones; the settings that change
// no allocation PyTorch sees are ignored, all of them without the switch; Megatron-LM
// asserts sequence parallelism.
TEST(MegatronArgs, TpCommOverlap) {
  const std::string base = std::string(kTinyGpt) +
                           "--bf16 --transformer-impl transformer_engine "
                           "--tensor-model-parallel-size 2 --sequence-parallel ";
  const MegatronArgsResult r =
      Parse(base +
                "--tp-comm-overlap --tp-comm-overlap-cfg ub.yaml --no-tp-comm-bulk-wgrad "
                "--tp-comm-bootstrap-backend nccl",
            2);
  EXPECT_TRUE(r.spec.training.tp_comm_overlap);
  EXPECT_TRUE(r.spec.training.tp_comm_overlap_ag);
  EXPECT_TRUE(r.spec.training.tp_comm_bulk_dgrad);
  EXPECT_FALSE(r.spec.training.tp_comm_bulk_wgrad);
  EXPECT_EQ(r.ignored,
            (std::vector<std::string>{"--tp-comm-overlap-cfg", "--tp-comm-bootstrap-backend"}));
  std::optional<ValidatedRun> run;
  EXPECT_TRUE(FinalizeRunSpec(r.spec, &run).ok());
  const MegatronArgsResult rs = Parse(base + "--tp-comm-overlap --tp-comm-overlap-rs-dgrad", 2);
  EXPECT_FALSE(rs.spec.training.tp_comm_bulk_dgrad);
  EXPECT_FALSE(rs.spec.training.tp_comm_bulk_wgrad);
  const MegatronArgsResult off = Parse(base + "--no-tp-comm-overlap-ag", 2);
  EXPECT_FALSE(off.spec.training.tp_comm_overlap);
  EXPECT_EQ(off.ignored, (std::vector<std::string>{"--no-tp-comm-overlap-ag"}));
  EXPECT_EQ(FinalizeRunSpec(
                Parse(std::string(kTinyGpt) + "--bf16 --transformer-impl transformer_engine "
                                              "--tensor-model-parallel-size 2 --tp-comm-overlap",
                      2)
                    .spec,
                &run)
                .message(),
            "TP communication overlap needs sequence parallelism (as Megatron-LM asserts)");
  EXPECT_EQ(FinalizeRunSpec(Parse(base + "--tp-comm-overlap --fp8-format hybrid --fp8-recipe "
                                         "blockwise",
                                  2)
                                .spec,
                            &run)
                .message(),
            "TP communication overlap does not work with blockwise FP8 (Transformer Engine's "
            "userbuffers raise on block scaling)");
}

// train_step empties the cache after forward-backward (1), and after the step too (2).
TEST(MegatronArgs, EmptyUnusedMemoryLevel) {
  const std::string base = std::string(kTinyGpt);
  EXPECT_EQ(Parse(base, 1).spec.training.empty_unused_memory_level, 0);
  EXPECT_EQ(
      Parse(base + "--empty-unused-memory-level 2", 1).spec.training.empty_unused_memory_level, 2);
  std::optional<ValidatedRun> run;
  EXPECT_EQ(FinalizeRunSpec(Parse(base + "--empty-unused-memory-level 3", 1).spec, &run).message(),
            "empty_unused_memory_level must be 0, 1 or 2, got 3");
}

// --pipeline-model-parallel-layout is kept for FinalizeLayout (parallel/layout_test.cc);
// Megatron-LM takes one way of giving virtual stages.
TEST(MegatronArgs, PipelineLayout) {
  const std::string base =
      "--num-layers 3 --hidden-size 64 --num-attention-heads 4 --seq-length 8 "
      "--micro-batch-size 1 --global-batch-size 8 --vocab-size 100 "
      "--pipeline-model-parallel-size 2 ";
  const MegatronArgsResult r = Parse(base + "--pipeline-model-parallel-layout Et|t|t|L", 2);
  EXPECT_EQ(r.spec.layout.pipeline_layout, "Et|t|t|L");
  EXPECT_EQ(ErrorOf(base + "--pipeline-model-parallel-layout Et|t|t|L "
                           "--num-virtual-stages-per-pipeline-rank 2",
                    2),
            "give one of --num-layers-per-virtual-pipeline-stage, "
            "--num-virtual-stages-per-pipeline-rank and --pipeline-model-parallel-layout "
            "(Megatron-LM rejects more)");
}

TEST(MegatronArgs, DeferredEmbeddingWgrad) {
  const std::string line = std::string(kTinyGpt) +
                           "--defer-embedding-wgrad-compute "
                           "--wgrad-deferral-limit 2 --pipeline-model-parallel-size 2";
  MegatronArgsResult r = Parse(line, 2);
  EXPECT_TRUE(r.spec.training.defer_embedding_wgrad);
  EXPECT_EQ(r.spec.training.wgrad_deferral_limit, 2);
  // Megatron-LM refuses it without pipeline parallelism or gradient accumulation fusion.
  r = Parse(line + " --no-gradient-accumulation-fusion", 2);
  RunSpec spec = r.spec;
  spec.gpu = FindGpu("H100");
  std::optional<ValidatedRun> run;
  EXPECT_NE(FinalizeRunSpec(spec, &run).message().find("gradient accumulation fusion"),
            std::string::npos);
  r = Parse(std::string(kTinyGpt) + "--defer-embedding-wgrad-compute", 1);
  spec = r.spec;
  spec.gpu = FindGpu("H100");
  EXPECT_NE(FinalizeRunSpec(spec, &run).message().find("PP > 1"), std::string::npos);
}

// Note [Muon]: --optimizer muon with Megatron-LM's defaults; what memsim does not model
// is refused by name.
TEST(MegatronArgs, Muon) {
  const std::string line =
      "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 8 "
      "--micro-batch-size 1 --vocab-size 100 --bf16 --optimizer muon --muon-momentum 0.9 "
      "--muon-extra-scale-factor 0.2 --muon-scale-mode spectral --muon-num-ns-steps 3";
  const MegatronArgsResult r = Parse(line, 8);
  EXPECT_EQ(r.spec.training.optimizer, OptimizerKind::kMuon);
  EXPECT_EQ(r.spec.training.muon_ns_steps, 3);
  EXPECT_FALSE(r.spec.training.layer_wise_optimizer);
  EXPECT_TRUE(r.spec.training.muon_split_qkv);
  EXPECT_FALSE(Parse(line + " --muon-no-split-qkv", 8).spec.training.muon_split_qkv);
  // Note [Layer-wise optimizer]: the distributed optimizer is the layer-wise one, over
  // plain DDP; memsim models it with the legacy parameter layout only.
  const MegatronArgsResult layer_wise =
      Parse(line + " --use-distributed-optimizer --no-use-layer-wise-param-layout", 8);
  EXPECT_TRUE(layer_wise.spec.training.layer_wise_optimizer);
  EXPECT_EQ(layer_wise.spec.layout.data_parallel, DataParallelKind::kDdp);
  EXPECT_EQ(ErrorOf(line + " --use-distributed-optimizer"),
            "--use-distributed-optimizer with --optimizer muon changes memory in a way memsim "
            "does not model (the layer-wise optimizer's parameter layout (Muon's matrices placed "
            "by LPT in padded shards of buffers of their own); add "
            "--no-use-layer-wise-param-layout for the layout memsim models); drop it to "
            "simulate the run without it");
  EXPECT_EQ(ErrorOf(line + " --muon-tp-mode blockwise"),
            "--muon-tp-mode 'blockwise' is not modelled (memsim supports duplicated)");
  EXPECT_EQ(ErrorOf(line + " --muon-num-ns-steps 0"), "--muon-num-ns-steps must be at least 1");
  EXPECT_EQ(ErrorOf(line + " --optimizer dist_muon"),
            "--optimizer dist_muon changes memory in a way memsim does not model (the "
            "layer-wise distributed Muon optimizer (Megatron-LM's deprecated name for "
            "--optimizer muon --use-distributed-optimizer)); drop it to simulate the run "
            "without it");
  // fp16 is Megatron-LM's own refusal, checked with the run.
  RunSpec spec = Parse(
                     "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 8 "
                     "--micro-batch-size 1 --vocab-size 100 --fp16 --optimizer muon",
                     8)
                     .spec;
  std::optional<ValidatedRun> run;
  EXPECT_EQ(FinalizeRunSpec(spec, &run).message(),
            "the Muon optimizer does not support fp16 (Megatron-LM rejects it); use bf16");
}

TEST(MegatronArgs, MultiLatentAttention) {
  // Megatron-LM's functional test gpt3_mcore_te_tp2_pp2_mla.
  const MegatronArgsResult r = Parse(
      "--num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 8 "
      "--micro-batch-size 1 --global-batch-size 8 --vocab-size 100 --multi-latent-attention "
      "--q-lora-rank 192 --kv-lora-rank 64 --qk-head-dim 16 --qk-pos-emb-head-dim 8 "
      "--v-head-dim 16",
      1);
  EXPECT_EQ(r.spec.model.q_lora_rank, 192);
  EXPECT_EQ(r.spec.model.kv_lora_rank, 64);
  EXPECT_EQ(r.spec.model.qk_head_dim, 16);
  EXPECT_EQ(r.spec.model.qk_pos_emb_head_dim, 8);
  EXPECT_EQ(r.spec.model.v_head_dim, 16);
  ModelConfig m = r.spec.model;
  ASSERT_TRUE(FinalizeModelConfig(&m).ok());
  EXPECT_EQ(m.head_dim, 24);  // q/k heads: 16 + 8
  // Megatron-LM's defaults: no q down projection, kv_lora_rank 32, 128 + 64, 128.
  const MegatronArgsResult d = Parse(std::string(kTinyGpt) + "--multi-latent-attention", 1);
  EXPECT_EQ(d.spec.model.q_lora_rank, 0);
  EXPECT_EQ(d.spec.model.kv_lora_rank, 32);
  EXPECT_EQ(d.spec.model.v_head_dim, 128);
  // YaRN's scalars change no tensor; the fused down projection is not modelled.
  const std::string base = std::string(kTinyGpt) + "--multi-latent-attention ";
  const MegatronArgsResult yarn =
      Parse(base + "--rotary-scaling-factor 40 --mscale 0.707 --mscale-all-dim 0.707", 1);
  for (const char* name : {"--rotary-scaling-factor", "--mscale", "--mscale-all-dim"}) {
    EXPECT_NE(std::find(yarn.ignored.begin(), yarn.ignored.end(), name), yarn.ignored.end())
        << name;
  }
  EXPECT_NE(ErrorOf(base + "--mla-down-proj-fusion", 1).find("--mla-down-proj-fusion"),
            std::string::npos);
  EXPECT_NE(ErrorOf(base + "--attention-output-gate", 1)
                .find("attention_output_gate is not supported with multi-latent attention"),
            std::string::npos);
}

// Megatron-LM 0.20's other spellings and deprecated forms are read as the arguments they
// stand for; memory-neutral ones of any kind are reported as ignored.
TEST(MegatronArgs, OtherSpellingsAndNeutralArgumentsOfTheRelease) {
  const std::string base = std::string(kTinyGpt) + "--tensor-model-parallel-size 2 ";
  // --disable-x is --no-x (Megatron-Core's config dataclasses make both).
  MegatronArgsResult r = Parse(base +
                                   "--tp-comm-overlap --sequence-parallel "
                                   "--disable-tp-comm-bulk-dgrad --persistent-save-interval 100",
                               2);
  MegatronArgsResult same = Parse(base +
                                      "--tp-comm-overlap --sequence-parallel "
                                      "--no-tp-comm-bulk-dgrad --save-interval 100",
                                  2);
  EXPECT_EQ(r.spec.training.tp_comm_bulk_dgrad, false);
  EXPECT_EQ(r.spec.training.tp_comm_bulk_dgrad, same.spec.training.tp_comm_bulk_dgrad);
  EXPECT_EQ(r.ignored, (std::vector<std::string>{"--save-interval"}));
  // Sequence parallelism's embedding output uncloned (TransformerModel::Embed); without
  // sequence parallelism there is nothing to clone.
  r = Parse(base + "--sequence-parallel --disable-clone-scatter-output-in-embedding", 2);
  EXPECT_FALSE(r.spec.training.clone_scatter_output_in_embedding);
  EXPECT_TRUE(r.ignored.empty());
  r = Parse(base + "--no-clone-scatter-output-in-embedding", 2);
  EXPECT_EQ(r.ignored, (std::vector<std::string>{"--no-clone-scatter-output-in-embedding"}));
  EXPECT_TRUE(
      Parse(base + "--sequence-parallel", 2).spec.training.clone_scatter_output_in_embedding);
  // Without padding the given size is the model's, as with padding to a divisor of 1.
  r = Parse(std::string(kTinyGpt) + "--no-pad-vocab-size --padded-vocab-size 100", 1);
  EXPECT_EQ(r.spec.model.vocab_size, 100);
  EXPECT_EQ(r.spec.model.make_vocab_size_divisible_by, 1);
  EXPECT_EQ(r.ignored, (std::vector<std::string>{"--vocab-size", "--no-pad-vocab-size"}));
  // Arguments of inference, RL settings, other models and the training loop's host side.
  r = Parse(std::string(kTinyGpt) +
                "--inference-max-seq-length 64 --grpo-group-size 4 --img-h 224 "
                "--inprocess-restart --dataloader-fast-cache-load --position-embedding-type rope "
                "--no-position-embedding --fake-process-group",
            1);
  EXPECT_EQ(r.ignored,
            (std::vector<std::string>{"--inference-max-seq-length", "--grpo-group-size", "--img-h",
                                      "--inprocess-restart", "--dataloader-fast-cache-load",
                                      "--no-position-embedding", "--fake-process-group"}));
}

// --moe-aux-loss-coeff takes one coefficient per load-balancing type (TransformerConfig
// asserts the pairing); the deprecated SM counts stand for --moe-flex-dispatcher-num-sms;
// the shared experts' gate needs shared experts.
TEST(MegatronArgs, MoeArgumentsOfTheRelease) {
  const std::string moe = std::string(kTinyGpt) + "--num-experts 4 --moe-router-topk 2 ";
  MegatronArgsResult r = Parse(
      moe + "--moe-router-load-balancing-type seq_aux_loss none --moe-aux-loss-coeff 1e-3 0", 1);
  EXPECT_EQ(r.spec.model.moe_aux_loss_coeff, 1e-3);
  EXPECT_EQ(ErrorOf(moe + "--moe-router-load-balancing-type aux_loss seq_aux_loss "
                          "--moe-aux-loss-coeff 1e-3",
                    1),
            "--moe-aux-loss-coeff needs one coefficient per --moe-router-load-balancing-type (1 "
            "for 2; Megatron-Core asserts it)");
  EXPECT_EQ(ErrorOf(moe + "--moe-router-load-balancing-type aux_loss seq_aux_loss "
                          "--moe-aux-loss-coeff 1e-3 1e-4",
                    1),
            "--moe-aux-loss-coeff changes memory in a way memsim does not model (several "
            "load-balancing losses at once); drop it to simulate the run without it");
  const std::string flex = moe + "--expert-model-parallel-size 2 --moe-token-dispatcher-type flex ";
  r = Parse(flex + "--moe-deepep-num-sms 32", 2);
  EXPECT_EQ(r.spec.training.deepep_num_sms, 32);
  EXPECT_TRUE(r.ignored.empty());
  r = Parse(flex + "--moe-deepep-num-sms 32 --moe-flex-dispatcher-num-sms 24", 2);
  EXPECT_EQ(r.spec.training.deepep_num_sms, 24);  // the explicit count wins
  EXPECT_EQ(r.ignored, (std::vector<std::string>{"--moe-deepep-num-sms"}));
  EXPECT_EQ(ErrorOf(flex + "--moe-deepep-num-sms 32 --moe-hybridep-num-sms 16", 2),
            "--moe-deepep-num-sms and --moe-hybridep-num-sms conflict; give one "
            "--moe-flex-dispatcher-num-sms (Megatron-Core raises it)");
  r = Parse(moe + "--moe-shared-expert-intermediate-size 64 --moe-shared-expert-gate", 1);
  EXPECT_TRUE(r.spec.model.moe_shared_expert_gate);
  r = Parse(moe + "--moe-shared-expert-gate", 1);
  EXPECT_EQ(r.ignored, (std::vector<std::string>{"--moe-shared-expert-gate"}));
  EXPECT_EQ(ErrorOf(flex + "--fake-process-group", 2),
            "--fake-process-group cannot be used with --moe-token-dispatcher-type flex "
            "(Megatron-LM asserts it)");
}

TEST(MegatronArgs, Errors) {
  const std::string base =
      "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 128 "
      "--micro-batch-size 1 --vocab-size 100 ";
  EXPECT_EQ(ErrorOf(base + "--foo 3"),
            "unknown Megatron-LM argument '--foo': Megatron-LM 0.20 has no such argument; check "
            "its spelling");
  // Deprecated spellings Megatron-LM's validate_args stops at, and older releases' arguments.
  EXPECT_EQ(ErrorOf(base + "--batch-size 4"),
            "--batch-size is no longer valid in Megatron-LM 0.20: use --micro-batch-size");
  EXPECT_EQ(ErrorOf(base + "--use-custom-fsdp"),
            "--use-custom-fsdp is not an argument of Megatron-LM 0.20 (renamed "
            "--use-megatron-fsdp)");
  // Megatron-Core 0.20's own features memsim does not simulate.
  EXPECT_EQ(ErrorOf(base + "--moe-latent-size 256"),
            "--moe-latent-size changes memory in a way memsim does not model (MoE latent "
            "projections); drop it to simulate the run without it");
  EXPECT_EQ(ErrorOf(base + "--no-pad-vocab-size"),
            "--no-pad-vocab-size needs --padded-vocab-size (without padding Megatron-LM sets no "
            "vocabulary size of its own)");
  // Deprecated: Megatron-LM raises without RoPE.
  EXPECT_EQ(ErrorOf(base + "--no-position-embedding"),
            "--no-position-embedding is deprecated and Megatron-LM raises without RoPE; use "
            "--position-embedding-type");
  // Known to change memory, so never "drop it if it does not change memory".
  EXPECT_EQ(ErrorOf(base + "--delay-offload-until-cuda-graph"),
            "--delay-offload-until-cuda-graph changes memory in a way memsim does not model "
            "(fine-grained activation offloading); drop it to simulate the run without it");
  EXPECT_EQ(ErrorOf(base + "--cpu-offloading-num-layers 4"),
            "cpu_offloading_num_layers must be in [0, num_layers), got 4");
  EXPECT_EQ(ErrorOf(base + "--cpu-offloading-num-layers 2 --pipeline-model-parallel-size 2"),
            "CPU offloading of layers (--cpu-offloading-num-layers) needs PP=1 (Megatron-Core "
            "rejects pipelines)");
  EXPECT_EQ(ErrorOf(base + "--cpu-offloading-num-layers 2 --recompute-activations"),
            "CPU offloading of layers cannot be used with activation recomputation "
            "(Megatron-Core rejects it)");
  EXPECT_EQ(ErrorOf(base + "--num-experts 4 --moe-token-dispatcher-type all2all"),
            "--moe-token-dispatcher-type 'all2all' is not modelled (memsim supports allgather, "
            "alltoall, flex)");
  EXPECT_EQ(ErrorOf(base + "--context-parallel-size 2 --cp-comm-type a2a p2p", 8),
            "--cp-comm-type p2p changes memory in a way memsim does not model "
            "(context-parallel communication other than p2p, a2a, allgather or a2a+p2p for every "
            "layer); drop it to simulate the run without it");
  EXPECT_EQ(ErrorOf(base + "--num-experts 4 --moe-layer-freq ([1]*3+[0]*1)"),
            "--moe-layer-freq '([1]*3+[0]*1)' is not modelled (memsim models dense layers "
            "followed by MoE layers, e.g. '([0]*3+[1]*1)', or 1)");
  EXPECT_EQ(ErrorOf(base + "--num-experts 4 --moe-layer-freq ([0]*1+[1]*2)"),
            "--moe-layer-freq '([0]*1+[1]*2)' describes 3 layers, not --num-layers 4");
  EXPECT_EQ(ErrorOf(base + "--position-embedding-type mrope"),
            "--position-embedding-type 'mrope' is not modelled (memsim supports "
            "learned_absolute, rope)");
  EXPECT_EQ(ErrorOf(base + "--optimizer lion"),
            "--optimizer 'lion' is not modelled (memsim supports adam, sgd, muon)");

  EXPECT_EQ(ErrorOf(base + "--tensor-model-parallel-size"),
            "--tensor-model-parallel-size needs a value");
  EXPECT_EQ(ErrorOf("--num-layers --hidden-size 64"), "--num-layers needs a value");
  EXPECT_EQ(ErrorOf(base + "--bf16=true"), "--bf16 takes no value, got '--bf16=true'");
  EXPECT_EQ(ErrorOf(base + "pretrain_gpt.py"),
            "unexpected argument 'pretrain_gpt.py': Megatron-LM arguments start with --");
  EXPECT_EQ(ErrorOf(base + "--tensor-model-parallel-size two"),
            "--tensor-model-parallel-size expects an integer, got 'two'");
  EXPECT_EQ(ErrorOf(base + "--global-batch-size 1.5"),
            "--global-batch-size expects an integer, got '1.5'");
  EXPECT_EQ(ErrorOf(base + "--hidden-dropout high"),
            "--hidden-dropout expects a number, got 'high'");

  EXPECT_EQ(ErrorOf(base + "--global-batch-size 12 --tensor-model-parallel-size 1", 8),
            "global batch size 12 is not a multiple of micro batch size 1 x data-parallel "
            "size 8 = 8");
  EXPECT_EQ(ErrorOf(base + "--global-batch-size 0"), "--global-batch-size must be positive, got 0");
  EXPECT_EQ(ErrorOf(base + "--tensor-model-parallel-size 3", 8),
            "world size 8 is not a multiple of TP*PP*CP = 3*1*1 = 3");
  EXPECT_EQ(ErrorOf(base + "--pipeline-model-parallel-size 0"),
            "--pipeline-model-parallel-size must be positive, got 0");
  EXPECT_EQ(ErrorOf("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --micro-batch-size 1 "
                    "--vocab-size 100"),
            "missing --seq-length (Megatron-LM requires it)");
  EXPECT_EQ(ErrorOf("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 8 "
                    "--micro-batch-size 1 --tokenizer-type HuggingFaceTokenizer"),
            "missing --vocab-size: memsim does not read tokenizer files (--tokenizer-type "
            "HuggingFaceTokenizer), so give the vocabulary size (e.g. --vocab-size 128256 for "
            "Llama 3)");
  EXPECT_EQ(ErrorOf("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 8 "
                    "--micro-batch-size 1 --tokenizer-type Llama2Tokenizer"),
            "missing --vocab-size: memsim does not read tokenizer files (--tokenizer-type "
            "Llama2Tokenizer), so give the vocabulary size (e.g. --vocab-size 32000 for Llama "
            "2's and Mixtral's tokenizer.model)");
  EXPECT_EQ(ErrorOf(base + "--pipeline-model-parallel-size 2 "
                           "--num-layers-per-virtual-pipeline-stage 3",
                    8),
            "--num-layers-per-virtual-pipeline-stage 3 does not split the 4 layers over 2 "
            "pipeline stages evenly (Megatron-LM asserts it)");
  EXPECT_EQ(ErrorOf(base + "--recompute-granularity full"),
            "--recompute-granularity full needs --recompute-method (uniform or block) and "
            "--recompute-num-layers (Megatron-LM requires both)");
  EXPECT_EQ(ErrorOf(base + "--recompute-activations --recompute-num-layers 1"),
            "--recompute-method and --recompute-num-layers need --recompute-granularity full "
            "(Megatron-LM rejects them otherwise)");
  EXPECT_EQ(ErrorOf(base + "--bf16 --fp16"), "--bf16 and --fp16 exclude each other");
  EXPECT_EQ(ErrorOf(base + "--fp16 --accumulate-allreduce-grads-in-fp32"),
            "--accumulate-allreduce-grads-in-fp32 changes memory in a way memsim does not model "
            "(fp32 gradients in fp16 training); drop it to simulate the run without it");
  EXPECT_EQ(ErrorOf(base + "--max-position-embeddings 64"),
            "--max-position-embeddings 64 is smaller than --seq-length 128 (Megatron-LM rejects "
            "it)");
  EXPECT_EQ(ErrorOf(base + "--pipeline-model-parallel-size 4 "
                           "--decoder-last-pipeline-num-layers 2"),
            "the 2 of 4 layers left by the last stage's 2 do not split evenly over the other 3 "
            "pipeline stages");
}

}  // namespace
}  // namespace memsim

namespace memsim {
namespace {

// Rules on the whole run are FinalizeRunSpec's alone (Note [One validated spec]): a
// sequence that 2*CP does not divide parses, and is refused before anything runs.
TEST(MegatronArgs, SequenceVersusContextParallelIsTheRunSpecsRule) {
  MegatronArgsResult r;
  ASSERT_TRUE(
      ParseMegatronArgs({"--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                         "--seq-length", "6", "--micro-batch-size", "1", "--vocab-size", "100",
                         "--context-parallel-size", "2", "--bf16"},
                        {}, 8, &r)
          .ok());
  r.spec.gpu = FindGpu("H100");
  std::optional<ValidatedRun> run;
  EXPECT_EQ(FinalizeRunSpec(r.spec, &run).message(),
            "sequence length 6 must be divisible by 2*CP = 4 (causal load balancing splits it "
            "into 2*CP chunks)");
}

}  // namespace
}  // namespace memsim

namespace memsim {
namespace {

// Megatron-FSDP (Note [Megatron-FSDP]): --use-megatron-fsdp with its default strategy, the
// dtype arguments ('auto' leaves them to the parameters); what it does not model is refused
// by name.
TEST(MegatronArgs, MegatronFsdp) {
  const std::string base = std::string(kTinyGpt) + "--bf16 --use-megatron-fsdp ";
  const MegatronArgsResult r =
      Parse(base + "--use-distributed-optimizer --ckpt-format fsdp_dtensor", 8);
  EXPECT_EQ(r.spec.layout.data_parallel, DataParallelKind::kMegatronFsdp);
  EXPECT_FALSE(r.spec.training.fsdp_main_grads_dtype.has_value());
  EXPECT_FALSE(r.spec.training.fsdp_grad_comm_dtype.has_value());
  const MegatronArgsResult typed =
      Parse(base +
                "--data-parallel-sharding-strategy optim_grads_params "
                "--megatron-fsdp-main-grads-dtype fp32 --megatron-fsdp-grad-comm-dtype bf16",
            8);
  EXPECT_EQ(typed.spec.training.fsdp_main_grads_dtype, Precision::kFp32);
  EXPECT_EQ(typed.spec.training.fsdp_grad_comm_dtype, Precision::kBf16);
  EXPECT_FALSE(typed.spec.training.fsdp_double_buffer);
  const MegatronArgsResult buffered =
      Parse(base + "--fsdp-double-buffer --fsdp-db-use-persist-buf-on-alloc-fail", 8);
  EXPECT_TRUE(buffered.spec.training.fsdp_double_buffer);
  EXPECT_TRUE(buffered.spec.training.fsdp_double_buffer_persistent_fallback);
  EXPECT_FALSE(buffered.spec.training.fsdp_meta_init);
  EXPECT_TRUE(Parse(base + "--init-model-with-meta-device", 8).spec.training.fsdp_meta_init);
  // Without Megatron-FSDP (its DDP has no such buffers) both are ignored.
  const MegatronArgsResult plain = Parse(
      std::string(kTinyGpt) + "--fsdp-double-buffer --fsdp-db-use-persist-buf-on-alloc-fail", 8);
  EXPECT_FALSE(plain.spec.training.fsdp_double_buffer);
  // Megatron-LM's DDP materializes a meta-device model as usual (to_empty).
  EXPECT_FALSE(Parse(std::string(kTinyGpt) + "--init-model-with-meta-device", 8)
                   .spec.training.fsdp_meta_init);
  EXPECT_EQ(ErrorOf(base + "--data-parallel-sharding-strategy optim_grads"),
            "--data-parallel-sharding-strategy 'optim_grads' is not modelled (memsim supports "
            "optim_grads_params)");
  EXPECT_EQ(ErrorOf(base + "--megatron-fsdp-main-params-dtype auto"),
            "--megatron-fsdp-main-params-dtype 'auto' is not modelled (memsim supports fp32)");
  EXPECT_EQ(ErrorOf(base + "--use-nccl-ub"),
            "--use-nccl-ub changes memory in a way memsim does not model (NCCL user buffers: DDP's "
            "or Megatron-FSDP's buffers in a memory pool of NCCL's segments apart from the caching "
            "allocator's own; under Megatron-FSDP it turns on --fsdp-double-buffer, which memsim "
            "models: give that in its place); drop it to simulate the run without it");
  EXPECT_EQ(ErrorOf(base + "--megatron-fsdp-max-pool-double-buffer"),
            "--megatron-fsdp-max-pool-double-buffer changes memory in a way memsim does not "
            "model (Megatron-FSDP's max-pool double buffers (MaxPoolAllocator, shared by unlike "
            "layers)); drop it to simulate the run without it");
  EXPECT_EQ(ErrorOf(std::string(kTinyGpt) + "--data-parallel-sharding-strategy optim_grads_params"),
            "--data-parallel-sharding-strategy changes memory in a way memsim does not model "
            "(FSDP); drop it to simulate the run without it");
  std::optional<ValidatedRun> run;
  EXPECT_TRUE(FinalizeRunSpec(r.spec, &run).ok());
  EXPECT_EQ(
      FinalizeRunSpec(Parse(base + "--pipeline-model-parallel-size 2", 8).spec, &run).message(),
      "Megatron-FSDP with pipeline parallelism is not modelled; use the distributed "
      "optimizer instead");
}

}  // namespace
}  // namespace memsim
