// Megatron-LM's theoretical memory (theoretical_memory_usage.py) for layouts worked by
// hand from its formulas; every expected number below is derived in the comments, not
// taken from the code under test. MB = 2^20 bytes.
#include "parallel/theoretical_memory.h"
#include "tests/support/test_models.h"
#include "tests/support/validated_run.h"

#include <gtest/gtest.h>

namespace memsim {
namespace {

constexpr double kMB = 1024.0 * 1024.0;

void ExpectClose(double actual, double expected) {
  EXPECT_NEAR(actual, expected, 1e-9 * expected) << "expected " << expected;
}

ModelConfig Gpt(int64_t layers, int64_t hidden, int64_t heads, int64_t vocab, int64_t tp) {
  ModelConfig m = test::Gpt(layers, hidden, heads, vocab);
  EXPECT_TRUE(FinalizeModelConfig(&m, tp).ok());
  return m;
}

ParallelLayout Layout(const ModelConfig& m, int64_t world, int64_t tp, int64_t pp,
                      DataParallelKind dp_kind, bool sequence_parallel, int64_t vpp = 1) {
  ParallelLayout l;
  l.world_size = world;
  l.tp = tp;
  l.pp = pp;
  l.vpp = vpp;
  l.data_parallel = dp_kind;
  l.sequence_parallel = sequence_parallel;
  EXPECT_TRUE(FinalizeLayout(&l, m).ok());
  return l;
}

TrainingConfig Training(int64_t seq, int64_t micro_batch, RecomputeKind recompute) {
  TrainingConfig t;
  t.seq_length = seq;
  t.micro_batch_size = micro_batch;
  t.recompute = recompute;
  return t;
}

// The estimate for stage `pp_rank` of the run with `microbatches` per iteration.
TheoreticalMemory Estimate(const ModelConfig& m, TrainingConfig t, const ParallelLayout& l,
                           int64_t microbatches, int64_t pp_rank = 0) {
  t.num_microbatches = microbatches;
  return ComputeTheoreticalMemory(test::Validated(m, t, l), pp_rank);
}

std::vector<std::string> Caveats(const ModelConfig& m, const TrainingConfig& t,
                                 const ParallelLayout& l, int64_t pp_rank) {
  return TheoreticalMemoryCaveats(test::Validated(m, t, l), pp_rank);
}

TEST(TheoreticalMemory, Gpt3_175BOnTp8Pp8Dp16) {
  // GPT-3 175B: L=96, H=12288, A=96, V=50257 padded to 51200 (a multiple of 128*8),
  // F=4H=49152, LayerNorm (2 params per norm element), GeLU, tied embeddings.
  const ModelConfig m = Gpt(96, 12288, 96, 50257, 8);
  ASSERT_EQ(m.padded_vocab_size, 51200);
  const ParallelLayout l =
      Layout(m, 1024, 8, 8, DataParallelKind::kDistributedOptimizer, /*sequence_parallel=*/true);
  ASSERT_EQ(l.dp, 16);
  const TheoreticalMemory r = Estimate(m, Training(2048, 1, RecomputeKind::kSelective), l, 96);

  // Attention: 2*H*H*(1 + G/A)*(D*A/H) = 4*H^2 = 603,979,776.
  // Layer: 2*H*(F + 2) + attention = 24576*49154 + 603,979,776 = 1,811,988,480.
  // Block: 96 layers + final norm 2*H = 173,950,918,656; embedding H*V = 629,145,600.
  ExpectClose(r.num_parameters, 173950918656.0 + 629145600.0);
  // First stage: (block/8 + embedding)/8 = (21,743,864,832 + 629,145,600)/8 = 2,796,626,304.
  ExpectClose(r.num_parameters_on_most_loaded_shard, 2796626304.0);
  // Distributed optimizer: 6 + 12/16 = 6.75 bytes per parameter.
  ExpectClose(r.weight_and_optimizer_mb, 2796626304.0 * 6.75 / kMB);  // 18002.73 MB
  EXPECT_NEAR(r.weight_and_optimizer_mb, 18002.727, 1e-3);

  // Sequence parallel + selective: per layer S*B*H*(18 + 4F/H) = 2048*12288*34 =
  // 855,638,016; * 96 layers = 82,141,249,536; + embedding input 8*S*B*pp = 131,072
  // + embedding dropout S*B*H*pp = 201,326,592; * min(1, 96/8) = 1; no output layer at
  // pp > 1; / TP 8 = 10,292,838,400 bytes.
  EXPECT_EQ(r.activation_formula, TheoreticalActivationFormula::kSequenceParallelSelective);
  ExpectClose(r.activation_mb, 10292838400.0 / kMB);  // 9816.015625 MB
  ExpectClose(r.total_mb, r.weight_and_optimizer_mb + r.activation_mb);
}

TEST(TheoreticalMemory, SmallGptWithoutParallelism) {
  // L=2, H=1024, A=16, V=51200, F=4096, LayerNorm, GeLU, tied; one GPU, DDP; S=1024, B=2.
  const ModelConfig m = Gpt(2, 1024, 16, 51200, 1);
  const ParallelLayout l = Layout(m, 1, 1, 1, DataParallelKind::kDdp, false);
  // Selective recomputation alone does not pick the first formula: there is no SP at TP 1.
  const TheoreticalMemory r = Estimate(m, Training(1024, 2, RecomputeKind::kSelective), l, 4);

  // Layer: 2*1024*(4096 + 2) + 4*1024^2 = 8,392,704 + 4,194,304 = 12,587,008.
  // Block: 2 layers + 2048 = 25,176,064; embedding 1024*51200 = 52,428,800 (tied).
  ExpectClose(r.num_parameters, 25176064.0 + 52428800.0);
  ExpectClose(r.num_parameters_on_most_loaded_shard, 77604864.0);
  ExpectClose(r.weight_and_optimizer_mb, 77604864.0 * 18 / kMB);  // 1332.18 MB

  // Without SP: per layer S*B*H*(10 + 24/1) = 1024*2*1024*34 = 71,303,168; * 2 layers =
  // 142,606,336; + 8*S*B = 16,384 + S*B*H = 2,097,152; pp == 1: logits S*B*V = 104,857,600
  // and final norm S*B*H = 2,097,152 at 2 bytes: + 213,909,504; total 358,629,376 * 1.05.
  EXPECT_EQ(r.activation_formula, TheoreticalActivationFormula::kWithoutSequenceParallel);
  ExpectClose(r.activation_mb, 358629376.0 * 1.05 / kMB);  // 359.116 MB
  EXPECT_NEAR(r.activation_mb, 359.1164, 1e-4);
}

TEST(TheoreticalMemory, LlamaSwigluGqaOnTp2) {
  // Llama 3 8B: L=32, H=4096, A=32, G=8, D=128, F=14336, V=128256 (a multiple of 128*2),
  // RMSNorm (1 param per norm element), SwiGLU (x 3/2), untied; TP 2, world 16 (dp 8),
  // distributed optimizer, SP + selective, S=8192, B=1.
  ModelConfig m = test::Llama(32, 4096, 32, 8, 14336, 128256);
  ASSERT_TRUE(FinalizeModelConfig(&m, 2).ok());
  const ParallelLayout l = Layout(m, 16, 2, 1, DataParallelKind::kDistributedOptimizer, true);
  const TheoreticalMemory r = Estimate(m, Training(8192, 1, RecomputeKind::kSelective), l, 16);

  // Attention: 2*H*H*(1 + 8/32)*1 = 41,943,040. Layer: 2*H*(14336*1.5 + 1) + attention =
  // 8192*21505 + 41,943,040 = 218,112,000. Block: 32 layers + H = 6,979,588,096.
  // Embedding: 4096*128256 = 525,336,576, twice (untied): 8,030,261,248 in all.
  ExpectClose(r.num_parameters, 8030261248.0);
  // pp == 1 and untied: (block + embedding)/2 + embedding/2 = 4,015,130,624.
  ExpectClose(r.num_parameters_on_most_loaded_shard, 4015130624.0);
  ExpectClose(r.weight_and_optimizer_mb, 4015130624.0 * (6 + 12.0 / 8) / kMB);  // 28718.45

  // Per layer S*H*(18 + 4*14336/4096) = 33,554,432*32 = 1,073,741,824; * 32 =
  // 34,359,738,368; + 8*S = 65,536 + S*H = 33,554,432; output layer and loss
  // S*H*4*(1 + 128256/4096) = 134,217,728*32.3125 = 4,336,910,336; total
  // 38,730,268,672 / TP 2 = 19,365,134,336 bytes.
  ExpectClose(r.activation_mb, 19365134336.0 / kMB);  // 18468.03 MB
}

TEST(TheoreticalMemory, PipelineSchedules) {
  // L=8, H=1024, A=16, F=4096, V=51200, LayerNorm, tied; TP 2, PP 4, world 16 (dp 2), DDP,
  // SP + selective, S=1024, B=1.
  const ModelConfig m = Gpt(8, 1024, 16, 51200, 2);
  // Layers 1024*1024*34*8 = 285,212,672 + 8*S*pp = 32,768 + S*H*pp = 4,194,304 =
  // 289,439,744 before the schedule's factor; no output layer at pp > 1; / TP 2.
  const double before_schedule = 289439744.0;

  // 1F1B with 2 microbatches for 4 stages: only min(1, 2/4) of the pp in flight.
  ParallelLayout l = Layout(m, 16, 2, 4, DataParallelKind::kDdp, true);
  TheoreticalMemory r = Estimate(m, Training(1024, 1, RecomputeKind::kSelective), l, 2);
  ExpectClose(r.activation_mb, before_schedule * 0.5 / 2 / kMB);  // 69.0078125 MB
  // 8 microbatches: the factor saturates at 1.
  r = Estimate(m, Training(1024, 1, RecomputeKind::kSelective), l, 8);
  ExpectClose(r.activation_mb, before_schedule / 2 / kMB);

  // Weights: layer 2*1024*(4096 + 2) + 4*1024^2 = 12,587,008; block 8 layers + 2048 =
  // 100,698,112; first stage (block/4 + 1024*51200)/2 = 38,801,664 at 18 bytes.
  ExpectClose(r.num_parameters_on_most_loaded_shard, 38801664.0);
  ExpectClose(r.weight_and_optimizer_mb, 38801664.0 * 18 / kMB);  // 666.07 MB

  // Interleaved, 2 chunks per stage: 1 + (4-1)/(4*2) = 1.375 whatever the microbatches
  // (at least PP of them, as Megatron-LM requires when interleaving).
  l = Layout(m, 16, 2, 4, DataParallelKind::kDdp, true, /*vpp=*/2);
  r = Estimate(m, Training(1024, 1, RecomputeKind::kSelective), l, 4);
  ExpectClose(r.activation_mb, before_schedule * 1.375 / 2 / kMB);  // 189.771484375 MB

  // Full recomputation, or no SP, takes the other formula: per layer S*H*(10 + 24/2) =
  // 1024*1024*22 = 23,068,672; * 8 = 184,549,376; + 32,768 + 4,194,304 = 188,776,448;
  // * 1.375; no output layer; * 1.05.
  TrainingConfig full = Training(1024, 1, RecomputeKind::kFull);
  r = Estimate(m, full, l, 4);
  EXPECT_EQ(r.activation_formula, TheoreticalActivationFormula::kWithoutSequenceParallel);
  ExpectClose(r.activation_mb, 188776448.0 * 1.375 * 1.05 / kMB);
}

TEST(TheoreticalMemory, MixtureOfExpertsCountsExpertsOverTpOnly) {
  // L=4 with the first dense, H=512, A=8 (D=64), dense F=1024, 8 experts of 256 and a
  // shared 512, SwiGLU, RMSNorm, untied, V=1000 padded to 1024; world 4 (dp 4), EP 2,
  // distributed optimizer; S=256, B=2.
  ModelConfig m;
  m.num_layers = 4;
  m.hidden_size = 512;
  m.num_attention_heads = 8;
  m.ffn_hidden_size = 1024;
  m.vocab_size = 1000;
  m.norm = NormKind::kRmsNorm;
  m.activation = ActivationKind::kSwiglu;
  m.tie_embeddings = false;
  m.num_experts = 8;
  m.moe_router_topk = 2;
  m.moe_ffn_hidden_size = 256;
  m.moe_shared_expert_size = 512;
  m.moe_first_k_dense_layers = 1;
  ASSERT_TRUE(FinalizeModelConfig(&m).ok());
  ParallelLayout l;
  l.world_size = 4;
  l.ep = 2;
  l.data_parallel = DataParallelKind::kDistributedOptimizer;
  ASSERT_TRUE(FinalizeLayout(&l, m).ok());
  const TheoreticalMemory r = Estimate(m, Training(256, 2, RecomputeKind::kNone), l, 1);

  // Attention 4*512^2 = 1,048,576. Dense layer: 2*512*(1024*1.5 + 1) + attention =
  // 2,622,464. MoE layer: 2*512*(256*8*1.5 + 512*1.5 + 1) + attention = 1024*3841 +
  // 1,048,576 = 4,981,760. Block: 2,622,464 + 3*4,981,760 + 512 = 17,568,256.
  // Embedding 512*1024 = 524,288, twice.
  ExpectClose(r.num_parameters, 17568256.0 + 2 * 524288.0);
  // pp == 1, untied: block + 2 embeddings, over TP 1 (EP 2 does not divide the experts).
  ExpectClose(r.num_parameters_on_most_loaded_shard, 18616832.0);
  ExpectClose(r.weight_and_optimizer_mb, 18616832.0 * (6 + 12.0 / 4) / kMB);  // 159.79 MB

  // Without SP: 256*2*512*34 = 8,912,896 per layer, * 4 = 35,651,584; + 8*S*B = 4,096
  // + S*B*H = 262,144; + (S*B*V + S*B*H)*2 = (524,288 + 262,144)*2 = 1,572,864;
  // 37,490,688 * 1.05.
  ExpectClose(r.activation_mb, 37490688.0 * 1.05 / kMB);  // 37.54 MB

  // FSDP counts as the distributed optimizer. (memsim models FSDP without EP, which the
  // formula ignores anyway.)
  l.data_parallel = DataParallelKind::kFsdp;
  l.ep = 1;
  ExpectClose(Estimate(m, Training(256, 2, RecomputeKind::kNone), l, 1).weight_and_optimizer_mb,
              r.weight_and_optimizer_mb);
}

TEST(TheoreticalMemory, FormulaNames) {
  EXPECT_STREQ(
      TheoreticalActivationFormulaName(TheoreticalActivationFormula::kSequenceParallelSelective),
      "sequence parallel + selective recomputation");
  EXPECT_STREQ(
      TheoreticalActivationFormulaName(TheoreticalActivationFormula::kWithoutSequenceParallel),
      "without sequence parallelism");
}

// Note [Theoretical memory per stage]: stage 0 is Megatron-LM's number; the last stage of
// a two-stage GPT holds its two layers, the final norm and the output layer, and one
// microbatch in flight.
TEST(TheoreticalMemory, LaterStageByHand) {
  const ModelConfig m = Gpt(4, 1024, 16, 1024, 1);
  const ParallelLayout l = Layout(m, 2, 1, 2, DataParallelKind::kDdp, /*sequence_parallel=*/false);
  const TrainingConfig t = Training(1024, 1, RecomputeKind::kNone);
  const TheoreticalMemory first = Estimate(m, t, l, 4);
  const TheoreticalMemory stage0 = Estimate(m, t, l, 4, 0);
  EXPECT_EQ(first.total_mb, stage0.total_mb);

  const TheoreticalMemory last = Estimate(m, t, l, 4, 1);
  // Layer: 2*H*(4H + 2) + 4*H^2 = 2048*4098 + 4,194,304 = 12,587,008 parameters.
  // Last stage: 2 layers + final norm 2*H + output layer H*V = 25,174,016 + 2048 + 1,048,576.
  const double params = 2 * 12587008.0 + 2048 + 1048576;
  ExpectClose(last.num_parameters_on_most_loaded_shard, params);
  ExpectClose(last.weight_and_optimizer_mb, params * 18 / kMB);  // DDP: 18 bytes each
  // Activations: per layer S*B*H*(10 + 24/tp) = 1024*1024*34 bytes, 2 layers, one
  // microbatch in flight (pp - s = 1); logits and final norm output (S*B*V + S*B*H)*2;
  // all times 1.05.
  const double activations = (2 * 1024.0 * 1024 * 34 + (1024.0 * 1024 + 1024.0 * 1024) * 2) * 1.05;
  ExpectClose(last.activation_mb, activations / kMB);

  const auto caveats = Caveats(m, t, l, 1);
  ASSERT_EQ(caveats.size(), 1u);
  EXPECT_EQ(caveats[0], "a later stage: memsim's extension of the formula");
  EXPECT_TRUE(Caveats(m, t, l, 0).empty());
}

// Interleaved: stage s keeps (2 (pp - s - 1) + (vpp - 1) pp + 1) / vpp microbatches in
// flight; for pp = 4, vpp = 2, stage 2: (2 + 4 + 1) / 2 = 3.5, of its 2 layers (one per chunk).
TEST(TheoreticalMemory, InterleavedLaterStageByHand) {
  const ModelConfig m = Gpt(8, 1024, 16, 1024, 1);
  const ParallelLayout l = Layout(m, 4, 1, 4, DataParallelKind::kDdp, false, /*vpp=*/2);
  const TheoreticalMemory r = Estimate(m, Training(1024, 1, RecomputeKind::kNone), l, 8, 2);
  ExpectClose(r.activation_mb, 3.5 * 2 * 1024.0 * 1024 * 34 * 1.05 / kMB);
}

}  // namespace
}  // namespace memsim
