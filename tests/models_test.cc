// The model zoo against published numbers: Korthikanti et al. 2022 activation bytes per
// layer, Megatron-LM's bytes per parameter, and published parameter counts.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "models/layers.h"
#include "models/model_config.h"
#include "models/moe.h"
#include "models/parameters.h"
#include "models/transformer.h"
#include "parallel/rank_training.h"
#include "parallel/run_spec.h"
#include "simulator/cost_model.h"
#include "simulator/session.h"
#include "simulator/timeline.h"
#include "simulator/tracking_allocator.h"
#include "tests/support/recorded_rank.h"
#include "tests/support/recorder_queries.h"
#include "tests/support/test_models.h"
#include "tests/support/validated_run.h"

namespace memsim {
namespace {

struct Shape {
  int64_t s, b, h, a;
};

ModelConfig GptConfig(const Shape& shape, int64_t layers) {
  ModelConfig m = test::Gpt(layers, shape.h, shape.a);
  EXPECT_TRUE(FinalizeModelConfig(&m).ok());
  return m;
}

TrainingConfig Fp16Eager(const Shape& shape) {
  TrainingConfig t;
  t.seq_length = shape.s;
  t.micro_batch_size = shape.b;
  t.precision = Precision::kFp16;
  t.attention = AttentionKind::kEager;
  return t;
}

// Runs one microbatch's forward (and with `backward`, its backward) of `shard` on a fresh
// session and returns what `measure` reads of the recording, while the graph is alive.
template <typename Measure>
auto RunStep(const ModelConfig& model, const TrainingConfig& training, const ModelShard& shard,
             bool backward, Measure measure) {
  Session session;
  ActiveSession active(session);
  ParameterStore store(training.precision);
  TransformerModel transformer(model, training, shard, &store);
  store.AllocateGradBuffer();
  session.SetPhase(Phase::kForward);
  at::Tensor loss = transformer.Forward();
  if (backward) {
    session.SetPhase(Phase::kBackward);
    loss.backward();
  }
  return measure(session.recorder());
}

ModelShard TensorParallelShard(const ModelConfig& model, int64_t tp, bool sequence_parallel) {
  ModelShard shard = ModelShard::Whole(model);
  shard.tp = tp;
  shard.sequence_parallel = sequence_parallel;
  return shard;
}

// Bytes of `category`'s storages alive when the forward pass ends (the loss is computed,
// backward has not started). `tp`: the whole model's tensor-parallel shard (REQUIRES:
// `model` finalized for it).
int64_t BytesAfterForward(const ModelConfig& model, const TrainingConfig& training,
                          Category category, int64_t tp = 1) {
  return RunStep(model, training, TensorParallelShard(model, tp, false), /*backward=*/false,
                 [category](const Recorder& r) {
                   int64_t bytes = 0;
                   ForEachLiveStorage(
                       r, static_cast<int64_t>(r.events().size()) - 1, [&](int64_t id) {
                         const StorageInfo& s = r.storages()[static_cast<size_t>(id)];
                         if (s.category == category) bytes += s.size_bytes;
                       });
                   return bytes;
                 });
}

// The activations: what the step holds for backward.
int64_t ActivationBytesAfterForward(const ModelConfig& model, const TrainingConfig& training,
                                    int64_t tp = 1) {
  return BytesAfterForward(model, training, Category::kActivation, tp);
}

// Sequence `s`, micro batch `b`, bf16, no dropout, `attention`: the setting the tables of the
// newer architectures are worked out in.
TrainingConfig Bf16WithoutDropout(int64_t s, int64_t b, AttentionKind attention) {
  TrainingConfig t;
  t.seq_length = s;
  t.micro_batch_size = b;
  t.precision = Precision::kBf16;
  t.attention = attention;
  t.dropout = false;
  return t;
}

// One layer's saved activations: the difference between an L=2 and an L=1 model, which
// cancels the embedding, loss and one-off workspaces.
int64_t PerLayerActivationBytes(const std::function<ModelConfig(int64_t layers)>& model,
                                const TrainingConfig& training) {
  return ActivationBytesAfterForward(model(2), training) -
         ActivationBytesAfterForward(model(1), training);
}

int64_t PerLayerActivationBytes(const Shape& shape, const TrainingConfig& training) {
  return PerLayerActivationBytes([&](int64_t layers) { return GptConfig(shape, layers); },
                                 training);
}

const Shape kShapes[] = {{128, 2, 256, 8}, {256, 1, 512, 16}, {64, 4, 128, 4}, {512, 2, 256, 4}};

// Table 2, no parallelism: s*b*h*(34 + 5*a*s/h). The real kernels also keep each
// LayerNorm's float32 mean and rstd ([s, b] each, two LayerNorms): 16*s*b more.
TEST(Activations, KorthikantiNoRecomputation) {
  for (const Shape& x : kShapes) {
    const int64_t paper = x.s * x.b * x.h * 34 + 5 * x.a * x.s * x.s * x.b;
    EXPECT_EQ(PerLayerActivationBytes(x, Fp16Eager(x)), paper + 16 * x.s * x.b)
        << "s=" << x.s << " b=" << x.b << " h=" << x.h << " a=" << x.a;
  }
}

// Selective recomputation keeps s*b*h*34 (+ LayerNorm statistics).
TEST(Activations, KorthikantiSelectiveRecomputation) {
  for (const Shape& x : kShapes) {
    TrainingConfig t = Fp16Eager(x);
    t.recompute = RecomputeKind::kSelective;
    EXPECT_EQ(PerLayerActivationBytes(x, t), x.s * x.b * x.h * 34 + 16 * x.s * x.b)
        << "s=" << x.s << " b=" << x.b << " h=" << x.h << " a=" << x.a;
  }
}

// Full recomputation keeps only each layer's input: 2*s*b*h.
TEST(Activations, KorthikantiFullRecomputation) {
  for (const Shape& x : kShapes) {
    TrainingConfig t = Fp16Eager(x);
    t.recompute = RecomputeKind::kFull;
    EXPECT_EQ(PerLayerActivationBytes(x, t), 2 * x.s * x.b * x.h)
        << "s=" << x.s << " b=" << x.b << " h=" << x.h << " a=" << x.a;
  }
}

// FP8 (Note [FP8 training]) against the same Transformer Engine layer in 16 bits, rows
// r = s*b, no tensor parallelism: linear_qkv and linear_fc1 keep their input's FP8
// transpose (r*h bytes and its scale) instead of the 16-bit norm output (2rh), linear_fc2
// the transpose of the GeLU output (4rh and a scale) instead of it (8rh); linear_proj keeps
// its 16-bit input (save_original_input), except with the delayed recipe, which keeps its
// transpose (rh and a scale) instead. Per-tensor scales are one fp32; blockwise columnwise
// scales are fp32 [ceil(r/128), roundup(cols, 4)]. MXFP8 keeps columnwise data of the
// transpose's bytes with one-byte scales per 32 values, [roundup(ceil(r/32), 4),
// roundup(cols, 128)].
TEST(Activations, Fp8LinearsKeepTransposesInsteadOf16BitInputs) {
  for (const Shape& x : kShapes) {
    TrainingConfig t = Fp16Eager(x);
    t.profile = ProfileKind::kTransformerEngine;
    const int64_t sixteen_bit = PerLayerActivationBytes(x, t);
    const int64_t r = x.s * x.b, h = x.h;
    t.fp8 = Fp8Recipe::kTensorwise;
    EXPECT_EQ(PerLayerActivationBytes(x, t) - sixteen_bit, 2 * (-r * h + 4) + (-4 * r * h + 4));
    t.fp8 = Fp8Recipe::kDelayed;
    EXPECT_EQ(PerLayerActivationBytes(x, t) - sixteen_bit,
              2 * (-r * h + 4) + (-4 * r * h + 4) + (-r * h + 4));
    t.fp8 = Fp8Recipe::kBlockwise;
    const auto scales = [r](int64_t cols) { return 4 * ((r + 127) / 128) * ((cols + 3) / 4 * 4); };
    EXPECT_EQ(PerLayerActivationBytes(x, t) - sixteen_bit,
              2 * (-r * h + scales(h)) + (-4 * r * h + scales(4 * h)));
    t.fp8 = Fp8Recipe::kMxfp8;
    const auto mx_scales = [r](int64_t cols) {
      return ((r + 31) / 32 + 3) / 4 * 4 * ((cols + 127) / 128 * 128);
    };
    EXPECT_EQ(PerLayerActivationBytes(x, t) - sixteen_bit,
              2 * (-r * h + mx_scales(h)) + (-4 * r * h + mx_scales(4 * h)))
        << "s=" << x.s << " b=" << x.b << " h=" << x.h;
  }
}

// FP8 weights (Note [FP8 training]), per GPT layer of hidden size h: its four GEMM weights
// hold 12h^2 elements. TE's cached FP8 copy adds data and transpose (2 bytes an element)
// and a 4-byte scale per weight; the delayed recipe adds per module fp32 scales [3] and [2]
// and amax histories [L, 3] and [L, 2]; FP8 parameters (--fp8-param-gather) replace the
// 16-bit weight (2 bytes an element) with data and transpose, leaving only the scales.
TEST(Parameters, Fp8WeightsPerLayer) {
  const Shape x{128, 2, 256, 8};
  TrainingConfig t = Fp16Eager(x);
  t.precision = Precision::kBf16;
  t.profile = ProfileKind::kTransformerEngine;
  auto per_layer = [&] {
    return BytesAfterForward(GptConfig(x, 2), t, Category::kParameter) -
           BytesAfterForward(GptConfig(x, 1), t, Category::kParameter);
  };
  const int64_t sixteen_bit = per_layer();
  const int64_t weight_elements = 12 * x.h * x.h;
  t.fp8 = Fp8Recipe::kTensorwise;
  EXPECT_EQ(per_layer() - sixteen_bit, 2 * weight_elements + 4 * 4);
  t.fp8 = Fp8Recipe::kDelayed;
  t.fp8_amax_history_len = 3;
  EXPECT_EQ(per_layer() - sixteen_bit, 2 * weight_elements + 4 * 4 + 4 * 4 * (3 + 2) * (1 + 3));
  t.fp8 = Fp8Recipe::kTensorwise;
  t.fp8_param_gather = true;
  EXPECT_EQ(per_layer() - sixteen_bit, 4 * 4);
  // MXFP8: rowwise and columnwise data of each weight [N, K] and their one-byte scales,
  // [roundup(N, 128), roundup(K/32, 4)] and [roundup(N/32, 4), roundup(K, 128)].
  t.fp8_param_gather = false;
  t.fp8 = Fp8Recipe::kMxfp8;
  const auto up = [](int64_t v, int64_t m) { return (v + m - 1) / m * m; };
  int64_t scales = 0;
  for (const auto& [n, k] : std::vector<std::pair<int64_t, int64_t>>{
           {3 * x.h, x.h}, {x.h, x.h}, {4 * x.h, x.h}, {x.h, 4 * x.h}}) {
    scales += up(n, 128) * up(k / 32, 4) + up(n / 32, 4) * up(k, 128);
  }
  EXPECT_EQ(scales, 2 * weight_elements / 32);  // h = 256: no padding
  EXPECT_EQ(per_layer() - sixteen_bit, 2 * weight_elements + scales);
  // Where the GPU's FP8 GEMMs read any layout (Blackwell), the per-tensor recipes keep no
  // transposes: TE's cached copy is its data alone, an FP8 parameter 1 byte an element.
  t.fp8 = Fp8Recipe::kTensorwise;
  t.fp8_gemm_any_layout = true;
  EXPECT_EQ(per_layer() - sixteen_bit, weight_elements + 4 * 4);
  t.fp8_param_gather = true;
  EXPECT_EQ(per_layer() - sixteen_bit, -weight_elements + 4 * 4);
}

// Bytes of every allocation of one forward and backward, on a TP rank with sequence
// parallelism (REQUIRES: `model` finalized for `tp`).
int64_t BytesAllocatedByStep(const ModelConfig& model, const TrainingConfig& training, int64_t tp) {
  return RunStep(model, training, TensorParallelShard(model, tp, true), /*backward=*/true,
                 [](const Recorder& r) {
                   int64_t bytes = 0;
                   for (const MemoryEvent& e : r.events()) {
                     if (e.is_alloc)
                       bytes += r.storages()[static_cast<size_t>(e.storage_id)].size_bytes;
                   }
                   return bytes;
                 });
}

// TP communication overlap (Note [Userbuffers]), per layer, rows n = s*b, TP 2 with
// sequence parallelism: the userbuffers take linear_qkv's and linear_fc1's all-gathered
// inputs in forward and backward and their full input gradients, and linear_proj's and
// linear_fc2's all-gathered output gradients: 8 tensors of n*h 16-bit values. With FP8
// (tensorwise) the six gathers are FP8 (n*h bytes, each with a 4-byte scale) and the two
// input gradients stay 16-bit.
TEST(Allocations, UserbuffersTakeTheSequenceParallelGathers) {
  for (const Shape& x : kShapes) {
    TrainingConfig t = Fp16Eager(x);
    t.profile = ProfileKind::kTransformerEngine;
    const int64_t n = x.s * x.b, h = x.h;
    auto per_layer = [&] {
      auto bytes = [&](int64_t layers) {
        ModelConfig m = test::Gpt(layers, x.h, x.a);
        EXPECT_TRUE(FinalizeModelConfig(&m, 2).ok());
        return BytesAllocatedByStep(m, t, /*tp=*/2);
      };
      return bytes(2) - bytes(1);
    };
    const int64_t nccl = per_layer();
    t.tp_comm_overlap = true;
    EXPECT_EQ(nccl - per_layer(), 8 * 2 * n * h) << "s=" << x.s << " b=" << x.b;
    t.fp8 = Fp8Recipe::kTensorwise;
    const int64_t fp8_userbuffers = per_layer();
    t.tp_comm_overlap = false;
    EXPECT_EQ(per_layer() - fp8_userbuffers, 6 * (n * h + 4) + 2 * 2 * n * h)
        << "s=" << x.s << " b=" << x.b;
  }
}

// The activations one MoE layer keeps after its forward (Transformer Engine layers, bf16,
// 4 experts all local, grouped GEMM, hidden h, expert FFN f): a 2-layer model less a
// 1-layer one.
int64_t MoeLayerActivationBytes(int64_t s, int64_t b, int64_t h, int64_t f, int64_t topk,
                                Fp8Recipe fp8, bool fp8_param = false) {
  TrainingConfig t;
  t.seq_length = s;
  t.micro_batch_size = b;
  t.precision = Precision::kBf16;
  t.profile = ProfileKind::kTransformerEngine;
  t.moe_grouped_gemm = true;
  t.fp8 = fp8;
  t.fp8_param_gather = fp8_param;
  auto bytes = [&](int64_t layers) {
    ModelConfig m = test::Llama(layers, h, 4, 4, 704, 1024);
    m.num_experts = 4;
    m.moe_router_topk = topk;
    m.moe_ffn_hidden_size = f;
    EXPECT_TRUE(FinalizeModelConfig(&m).ok());
    return ActivationBytesAfterForward(m, t);
  };
  return bytes(2) - bytes(1);
}

// Where the GPU's FP8 GEMMs read any layout (Blackwell), tensorwise FP8 quantizes without
// transposes; per layer, rows r = s*b, no tensor parallelism, the step allocates r*h bytes
// less for each of linear_qkv's and linear_fc1's inputs, linear_proj's 16-bit input
// quantized again in backward, and linear_fc2's output gradient; 4rh less for linear_fc2's
// input and linear_fc1's output gradient; 3rh less for linear_qkv's output gradient; rh
// for linear_proj's: 16*r*h in all; and the four weights' cached transposes (12h^2 bytes,
// made with the model here).
TEST(Allocations, Fp8WithoutTransposesWhereGemmsReadAnyLayout) {
  for (const Shape& x : kShapes) {
    TrainingConfig t = Fp16Eager(x);
    t.profile = ProfileKind::kTransformerEngine;
    t.fp8 = Fp8Recipe::kTensorwise;
    auto per_layer = [&] {
      auto bytes = [&](int64_t layers) {
        const ModelConfig m = GptConfig(x, layers);
        return BytesAllocatedByStep(m, t, /*tp=*/1);
      };
      return bytes(2) - bytes(1);
    };
    const int64_t hopper = per_layer();
    t.fp8_gemm_any_layout = true;
    EXPECT_EQ(hopper - per_layer(), 16 * x.s * x.b * x.h + 12 * x.h * x.h)
        << "s=" << x.s << " b=" << x.b << " h=" << x.h;
  }
}

// FP8 MoE layers (Note [FP8 training]) against the same in 16 bits, r = s*b tokens, M =
// r*topk expert rows (all experts local, 128 rows each: no padding), no tensor
// parallelism: linear_qkv keeps its input's transpose (r*h bytes and a 4-byte scale)
// instead of the 16-bit norm output (2rh); the experts' fc1 the transpose of the permuted
// tokens (M*h + 4) instead of them (2Mh), fc2 the transpose of the weighted activation
// (M*f + 4) instead of it (2Mf); linear_proj keeps its 16-bit input.
TEST(Activations, Fp8MoeLayerKeepsTransposes) {
  const int64_t s = 256, b = 1, h = 256, f = 512, topk = 2;
  const int64_t sixteen_bit = MoeLayerActivationBytes(s, b, h, f, topk, Fp8Recipe::kNone);
  const int64_t r = s * b, M = r * topk;
  EXPECT_EQ(MoeLayerActivationBytes(s, b, h, f, topk, Fp8Recipe::kTensorwise) - sixteen_bit,
            (-r * h + 4) + (-M * h + 4) + (-M * f + 4));
  // FP8 parameters (the experts' 16-bit weights without bytes) keep the same activations.
  EXPECT_EQ(MoeLayerActivationBytes(s, b, h, f, topk, Fp8Recipe::kTensorwise, true) - sixteen_bit,
            (-r * h + 4) + (-M * h + 4) + (-M * f + 4));
}

// The same under MXFP8 with 32 rows per expert (s = 64): each expert's rows are quantized
// alone, so each has its own columnwise scales, [roundup(32/32, 4) = 4, roundup(cols, 128)]
// (16 scale rows for the 4 experts where one tensor of 128 rows would have 4);
// linear_qkv keeps [roundup(64/32, 4) = 4, h] scales with its columnwise data.
TEST(Activations, Mxfp8ExpertsScaleEachExpertAlone) {
  const int64_t s = 64, h = 256, f = 512, topk = 2, experts = 4;
  const int64_t sixteen_bit = MoeLayerActivationBytes(s, 1, h, f, topk, Fp8Recipe::kNone);
  const int64_t r = s, M = r * topk;
  EXPECT_EQ(MoeLayerActivationBytes(s, 1, h, f, topk, Fp8Recipe::kMxfp8) - sixteen_bit,
            (-r * h + 4 * h) + (-M * h + experts * 4 * h) + (-M * f + experts * 4 * f));
}

// Fp8Padding (Note [FP8 training]): with two local experts of 200 rows each (s*b*topk/E =
// 200*1*2/2, off the multiple of 16) the experts' rows are copied into [2, 208, h] and
// their probabilities into [2, 208] before fc1; with 256 or 208 rows each nothing is
// copied. MXFP8 aligns to 32: 208 rows are copied into [2, 224, h] and [2, 224].
TEST(Moe, Fp8PaddingCopiesRowsOnlyWhenAnExpertIsOffTheMultiple) {
  using Shapes = std::vector<std::vector<int64_t>>;
  const struct {
    Fp8Recipe recipe;
    int64_t seq;
    Shapes copies;
  } cases[] = {{Fp8Recipe::kTensorwise, 200, {{2, 208, 256}, {2, 208}}},
               {Fp8Recipe::kTensorwise, 256, {}},
               {Fp8Recipe::kTensorwise, 208, {}},
               {Fp8Recipe::kMxfp8, 208, {{2, 224, 256}, {2, 224}}},
               {Fp8Recipe::kMxfp8, 256, {}}};
  for (const auto& c : cases) {
    ModelConfig m = test::Llama(1, 256, 4, 4, 512, 1024);
    m.num_experts = 2;
    m.moe_router_topk = 2;
    ASSERT_TRUE(FinalizeModelConfig(&m).ok());
    TrainingConfig t;
    t.seq_length = c.seq;
    t.precision = Precision::kBf16;
    t.profile = ProfileKind::kTransformerEngine;
    t.moe_grouped_gemm = true;
    t.fp8 = c.recipe;
    ASSERT_TRUE(ValidateTrainingConfig(t, m).ok());
    const auto padded =
        RunStep(m, t, ModelShard::Whole(m), /*backward=*/false, [](const Recorder& r) {
          Shapes shapes;
          for (const StorageInfo& info : r.storages()) {
            if (r.names().Name(info.op) == "aten::cat" &&
                r.names().Name(info.module).rfind("decoder.layers.0.mlp", 0) == 0) {
              shapes.push_back(r.ShapeOf(info).vec());
            }
          }
          return shapes;
        });
    EXPECT_EQ(padded, c.copies) << NameOf(kFp8RecipeNames, c.recipe) << ", seq " << c.seq;
  }
}

// The (shape, dtype) of storages a step records, as a multiset.
using ShapeSet = std::multiset<std::pair<std::vector<int64_t>, at::ScalarType>>;

// One MoE layer of two experts, top-2 (each expert takes every token), h = 256, bf16,
// Transformer Engine's grouped experts, on s tokens; `configure` adjusts it. Returns the
// shapes of the storages the step (forward, and with `backward` backward too) records in
// `module` (every module when empty).
ShapeSet TwoExpertStepShapeSet(
    int64_t s, bool backward, const std::string& module,
    const std::function<void(ModelConfig*, TrainingConfig*)>& configure) {
  ModelConfig m = test::Llama(1, 256, 4, 4, 512, 1024);
  m.num_experts = 2;
  m.moe_router_topk = 2;
  TrainingConfig t;
  t.seq_length = s;
  t.precision = Precision::kBf16;
  t.profile = ProfileKind::kTransformerEngine;
  t.moe_grouped_gemm = true;
  configure(&m, &t);
  const Status model = FinalizeModelConfig(&m);
  EXPECT_TRUE(model.ok()) << model.message();
  const Status training = ValidateTrainingConfig(t, m);
  EXPECT_TRUE(training.ok()) << training.message();
  return RunStep(m, t, ModelShard::Whole(m), backward, [&module](const Recorder& r) {
    ShapeSet shapes;
    for (const StorageInfo& info : r.storages()) {
      if (module.empty() || r.names().Name(info.module) == module) {
        shapes.emplace(r.ShapeOf(info).vec(), info.dtype);
      }
    }
    return shapes;
  });
}

// What `with` holds beyond `without` (a multiset difference).
ShapeSet Added(ShapeSet with, const ShapeSet& without) {
  for (const auto& shape : without) {
    const auto it = with.find(shape);
    if (it != with.end()) with.erase(it);
  }
  return with;
}

// --moe-apply-probs-on-input (experts.py, top-1): the experts' N = 64 input rows times their
// probabilities make a new [N, 256] (bf16 probabilities: bf16; fp32 ones with
// --moe-router-dtype fp32: an fp32 product and its bf16 cast), which fc1 saves while the
// product keeps the rows; the activation is weighted by ones_like(probabilities), [N].
TEST(Moe, ProbabilitiesAppliedOnTheExpertsInput) {
  const int64_t N = 64;
  for (bool fp32_router : {false, true}) {
    auto run = [&](bool on_input) {
      return TwoExpertStepShapeSet(N, /*backward=*/false, "", [&](ModelConfig* m, TrainingConfig*) {
        m->moe_router_topk = 1;  // sigmoid scores, as Llama 4
        m->moe_router_score_function = MoeScoreFunction::kSigmoid;
        m->moe_router_fp32 = fp32_router;
        m->moe_apply_probs_on_input = on_input;
      });
    };
    const at::ScalarType p = fp32_router ? at::kFloat : at::kBFloat16;
    ShapeSet expected = {{{N, 256}, p}, {{N}, p}};
    if (fp32_router) expected.emplace(std::vector<int64_t>{N, 256}, at::kBFloat16);
    EXPECT_EQ(Added(run(true), run(false)), expected) << "fp32 router " << fp32_router;
    EXPECT_TRUE(Added(run(false), run(true)).empty()) << "fp32 router " << fp32_router;
  }
}

// One layer of two experts, top-2, MoE FFN `ffn` (hidden 256, 4 heads).
ModelConfig TwoExperts(int64_t ffn) {
  ModelConfig m = test::Llama(1, 256, 4, 4, ffn, 1024);
  m.num_experts = 2;
  m.moe_router_topk = 2;
  return m;
}

// bf16, sequence `s`, Transformer Engine's layers, grouped GEMM experts.
TrainingConfig GroupedExpertsTraining(int64_t s) {
  TrainingConfig t;
  t.seq_length = s;
  t.precision = Precision::kBf16;
  t.profile = ProfileKind::kTransformerEngine;
  t.moe_grouped_gemm = true;
  return t;
}

// The storages layer 0's experts made in one forward and still hold when it ends.
ShapeSet AliveInLayer0Experts(ModelConfig m, const TrainingConfig& t) {
  EXPECT_TRUE(FinalizeModelConfig(&m).ok());
  EXPECT_TRUE(ValidateTrainingConfig(t, m).ok());
  return RunStep(m, t, ModelShard::Whole(m), /*backward=*/false, [](const Recorder& r) {
    ShapeSet shapes;
    for (const StorageInfo& info : r.storages()) {
      const std::string& module = r.names().Name(info.module);
      if (info.phase == Phase::kForward && info.free_event < 0 &&
          module.rfind("decoder.layers.0.mlp.experts", 0) == 0) {
        shapes.emplace(r.ShapeOf(info).vec(), info.dtype);
      }
    }
    return shapes;
  });
}

// Megatron-Core's weighted SwiGLU (weighted_bias_swiglu_impl, --bias-activation-fusion):
// WeightedSwiGLUFunction saves the fc1 output and the probabilities and returns the
// weighted activation; nothing else of the activation outlives the forward. Two experts,
// top-2, s = 64 tokens: n = 128 expert rows, fc1 output [n, 2F], F = 512 (the MoE FFN),
// bf16. Alive in the experts when the forward ends: the fc1 output and the weighted
// activation fc2 saves. Unfused (the old stand-in kept one of these under fusion too),
// silu(gate) [n, F], (linear + offset) [n, F] and their product [n, F] stay saved as well:
// the product's factors for its backward, the product for the probabilities' gradient.
TEST(Moe, WeightedSwigluKeepsItsInputAndTheProbabilitiesOnly) {
  const int64_t n = 128, F = 512;
  auto alive = [&](bool fused) {
    TrainingConfig t = GroupedExpertsTraining(n / 2);
    t.bias_activation_fusion = fused;
    return AliveInLayer0Experts(TwoExperts(F), t);
  };
  const at::ScalarType bf16 = at::kBFloat16;
  const ShapeSet fused = alive(true);
  EXPECT_EQ(fused, ShapeSet({{{n, 2 * F}, bf16}, {{n, F}, bf16}}));
  EXPECT_EQ(Added(alive(false), fused), ShapeSet({{{n, F}, bf16}, {{n, F}, bf16}, {{n, F}, bf16}}));
}

// --mlp-chunks-for-training (TransformerLayer._forward_mlp), worked by hand for one GeLU
// layer, h = 64, F = 4h = 256, s = 8, b = 2, bf16, Transformer Engine's layers: with 2 chunks
// the MLP runs twice on [4, 2, 64] rows, so linear_fc1 makes two [4, 2, 256] outputs where
// one call makes [8, 2, 256], each chunk's fused norm its own [4, 2, 64] output (none for
// the whole sequence), and the
// layer joins the two [4, 2, 64] MLP outputs with torch.cat into one [8, 2, 64]. What the
// forward keeps is the same bytes either way. Three chunks of 8 rows are 3, 3 and 2 rows
// (torch.chunk); 20 chunks are 8 (at most one row a chunk); 0 is none. The local spec
// chunks the whole norm's output.
TEST(Mlp, ChunksForTrainingSplitTheSequence) {
  const int64_t s = 8, b = 2, h = 64, F = 256;
  ModelConfig m = test::Gpt(1, h, 4);
  ASSERT_TRUE(FinalizeModelConfig(&m).ok());
  auto made = [&](int64_t chunks, ProfileKind profile, const std::string& module,
                  const std::string& op) {
    TrainingConfig t = Bf16WithoutDropout(s, b, AttentionKind::kFused);
    t.profile = profile;
    t.mlp_chunks_for_training = chunks;
    EXPECT_TRUE(ValidateTrainingConfig(t, m).ok());
    return RunStep(m, t, ModelShard::Whole(m), /*backward=*/false, [&](const Recorder& r) {
      ShapeSet shapes;
      for (const StorageInfo& info : r.storages()) {
        if (info.phase == Phase::kForward && r.names().Name(info.module) == module &&
            (op.empty() || r.names().Name(info.op) == op)) {
          shapes.emplace(r.ShapeOf(info).vec(), info.dtype);
        }
      }
      return shapes;
    });
  };
  const at::ScalarType bf16 = at::kBFloat16;
  const ProfileKind te = ProfileKind::kTransformerEngine;
  const std::string fc1 = "decoder.layers.0.mlp.linear_fc1";
  const std::string layer = "decoder.layers.0";
  EXPECT_EQ(made(1, te, fc1, "aten::matmul"), ShapeSet({{{s, b, F}, bf16}}));
  EXPECT_EQ(made(2, te, fc1, "aten::matmul"), ShapeSet({{{4, b, F}, bf16}, {{4, b, F}, bf16}}));
  EXPECT_EQ(made(3, te, fc1, "aten::matmul"),
            ShapeSet({{{3, b, F}, bf16}, {{3, b, F}, bf16}, {{2, b, F}, bf16}}));
  EXPECT_EQ(made(20, te, fc1, "aten::matmul").size(), 8u);
  EXPECT_TRUE(made(1, te, layer, "aten::cat").empty());
  EXPECT_EQ(made(2, te, layer, "aten::cat"), ShapeSet({{{s, b, h}, bf16}}));
  const std::string norm = "decoder.layers.0.pre_mlp_layernorm";
  const ShapeSet norms = made(2, te, norm, "");
  EXPECT_EQ(norms.count({{4, b, h}, bf16}), 2u);
  EXPECT_EQ(norms.count({{s, b, h}, bf16}), 0u);
  EXPECT_EQ(made(2, ProfileKind::kMegatronLocal, fc1, "aten::matmul"),
            ShapeSet({{{4, b, F}, bf16}, {{4, b, F}, bf16}}));
  auto kept = [&](int64_t chunks) {
    TrainingConfig t = Bf16WithoutDropout(s, b, AttentionKind::kFused);
    t.profile = te;
    t.mlp_chunks_for_training = chunks;
    return ActivationBytesAfterForward(m, t);
  };
  EXPECT_EQ(kept(2), kept(1));
  EXPECT_EQ(kept(0), kept(1));  // Megatron-Core chunks only above 1
  EXPECT_EQ(made(0, te, fc1, "aten::matmul"), ShapeSet({{{s, b, F}, bf16}}));
  TrainingConfig bad = Bf16WithoutDropout(s, b, AttentionKind::kFused);
  bad.mlp_chunks_for_training = 2;
  ModelConfig moe = TwoExperts(512);
  ASSERT_TRUE(FinalizeModelConfig(&moe).ok());
  EXPECT_NE(ValidateTrainingConfig(bad, moe).message().find("MoE layers"), std::string::npos);
}

// Megatron-Core's weighted squared ReLU (--use-fused-weighted-squared-relu,
// WeightedSquaredReLUFunction in fusions/fused_weighted_squared_relu.py) saves the fc1
// output and the probabilities and returns the weighted activation in the fc1 output's
// dtype. Without it TEGroupedMLP runs the compiled squared_relu (saves its input, returns a
// new [n, F]) and multiplies by the probabilities, a product that keeps the activation:
// one [n, F] bf16 more alive when the forward ends. Two experts, top-2, s = 64 tokens:
// n = 128 expert rows, F = 512, bf16 probabilities (the product is the weighted
// activation itself); with float32 probabilities the product is a float32 [n, F] that goes
// once its bf16 copy is made, so the same storages stay. SequentialMLP ignores the switch.
TEST(Moe, FusedWeightedSquaredReluKeepsItsInputAndTheProbabilitiesOnly) {
  const int64_t n = 128, F = 512;
  auto alive = [&](bool fused, bool grouped, bool fp32_router) {
    ModelConfig m = TwoExperts(F);
    m.activation = ActivationKind::kSquaredRelu;
    m.moe_router_fp32 = fp32_router;
    TrainingConfig t = GroupedExpertsTraining(n / 2);
    t.moe_grouped_gemm = grouped;
    t.bias_activation_fusion = false;
    t.fused_weighted_squared_relu = fused;
    return AliveInLayer0Experts(m, t);
  };
  const at::ScalarType bf16 = at::kBFloat16;
  for (bool fp32_router : {false, true}) {
    const ShapeSet fused = alive(true, true, fp32_router);
    EXPECT_EQ(fused, ShapeSet({{{n, F}, bf16}, {{n, F}, bf16}})) << fp32_router;
    EXPECT_EQ(Added(alive(false, true, fp32_router), fused), ShapeSet({{{n, F}, bf16}}))
        << fp32_router;
  }
  EXPECT_EQ(alive(true, false, false), alive(false, false, false));
}

// The op fuser takes squared ReLU only with the weighted kernel (_is_fused_impl_supported),
// and its ScaledSReLU saves what Megatron-Core's kernel saves. Megatron-Core takes the
// switch with fc1 biases (TEGroupedMLP adds them in its GEMM, so bias_parallel is None) and
// ignores it for other activations: SwiGLU experts keep the same bytes with it.
TEST(Moe, FusedWeightedSquaredReluRules) {
  ModelConfig m = TwoExperts(512);
  m.activation = ActivationKind::kSquaredRelu;
  ASSERT_TRUE(FinalizeModelConfig(&m).ok());
  TrainingConfig t = GroupedExpertsTraining(64);
  t.bias_activation_fusion = false;
  t.te_op_fuser = true;
  EXPECT_NE(ValidateTrainingConfig(t, m).message().find("--use-fused-weighted-squared-relu"),
            std::string::npos);
  t.fused_weighted_squared_relu = true;
  EXPECT_TRUE(ValidateTrainingConfig(t, m).ok());
  const int64_t op_fuser_bytes = ActivationBytesAfterForward(m, t);
  t.te_op_fuser = false;
  EXPECT_EQ(ActivationBytesAfterForward(m, t), op_fuser_bytes);
  ModelConfig biased = m;
  biased.add_bias_linear = true;
  ASSERT_TRUE(FinalizeModelConfig(&biased).ok());
  EXPECT_TRUE(ValidateTrainingConfig(t, biased).ok());
  ModelConfig swiglu = TwoExperts(512);
  ASSERT_TRUE(FinalizeModelConfig(&swiglu).ok());
  ASSERT_TRUE(ValidateTrainingConfig(t, swiglu).ok());
  const int64_t with_switch = ActivationBytesAfterForward(swiglu, t);
  t.fused_weighted_squared_relu = false;
  EXPECT_EQ(ActivationBytesAfterForward(swiglu, t), with_switch);
}

// fc2's bias on TEGroupedMLP (Note [MoE biases]): two experts, top-2, so each expert takes
// every one of the r = s*b tokens. _apply_bias runs per expert t + b * p, each a product
// and a sum [r, h] in the promoted dtype, then their concatenation [2r, h] and, where that
// dtype is wider than the output's, its bf16 copy. bf16 probabilities keep everything in
// bf16 (no copy); --moe-router-dtype fp32 promotes to float32.
TEST(Moe, GroupedExpertsAddFc2BiasPerExpert) {
  const int64_t r = 64, h = 256;
  auto added = [&](bool router_fp32) {
    auto experts = [&](bool bias) {
      return TwoExpertStepShapeSet(r, /*backward=*/false, "decoder.layers.0.mlp.experts",
                                   [=](ModelConfig* m, TrainingConfig*) {
                                     m->add_bias_linear = bias;
                                     m->moe_router_fp32 = router_fp32;
                                   });
    };
    return Added(experts(true), experts(false));
  };
  const at::ScalarType bf16 = at::kBFloat16, fp32 = at::kFloat;
  EXPECT_EQ(
      added(false),
      ShapeSet(
          {{{r, h}, bf16}, {{r, h}, bf16}, {{r, h}, bf16}, {{r, h}, bf16}, {{2 * r, h}, bf16}}));
  EXPECT_EQ(added(true), ShapeSet({{{r, h}, fp32},
                                   {{r, h}, fp32},
                                   {{r, h}, fp32},
                                   {{r, h}, fp32},
                                   {{2 * r, h}, fp32},
                                   {{2 * r, h}, bf16}}));
}

// Note [Deterministic index_add_]: under torch.use_deterministic_algorithms the unfused
// permutation's index_add_s sort. One MoE layer (allgather dispatcher, two experts, top-2:
// X = s*b = 64 tokens, n = 2X = 128 expert rows, h = 256): unpermute zeroes its [X, h]
// output a second time, and it and the permute's backward each copy their source [n, h]
// (source * alpha) and make int64 scalars max and min, the remainder, the linear index,
// sorted and original indices and the range [n], and cub's scratch [2n]. TE's fused
// permutation makes none of them.
TEST(Moe, DeterministicIndexAddSortsWithTemporaries) {
  const int64_t X = 64, h = 256, n = 2 * X;
  auto added = [&](bool fused) {
    auto step = [&](bool deterministic) {
      return TwoExpertStepShapeSet(X, /*backward=*/true, "", [=](ModelConfig*, TrainingConfig* t) {
        t->moe_permute_fusion = fused;
        t->deterministic_algorithms = deterministic;
      });
    };
    return Added(step(true), step(false));
  };
  const at::ScalarType bf16 = at::kBFloat16, i64 = at::kLong;
  ShapeSet sorted_index_add = {{{n, h}, bf16}, {{}, i64},  {{}, i64},  {{n}, i64},    {{n}, i64},
                               {{n}, i64},     {{n}, i64}, {{n}, i64}, {{2 * n}, i64}};
  ShapeSet expected = sorted_index_add;
  expected.insert(sorted_index_add.begin(), sorted_index_add.end());
  expected.insert({{X, h}, bf16});
  EXPECT_EQ(added(false), expected);
  EXPECT_EQ(added(true), ShapeSet());
}

// The same sort keeps the experts' output: autograd's IndexAddBackward0 saves index_add_'s
// whole source (its formula expand_as(source)s the gathered gradient), where scatter_add_
// keeps only the index. One MoE layer of T = 256 tokens, top-2 over 8 experts, h = 256, even
// routing on one rank: its [2T, h] bf16 output lives until the layer's backward, 4Th bytes.
TEST(Moe, DeterministicIndexAddKeepsTheExpertsOutput) {
  const int64_t T = 256, h = 256;
  auto per_layer = [&](bool deterministic) {
    auto bytes = [&](int64_t layers) {
      ModelConfig m = test::Llama(layers, h, 4, 4, 704, 1024);
      m.num_experts = 8;
      m.moe_router_topk = 2;
      m.moe_ffn_hidden_size = 512;
      EXPECT_TRUE(FinalizeModelConfig(&m).ok());
      TrainingConfig t;
      t.seq_length = T;
      t.precision = Precision::kBf16;
      t.profile = ProfileKind::kTransformerEngine;
      t.moe_grouped_gemm = true;
      t.deterministic_algorithms = deterministic;
      EXPECT_TRUE(ValidateTrainingConfig(t, m).ok());
      return ActivationBytesAfterForward(m, t);
    };
    return bytes(2) - bytes(1);
  };
  EXPECT_EQ(per_layer(true) - per_layer(false), 2 * (2 * T) * h);
}

// A one-layer MoE GPT (T = 256 tokens, H = 256, 4 experts of F_e = 512, top-2, shared experts
// of F_s = 512, GeLU, no biases, bf16, Transformer Engine's layers) on tp = 2, and what the
// shared experts' module left alive when the forward ends: storages of `category`, or with
// `any_category` those of the forward of any category (a kept reduce-scatter output counts
// as communication).
constexpr int64_t kSharedTokens = 256, kSharedHidden = 256, kSharedFfn = 512, kSharedTp = 2;
ModelConfig SharedExpertsModel(bool gate) {
  ModelConfig m = test::Gpt(1, kSharedHidden, 4);
  m.num_experts = 4;
  m.moe_router_topk = 2;
  m.moe_ffn_hidden_size = 512;
  m.moe_shared_expert_size = kSharedFfn;
  m.moe_shared_expert_gate = gate;
  m.add_bias_linear = false;
  EXPECT_TRUE(FinalizeModelConfig(&m, kSharedTp).ok());
  return m;
}
int64_t SharedExpertsBytesAfterForward(bool gate, bool sequence_parallel, bool any_category) {
  const ModelConfig m = SharedExpertsModel(gate);
  TrainingConfig t;
  t.seq_length = kSharedTokens;
  t.precision = Precision::kBf16;
  t.profile = ProfileKind::kTransformerEngine;
  t.dropout = false;
  EXPECT_TRUE(ValidateTrainingConfig(t, m).ok());
  return RunStep(m, t, TensorParallelShard(m, kSharedTp, sequence_parallel), /*backward=*/false,
                 [any_category](const Recorder& r) {
                   int64_t bytes = 0;
                   for (const StorageInfo& s : r.storages()) {
                     const bool counted = any_category ? s.phase == Phase::kForward
                                                       : s.category == Category::kActivation;
                     if (s.free_event < 0 && counted &&
                         r.names().Name(s.module).find("shared_experts") != std::string::npos) {
                       bytes += s.size_bytes;
                     }
                   }
                   return bytes;
                 });
}

// SharedExpertMLP is an MLP over the attention tp group: with sequence parallelism fc1
// gathers the whole sequence (keeping only the [T/tp, H] shard, the router's input anyway)
// and fc2's output is reduce-scattered, so what the shared experts keep after the forward is
// the whole sequence's fc1 output and activation, [T, F_s/tp] 16-bit each, 4 T F_s/tp bytes,
// with or without sequence parallelism.
TEST(Moe, SharedExpertsGatherTheSequence) {
  const int64_t expected = 4 * kSharedTokens * kSharedFfn / kSharedTp;
  EXPECT_EQ(SharedExpertsBytesAfterForward(false, false, false), expected);
  EXPECT_EQ(SharedExpertsBytesAfterForward(false, true, false), expected);
}

// Megatron's own ColumnParallelLinear, the output layer under any spec, gathers its
// sequence-parallel input into the global "mpu" buffer (get_global_memory_buffer), which
// persists: after a step with Transformer Engine's layers a [S, B, H] 16-bit buffer stays.
// S = 128, B = 2, H = 256, tp = 2.
TEST(Activations, OutputLayerGathersIntoThePersistentMpuBuffer) {
  const int64_t S = 128, B = 2, H = 256, tp = 2;
  auto buffer_bytes = [&](bool sequence_parallel) {
    ModelConfig m = test::Gpt(1, H, 4);
    EXPECT_TRUE(FinalizeModelConfig(&m, tp).ok());
    TrainingConfig t = Bf16WithoutDropout(S, B, AttentionKind::kFused);
    t.profile = ProfileKind::kTransformerEngine;
    return RunStep(
        m, t, TensorParallelShard(m, tp, sequence_parallel), /*backward=*/true,
        [](const Recorder& r) {
          int64_t bytes = 0;
          for (const StorageInfo& s : r.storages()) {
            if (s.free_event < 0 && r.names().Name(s.module) == "mpu.global_memory_buffer") {
              bytes += s.size_bytes;
            }
          }
          return bytes;
        });
  };
  EXPECT_EQ(buffer_bytes(true), 2 * S * B * H);
  EXPECT_EQ(buffer_bytes(false), 0);
}

// Note [MoE routing]: what one MoE layer's router keeps, against the default (softmax of the
// top-K logits, which keeps the indices int64 [T, K] and the float32 softmax [T, K]). T = 256
// tokens, E = 8 experts, K = 2, float32 router (no dtype copies):
//   --moe-router-pre-softmax: the softmax over every expert, float32 [T, E], instead of the
//     K-wide one: 4TE - 4TK;
//   sigmoid: the sigmoid [T, E], and the renormalisation's [T, 1] sum (its chosen scores
//     [T, K] take the softmax's place): 4TE + 4T, the same with the expert bias (which
//     only chooses; its buffers are not activations);
//   Sinkhorn: the float32 softmax [T, E] and the map bool [T, E] (kept by their product),
//     no indices, no K-wide softmax: 5TE - 12TK;
//   TE's fused kernel: a float32 [T, E] and the map: 5TE - 12TK.
int64_t RouterLayerBytes(const std::function<void(ModelConfig*, TrainingConfig*)>& configure) {
  TrainingConfig t;
  t.seq_length = 256;
  t.precision = Precision::kBf16;
  t.profile = ProfileKind::kTransformerEngine;
  t.moe_grouped_gemm = true;
  auto bytes = [&](int64_t layers) {
    ModelConfig m = test::Llama(layers, 256, 4, 4, 704, 1024);
    m.num_experts = 8;
    m.moe_router_topk = 2;
    m.moe_ffn_hidden_size = 512;
    m.moe_router_fp32 = true;
    TrainingConfig run = t;
    configure(&m, &run);
    EXPECT_TRUE(FinalizeModelConfig(&m).ok());
    EXPECT_TRUE(ValidateTrainingConfig(run, m).ok());
    return ActivationBytesAfterForward(m, run);
  };
  return bytes(2) - bytes(1);
}

TEST(Moe, RouterKeepsWhatItsScoreFunctionSaves) {
  const int64_t T = 256, E = 8, K = 2;
  const int64_t softmax = RouterLayerBytes([](ModelConfig*, TrainingConfig*) {});
  auto delta = [&](const std::function<void(ModelConfig*, TrainingConfig*)>& configure) {
    return RouterLayerBytes(configure) - softmax;
  };
  EXPECT_EQ(delta([](ModelConfig* m, TrainingConfig*) { m->moe_router_pre_softmax = true; }),
            4 * T * E - 4 * T * K);
  EXPECT_EQ(delta([](ModelConfig* m, TrainingConfig*) {
              m->moe_router_score_function = MoeScoreFunction::kSigmoid;
            }),
            4 * T * E + 4 * T);
  EXPECT_EQ(delta([](ModelConfig* m, TrainingConfig*) {
              m->moe_router_score_function = MoeScoreFunction::kSigmoid;
              m->moe_router_expert_bias = true;
              m->moe_router_topk_scaling_factor = 2.5;
            }),
            4 * T * E + 4 * T);
  EXPECT_EQ(delta([](ModelConfig* m, TrainingConfig*) { m->moe_router_sinkhorn = true; }),
            5 * T * E - 12 * T * K);
  EXPECT_EQ(delta([](ModelConfig*, TrainingConfig* t) { t->moe_router_fusion = true; }),
            5 * T * E - 12 * T * K);
}

// The router's benchmarking knobs (TopKRouter.forward, moe_utils.py): the storages its
// forward allocates, as (bytes, persistent), layer 0 of a 2-layer MoE model, router in
// float32, T = 256 tokens, E = 8 experts. --moe-router-force-load-balancing adds the random
// logits' clone, float32 [T, E]; --moe-router-force-biased adds a clone of its own, the
// bias [E] and logits + bias, a new [T, E]; with a negative STD the bias is the layer's
// cached one, kept. Nothing more stays after the forward: RandomSTE and RandomSTEShared save
// nothing. (The input jitter, below, does keep its noise and its product.)
TEST(Moe, ForcedRoutingClonesTheLogitsAndAddsASharedBias) {
  const int64_t T = 256, E = 8;
  using Allocations = std::multiset<std::pair<int64_t, bool>>;
  auto router_allocations = [](const std::function<void(ModelConfig*)>& configure) {
    ModelConfig m = test::Llama(2, 256, 4, 4, 704, 1024);
    m.num_experts = 8;
    m.moe_router_topk = 2;
    m.moe_ffn_hidden_size = 512;
    m.moe_router_fp32 = true;
    configure(&m);
    EXPECT_TRUE(FinalizeModelConfig(&m).ok());
    TrainingConfig t;
    t.seq_length = 256;
    t.precision = Precision::kBf16;
    t.profile = ProfileKind::kTransformerEngine;
    t.moe_grouped_gemm = true;
    return RunStep(m, t, ModelShard::Whole(m), /*backward=*/false, [](const Recorder& r) {
      Allocations out;
      for (const StorageInfo& info : r.storages()) {
        if (info.phase == Phase::kForward &&
            r.names().Name(info.module) == "decoder.layers.0.mlp.router") {
          out.insert({info.size_bytes, info.persistent});
        }
      }
      return out;
    });
  };
  auto added = [&](const std::function<void(ModelConfig*)>& configure) {
    const Allocations plain = router_allocations([](ModelConfig*) {});
    const Allocations forced = router_allocations(configure);
    Allocations extra;
    std::set_difference(forced.begin(), forced.end(), plain.begin(), plain.end(),
                        std::inserter(extra, extra.end()));
    EXPECT_EQ(forced.size(), plain.size() + extra.size());  // nothing went away
    return extra;
  };
  EXPECT_EQ(added([](ModelConfig* m) { m->moe_router_force_load_balancing = true; }),
            (Allocations{{4 * T * E, false}}));
  auto biased = [](double std) {
    return [std](ModelConfig* m) { m->moe_router_force_biased = std; };
  };
  EXPECT_EQ(added(biased(0.5)),
            (Allocations{{4 * T * E, false}, {4 * T * E, false}, {4 * E, false}}));
  EXPECT_EQ(added(biased(-0.5)),
            (Allocations{{4 * T * E, false}, {4 * T * E, false}, {4 * E, true}}));
  // Both: apply_biased_logits clones the already random logits again.
  EXPECT_EQ(
      added([](ModelConfig* m) {
        m->moe_router_force_load_balancing = true;
        m->moe_router_force_biased = 0.5;
      }),
      (Allocations{{4 * T * E, false}, {4 * T * E, false}, {4 * T * E, false}, {4 * E, false}}));
  const int64_t plain_after_forward = RouterLayerBytes([](ModelConfig*, TrainingConfig*) {});
  EXPECT_EQ(RouterLayerBytes([&](ModelConfig* m, TrainingConfig*) { biased(0.5)(m); }),
            plain_after_forward);

  // --moe-input-jitter-eps (apply_input_jitter, H = 256, bf16): rsample's rand, its scaled
  // copy and the noise, then the jittered input, [T, H] each; the noise (the product's
  // backward) and the jittered input (the gating GEMM's) stay after the forward, and the
  // router's own input, which only the gating GEMM kept, goes: one [T, H] more a layer.
  const int64_t H = 256;
  const auto jitter = [](ModelConfig* m) { m->moe_input_jitter_eps = 0.01; };
  EXPECT_EQ(added(jitter),
            (Allocations{
                {2 * T * H, false}, {2 * T * H, false}, {2 * T * H, false}, {2 * T * H, false}}));
  EXPECT_EQ(RouterLayerBytes([&](ModelConfig* m, TrainingConfig*) { jitter(m); }),
            plain_after_forward + 2 * T * H);
}

// The load-balancing loss (--moe-aux-loss-coeff) on top of the same router: its scores over
// every expert (the float32 softmax [T, E]; sigmoid: the sigmoid [T, E] and the [T, 1]
// normaliser), the tokens per expert int64 [E] its product keeps, the loss (float32 scalar)
// the probabilities carry; fused, a float32 [T, E], a float32 [2] and the counts.
TEST(Moe, AuxLossKeepsItsScores) {
  const int64_t T = 256, E = 8;
  auto with_aux = [](MoeScoreFunction score, bool fused) {
    return RouterLayerBytes([=](ModelConfig* m, TrainingConfig* t) {
             m->moe_router_score_function = score;
             m->moe_aux_loss_coeff = 0.01;
             t->moe_router_fusion = fused;
           }) -
           RouterLayerBytes([=](ModelConfig* m, TrainingConfig* t) {
             m->moe_router_score_function = score;
             t->moe_router_fusion = fused;
           });
  };
  EXPECT_EQ(with_aux(MoeScoreFunction::kSoftmax, false), 4 * T * E + 8 * E + 4);
  EXPECT_EQ(with_aux(MoeScoreFunction::kSigmoid, false), 4 * T * E + 4 * T + 8 * E + 4);
  EXPECT_EQ(with_aux(MoeScoreFunction::kSoftmax, true), 4 * T * E + 8 + 8 * E + 4);
}

// --distribute-saved-activations with TP 2 (no sequence parallelism): each checkpointed
// layer keeps half of its input, sbh bytes instead of 2sbh; the input's full storage goes
// (nothing else holds the previous layer's output).
TEST(Activations, DistributedSavedActivationsKeepATensorParallelShare) {
  for (const Shape& x : kShapes) {
    auto after_forward = [&](int64_t layers) {
      ModelConfig m = test::Gpt(layers, x.h, x.a);
      EXPECT_TRUE(FinalizeModelConfig(&m, 2).ok());
      TrainingConfig t = Fp16Eager(x);
      t.recompute = RecomputeKind::kFull;
      t.distribute_saved_activations = true;
      return ActivationBytesAfterForward(m, t, /*tp=*/2);
    };
    EXPECT_EQ(after_forward(2) - after_forward(1), x.s * x.b * x.h)
        << "s=" << x.s << " b=" << x.b << " h=" << x.h << " a=" << x.a;
  }
}

// Megatron's checkpoints save the batch's attention mask with their inputs (recompute.py's
// chunk_runner, attention.py's _checkpointed_attention_forward): with full recomputation or
// selective core attention the bool [B, 1, S, S] mask outlives the forward, which it
// otherwise ends with (Note [The batch on the GPU]). Eager attention, S = 64, B = 2.
TEST(Activations, CheckpointsKeepTheBatchsAttentionMask) {
  const int64_t S = 64, B = 2;
  auto mask_alive_after_forward = [&](RecomputeKind recompute) {
    ModelConfig m = test::Gpt(2, 256, 4, 1024);
    EXPECT_TRUE(FinalizeModelConfig(&m).ok());
    TrainingConfig t = Bf16WithoutDropout(S, B, AttentionKind::kEager);
    t.recompute = recompute;
    EXPECT_TRUE(ValidateTrainingConfig(t, m).ok());
    return RunStep(m, t, ModelShard::Whole(m), /*backward=*/false, [&](const Recorder& r) {
      ShapeSet alive;
      for (const StorageInfo& info : r.storages()) {
        if (info.free_event < 0 && info.dtype == at::kBool &&
            r.names().Name(info.module) == "batch")
          alive.emplace(r.ShapeOf(info).vec(), info.dtype);
      }
      return alive;
    });
  };
  const ShapeSet mask = {{{B, 1, S, S}, at::kBool}};
  EXPECT_EQ(mask_alive_after_forward(RecomputeKind::kFull), mask);
  EXPECT_EQ(mask_alive_after_forward(RecomputeKind::kSelective), mask);
  EXPECT_TRUE(mask_alive_after_forward(RecomputeKind::kNone).empty());
}

// Recompute modules (Note [Recompute modules] in transformer.h) on top of Korthikanti's
// selective 34sbh (core_attn), Megatron-Core local layers: layernorm discards both norms'
// outputs (2sbh each; the linears after them saved them) and nothing inside a norm is saved
// (its float32 statistics, 16sb): 30sbh. mlp also checkpoints the MLP from the norm's
// output, which drops fc1's and GeLU's outputs (8sbh each): 14sbh.
TEST(Activations, RecomputeModulesLayerNormAndMlp) {
  const uint32_t core_attn = RecomputeModuleBit(RecomputeModule::kCoreAttn);
  const uint32_t layernorm = RecomputeModuleBit(RecomputeModule::kLayerNorm);
  const uint32_t mlp = RecomputeModuleBit(RecomputeModule::kMlp);
  for (const Shape& x : kShapes) {
    TrainingConfig t = Fp16Eager(x);
    t.recompute = RecomputeKind::kSelective;
    t.recompute_modules = core_attn | layernorm;
    EXPECT_EQ(PerLayerActivationBytes(x, t), 30 * x.s * x.b * x.h)
        << "s=" << x.s << " b=" << x.b << " h=" << x.h << " a=" << x.a;
    t.recompute_modules = core_attn | layernorm | mlp;
    EXPECT_EQ(PerLayerActivationBytes(x, t), 14 * x.s * x.b * x.h)
        << "s=" << x.s << " b=" << x.b << " h=" << x.h << " a=" << x.a;
  }
}

// Transformer Engine fuses a dense layer's norms into linear_qkv and linear_fc1
// (input_layernorm and pre_mlp_layernorm are IdentityOp in its layer spec): layernorm
// changes nothing, and mlp checkpoints from the residual, so the pre-MLP norm's output
// (2sbh) and statistics (8sb) go with fc1's and GeLU's outputs: 16sbh + 8sb.
TEST(Activations, TransformerEngineFusesTheDenseNorms) {
  for (const Shape& x : kShapes) {
    TrainingConfig t = Fp16Eager(x);
    t.profile = ProfileKind::kTransformerEngine;
    t.recompute = RecomputeKind::kSelective;
    t.recompute_modules = RecomputeModuleBit(RecomputeModule::kCoreAttn) |
                          RecomputeModuleBit(RecomputeModule::kLayerNorm);
    EXPECT_EQ(PerLayerActivationBytes(x, t), 34 * x.s * x.b * x.h + 16 * x.s * x.b);
    t.recompute_modules =
        RecomputeModuleBit(RecomputeModule::kCoreAttn) | RecomputeModuleBit(RecomputeModule::kMlp);
    EXPECT_EQ(PerLayerActivationBytes(x, t), 16 * x.s * x.b * x.h + 8 * x.s * x.b)
        << "s=" << x.s << " b=" << x.b << " h=" << x.h << " a=" << x.a;
  }
}

// Fine-grained activation offloading (Note [Fine-grained activation offloading] in
// models/activation_offload.h) of core_attn and attn_proj takes what those regions saved off
// the device at their commits: eager attention's probabilities (2bas^2, one storage however
// many ops save it), the qkv projection's output that query, key and value view (6sbh) and
// the output projection's input (2sbh). --min-offloaded-tensor-size applies to each
// tensor's own elements: above sbh, query, key and value (views of sbh elements each) and
// the projection's input stay, and only the probabilities go.
TEST(Activations, OffloadingCoreAttentionAndProjection) {
  for (const Shape& x : kShapes) {
    TrainingConfig t = Bf16WithoutDropout(x.s, x.b, AttentionKind::kEager);
    t.profile = ProfileKind::kTransformerEngine;
    const int64_t kept = PerLayerActivationBytes(x, t);
    t.offload_modules =
        OffloadModuleBit(OffloadModule::kCoreAttn) | OffloadModuleBit(OffloadModule::kAttnProj);
    t.min_offloaded_tensor_elements = 0;
    EXPECT_EQ(kept - PerLayerActivationBytes(x, t), 2 * x.b * x.a * x.s * x.s + 8 * x.s * x.b * x.h)
        << "s=" << x.s << " b=" << x.b << " h=" << x.h << " a=" << x.a;
    t.min_offloaded_tensor_elements = x.s * x.b * x.h + 1;
    EXPECT_EQ(kept - PerLayerActivationBytes(x, t), 2 * x.b * x.a * x.s * x.s)
        << "s=" << x.s << " b=" << x.b << " h=" << x.h << " a=" << x.a;
  }
}

// mla_up_proj discards the query, key and value the up projections and RoPE make
// (2sb*A*(qk+rope) twice, 2sb*A*v; cuDNN attention saved them in place) and keeps the
// up projection's inputs: the compressed query and key-value, which the linears kept
// anyway, and the key's positional part, a view that holds the whole down projection
// output [s, b, R + rope] (2sb(R + rope)) as Megatron's save_for_backward does.
TEST(Activations, MlaUpProjectionRecompute) {
  const int64_t s = 64, b = 2, A = 4, q_lora = 64, R = 32, qk = 16, rope = 8, v = 16;
  auto per_layer = [&](uint32_t modules) {
    auto after_forward = [&](int64_t layers) {
      ModelConfig m = test::WithLatentAttention(test::Llama(layers, 256, A, A, 512, 1024), q_lora,
                                                R, qk, rope, v);
      EXPECT_TRUE(FinalizeModelConfig(&m).ok());
      TrainingConfig t = Bf16WithoutDropout(s, b, AttentionKind::kFused);
      t.profile = ProfileKind::kTransformerEngine;
      t.recompute = RecomputeKind::kSelective;
      t.recompute_modules = modules;
      return ActivationBytesAfterForward(m, t);
    };
    return after_forward(2) - after_forward(1);
  };
  const uint32_t core_attn = RecomputeModuleBit(RecomputeModule::kCoreAttn);
  const int64_t saved =
      per_layer(core_attn) - per_layer(core_attn | RecomputeModuleBit(RecomputeModule::kMlaUpProj));
  EXPECT_EQ(saved, 2 * s * b * A * (2 * (qk + rope) + v) - 2 * s * b * (R + rope));
}

// MLASelfAttention.forward keeps get_query_key_value_tensors' kv_compressed (a view of the
// kv down projection's output [s, b, R + rope] under Transformer Engine's spec) until it
// returns, after its output projection: that output outlives the core attention's and is
// gone when the forward ends.
TEST(Activations, MlaKeepsTheKvDownProjectionThroughAttention) {
  const int64_t s = 64, b = 2, A = 4, R = 32, rope = 8;
  ModelConfig m =
      test::WithLatentAttention(test::Llama(1, 256, A, A, 512, 1024), 64, R, 16, rope, 16);
  ASSERT_TRUE(FinalizeModelConfig(&m).ok());
  TrainingConfig t = Bf16WithoutDropout(s, b, AttentionKind::kFused);
  t.profile = ProfileKind::kTransformerEngine;
  ASSERT_TRUE(ValidateTrainingConfig(t, m).ok());
  struct Events {
    int64_t down_freed = -1, attention_done = -1, projection = -1;
  };
  const Events e = RunStep(m, t, ModelShard::Whole(m), /*backward=*/false, [&](const Recorder& r) {
    Events out;
    for (const StorageInfo& info : r.storages()) {
      const std::string& module = r.names().Name(info.module);
      if (module == "decoder.layers.0.self_attention.linear_kv_down_proj" &&
          r.ShapeOf(info).vec() == std::vector<int64_t>{s, b, R + rope}) {
        out.down_freed = info.free_event;
      }
      if (module == "decoder.layers.0.self_attention.core_attention") {
        out.attention_done = std::max(out.attention_done, info.alloc_event);
      }
      if (module == "decoder.layers.0.self_attention.linear_proj" &&
          info.phase == Phase::kForward && out.projection < 0) {
        out.projection = info.alloc_event;
      }
    }
    return out;
  });
  EXPECT_GT(e.down_freed, e.attention_done);
  EXPECT_GT(e.down_freed, e.projection);
  EXPECT_GE(e.attention_done, 0);
}

// Note [RoPE frequencies]: a Llama of L = 2 layers, head width D = 64, S = 64, B = 1, bf16.
// Alive when the forward ends, made in it: the chunk's cached frequencies [S, 1, 1, D] and
// inv_freq [D/2] (float32) on either path; --no-rope-fusion adds each layer's cos_ and
// sin_ for q and for k, four bf16 [S, 1, 1, D]. With context parallelism 2 the cache
// keeps this rank's half of the frequencies, [S/2, 1, 1, D]. (Storages are named by the
// shape the op made: cat's [S, D], index_select's [2, S/4, 1, 1, D].)
TEST(Activations, RopeKeepsItsFrequenciesAndUnfusedItsCosinesAndSines) {
  const int64_t L = 2, D = 64, S = 64;
  auto alive = [&](bool fused, int64_t cp, const std::string& module) {
    ModelConfig m = test::Llama(L, 256, 4, 4, 512, 1024);
    EXPECT_TRUE(FinalizeModelConfig(&m).ok());
    TrainingConfig t = Bf16WithoutDropout(S, 1, AttentionKind::kFlash);
    t.rope_fusion = fused;
    EXPECT_TRUE(ValidateTrainingConfig(t, m).ok());
    ModelShard shard = ModelShard::Whole(m);
    shard.cp = cp;
    return RunStep(m, t, shard, /*backward=*/false, [&module](const Recorder& r) {
      ShapeSet shapes;
      for (const StorageInfo& info : r.storages()) {
        if (info.phase == Phase::kForward && info.free_event < 0 &&
            r.names().Name(info.module).find(module) != std::string::npos) {
          shapes.emplace(r.ShapeOf(info).vec(), info.dtype);
        }
      }
      return shapes;
    });
  };
  const at::ScalarType f32 = at::kFloat, bf16 = at::kBFloat16;
  for (bool fused : {true, false}) {
    EXPECT_EQ(alive(fused, 1, "rotary_pos_emb"), ShapeSet({{{S, D}, f32}, {{D / 2}, f32}}));
  }
  EXPECT_EQ(alive(true, 2, "rotary_pos_emb"),
            ShapeSet({{{2, S / 4, 1, 1, D}, f32}, {{D / 2}, f32}}));
  ShapeSet cos_and_sin;
  for (int i = 0; i < 4 * L; ++i) cos_and_sin.emplace(std::vector<int64_t>{S, 1, 1, D}, bf16);
  EXPECT_EQ(Added(alive(false, 1, "decoder"), alive(true, 1, "decoder")), cos_and_sin);
  EXPECT_TRUE(Added(alive(true, 1, "decoder"), alive(false, 1, "decoder")).empty());
}

// Transformer Engine's op fuser runs the grouped experts' weighted SwiGLU as ScaledSwiGLU,
// which saves its input and the probabilities only, as Megatron-Core's own fused path
// (weighted_bias_swiglu_impl) does: both keep the same bytes after the forward, where
// memsim's former stand-in for the Megatron path kept the [N, F_e] 16-bit SwiGLU output
// too (N = S*B*K tokens routed on one rank).
TEST(Activations, OpFuserExpertsKeepWhatMegatronsWeightedSwigluKeeps) {
  const int64_t s = 64, b = 2, K = 2, F_e = 96, layers = 2;
  ModelConfig m = test::Llama(layers, 256, 8, 2, 512, 1024);
  m.num_experts = 4;
  m.moe_router_topk = K;
  m.moe_ffn_hidden_size = F_e;
  ASSERT_TRUE(FinalizeModelConfig(&m).ok());
  TrainingConfig t = Bf16WithoutDropout(s, b, AttentionKind::kFlash);
  t.moe_grouped_gemm = true;
  t.profile = ProfileKind::kTransformerEngine;
  ASSERT_TRUE(ValidateTrainingConfig(t, m).ok());
  const int64_t megatron_path = ActivationBytesAfterForward(m, t);
  t.te_op_fuser = true;
  ASSERT_TRUE(ValidateTrainingConfig(t, m).ok());
  EXPECT_EQ(ActivationBytesAfterForward(m, t), megatron_path);
  t.te_op_fuser = false;
  t.bias_activation_fusion = false;  // the unfused product keeps the SwiGLU output
  EXPECT_EQ(ActivationBytesAfterForward(m, t) - megatron_path, layers * 2 * s * b * K * F_e * 3);
}

// --use-te-activation-func: Transformer Engine's SwiGLU op saves its input only, as the fused
// kernels do, so a dense layer keeps what the fused path keeps. In the experts the op runs
// unweighted and the probabilities follow in an eager product, which keeps the op's
// [N, F_e] 16-bit output (N = s*b*K routed rows): 2*N*F_e a layer more than Megatron's
// weighted kernel, where the unfused eager path keeps 6*N*F_e more (the test above).
TEST(Activations, TransformerEngineActivationOpsKeepTheirInputs) {
  const int64_t s = 64, b = 2, K = 2, F_e = 96, layers = 2;
  TrainingConfig t = Bf16WithoutDropout(s, b, AttentionKind::kFlash);
  t.profile = ProfileKind::kTransformerEngine;
  auto bytes = [&](const ModelConfig& m, bool te_activation) {
    TrainingConfig run = t;
    run.bias_activation_fusion = !te_activation;
    run.te_activation_func = te_activation;
    EXPECT_TRUE(ValidateTrainingConfig(run, m).ok());
    return ActivationBytesAfterForward(m, run);
  };
  ModelConfig dense = test::Llama(layers, 256, 8, 2, 512, 1024);
  ASSERT_TRUE(FinalizeModelConfig(&dense).ok());
  EXPECT_EQ(bytes(dense, true), bytes(dense, false));
  // The eager SwiGLU beside it (mlp.py's glu: activation_func(x_glu) * (x_linear +
  // glu_linear_offset)) keeps both factors of its product, silu's [s, b, F] output and the
  // offset sum, a new [s, b, F] even for an offset of 0: 4sbF more.
  TrainingConfig eager = t;
  eager.bias_activation_fusion = false;
  EXPECT_EQ(ActivationBytesAfterForward(dense, eager) - bytes(dense, true),
            layers * 4 * s * b * 512);
  ModelConfig moe = dense;
  moe.num_experts = 4;
  moe.moe_router_topk = K;
  moe.moe_ffn_hidden_size = F_e;
  ASSERT_TRUE(FinalizeModelConfig(&moe).ok());
  t.moe_grouped_gemm = true;
  EXPECT_EQ(bytes(moe, true) - bytes(moe, false), layers * 2 * s * b * K * F_e);
  // What Megatron-Core refuses: the fusion on as well, the local spec, squared ReLU.
  TrainingConfig both = t;
  both.te_activation_func = true;
  EXPECT_FALSE(ValidateTrainingConfig(both, dense).ok());
  both.bias_activation_fusion = false;
  both.profile = ProfileKind::kMegatronLocal;
  EXPECT_FALSE(ValidateTrainingConfig(both, dense).ok());
  ModelConfig gelu = test::Gpt(layers, 256, 8, 1024);  // the local spec's own GeLU
  ASSERT_TRUE(FinalizeModelConfig(&gelu).ok());
  EXPECT_TRUE(ValidateTrainingConfig(both, gelu).ok());
  both.profile = ProfileKind::kTransformerEngine;
  ModelConfig relu2 = dense;
  relu2.activation = ActivationKind::kSquaredRelu;
  ASSERT_TRUE(FinalizeModelConfig(&relu2).ok());
  EXPECT_FALSE(ValidateTrainingConfig(both, relu2).ok());
}

// FlashAttention keeps no s^2 tensor. Per layer it saves (16-bit): LayerNorm input and
// output 4sbh; contiguous q, k, v 6sbh; the kernel output 2sbh, float32 log-sum-exp
// 4*a*s*b and an int64[2] RNG state; the projection input 2sbh; two dropout masks 2sbh;
// the MLP 20sbh (LayerNorm input and output, fc1 and GeLU outputs): 36sbh + 4asb + 16,
// plus the LayerNorm statistics 16sb. With b = 1 the rearrange of the output back to
// [s, b, h] is already contiguous, so the projection saves the kernel's own output: 34sbh.
TEST(Activations, FlashAttentionSavesNoQuadraticTensor) {
  for (const Shape& x : kShapes) {
    TrainingConfig t = Fp16Eager(x);
    t.attention = AttentionKind::kFlash;
    const int64_t sbh_factor = x.b > 1 ? 36 : 34;
    EXPECT_EQ(PerLayerActivationBytes(x, t),
              sbh_factor * x.s * x.b * x.h + 4 * x.a * x.s * x.b + 16 + 16 * x.s * x.b)
        << "s=" << x.s << " b=" << x.b << " h=" << x.h << " a=" << x.a;
  }
}

// Without dropout the three masks and the attention-dropout output disappear:
// 34sbh - 2sbh (masks) and 5as^2b - 3as^2b.
TEST(Activations, DropoutOffDropsMasks) {
  const Shape x = kShapes[0];
  TrainingConfig t = Fp16Eager(x);
  t.dropout = false;
  EXPECT_EQ(PerLayerActivationBytes(x, t),
            32 * x.s * x.b * x.h + 2 * x.a * x.s * x.s * x.b + 16 * x.s * x.b);
}

// The Llama table of transformer.h (bf16, flash attention, no dropout, no recomputation,
// tp = 1): per layer SB(8H + 8 + 6H + 4GD + 4A + 6F) + 16 (FlashAttention-2's int64[2]
// RNG state, returned with or without dropout), measured as the difference between an
// L = 2 and an L = 1 model.
TEST(Activations, LlamaFlashAttentionTable) {
  struct LlamaShape {
    int64_t s, b, h, a, g, f;
  };
  for (const LlamaShape& x : {LlamaShape{128, 2, 256, 8, 2, 688}, LlamaShape{64, 3, 128, 4, 4, 344},
                              LlamaShape{256, 2, 512, 16, 8, 1376}}) {
    auto after_forward = [&](int64_t layers) {
      ModelConfig m = test::Llama(layers, x.h, x.a, x.g, x.f, 1024);
      EXPECT_TRUE(FinalizeModelConfig(&m).ok());
      TrainingConfig t = Bf16WithoutDropout(x.s, x.b, AttentionKind::kFlash);
      return ActivationBytesAfterForward(m, t);
    };
    const int64_t d = x.h / x.a;
    EXPECT_EQ(after_forward(2) - after_forward(1),
              x.s * x.b * (8 * x.h + 8 + 6 * x.h + 4 * x.g * d + 4 * x.a + 6 * x.f) + 16)
        << "s=" << x.s << " b=" << x.b << " h=" << x.h << " a=" << x.a << " g=" << x.g;
  }
}

// Note [FP32 residual stream] (Llama, Transformer Engine, bf16, flash attention, no
// dropout): the norms keep 16-bit copies of the float32 stream, so a layer, and the whole
// model with its embedding and loss, keeps after forward what 16-bit training keeps; full
// recomputation's checkpoints keep their float32 inputs, 4SBH a layer where 16 bits keep 2SBH.
TEST(Activations, Fp32ResidualStreamKeeps16BitCopiesAndFloat32Checkpoints) {
  const int64_t S = 128, B = 2, H = 256, A = 8, G = 2, F = 688;
  auto after_forward = [&](int64_t layers, bool fp32_residual, RecomputeKind recompute) {
    ModelConfig m = test::Llama(layers, H, A, G, F, 1024);
    EXPECT_TRUE(FinalizeModelConfig(&m).ok());
    TrainingConfig t = Bf16WithoutDropout(S, B, AttentionKind::kFlash);
    t.profile = ProfileKind::kTransformerEngine;
    t.fp32_residual_connection = fp32_residual;
    t.recompute = recompute;
    return ActivationBytesAfterForward(m, t);
  };
  for (int64_t layers : {1, 2}) {
    EXPECT_EQ(after_forward(layers, true, RecomputeKind::kNone),
              after_forward(layers, false, RecomputeKind::kNone))
        << layers << " layers";
  }
  auto full_recompute_per_layer = [&](bool fp32_residual) {
    return after_forward(2, fp32_residual, RecomputeKind::kFull) -
           after_forward(1, fp32_residual, RecomputeKind::kFull);
  };
  EXPECT_EQ(full_recompute_per_layer(false), 2 * S * B * H);
  EXPECT_EQ(full_recompute_per_layer(true), 4 * S * B * H);
}

// Megatron-Core 0.20's LanguageModelEmbedding under sequence parallelism, TP 2, no dropout
// (what the forward left alive: a kept reduce-scatter output counts as communication).
// With learned positions the all-reduced [S, B, H] is scattered as a view of the whole,
// which Megatron clones (clone_scatter_output_in_embedding) so that the first layer keeps
// only this rank's 2SBH/2 bytes; without the clone the view keeps the whole 2SBH. With RoPE
// the word embeddings reduce-scatter straight to this rank's part, which the clone only
// replaces: SBH either way. Besides, the embedding keeps its shifted int64 indices (8BS)
// and the bool mask of the tokens outside this rank's vocabulary (BS).
TEST(Activations, SequenceParallelEmbeddingKeepsThisRanksPart) {
  const int64_t S = 128, B = 2, H = 256, tp = 2;
  auto embedding_bytes = [&](ModelConfig m, bool clone) {
    EXPECT_TRUE(FinalizeModelConfig(&m, tp).ok());
    TrainingConfig t = Bf16WithoutDropout(S, B, AttentionKind::kFlash);
    t.clone_scatter_output_in_embedding = clone;
    return RunStep(
        m, t, TensorParallelShard(m, tp, true), /*backward=*/false, [](const Recorder& r) {
          int64_t bytes = 0;
          ForEachLiveStorage(r, static_cast<int64_t>(r.events().size()) - 1, [&](int64_t id) {
            const StorageInfo s = r.storages()[static_cast<size_t>(id)];
            if (s.phase == Phase::kForward && r.names().Name(s.module).rfind("embedding", 0) == 0) {
              bytes += s.size_bytes;
            }
          });
          return bytes;
        });
  };
  const ModelConfig gpt = test::Gpt(1, H, 8, 1024);
  const ModelConfig llama = test::Llama(1, H, 8, 2, 688, 1024);
  EXPECT_EQ(embedding_bytes(gpt, true), S * B * H + 9 * B * S);
  EXPECT_EQ(embedding_bytes(gpt, false), 2 * S * B * H + 9 * B * S);
  EXPECT_EQ(embedding_bytes(llama, true), S * B * H + 9 * B * S);
  EXPECT_EQ(embedding_bytes(llama, false), S * B * H + 9 * B * S);
}

// Squared ReLU (--squared-relu, Nemotron): the Llama table above with its SwiGLU input
// 4SBF/t replaced by squared_relu's saved input, fc1's F-wide output, 2SBF/t; fc2 keeps the
// activation's output, 2SBF/t, as with SwiGLU: SB(8H + 8 + (6H + 4GD + 4A + 4F)/t) + 16.
TEST(Activations, SquaredReluKeepsItsInputAndOutput) {
  const int64_t S = 128, B = 2, H = 256, A = 8, G = 2, F = 1024, D = H / A;
  auto after_forward = [&](int64_t layers) {
    ModelConfig m = test::Llama(layers, H, A, G, F, 1024);
    m.activation = ActivationKind::kSquaredRelu;
    EXPECT_TRUE(FinalizeModelConfig(&m).ok());
    TrainingConfig t = Bf16WithoutDropout(S, B, AttentionKind::kFlash);
    return ActivationBytesAfterForward(m, t);
  };
  EXPECT_EQ(after_forward(2) - after_forward(1),
            S * B * (8 * H + 8 + 6 * H + 4 * G * D + 4 * A + 4 * F) + 16);
}

// The parameters of model `m` (finalized here) built whole with `profile`'s layers.
int64_t ParameterCount(ModelConfig m, ProfileKind profile = ProfileKind::kMegatronLocal) {
  EXPECT_TRUE(FinalizeModelConfig(&m).ok());
  Session session;
  ActiveSession active(session);
  TrainingConfig t;
  t.seq_length = m.max_position_embeddings > 0 ? m.max_position_embeddings : 2048;
  t.profile = profile;
  ParameterStore store(Precision::kBf16);
  TransformerModel model(m, t, ModelShard::Whole(m), &store);
  return store.num_elements();
}

// --moe-shared-expert-gate: SharedExpertMLP scales its output by sigmoid(x g^T). The
// product keeps the ungated output (after fc2's reduce-scatter or all-reduce: [T/tp, H] or
// [T, H] 16-bit) and the sigmoid's [T/tp, 1] or [T, 1] 16-bit result, beyond what
// Moe.SharedExpertsGatherTheSequence counts; the model gains g, (1, H) per MoE layer,
// unsharded (SharedExpertsModel's shape).
TEST(Moe, SharedExpertGateKeepsTheUngatedOutput) {
  const int64_t T = kSharedTokens, H = kSharedHidden, sp_tokens = T / kSharedTp;
  auto added = [](bool sequence_parallel) {
    return SharedExpertsBytesAfterForward(true, sequence_parallel, true) -
           SharedExpertsBytesAfterForward(false, sequence_parallel, true);
  };
  EXPECT_EQ(added(true), 2 * sp_tokens * H + 2 * sp_tokens);
  EXPECT_EQ(added(false), 2 * T * H + 2 * T);
  EXPECT_EQ(ParameterCount(SharedExpertsModel(true)) - ParameterCount(SharedExpertsModel(false)),
            H);
}

// --qk-l2-norm (Megatron-Core's L2Norm on each head's query and key, before RoPE): per layer
// it keeps the reshaped query it normalizes (a copy when G < A: 2SBAD), the key as the view
// of linear_qkv's output it is, which keeps that whole output, 2SB(A + 2G)D (without the
// norm fused attention keeps copies of the key and value instead, Note [Transformer Engine's
// qkv layout], and the output dies), and float32 rsqrt per head row, 4SB(A + G); the normed
// query and key replace the copies fused attention saved. Megatron-Core's local dense
// layers leave it out; with --qk-layernorm too it takes the norms' place, and they have no
// parameters.
TEST(Activations, QkL2NormKeepsItsInputsAndRsqrt) {
  const int64_t S = 128, B = 2, H = 256, A = 8, G = 2, F = 512, D = H / A;
  auto model = [&](int64_t layers, bool l2, bool layernorm) {
    ModelConfig m = test::Llama(layers, H, A, G, F, 1024);
    m.qk_l2_norm = l2;
    m.qk_layernorm = layernorm;
    EXPECT_TRUE(FinalizeModelConfig(&m).ok());
    return m;
  };
  auto per_layer = [&](bool l2, ProfileKind profile) {
    TrainingConfig t = Bf16WithoutDropout(S, B, AttentionKind::kFused);
    t.profile = profile;
    return ActivationBytesAfterForward(model(2, l2, false), t) -
           ActivationBytesAfterForward(model(1, l2, false), t);
  };
  EXPECT_EQ(per_layer(true, ProfileKind::kTransformerEngine) -
                per_layer(false, ProfileKind::kTransformerEngine),
            2 * S * B * A * D + 2 * S * B * (A + 2 * G) * D + 4 * S * B * (A + G));
  EXPECT_EQ(per_layer(true, ProfileKind::kMegatronLocal),
            per_layer(false, ProfileKind::kMegatronLocal));
  auto parameters = [&](bool l2, bool layernorm, ProfileKind profile) {
    return ParameterCount(model(2, l2, layernorm), profile);
  };
  const int64_t plain = parameters(false, false, ProfileKind::kTransformerEngine);
  EXPECT_EQ(parameters(true, true, ProfileKind::kTransformerEngine), plain);
  EXPECT_EQ(parameters(true, true, ProfileKind::kMegatronLocal), plain + 2 * 2 * D);  // q, k
}

// --qk-layernorm on Megatron-Core's local spec with RMSNorm: the norms are torch.nn.RMSNorm
// (WrappedTorchNorm, with Apex or without), which save their inputs as they come. Per layer
// the q norm keeps the reshaped query (a copy when G < A: 2SBAD) and float32 rstd per head
// row (4SBA); the k norm keeps the key, a view of linear_qkv's output, so that whole
// output, 2SB(A + 2G)D, and its rstd (4SBG). Without the norms nothing keeps that output
// (FlashAttention-2 makes its own contiguous q, k and v). Transformer Engine's and Apex's
// norms would keep a contiguous copy of the key instead, 2SBGD (an H200 run of
// Megatron-LM with the local spec kept the whole output: validation/fake_pg).
TEST(Activations, LocalQkRmsNormKeepsTheKeyAsAViewOfLinearQkvOutput) {
  const int64_t S = 128, B = 2, H = 256, A = 8, G = 2, F = 512, D = H / A;
  auto per_layer = [&](bool layernorm) {
    auto model = [&](int64_t layers) {
      ModelConfig m = test::Llama(layers, H, A, G, F, 1024);
      m.qk_layernorm = layernorm;
      EXPECT_TRUE(FinalizeModelConfig(&m).ok());
      return m;
    };
    TrainingConfig t = Bf16WithoutDropout(S, B, AttentionKind::kFlash);
    t.profile = ProfileKind::kMegatronLocal;
    return PerLayerActivationBytes(model, t);
  };
  EXPECT_EQ(per_layer(true) - per_layer(false),
            2 * S * B * A * D + 4 * S * B * A + 2 * S * B * (A + 2 * G) * D + 4 * S * B * G);
}

// --attention-output-gate (Attention._apply_output_gate): per layer the compiled gate keeps
// core attention's output, which linear_proj kept before, and the gate as
// get_query_key_value_tensors reshaped it; linear_proj keeps the gated output, a new 2SBAD.
// With G < A query groups (here 2 of 8) the reshape copies the gate: 2SBAD; with one group
// per head it is a view that keeps linear_qkv's whole output, [S, B, (2A + 2G)D] = 8SBAD,
// which FlashAttention-2's contiguous q, k and v let go before. linear_qkv gains A*D rows.
TEST(Activations, AttentionOutputGateKeepsTheGateAndTheGatedOutput) {
  const int64_t S = 128, B = 2, H = 256, A = 8, F = 512, D = H / A;
  auto model = [&](int64_t layers, int64_t groups, bool gate) {
    ModelConfig m = test::Llama(layers, H, A, groups, F, 1024);
    m.attention_output_gate = gate;
    EXPECT_TRUE(FinalizeModelConfig(&m).ok());
    return m;
  };
  auto per_layer = [&](int64_t groups, bool gate) {
    const TrainingConfig t = Bf16WithoutDropout(S, B, AttentionKind::kFlash);
    return ActivationBytesAfterForward(model(2, groups, gate), t) -
           ActivationBytesAfterForward(model(1, groups, gate), t);
  };
  EXPECT_EQ(per_layer(2, true) - per_layer(2, false), 2 * S * B * A * D + 2 * S * B * A * D);
  EXPECT_EQ(per_layer(A, true) - per_layer(A, false), 8 * S * B * A * D + 2 * S * B * A * D);
  EXPECT_EQ(ParameterCount(model(2, 2, true)) - ParameterCount(model(2, 2, false)), 2 * A * D * H);
  ModelConfig latent = model(1, A, true);
  latent.kv_lora_rank = 32;
  latent.qk_head_dim = 16;
  latent.qk_pos_emb_head_dim = 8;
  latent.v_head_dim = 16;
  EXPECT_FALSE(FinalizeModelConfig(&latent).ok());
}

// Note [Transformer Engine's unfused mask]: one GPT layer (S = 64, B = 2, 4 heads) under
// Transformer Engine's unfused attention, bf16, no dropout. Before the scores: two int32
// aranges [64], the int32 distance and window bounds [1, 1, 64, 64] (three), five bool
// [1, 1, 64, 64] (the comparisons, the negation, the conjunction, the window mask), then
// its logical_or with the batch's mask, bool [2, 1, 64, 64], which lives until the context's
// bmm is made and goes when attention returns. Without the batch's mask the window mask is
// the one kept. Megatron's own DotProductAttention makes none of them.
TEST(Activations, TransformerEngineUnfusedAttentionMakesItsMask) {
  constexpr int64_t S = 64, B = 2, heads = 4;
  struct Recorded {
    ShapeSet masks;  // the core attention's int32 and bool storages
    bool or_mask_spans_the_attention = false;
  };
  auto record = [&](ProfileKind profile, bool batch_mask) {
    ModelConfig m = test::Gpt(1, 64, heads);
    EXPECT_TRUE(FinalizeModelConfig(&m).ok());
    TrainingConfig t = Bf16WithoutDropout(S, B, AttentionKind::kEager);
    t.profile = profile;
    t.create_attention_mask = batch_mask;
    EXPECT_TRUE(ValidateTrainingConfig(t, m).ok());
    return RunStep(m, t, ModelShard::Whole(m), /*backward=*/false, [&](const Recorder& r) {
      Recorded out;
      int64_t scores = -1, context = -1;
      std::optional<StorageInfo> kept;
      for (const StorageInfo& info : r.storages()) {
        if (r.names().Name(info.module) != "decoder.layers.0.self_attention.core_attention") {
          continue;
        }
        const std::vector<int64_t> shape = r.ShapeOf(info).vec();
        if (info.dtype == at::kInt || info.dtype == at::kBool) out.masks.emplace(shape, info.dtype);
        if (shape == std::vector<int64_t>{B * heads, S, S} && scores < 0) scores = info.alloc_event;
        if (r.names().Name(info.op) == "aten::bmm") context = info.alloc_event;
        if (info.dtype == at::kBool) kept = info;  // the last mask made
      }
      out.or_mask_spans_the_attention = kept.has_value() && kept->alloc_event < scores &&
                                        kept->free_event > context && kept->free_event >= 0;
      return out;
    });
  };
  const ShapeSet window = {{{S}, at::kInt},           {{S}, at::kInt},
                           {{1, 1, S, S}, at::kInt},  {{1, 1, S, S}, at::kInt},
                           {{1, 1, S, S}, at::kInt},  {{1, 1, S, S}, at::kBool},
                           {{1, 1, S, S}, at::kBool}, {{1, 1, S, S}, at::kBool},
                           {{1, 1, S, S}, at::kBool}, {{1, 1, S, S}, at::kBool}};
  ShapeSet with_batch_mask = window;
  with_batch_mask.emplace(std::vector<int64_t>{B, 1, S, S}, at::kBool);
  const Recorded te = record(ProfileKind::kTransformerEngine, true);
  EXPECT_EQ(te.masks, with_batch_mask);
  EXPECT_TRUE(te.or_mask_spans_the_attention);
  const Recorded te_without = record(ProfileKind::kTransformerEngine, false);
  EXPECT_EQ(te_without.masks, window);
  EXPECT_TRUE(te_without.or_mask_spans_the_attention);
  EXPECT_TRUE(record(ProfileKind::kMegatronLocal, true).masks.empty());
}

// Note [Transformer Engine's qkv layout], GPT layers (learned positions: no RoPE) with cuDNN
// fused attention, bf16, no dropout: with one query per group (G = A) q, k and v are views
// at offsets 0, D, 2D of linear_qkv's output (sbh3d), which the kernel keeps whole, 6SBAD;
// with grouped queries (G < A) the reshaped query is a copy and Transformer Engine copies
// the key and value it cannot read in place, keeping 2SBAD + 4SBGD, and the output dies.
TEST(Activations, TransformerEngineCopiesKeysAndValuesItCannotRead) {
  const int64_t S = 64, B = 2, H = 256, A = 8, D = H / A;
  auto per_layer = [&](int64_t groups) {
    auto model = [&](int64_t layers) {
      ModelConfig m = test::Gpt(layers, H, A);
      m.num_query_groups = groups;
      EXPECT_TRUE(FinalizeModelConfig(&m).ok());
      return m;
    };
    TrainingConfig t = Bf16WithoutDropout(S, B, AttentionKind::kFused);
    t.profile = ProfileKind::kTransformerEngine;
    return PerLayerActivationBytes(model, t);
  };
  for (const int64_t G : {1, 2, 4}) {
    EXPECT_EQ(per_layer(A) - per_layer(G),
              6 * S * B * A * D - (2 * S * B * A * D + 4 * S * B * G * D))
        << G;
  }
}

// The gated activations without Megatron's fused kernel (mlp.py's glu(): the Llama table
// above, whose fused SwiGLU saves only its 4SBF input): the chunked halves are views of
// fc1's output, which the gate's activation (silu, or the compiled quick_gelu) keeps;
// the activated gate 2SBF and the linear half plus the offset 2SBF are saved by their
// product: 4SBF more per layer. With --activation-func-clamp-value the gate is clamped
// first: its 2SBF clamped copy is what the activation saves (the clamps keep fc1's output),
// 2SBF more; the clamped linear half goes once the offset is added.
TEST(Activations, EagerGatedActivationsKeepTheirIntermediates) {
  const int64_t S = 128, B = 2, H = 256, A = 8, G = 2, F = 512;
  auto per_layer = [&](ActivationKind kind, bool fused, double clamp) {
    auto after_forward = [&](int64_t layers) {
      ModelConfig m = test::Llama(layers, H, A, G, F, 1024);
      m.activation = kind;
      m.activation_clamp_value = clamp;
      EXPECT_TRUE(FinalizeModelConfig(&m).ok());
      TrainingConfig t = Bf16WithoutDropout(S, B, AttentionKind::kFlash);
      t.bias_activation_fusion = fused;
      return ActivationBytesAfterForward(m, t);
    };
    return after_forward(2) - after_forward(1);
  };
  const int64_t fused_swiglu = per_layer(ActivationKind::kSwiglu, true, 0);
  EXPECT_EQ(per_layer(ActivationKind::kSwiglu, false, 0) - fused_swiglu, 4 * S * B * F);
  EXPECT_EQ(per_layer(ActivationKind::kQuickGeglu, false, 0) - fused_swiglu, 4 * S * B * F);
  EXPECT_EQ(per_layer(ActivationKind::kQuickGeglu, false, 7.0) - fused_swiglu, 6 * S * B * F);
  // The fused quick-GeGLU kernel keeps its input alone, as SwiGLU's does.
  EXPECT_EQ(per_layer(ActivationKind::kQuickGeglu, true, 7.0), fused_swiglu);
  // GeGLU (fast_gelu) has no fused kernel: the eager glu() runs whatever the fusion says.
  EXPECT_EQ(per_layer(ActivationKind::kGeglu, true, 0) - fused_swiglu, 4 * S * B * F);
}

// Gemma-2 as Megatron-Bridge builds it (Note [Gemma-2] in transformer.h), each feature
// against the same Llama layer on Transformer Engine with cuDNN fused attention (bf16, no
// dropout, tp = 1, B > 1), worked out from Megatron-Bridge's modules:
//   post_projection_norms: linear_proj's and linear_fc2's outputs, kept by their post
//     norms, and each norm's float32 rsigma [S*B]: 2 * (2SBH + 4SB) a layer;
//   flex_attention: FlexAttention keeps q, k, v as they come (RoPE's q and k, the value a
//     view that keeps linear_qkv's whole output, 2SB(A + 2G)D), the output and the float32
//     log-sum-exp; the fused kernel keeps a copy of the value instead (2SBGD: Note
//     [Transformer Engine's qkv layout]) and an int64[2] RNG state: 2SB(A + G)D - 16 more;
//   megatron_bridge: get_batch puts no [B, 1, S, S] bool attention mask on the GPU: BS^2 less;
//   final logit soft-capping: tanh's output [S, B, V] 16-bit, 2SBV, kept until backward;
//   embedding scaling: a transient only, nothing more kept.
struct Gemma2Run {
  static constexpr int64_t S = 64, B = 2, H = 256, A = 8, G = 2, F = 512, V = 1024;
  // Activation bytes after the forward of an L-layer model configured by `configure`.
  static int64_t AfterForward(int64_t layers, const std::function<void(ModelConfig*)>& configure) {
    ModelConfig m = test::Llama(layers, H, A, G, F, V);
    configure(&m);
    EXPECT_TRUE(FinalizeModelConfig(&m).ok());
    TrainingConfig t = Bf16WithoutDropout(S, B, AttentionKind::kFused);
    t.profile = ProfileKind::kTransformerEngine;
    const Status valid = ValidateTrainingConfig(t, m);
    EXPECT_TRUE(valid.ok()) << valid.message();
    return ActivationBytesAfterForward(m, t);
  }
  static int64_t PerLayer(const std::function<void(ModelConfig*)>& configure) {
    return AfterForward(2, configure) - AfterForward(1, configure);
  }
  // Bytes get_batch puts on the GPU for a one-layer model's forward.
  static int64_t BatchBytes(const std::function<void(ModelConfig*)>& configure) {
    ModelConfig m = test::Llama(1, H, A, G, F, V);
    configure(&m);
    EXPECT_TRUE(FinalizeModelConfig(&m).ok());
    TrainingConfig t = Bf16WithoutDropout(S, B, AttentionKind::kFused);
    t.profile = ProfileKind::kTransformerEngine;
    return RunStep(m, t, ModelShard::Whole(m), /*backward=*/false, [](const Recorder& r) {
      int64_t bytes = 0;
      for (const StorageInfo& s : r.storages()) {
        if (r.names().Name(s.module) == "batch") bytes += s.size_bytes;
      }
      return bytes;
    });
  }
};

TEST(Activations, Gemma2PostNormsFlexAttentionAndSoftCaps) {
  using R = Gemma2Run;
  const auto llama = [](ModelConfig*) {};
  const int64_t te_layer = R::PerLayer(llama);
  EXPECT_EQ(R::PerLayer([](ModelConfig* m) { m->post_projection_norms = true; }) - te_layer,
            2 * (2 * R::S * R::B * R::H + 4 * R::S * R::B));
  const auto flex_attention = [](ModelConfig* m) { m->flex_attention = true; };
  EXPECT_EQ(R::PerLayer(flex_attention) - te_layer,
            2 * R::S * R::B * (R::A + R::G) * (R::H / R::A) - 16);
  EXPECT_EQ(R::BatchBytes(llama) - R::BatchBytes([](ModelConfig* m) { m->megatron_bridge = true; }),
            R::B * R::S * R::S);
  EXPECT_EQ(R::AfterForward(1, [](ModelConfig* m) { m->final_logit_softcap = 30; }) -
                R::AfterForward(1, llama),
            2 * R::S * R::B * R::V);
  EXPECT_EQ(R::AfterForward(1, [](ModelConfig* m) { m->scale_embeddings = true; }),
            R::AfterForward(1, llama));
}

// Note [The batch on the GPU], on tensor-parallel rank 0 (copied from the data loader, key by
// key in BATCH_KEYS order) of a stage with both embedding and loss, B = 2, S = 64, CP 2: the
// whole sequence's mask (B*S*S bool), labels (8BS), loss mask (4BS), positions, tokens; then,
// in GPTDataset's key order, a 16-byte index and this rank's share of each: tokens (4BS),
// labels, mask (B*S*S/2: this rank's queries, every key), loss mask (2BS), positions.
TEST(Allocations, BatchIsTheWholeSequenceThenTheContextParallelShare) {
  const int64_t B = 2, S = 64;
  auto batch_allocations = [](bool mask) {
    ModelConfig m = test::Llama(1, 128, 4, 4, 256, 1024);
    EXPECT_TRUE(FinalizeModelConfig(&m).ok());
    TrainingConfig t = Bf16WithoutDropout(S, B, AttentionKind::kFlash);
    t.create_attention_mask = mask;
    ModelShard shard = ModelShard::Whole(m);
    shard.cp = 2;
    return RunStep(m, t, shard, /*backward=*/false, [](const Recorder& r) {
      std::vector<int64_t> sizes;
      for (const StorageInfo& s : r.storages()) {
        if (r.names().Name(s.module) == "batch") sizes.push_back(s.size_bytes);
      }
      return sizes;
    });
  };
  EXPECT_EQ(
      batch_allocations(true),
      (std::vector<int64_t>{B * S * S, 8 * B * S, 4 * B * S, 8 * B * S, 8 * B * S, 16, 4 * B * S,
                            16, 4 * B * S, 16, B * S * S / 2, 16, 2 * B * S, 16, 4 * B * S}));
  EXPECT_EQ(batch_allocations(false),
            (std::vector<int64_t>{8 * B * S, 4 * B * S, 8 * B * S, 8 * B * S, 16, 4 * B * S, 16,
                                  4 * B * S, 16, 2 * B * S, 16, 4 * B * S}));
}

// What Megatron-Bridge's Gemma-2 cannot run, or memsim does not model, is refused.
TEST(TrainingConfig, Gemma2Refusals) {
  ModelConfig m = test::Llama(2, 256, 8, 2, 512, 1024);
  m.megatron_bridge = true;
  m.activation = ActivationKind::kGeglu;
  m.post_projection_norms = true;
  m.flex_attention = true;
  ASSERT_TRUE(FinalizeModelConfig(&m).ok());
  TrainingConfig t = Bf16WithoutDropout(64, 2, AttentionKind::kFused);
  EXPECT_EQ(ValidateTrainingConfig(t, m).message(),
            "Gemma's norms after the projections and Gemma-2's FlexAttention are "
            "Megatron-Bridge's Transformer Engine layer specs: use profile transformer_engine "
            "(memsim simulate: --profile transformer_engine)");
  t.profile = ProfileKind::kTransformerEngine;
  EXPECT_TRUE(ValidateTrainingConfig(t, m).ok());
  ModelConfig with_dropout = m;
  with_dropout.attention_dropout = 0.1;
  t.dropout = true;
  EXPECT_EQ(ValidateTrainingConfig(t, with_dropout).message(),
            "attention dropout with FlexAttention is not modelled (Megatron-Bridge's Gemma-2 "
            "attention then leaves FlexAttention for its unfused path); set attention_dropout to "
            "0 as Gemma-2 does");
  // Megatron-Bridge leaves the bias-activation fusion off; with Megatron-LM's default (on)
  // TransformerConfig refuses fast_gelu.
  ModelConfig megatron_lm = m;
  megatron_lm.megatron_bridge = false;
  EXPECT_EQ(ValidateTrainingConfig(t, megatron_lm).message(),
            "a fused GeGLU (fast_gelu) does not exist: Megatron-Core's TransformerConfig raises "
            "ValueError; turn the bias-activation fusion off");
  t.dropout = false;
  t.offload_modules = OffloadModuleBit(OffloadModule::kCoreAttn);
  EXPECT_EQ(ValidateTrainingConfig(t, m).message(),
            "fine-grained activation offloading with norms after the projections (Gemma) is not "
            "modelled");

  ModelConfig experts = test::Llama(2, 256, 8, 2, 512, 1024);
  experts.activation = ActivationKind::kGeglu;
  experts.num_experts = 4;
  EXPECT_EQ(FinalizeModelConfig(&experts).message(),
            "GeGLU (fast_gelu) is modelled in dense MLPs only (Gemma-2); Megatron-Core's experts "
            "fuse SwiGLU and quick-GeGLU");
  ModelConfig negative = test::Llama(2, 256, 8, 2, 512, 1024);
  negative.final_logit_softcap = -1;
  EXPECT_EQ(FinalizeModelConfig(&negative).message(),
            "final_logit_softcap must be positive and finite (0: none), got -1");

  RunSpec spec;
  spec.model = m;
  spec.training = Bf16WithoutDropout(64, 2, AttentionKind::kFused);
  spec.training.profile = ProfileKind::kTransformerEngine;
  spec.layout.world_size = 2;
  spec.layout.cp = 2;
  std::optional<ValidatedRun> run;
  EXPECT_EQ(FinalizeRunSpec(spec, &run).message(),
            "context parallelism with FlexAttention (Gemma-2) does not exist: Megatron-Bridge's "
            "Gemma2DotProductAttention raises ValueError for CP > 1");
}

// A learnable softmax offset (attention sinks) with Transformer Engine's fused attention:
// the kernel keeps the offsets' float32 [1, A, 1, 1] copy for backward, 4A bytes a layer.
TEST(Activations, AttentionSinksKeepTheirFloat32Offsets) {
  const int64_t S = 64, B = 2, H = 256, A = 8, G = 2, F = 512;
  auto per_layer = [&](SoftmaxKind softmax) {
    auto after_forward = [&](int64_t layers) {
      ModelConfig m = test::Llama(layers, H, A, G, F, 1024);
      m.softmax = softmax;
      EXPECT_TRUE(FinalizeModelConfig(&m).ok());
      TrainingConfig t = Bf16WithoutDropout(S, B, AttentionKind::kFused);
      t.profile = ProfileKind::kTransformerEngine;
      return ActivationBytesAfterForward(m, t);
    };
    return after_forward(2) - after_forward(1);
  };
  EXPECT_EQ(per_layer(SoftmaxKind::kLearnable) - per_layer(SoftmaxKind::kVanilla), 4 * A);
}

// Multi-token prediction (Note [Multi-token prediction] in transformer.h): what one more
// depth keeps for backward, measured as the difference between k = 2 and k = 1 depths
// (Llama, bf16, flash attention, no dropout, tp = 1, B > 1), worked out from
// Megatron-Core's MultiTokenPredictionLayer and process_mtp_loss:
// clang-format off
//   its rolled tokens (the embedding saves them as indices)      8SB
//   their embedding, enorm's input, and enorm's fp32 invvar      2SBH + 4SB
//   the previous depth's output (hnorm's input), its invvar      2SBH + 4SB
//   eh_proj's input, both normed inputs concatenated             4SBH
//   its decoder layer, as the Llama table above                  SB(14H + 8 + 4GD + 4A + 6F) + 16
//   final_layernorm's input and invvar                           2SBH + 4SB
//   one more [S, B, H] slice of the concatenated outputs         2SBH
//   its head's cross-entropy: fp32 softmax, int64 labels         4SBV + 8SB
//   its rolled loss mask (mask * loss saves it)                  4SB
//   the scaled loss AttachLoss keeps, and the divisor            4SB + 4
// clang-format on
TEST(Activations, MultiTokenPredictionDepth) {
  const int64_t S = 64, B = 2, H = 128, A = 4, G = 2, F = 344, V = 1024, D = H / A;
  auto after_forward = [&](int64_t depths) {
    ModelConfig m = test::Llama(1, H, A, G, F, V);
    m.mtp_num_layers = depths;
    EXPECT_TRUE(FinalizeModelConfig(&m).ok());
    TrainingConfig t = Bf16WithoutDropout(S, B, AttentionKind::kFlash);
    return ActivationBytesAfterForward(m, t);
  };
  const int64_t layer = S * B * (14 * H + 8 + 4 * G * D + 4 * A + 6 * F) + 16;
  EXPECT_EQ(after_forward(2) - after_forward(1),
            8 * S * B + (2 * S * B * H + 4 * S * B) * 2 + 4 * S * B * H + layer +
                (2 * S * B * H + 4 * S * B) + 2 * S * B * H + (4 * S * B * V + 8 * S * B) +
                4 * S * B + 4 * S * B + 4);
}

// --mtp-use-repeated-layer: one MTP layer (mtp.layers.0) runs at every depth. Each depth
// keeps what a layer of its own keeps; the parameters are one layer's: three separate
// layers hold two more, each with five RMSNorm weights (enorm, hnorm, final_layernorm and
// the decoder layer's two, 5H), eh_proj (H, 2H), linear_qkv ((A + 2G)D, H), linear_proj
// (H, AD), linear_fc1 (2F, H) and linear_fc2 (H, F).
TEST(Activations, RepeatedMultiTokenPredictionLayer) {
  const int64_t S = 64, B = 2, H = 128, A = 4, G = 2, F = 344, V = 1024, D = H / A;
  auto model = [&](bool repeated) {
    ModelConfig m = test::Llama(1, H, A, G, F, V);
    m.mtp_num_layers = 3;
    m.mtp_use_repeated_layer = repeated;
    return m;
  };
  auto after_forward = [&](bool repeated) {
    ModelConfig m = model(repeated);
    EXPECT_TRUE(FinalizeModelConfig(&m).ok());
    return ActivationBytesAfterForward(m, Bf16WithoutDropout(S, B, AttentionKind::kFlash));
  };
  EXPECT_EQ(after_forward(true), after_forward(false));
  const int64_t layer = 5 * H + 2 * H * H + (A + 2 * G) * D * H + H * A * D + 2 * F * H + H * F;
  EXPECT_EQ(ParameterCount(model(false)) - ParameterCount(model(true)), 2 * layer);
}

// --mtp-detach-heads (Llama, bf16, flash attention, no dropout, tp = 1, k = 2 depths): each
// depth's embedding is detached, so its graph, which saved the rolled tokens as indices
// (int64 [B, S], 8SB), goes at once: 16SB less after forward. After backward, while the
// graph lives, the block's detached input, a leaf that requires grad, holds the decoder's
// normed output (2SBH), which its hnorm no longer keeps, and its gradient (2SBH).
TEST(Activations, DetachedMultiTokenPredictionHeads) {
  const int64_t S = 64, B = 2, H = 128, A = 4, G = 2, F = 344, V = 1024;
  auto model = [&](bool detach) {
    ModelConfig m = test::Llama(1, H, A, G, F, V);
    m.mtp_num_layers = 2;
    m.mtp_detach_heads = detach;
    EXPECT_TRUE(FinalizeModelConfig(&m).ok());
    return m;
  };
  const TrainingConfig t = Bf16WithoutDropout(S, B, AttentionKind::kFlash);
  EXPECT_EQ(
      ActivationBytesAfterForward(model(false), t) - ActivationBytesAfterForward(model(true), t),
      16 * S * B);
  auto after_backward = [&](bool detach) {
    const ModelConfig m = model(detach);
    return RunStep(m, t, ModelShard::Whole(m), /*backward=*/true, [](const Recorder& r) {
      int64_t bytes = 0;
      ForEachLiveStorage(r, static_cast<int64_t>(r.events().size()) - 1, [&](int64_t id) {
        bytes += r.storages()[static_cast<size_t>(id)].size_bytes;
      });
      return bytes;
    });
  };
  EXPECT_EQ(after_backward(true) - after_backward(false), 4 * S * B * H);
}

// --mtp-hsm (Llama, bf16, flash attention, no dropout, tp = 1): the nth mixing (before depth
// n) keeps, until backward, the n older states rolled a token left (gather keeps its input,
// 2nSBH), gather's int64 indices and where's bool mask ([1, S, B, 1]: 8SB + SB). Two depths
// mix once, three twice.
TEST(Activations, MultiTokenPredictionHiddenStateMixing) {
  const int64_t S = 64, B = 2, H = 128, A = 4, G = 2, F = 344, V = 1024;
  auto after_forward = [&](int64_t depths, bool hsm) {
    ModelConfig m = test::Llama(1, H, A, G, F, V);
    m.mtp_num_layers = depths;
    m.mtp_hsm = hsm;
    EXPECT_TRUE(FinalizeModelConfig(&m).ok());
    return ActivationBytesAfterForward(m, Bf16WithoutDropout(S, B, AttentionKind::kFlash));
  };
  const int64_t per_mixing = 9 * S * B;
  EXPECT_EQ(after_forward(2, true) - after_forward(2, false), 2 * S * B * H + per_mixing);
  EXPECT_EQ(after_forward(3, true) - after_forward(3, false), 6 * S * B * H + 2 * per_mixing);
  ModelConfig one_depth = test::Llama(1, H, A, G, F, V);
  one_depth.mtp_num_layers = 1;
  one_depth.mtp_hsm = true;
  EXPECT_EQ(FinalizeModelConfig(&one_depth).message(),
            "MTP hidden-state mixing needs mtp_num_layers >= 2, got 1 (Megatron-Core raises "
            "ValueError)");
}

// The model state alive at the end of the first optimizer step (the optimizer's state
// exists by then) of a 2-layer GPT: h = 128, V = 1024, s = 64.
struct ModelStateRun {
  Session session;
  int64_t optimizer_begin = -1;  // first event of the optimizer phase
  int64_t step_end = -1;         // last event of the step
  int64_t state_bytes = 0;       // parameters, gradients and optimizer state at step_end
};

void RunModelState(Precision precision, OptimizerKind optimizer, ModelStateRun* run) {
  ModelConfig m = GptConfig({64, 1, 128, 4}, 2);
  TrainingConfig t;
  t.seq_length = 64;
  t.precision = precision;
  t.optimizer = optimizer;
  t.iterations = 1;
  {
    ActiveSession active(run->session);
    RunRankTraining(test::Validated(m, t), 0, run->session);
  }
  const Recorder& r = run->session.recorder();
  for (const Marker& mk : r.markers()) {
    if (mk.kind == MarkerKind::kIterationEnd) run->step_end = mk.event_index - 1;
    if (mk.kind == MarkerKind::kPhaseBegin && mk.phase == Phase::kOptimizer) {
      run->optimizer_begin = mk.event_index;
    }
  }
  run->state_bytes = test::ModelStateBytesAfter(r, run->step_end);
}

// Parameters of that model: V*h + s*h + L*(12h^2 + 13h) + 2h.
struct StateModel {
  static constexpr int64_t h = 128, V = 1024, s = 64, L = 2;
  static constexpr int64_t params = V * h + s * h + L * (12 * h * h + 13 * h) + 2 * h;
};

int64_t ModelStateBytesPerParameter(Precision precision) {
  ModelStateRun run;
  RunModelState(precision, OptimizerKind::kAdam, &run);
  EXPECT_EQ(run.state_bytes % StateModel::params, 0);
  return run.state_bytes / StateModel::params;
}

// Megatron-LM's distributed-optimizer documentation, non-distributed column.
TEST(ModelState, BytesPerParameter) {
  EXPECT_EQ(ModelStateBytesPerParameter(Precision::kFp32), 16);
  EXPECT_EQ(ModelStateBytesPerParameter(Precision::kBf16), 18);
  EXPECT_EQ(ModelStateBytesPerParameter(Precision::kFp16), 20);
}

// Note [Muon]: the 2-D weights other than the word embedding (position embedding, QKV,
// projection, fc1, fc2: s*h + L*12h^2) keep one fp32 momentum, 14 bytes per parameter in
// bf16; the rest (word embedding, norms, biases) Adam's 18. During the step the largest
// matrices (fc1 [4h, h] and fc2 [h, 4h]) take the most temporary memory: newton_schulz_tp
// gathers the momentum (a tensor-parallel weight, at TP 1 too) into a list of fp32 shards
// and concatenates them, normalizes the whole in fp32 and casts it to bf16, so the list,
// the whole, X in fp32 and X in bf16 are alive together: (4 + 4 + 4 + 2) * 4h * h bytes
// (the iterations' [h, h] products and their new X stay below it, as do the two scalings
// after the gathered copies are gone).
TEST(ModelState, MuonKeepsOneMomentumPerMatrix) {
  ModelStateRun run;
  RunModelState(Precision::kBf16, OptimizerKind::kMuon, &run);
  const int64_t muon_params =
      StateModel::s * StateModel::h + StateModel::L * 12 * StateModel::h * StateModel::h;
  EXPECT_EQ(run.state_bytes, 18 * (StateModel::params - muon_params) + 14 * muon_params);
  const Timeline timeline = Timeline::Replay(run.session.recorder());
  int64_t step_peak = 0;
  for (int64_t e = run.optimizer_begin; e <= run.step_end; ++e) {
    step_peak = std::max(step_peak, timeline.AllocatedAfter(e));
  }
  EXPECT_EQ(step_peak - timeline.AllocatedBefore(run.step_end + 1),
            (4 + 4 + 4 + 2) * 4 * StateModel::h * StateModel::h);
}

using test::Llama;
using test::WithLatentAttention;

TEST(ParameterCount, PublishedTotals) {
  // Hugging Face model cards' exact counts (the vocabularies are multiples of 128).
  EXPECT_EQ(ParameterCount(Llama(32, 4096, 32, 32, 11008, 32000)), 6738415616);   // Llama-2-7B
  EXPECT_EQ(ParameterCount(Llama(32, 4096, 32, 8, 14336, 128256)), 8030261248);   // Llama-3-8B
  EXPECT_EQ(ParameterCount(Llama(80, 8192, 64, 8, 28672, 128256)), 70553706496);  // Llama-3-70B
  // Phi-3-mini (Llama's shapes, fused projections): 3,821,079,552 (keras-hub's preset
  // metadata), with its 32064-token vocabulary padded to 32128 as Megatron pads it, in the
  // embedding and the untied output layer: 2 * 64 * 3072 more.
  EXPECT_EQ(ParameterCount(Llama(32, 3072, 32, 32, 8192, 32064)), 3821079552 + 2 * 64 * 3072);
  // Qwen3-32B ("32.8B"): head_dim 128 and q/k norms; per layer 2H (norms) + (A+2G)DH (qkv)
  // + HAD (proj) + 2D (q/k norms) + 3FH (SwiGLU MLP) = 487,598,336; x 64, + 2VH + H.
  ModelConfig qwen3 = Llama(64, 5120, 64, 8, 25600, 151936);
  qwen3.kv_channels = 128;
  qwen3.qk_layernorm = true;
  EXPECT_EQ(ParameterCount(qwen3), 64 * int64_t{487598336} + 2 * int64_t{151936} * 5120 + 5120);
  // GPT-3 175B (Brown et al. 2020): L=96, h=12288, a=96, vocabulary 50257 padded to
  // 50304, 2048 learned positions, tied: V*h + S*h + L*(12h^2 + 13h) + 2h.
  ModelConfig gpt3;
  gpt3.num_layers = 96;
  gpt3.hidden_size = 12288;
  gpt3.num_attention_heads = 96;
  gpt3.vocab_size = 50257;
  gpt3.max_position_embeddings = 2048;
  EXPECT_EQ(ParameterCount(gpt3), 174604836864);  // "175B"
}

// gpt-oss (OpenAI's model card: gpt-oss-20b 20.91B parameters, gpt-oss-120b 116.83B), from
// its config.json shapes: H 2880, 64 heads of 64 and 8 kv heads, E experts of F 2880, vocab
// 201088 (a multiple of 128), untied. Per layer: RMSNorms 2H; linear_qkv (64 + 16) * 64 * H
// and its bias 5120; the sinks 64; linear_proj 4096 * H and its bias H; router E*H + E;
// experts E * (2F*H + 2F + H*F + H): 26,555,904 + E * 24,894,721. 20b: 24 layers, 32
// experts: 823,186,976 a layer; 120b: 36 layers, 128 experts: 3,213,080,192 a layer; plus
// the untied embedding and output layer 2VH and the final norm H.
TEST(ParameterCount, GptOss) {
  auto gpt_oss = [](int64_t layers, int64_t experts) {
    ModelConfig m = Llama(layers, 2880, 64, 8, 2880, 201088);
    m.kv_channels = 64;
    m.activation = ActivationKind::kQuickGeglu;
    m.activation_clamp_value = 7.0;
    m.softmax = SoftmaxKind::kLearnable;
    m.add_bias_linear = m.add_qkv_bias = true;
    m.num_experts = experts;
    m.moe_router_topk = 4;
    m.moe_ffn_hidden_size = 2880;
    return m;
  };
  const int64_t embeddings = 2 * int64_t{201088} * 2880 + 2880;
  EXPECT_EQ(ParameterCount(gpt_oss(24, 32)), 24 * int64_t{823186976} + embeddings);
  EXPECT_EQ(ParameterCount(gpt_oss(24, 32)), int64_t{20914757184});
  EXPECT_EQ(ParameterCount(gpt_oss(36, 128)), 36 * int64_t{3213080192} + embeddings);
  EXPECT_EQ(ParameterCount(gpt_oss(36, 128)), int64_t{116829156672});
}

// Gemma's decoder (Note [Gemma-2] in transformer.h): heads of 256, GeGLU, tied embeddings,
// four norms a layer; `L` layers of width `H` with `A` heads, `G` KV heads, FFN `F`, vocab `V`.
ModelConfig Gemma(int64_t L, int64_t H, int64_t A, int64_t G, int64_t F, int64_t V) {
  ModelConfig m = Llama(L, H, A, G, F, V);
  m.megatron_bridge = true;
  m.kv_channels = 256;
  m.activation = ActivationKind::kGeglu;
  m.tie_embeddings = true;
  m.post_projection_norms = true;
  m.scale_embeddings = true;
  return m;
}

// Gemma-2-9B (HfConfig.Gemma2_9B): H = 3584, 16 heads and 8 KV heads, F = 14336,
// V = 256000. Per layer: linear_qkv (16 + 2 * 8) * 256 * H = 29,360,128, linear_proj
// 4096 * H = 14,680,064, fc1 2FH = 102,760,448, fc2 FH = 51,380,224, four norms 4H =
// 14,336 (input, post-attention, pre-FFN, post-FFN): 198,195,200; 42 of them, the embedding
// VH and the final norm H: 9,241,705,984, the model card's 9.24B and Hugging Face's count of
// the checkpoint. Gemma-3-1B (HfConfig.Gemma3_1B): H = 1152, 4 heads and 1 KV head,
// F = 6912, V = 262144, q/k norms. Per layer: linear_qkv (4 + 2) * 256 * H = 1,769,472,
// linear_proj 1024 * H = 1,179,648, the MLP 3FH = 23,887,872, four norms 4H and the q/k
// norms 2D: 26,842,112; 26 of them, the embedding and the final norm: 999,885,952 (the model
// card's 1B). FlexAttention and the soft caps add no parameters.
TEST(ParameterCount, Gemma) {
  ModelConfig gemma2 = Gemma(42, 3584, 16, 8, 14336, 256000);
  gemma2.flex_attention = true;
  gemma2.final_logit_softcap = 30;
  EXPECT_EQ(ParameterCount(gemma2, ProfileKind::kTransformerEngine),
            42 * int64_t{198195200} + int64_t{256000} * 3584 + 3584);
  EXPECT_EQ(ParameterCount(gemma2, ProfileKind::kTransformerEngine), int64_t{9241705984});
  ModelConfig gemma3 = Gemma(26, 1152, 4, 1, 6912, 262144);
  gemma3.qk_layernorm = true;
  EXPECT_EQ(ParameterCount(gemma3, ProfileKind::kTransformerEngine),
            26 * int64_t{26842112} + int64_t{262144} * 1152 + 1152);
  EXPECT_EQ(ParameterCount(gemma3, ProfileKind::kTransformerEngine), int64_t{999885952});
}

// GLM-4.5-Air (HfConfig.Glm45Air): H = 4096, 96 heads and 8 KV heads of D = 128, q/k/v
// biases, one dense layer (F = 10944), then 45 MoE layers of 128 experts (F_e = 1408) and a
// shared expert of the same width, V = 151552 untied. Per layer: attention
// 2*H*96D + 96D + 2*(H*8D + 8D) = 109,066,240 and two norms 2H; dense MLP 3*H*F =
// 134,479,872; MoE: router E*H, experts E*3*H*F_e, shared 3*H*F_e = 2,232,418,304 (the
// router's expert bias is a buffer). In all 106,852,245,504: the model card's 106B.
TEST(ParameterCount, Glm45Air) {
  ModelConfig m = Llama(46, 4096, 96, 8, 10944, 151552);
  m.kv_channels = 128;
  m.add_qkv_bias = true;
  m.num_experts = 128;
  m.moe_router_topk = 8;
  m.moe_ffn_hidden_size = 1408;
  m.moe_shared_expert_size = 1408;
  m.moe_first_k_dense_layers = 1;
  m.moe_router_score_function = MoeScoreFunction::kSigmoid;
  m.moe_router_expert_bias = true;
  const int64_t H = 4096, attention = 109066240 + 2 * H;
  EXPECT_EQ(ParameterCount(m),
            (attention + 134479872) + 45 * (attention + 2232418304) + 2 * int64_t{151552} * H + H);
  EXPECT_EQ(ParameterCount(m), int64_t{106852245504});
}

// --qk-layernorm adds a D-wide norm for the queries and one for the keys per layer:
// weight only for RMSNorm (Qwen3), weight and bias for LayerNorm.
TEST(ParameterCount, QkLayernormAddsTwoHeadWidthNormsPerLayer) {
  ModelConfig llama = Llama(3, 256, 8, 2, 512, 1024);  // D = 32
  const int64_t plain = ParameterCount(llama);
  llama.qk_layernorm = true;
  EXPECT_EQ(ParameterCount(llama) - plain, 3 * 2 * 32);
  ModelConfig gpt = test::Gpt(2, 128, 4);  // D = 32, LayerNorm
  const int64_t gpt_plain = ParameterCount(gpt);
  gpt.qk_layernorm = true;
  EXPECT_EQ(ParameterCount(gpt) - gpt_plain, 2 * 2 * 2 * 32);
}

// Multi-latent attention's projections (MLASelfAttention), worked by hand for a small
// model: H 256, A 4, q_lora 64, kv_lora 32, q/k heads 16 + 8, v heads 16, FFN 512, V 1024.
// Per layer: norms 2H = 512; q_down 64*256 = 16,384; q_layernorm 64; q_up 4*24*64 = 6,144;
// kv_down (32+8)*256 = 10,240; kv_layernorm 32; kv_up 4*(16+16)*32 = 4,096; proj
// 256*4*16 = 16,384; SwiGLU MLP 3*512*256 = 393,216: 447,072. Two layers, untied
// embeddings 2*1024*256 and the final norm 256.
TEST(ParameterCount, MultiLatentAttention) {
  const ModelConfig m = WithLatentAttention(Llama(2, 256, 4, 4, 512, 1024), 64, 32, 16, 8, 16);
  EXPECT_EQ(ParameterCount(m), 2 * 447072 + 2 * 1024 * 256 + 256);
  // DeepSeek-V3's attention: 187,107,328 parameters a layer (published shapes).
  const ModelConfig v3 =
      WithLatentAttention(Llama(1, 7168, 128, 128, 18432, 1024), 1536, 512, 128, 64, 128);
  const int64_t mlp_norms_embeddings =
      2 * 7168 + 3 * int64_t{18432} * 7168 + 2 * 1024 * 7168 + 7168;
  EXPECT_EQ(ParameterCount(v3) - mlp_norms_embeddings, 187107328);
}

// TransformerConfig's rules for recompute modules, checked when the run is finalized.
TEST(TrainingConfig, RecomputeModulesNeedTheirModules) {
  ModelConfig m = Llama(2, 256, 4, 4, 512, 1024);
  ASSERT_TRUE(FinalizeModelConfig(&m).ok());
  TrainingConfig t;
  t.recompute = RecomputeKind::kSelective;
  t.recompute_modules = RecomputeModuleBit(RecomputeModule::kMoeAct);
  EXPECT_EQ(ValidateTrainingConfig(t, m).message(),
            "recompute module moe_act needs the grouped GEMM experts (--moe-grouped-gemm), as "
            "Megatron-Core requires");
  t.moe_grouped_gemm = true;
  EXPECT_TRUE(ValidateTrainingConfig(t, m).ok());
  t.recompute_modules = RecomputeModuleBit(RecomputeModule::kMlaUpProj);
  EXPECT_EQ(ValidateTrainingConfig(t, m).message(),
            "recompute module mla_up_proj needs multi-latent attention (kv_lora_rank > 0)");
  t.recompute = RecomputeKind::kFull;  // the modules count only under selective
  EXPECT_TRUE(ValidateTrainingConfig(t, m).ok());
  t.recompute_modules = 1u << 20;
  EXPECT_EQ(ValidateTrainingConfig(t, m).message(),
            "recompute_modules has bits of no module: 1048576");
  // Transformer Engine's op fuser is modelled for all-MoE models with grouped SwiGLU (or
  // weighted squared-ReLU) experts.
  t = TrainingConfig();
  t.te_op_fuser = true;
  EXPECT_EQ(ValidateTrainingConfig(t, m).message(),
            "Transformer Engine's op fuser is modelled for MoE layers only, every layer, with "
            "grouped SwiGLU experts, or squared ReLU with the fused weighted kernel "
            "(--moe-grouped-gemm --swiglu or --squared-relu --use-fused-weighted-squared-relu, "
            "Transformer Engine layers); its fused dense MLP is not");
}

TEST(ModelConfig, RejectsImpossibleShapes) {
  ModelConfig m;
  m.hidden_size = 1000;
  m.num_attention_heads = 16;
  Status s = FinalizeModelConfig(&m);
  EXPECT_EQ(s.message(),
            "16 attention heads do not divide hidden size 1000; change one or set kv_channels");
  m = ModelConfig();
  m.num_query_groups = 5;
  EXPECT_EQ(FinalizeModelConfig(&m).message(),
            "5 query groups (kv heads) do not divide 16 attention heads");
  m = ModelConfig();
  m.num_experts = 8;
  m.moe_router_topk = 9;
  EXPECT_EQ(FinalizeModelConfig(&m).message(), "top-k 9 is larger than the 8 experts");
  m = ModelConfig();
  m.num_layers = 0;
  EXPECT_EQ(FinalizeModelConfig(&m).message(), "num_layers must be positive, got 0");
  m = ModelConfig();
  m.hidden_size = -4096;
  EXPECT_EQ(FinalizeModelConfig(&m).message(), "hidden_size must be positive, got -4096");
  m = ModelConfig();  // learned absolute positions
  m.mtp_num_layers = 1;
  EXPECT_EQ(FinalizeModelConfig(&m).message(),
            "multi-token prediction needs RoPE position embeddings (Megatron-LM asserts it); use "
            "--position-embedding-type rope or drop --mtp-num-layers");
  m.mtp_num_layers = -1;
  m.position = PositionKind::kRope;
  EXPECT_EQ(FinalizeModelConfig(&m).message(),
            "sizes must not be negative (query groups, kv channels, ffn, experts, MTP layers)");
  m = test::WithLatentAttention(ModelConfig(), 0, 64, 32, 16, 32);
  m.qk_l2_norm = true;
  EXPECT_EQ(FinalizeModelConfig(&m).message(),
            "qk_l2_norm is not supported with multi-latent attention (Megatron-Core refuses it)");
  m = ModelConfig();
  m.num_experts = 4;
  m.moe_capacity_factor = std::nan("");
  EXPECT_EQ(FinalizeModelConfig(&m).message(),
            "moe_capacity_factor must be in [0, 1e6] (0: dropless), got nan");
  m = ModelConfig();
  m.num_experts = 4;
  m.moe_imbalance_factor = 0.5;
  EXPECT_EQ(FinalizeModelConfig(&m).message(),
            "moe_imbalance_factor is the busiest expert's load over the mean: in [1, 1e6], got "
            "0.5");
  m = ModelConfig();
  m.num_experts = 4;
  m.moe_pad_to_capacity = true;
  EXPECT_EQ(FinalizeModelConfig(&m).message(),
            "padding expert inputs to capacity needs a capacity factor (Megatron-LM: "
            "--moe-pad-expert-input-to-capacity requires --moe-expert-capacity-factor)");
}

TEST(ModelConfig, PadsVocabularyLikeMegatron) {
  ModelConfig m;
  m.vocab_size = 50257;
  ASSERT_TRUE(FinalizeModelConfig(&m, /*tp=*/1).ok());
  EXPECT_EQ(m.padded_vocab_size, 50304);  // multiple of 128
  m.vocab_size = 50257;
  ASSERT_TRUE(FinalizeModelConfig(&m, /*tp=*/8).ok());
  EXPECT_EQ(m.padded_vocab_size, 51200);  // multiple of 1024
}

}  // namespace
}  // namespace memsim

namespace memsim {
namespace {

// Peak of exact requested bytes while the cross-entropy runs forward on bf16 logits
// [S, B, V] that need a gradient; then backward, reporting the gradient's dtype.
constexpr int64_t kS = 16, kB = 2, kV = 64;
using CrossEntropyFn = std::function<at::Tensor(const at::Tensor&, const at::Tensor&)>;
int64_t CrossEntropyForwardPeakBytes(const CrossEntropyFn& cross_entropy,
                                     at::ScalarType* grad_dtype) {
  Session session;
  {
    ActiveSession active(session);
    auto meta = at::TensorOptions().device(at::kMeta);
    at::Tensor logits = at::empty({kS, kB, kV}, meta.dtype(at::kBFloat16)).requires_grad_(true);
    at::Tensor labels = at::empty({kS, kB}, meta.dtype(at::kLong));
    at::Tensor loss = cross_entropy(logits, labels);
    session.BeginIteration(0);  // marks the end of the forward on the timeline
    loss.sum().backward();
    *grad_dtype = logits.grad().scalar_type();
  }
  // The exact bytes alive at their highest before the end of the forward.
  const Recorder& recorder = session.recorder();
  const int64_t forward_end = Timeline::Replay(recorder).iterations().front().begin_event;
  int64_t live = 0, peak = 0;
  for (int64_t e = 0; e < forward_end; ++e) {
    const MemoryEvent& event = recorder.events()[static_cast<size_t>(e)];
    const int64_t bytes = recorder.storages()[static_cast<size_t>(event.storage_id)].size_bytes;
    live += event.is_alloc ? bytes : -bytes;
    peak = std::max(peak, live);
  }
  return peak;
}

// Note [Output-discarding recomputation], on real CPU tensors: y = 3x is discarded once
// z = y * w has saved it, and recomputed into y's storage when z's gradient arrives, so
// dL/dw = y reads the recomputed values (3x) and dL/dx = 3w. The forward's y is freed at
// the discard (before the loss exists), the recomputation allocates anew in backward, and
// nothing but the two gradients outlives the graph.
TEST(CheckpointWithoutOutput, RecomputesIntoTheDiscardedStorageOnCpu) {
  InstallCpuTrackingAllocator();
  const at::Tensor x = at::arange(32, at::kFloat).view({4, 8}).requires_grad_();
  const at::Tensor w = (at::arange(32, at::kFloat).view({4, 8}) + 1).requires_grad_();
  Session session(nullptr, c10::DeviceType::CPU);
  int64_t y_id = -1;
  bool discarded_before_loss = false;
  {
    ActiveSession active(session);
    CheckpointWithoutOutput checkpoint;
    at::Tensor y = checkpoint.Run(
        [](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{in[0] * 3}; },
        {x})[0];
    y_id = TrackingAllocator::StorageIdOf(y.storage().data_ptr(), &session.recorder());
    at::Tensor z = y * w;
    checkpoint.DiscardOutputAndRegisterRecompute(z);
    EXPECT_EQ(y.storage().nbytes(), 0u);
    discarded_before_loss = !session.recorder().events().back().is_alloc &&
                            session.recorder().events().back().storage_id == y_id;
    at::Tensor loss = z.sum();
    loss.backward();
    EXPECT_EQ(y.storage().nbytes(), 128u);  // the recomputed y, shared
  }
  EXPECT_TRUE(at::equal(w.grad(), x.detach() * 3));
  EXPECT_TRUE(at::equal(x.grad(), w.detach() * 3));
  // The [4, 8] float tensors' events (CPU kernels also make small scalar buffers), each
  // storage named by the order it first appears: y, z, y freed by the discard; in
  // backward the recomputed y (3), dL/dw and dL/dy (4, 5), dL/dx (6); dL/dy goes with the
  // recomputed graph; z and the recomputed y when the test's y and z go, y holding the
  // recomputed memory through its storage.
  const Recorder& r = session.recorder();
  std::vector<std::pair<bool, int>> events;
  std::map<int64_t, int> order;
  int64_t live_bytes = 0;
  for (const MemoryEvent& e : r.events()) {
    const int64_t bytes = r.storages()[static_cast<size_t>(e.storage_id)].size_bytes;
    live_bytes += e.is_alloc ? bytes : -bytes;
    if (bytes != 128) continue;
    const int index = order.emplace(e.storage_id, static_cast<int>(order.size())).first->second;
    events.emplace_back(e.is_alloc, index);
  }
  const std::vector<std::pair<bool, int>> expected = {{true, 0},  {true, 1}, {false, 0}, {true, 2},
                                                      {true, 3},  {true, 4}, {true, 5},  {false, 4},
                                                      {false, 1}, {false, 2}};
  EXPECT_EQ(events, expected);
  EXPECT_EQ(order.begin()->first, y_id);
  EXPECT_EQ(discarded_before_loss, true);
  EXPECT_EQ(live_bytes, 2 * 128);  // x.grad and w.grad
}

// Unfused forward: logits bf16 (S*B*V*2 = 4096 B), int64 labels (S*B*8 = 256 B), the
// logits' float32 copy turned into the softmax in place (8192 B), and four [S, B] float32
// vectors (max, target logit, sum of exps, loss: 4 * 128 B). --cross-entropy-loss-fusion (native):
// each compiled in-place step holds one more float32 buffer of the logits' size while it runs, the
// last one with all of the above alive. Both hand back a bf16 gradient.
TEST(Activations, FusedCrossEntropyHoldsOneMoreFloat32Logits) {
  at::ScalarType unfused_dtype, fused_dtype;
  const auto vocab_parallel = [](bool fused) {
    return [fused](const at::Tensor& logits, const at::Tensor& labels) {
      return VocabCrossEntropy(logits, labels, /*tp_group=*/1, fused);
    };
  };
  const int64_t unfused = CrossEntropyForwardPeakBytes(vocab_parallel(false), &unfused_dtype);
  const int64_t fused = CrossEntropyForwardPeakBytes(vocab_parallel(true), &fused_dtype);
  EXPECT_EQ(unfused, kS * kB * kV * (2 + 4) + kS * kB * 8 + 4 * kS * kB * 4);
  EXPECT_EQ(fused - unfused, kS * kB * kV * 4);
  EXPECT_EQ(unfused_dtype, at::kBFloat16);
  EXPECT_EQ(fused_dtype, at::kBFloat16);
}

// Transformer Engine's kernel (--cross-entropy-fusion-impl te): logits bf16 and labels as
// above, float32 loss [S*B] and statistics [3*S*B] (16 B a row), the int64 count and its
// clamped copy (8 B each) and the float32 gradient computed in forward (4 B an element); no
// float32 copy of the logits. The gradient handed back is bf16.
TEST(Activations, TransformerEngineCrossEntropyKeepsOnlyTheGradient) {
  at::ScalarType dtype;
  const int64_t peak = CrossEntropyForwardPeakBytes(
      [](const at::Tensor& logits, const at::Tensor& labels) {
        return TeParallelCrossEntropy(logits, labels);
      },
      &dtype);
  EXPECT_EQ(peak, kS * kB * kV * (2 + 4) + kS * kB * 8 + kS * kB * 16 + 2 * 8);
  EXPECT_EQ(dtype, at::kBFloat16);
}

// Every storage one step of `m` under `t` allocates on an H100, as (phase, dtype, op,
// elements).
using StorageKey = std::tuple<Phase, at::ScalarType, std::string, int64_t>;
std::multiset<StorageKey> StepStorages(const ModelConfig& m, const TrainingConfig& t) {
  const std::unique_ptr<Session> session =
      test::RecordRank(test::Validated(m, t), 0, FindGpu("H100-80GB"));
  const Recorder& r = session->recorder();
  std::multiset<StorageKey> found;
  for (const StorageInfo& s : r.storages()) {
    const int64_t elements = s.dtype == at::ScalarType::Undefined
                                 ? 0
                                 : s.size_bytes / static_cast<int64_t>(c10::elementSize(s.dtype));
    found.emplace(s.phase, s.dtype, r.names().Name(s.op), elements);
  }
  return found;
}

// What `a` holds beyond `b`.
std::multiset<StorageKey> Beyond(const std::multiset<StorageKey>& a,
                                 const std::multiset<StorageKey>& b) {
  std::multiset<StorageKey> out;
  std::set_difference(a.begin(), a.end(), b.begin(), b.end(), std::inserter(out, out.end()));
  return out;
}

// --output-logit-dtype fp32 (Megatron's _linear_forward and LinearWithGradAccumulation...
// backward): the output layer writes float32 logits through Transformer Engine's
// general_gemm, which vocab_parallel_cross_entropy's .float() returns as they are, instead of
// bf16 logits and their float32 copy; backward casts the float32 gradient to bf16 in the
// linear, where by default autograd casts it after the cross-entropy. The logits-sized
// storages (S*B*V elements, no other tensor's count here) of one microbatch.
TEST(Activations, Float32LogitsSkipTheBf16Logits) {
  const int64_t S = 96, B = 2, V = 2048;
  ModelConfig m = test::Llama(1, 256, 8, 2, 512, V);
  ASSERT_TRUE(FinalizeModelConfig(&m).ok());
  bool fused = false;
  auto logits_storages = [&](std::optional<Precision> logit_dtype) {
    TrainingConfig t = Bf16WithoutDropout(S, B, AttentionKind::kFlash);
    t.iterations = 1;
    t.output_logit_dtype = logit_dtype;
    t.cross_entropy_fusion = fused;
    std::multiset<StorageKey> logits;
    for (const StorageKey& key : StepStorages(m, t)) {
      if (std::get<3>(key) == S * B * V) logits.insert(key);
    }
    return logits;
  };
  EXPECT_EQ(
      logits_storages(std::nullopt),
      (std::multiset<StorageKey>{{Phase::kForward, at::kBFloat16, "aten::matmul", S * B * V},
                                 {Phase::kForward, at::kFloat, "aten::to.dtype", S * B * V},
                                 {Phase::kBackward, at::kBFloat16, "aten::to.dtype", S * B * V}}));
  EXPECT_EQ(
      logits_storages(Precision::kFp32),
      (std::multiset<StorageKey>{{Phase::kForward, at::kFloat, "memsim::te_gemm", S * B * V},
                                 {Phase::kBackward, at::kBFloat16, "aten::to.dtype", S * B * V}}));
  EXPECT_EQ(logits_storages(Precision::kBf16), logits_storages(std::nullopt));
  // --cross-entropy-loss-fusion (native): calculate_gradients ends in a bf16 cast whatever the
  // logits' dtype, which autograd casts back to float32 for float32 logits, and the output
  // layer to bf16 again. Each compiled in-place step holds a float32 buffer besides (two in
  // forward, one in backward), as with bf16 logits.
  fused = true;
  EXPECT_EQ(
      logits_storages(Precision::kFp32),
      (std::multiset<StorageKey>{{Phase::kForward, at::kFloat, "memsim::te_gemm", S * B * V},
                                 {Phase::kForward, at::kFloat, "aten::empty_like", S * B * V},
                                 {Phase::kForward, at::kFloat, "aten::empty_like", S * B * V},
                                 {Phase::kBackward, at::kFloat, "aten::empty_like", S * B * V},
                                 {Phase::kBackward, at::kBFloat16, "aten::to.dtype", S * B * V},
                                 {Phase::kBackward, at::kFloat, "aten::to.dtype", S * B * V},
                                 {Phase::kBackward, at::kBFloat16, "aten::to.dtype", S * B * V}}));
}

// MuP (--use-mup): the embedding's [S, B, H] output times --mup-embedding-mult and the
// [S, B, V] logits times the output multiplier (1/width, width = H / --mup-base-hidden-size
// = 2 here) are new bf16 tensors in forward, and their products' gradients new ones in
// backward (MulBackward1 multiplies by the scalar as a wrapped tensor); nothing else changes. With
// both multipliers 1 nothing is made.
TEST(Activations, MupMultipliersMakeNewTensors) {
  const int64_t S = 96, B = 2, H = 256, V = 2048;
  auto storages = [&](bool mup, double embedding_mult, int64_t base_hidden_size) {
    ModelConfig m = test::Llama(1, H, 8, 2, 512, V);
    m.use_mup = mup;
    m.mup_embedding_mult = embedding_mult;
    m.mup_base_hidden_size = base_hidden_size;
    EXPECT_TRUE(FinalizeModelConfig(&m).ok());
    TrainingConfig t = Bf16WithoutDropout(S, B, AttentionKind::kFlash);
    t.iterations = 1;
    return StepStorages(m, t);
  };
  const std::multiset<StorageKey> plain = storages(false, 1.0, 0);
  const std::multiset<StorageKey> mup = storages(true, 2.0, H / 2);
  EXPECT_EQ(Beyond(mup, plain),
            (std::multiset<StorageKey>{
                {Phase::kForward, at::kBFloat16, "aten::mul.Scalar", S * B * H},
                {Phase::kForward, at::kBFloat16, "aten::mul.Scalar", S * B * V},
                {Phase::kBackward, at::kBFloat16, "aten::mul.Tensor", S * B * H},
                {Phase::kBackward, at::kBFloat16, "aten::mul.Tensor", S * B * V}}));
  EXPECT_TRUE(Beyond(plain, mup).empty());
  EXPECT_EQ(storages(true, 1.0, 0), plain);
}

// With MTP each depth's logits replace the previous depth's as the output layer returns
// (process_mtp_loss rebinds mtp_logits), so MuP's scaling holds two bf16 [S, B, V] at most
// (the raw logits and their scaled copy), never the previous depth's besides.
TEST(Activations, MupScalesEachMtpDepthAfterThePreviousLogitsGo) {
  const int64_t S = 96, B = 2, H = 256, V = 2048;
  ModelConfig m = test::Llama(1, H, 8, 2, 512, V);
  m.mtp_num_layers = 2;
  m.use_mup = true;
  m.mup_base_hidden_size = H / 2;
  ASSERT_TRUE(FinalizeModelConfig(&m).ok());
  TrainingConfig t = Bf16WithoutDropout(S, B, AttentionKind::kFlash);
  t.iterations = 1;
  const std::unique_ptr<Session> session =
      test::RecordRank(test::Validated(m, t), 0, FindGpu("H100-80GB"));
  const Recorder& r = session->recorder();
  std::vector<std::pair<int64_t, int>> changes;  // (event, +1 allocated / -1 freed)
  for (const StorageInfo& s : r.storages()) {
    if (s.phase != Phase::kForward || s.dtype != at::kBFloat16 || s.size_bytes != 2 * S * B * V) {
      continue;
    }
    changes.emplace_back(s.alloc_event, +1);
    if (s.free_event >= 0) changes.emplace_back(s.free_event, -1);
  }
  std::sort(changes.begin(), changes.end());
  int alive = 0, most = 0;
  for (const auto& [event, change] : changes) most = std::max(most, alive += change);
  EXPECT_EQ(most, 2);
  EXPECT_GE(changes.size(), 6u);  // three output layers' logits and three scaled copies
}

// --no-rope-freq 4 on 4 layers: the fourth runs no RoPE, so what differs from RoPE on every
// layer is that layer's fused RoPE outputs, a new query [S, B, A, D] and key [S, B, G, D]
// in forward, and their gradients in backward (FusedRoPEFunc saves nothing, so nothing
// else changes).
TEST(Activations, NoRopeLayersSkipTheRotaryEmbedding) {
  const int64_t S = 96, B = 2, H = 256, A = 8, G = 2, D = H / A;
  auto storages = [&](int64_t no_rope_freq) {
    ModelConfig m = test::Llama(4, H, A, G, 512, 1024);
    m.no_rope_freq = no_rope_freq;
    EXPECT_TRUE(FinalizeModelConfig(&m).ok());
    TrainingConfig t = Bf16WithoutDropout(S, B, AttentionKind::kFlash);
    t.iterations = 1;
    return StepStorages(m, t);
  };
  const std::multiset<StorageKey> every = storages(0), fourth = storages(4);
  EXPECT_EQ(Beyond(every, fourth),
            (std::multiset<StorageKey>{
                {Phase::kForward, at::kBFloat16, "aten::empty_like", S * B * A * D},
                {Phase::kForward, at::kBFloat16, "aten::empty_like", S * B * G * D},
                {Phase::kBackward, at::kBFloat16, "aten::empty_like", S * B * A * D},
                {Phase::kBackward, at::kBFloat16, "aten::empty_like", S * B * G * D}}));
  EXPECT_TRUE(Beyond(fourth, every).empty());
  ModelConfig uneven = test::Llama(4, H, A, G, 512, 1024);
  uneven.no_rope_freq = 3;
  EXPECT_FALSE(FinalizeModelConfig(&uneven).ok());
  // MTP layer j's attention reads entry j (its layer number is j + 1): with [1, 0, 0, 0] and
  // two MTP layers, decoder layer 0 and MTP depth 0 make no RoPE outputs.
  auto mtp_storages = [&](std::vector<int64_t> pattern) {
    ModelConfig m = test::Llama(4, H, A, G, 512, 1024);
    m.mtp_num_layers = 2;
    m.no_rope_layers = std::move(pattern);
    EXPECT_TRUE(FinalizeModelConfig(&m).ok());
    TrainingConfig t = Bf16WithoutDropout(S, B, AttentionKind::kFlash);
    t.iterations = 1;
    return StepStorages(m, t);
  };
  const std::multiset<StorageKey> one_layer = Beyond(every, fourth);
  std::multiset<StorageKey> two_layers = one_layer;
  two_layers.insert(one_layer.begin(), one_layer.end());
  const std::multiset<StorageKey> with_mtp = mtp_storages({0, 0, 0, 0});
  EXPECT_EQ(Beyond(with_mtp, mtp_storages({1, 0, 0, 0})), two_layers);
  EXPECT_EQ(Beyond(with_mtp, mtp_storages({0, 0, 1, 0})), one_layer);
}

// Note [All-to-all context parallelism]: on cp = 2 with --cp-comm-type a2a a layer keeps
// what attention on the whole sequence for half the heads keeps (the exchanged q, k, v, the
// output before its exchange back, the float32 statistics: the bytes attention on the local
// half of the sequence keeps for every head), and the exchanged-back output, which
// linear_proj keeps apart from attention's: 2sbh bytes a layer more than the same layer
// without CP on the local sequence s.
TEST(Activations, AllToAllContextParallelKeepsTheOutputTwice) {
  auto per_layer = [](const Shape& x, const TrainingConfig& t, int64_t cp) {
    auto bytes = [&](int64_t layers) {
      const ModelConfig m = GptConfig(x, layers);
      ModelShard shard = ModelShard::Whole(m);
      shard.cp = cp;
      return RunStep(m, t, shard, /*backward=*/false, [](const Recorder& r) {
        int64_t kept = 0;
        ForEachLiveStorage(r, static_cast<int64_t>(r.events().size()) - 1, [&](int64_t id) {
          const StorageInfo& s = r.storages()[static_cast<size_t>(id)];
          if (s.category == Category::kActivation) kept += s.size_bytes;
        });
        return kept;
      });
    };
    return bytes(2) - bytes(1);
  };
  for (const Shape& x : kShapes) {
    TrainingConfig local = Bf16WithoutDropout(x.s, x.b, AttentionKind::kFused);
    local.profile = ProfileKind::kTransformerEngine;
    TrainingConfig a2a = local;
    a2a.seq_length = 2 * x.s;
    a2a.cp_all_to_all = 2;
    EXPECT_EQ(per_layer(x, a2a, 2) - per_layer(x, local, 1), 2 * x.s * x.b * x.h)
        << "s=" << x.s << " b=" << x.b << " h=" << x.h << " a=" << x.a;
  }
}

// Note [All-gather context parallelism] on cp = 2: a Llama layer (A = 8 heads, G = 2 kv heads
// of D = 32, local sequence s = 64 of 128, b = 2; RoPE makes q and k contiguous, v is a view
// of linear_qkv's output, so the function's contiguous copy of v is its own), X_kv = s*b*G*D
// and X_q = s*b*A*D elements in bf16. During the forward core attention holds v's copy,
// k and v gathered and reordered (2 X_kv each; the raw gathers gone), the output and its
// zeroed thd twin (X_q each), and per chunk (h = s/2 rows) an output X_q/2, float32
// statistics [b, A, h] and an int64 [2] RNG state: 5 X_kv + 3 X_q elements, 8bAh + 32 bytes
// more, at its peak. After it: v's copy, the output, the statistics and RNG states.
TEST(Activations, AllGatherContextParallelGathersKeysAndValues) {
  constexpr int64_t s = 64, b = 2, A = 8, G = 2, D = 32, h = s / 2;
  ModelConfig m = test::Llama(1, A * D, A, G, 512, 1024);
  ASSERT_TRUE(FinalizeModelConfig(&m).ok());
  TrainingConfig t = Bf16WithoutDropout(2 * s, b, AttentionKind::kFused);
  t.profile = ProfileKind::kTransformerEngine;
  t.cp_all_gather = true;
  ModelShard shard = ModelShard::Whole(m);
  shard.cp = 2;
  const auto [peak, after] = RunStep(m, t, shard, /*backward=*/false, [](const Recorder& r) {
    int64_t live = 0, peak_bytes = 0;
    for (const MemoryEvent& e : r.events()) {
      const StorageInfo& info = r.storages()[static_cast<size_t>(e.storage_id)];
      if (r.names().Name(info.module) != "decoder.layers.0.self_attention.core_attention") {
        continue;
      }
      live += e.is_alloc ? info.size_bytes : -info.size_bytes;
      peak_bytes = std::max(peak_bytes, live);
    }
    return std::make_pair(peak_bytes, live);
  });
  const int64_t kv = s * b * G * D * 2, q = s * b * A * D * 2;
  EXPECT_EQ(peak, 5 * kv + 3 * q + 8 * b * A * h + 32);
  EXPECT_EQ(after, kv + q + 8 * b * A * h + 32);
}

// Context parallelism with multi-latent attention, whose keys (qk 32 + rope 16 = 48 wide)
// and values (32) differ in width: the ring sends them flattened into one buffer, and its
// one receive buffer on cp = 2 is k's and v's elements together, b*s*A*(48 + 32) in bf16
// (s = 64 local rows of 128); the all-gather keeps v's width in its output. Both run a
// step whole.
TEST(Activations, ContextParallelCarriesLatentAttentionsKeysAndValues) {
  constexpr int64_t b = 2, s = 64, A = 4;
  const ModelConfig m = [] {
    ModelConfig c =
        test::WithLatentAttention(test::Llama(1, 256, A, A, 512, 1024), 64, 32, 32, 16, 32);
    EXPECT_TRUE(FinalizeModelConfig(&c).ok());
    return c;
  }();
  ModelShard shard = ModelShard::Whole(m);
  shard.cp = 2;
  for (bool all_gather : {false, true}) {
    TrainingConfig t = Bf16WithoutDropout(2 * s, b, AttentionKind::kFused);
    t.profile = ProfileKind::kTransformerEngine;
    t.cp_all_gather = all_gather;
    ASSERT_TRUE(ValidateTrainingConfig(t, m).ok());
    const int64_t receive_buffers = RunStep(m, t, shard, /*backward=*/true, [](const Recorder& r) {
      int64_t count = 0;
      for (const StorageInfo& info : r.storages()) {
        count += r.names().Name(info.op) == "aten::empty_like" &&
                 info.size_bytes == b * s * A * (48 + 32) * 2 &&
                 r.names().Name(info.module).find("core_attention") != std::string::npos;
      }
      return count;
    });
    EXPECT_EQ(receive_buffers, all_gather ? 0 : 1) << "all_gather=" << all_gather;
  }
}

// The bytes layer 0's token dispatcher (its own module) holds when one forward ends.
int64_t DispatcherBytesAfterForward(const ModelConfig& m, const TrainingConfig& t,
                                    const ModelShard& shard) {
  return RunStep(m, t, shard, /*backward=*/false, [](const Recorder& r) {
    int64_t bytes = 0;
    ForEachLiveStorage(r, static_cast<int64_t>(r.events().size()) - 1, [&](int64_t id) {
      const StorageInfo& s = r.storages()[static_cast<size_t>(id)];
      if (r.names().Name(s.module) == "decoder.layers.0.mlp.token_dispatcher") {
        bytes += s.size_bytes;
      }
    });
    return bytes;
  });
}

// One MoE layer (Llama, h = 128, E = 4 experts of F_e = 64, top-K, Transformer Engine's
// grouped experts, bf16 without dropout, flash attention) on `tokens` tokens, EP = 2, with
// `dispatcher`.
struct TwoRankMoeLayer {
  ModelConfig model;
  TrainingConfig training;
  ModelShard shard;
};
TwoRankMoeLayer MakeTwoRankMoeLayer(int64_t tokens, int64_t topk, MoeDispatcher dispatcher) {
  TwoRankMoeLayer layer;
  ModelConfig& m = layer.model;
  m = test::Llama(1, 128, 4, 2, 256, 512);
  m.num_experts = 4;
  m.moe_router_topk = topk;
  m.moe_ffn_hidden_size = 64;
  EXPECT_TRUE(FinalizeModelConfig(&m).ok());
  TrainingConfig& t = layer.training;
  t = Bf16WithoutDropout(tokens, 1, AttentionKind::kFlash);
  t.moe_grouped_gemm = true;
  t.profile = ProfileKind::kTransformerEngine;
  t.moe_dispatcher = dispatcher;
  layer.shard = ModelShard::Whole(m);
  layer.shard.ep = 2;
  return layer;
}

// Note [DeepEP dispatch]: a one-layer MoE model (E = 4 experts, K = 2, EP = 2: E_local = 2,
// G = 2) on T = 48 tokens, bf16 router. A token misses a rank's two experts with
// probability (2/4)(1/3) = 1/6, so the rank receives N_r = ceil(2 * 48 * 5/6) = 80 rows, and
// its experts take N = T*K = 96. What the dispatcher holds when the forward ends (its own
// module, not the experts'): token_probs fp32 [T, K] and token_indices int64 [T, K]; the
// handle: rank prefix int32 [G, G], two channel prefixes int32 [G, 10], recv_src_idx int32
// [N_r], is_token_in_rank bool [T, G], send_head int32 [T, G]; the multihot's mask
// [N_r, K] bool and two int64 [N]; the received routing map bool [N_r, E_local]; the
// permutation: unfused, index int64 [N] and argsort int64 [E_local * N_r]; fused, TE's
// int32 [N_r, 2 E_local + 1]; and what it makes for the experts, which keep it: their input
// [N, H] bf16 and the permuted probabilities fp32 [N].
TEST(Activations, DeepEpDispatcherHoldsItsMetadata) {
  constexpr int64_t T = 48, K = 2, G = 2, local = 2, R = 80, N = 96;
  auto [m, t, shard] = MakeTwoRankMoeLayer(T, K, MoeDispatcher::kDeepEp);
  EXPECT_EQ(DeepEpReceivedRows(m, {G, 1, 1}, T), R);
  const int64_t common = T * K * (4 + 8) + (G * G + 2 * G * 10 + R + T * G) * 4 + T * G + R * K +
                         2 * N * 8 + R * local + N * 128 * 2 + N * 4;
  for (bool fused : {false, true}) {
    t.moe_permute_fusion = fused;
    ASSERT_TRUE(ValidateTrainingConfig(t, m).ok());
    const int64_t held = DispatcherBytesAfterForward(m, t, shard);
    const int64_t permutation = fused ? R * (2 * local + 1) * 4 : N * 8 + local * R * 8;
    EXPECT_EQ(held, common + permutation) << "fused=" << fused;
  }
}

// Note [HybridEP dispatch]: the same layer (T = 48 tokens, K = 2 of E = 4 experts, EP = G =
// 2: 2 local experts, one NVLink domain) with HybridEP. What the dispatcher holds when the
// forward ends: the probabilities' float32 copy [T, E] (the bf16 router's); the handle:
// sparse_to_dense int32 [T, G], rdma_to_attn bool [48, 1], attn_to_rdma bool [T, 0], the
// local expert map bool and dense-to-expert map int32, [T*G, 2] each, the chunk layout int32
// [1*G], counts int32 [2], a flag int32 [1]; and what it hands the experts, which keep it:
// their rows [N_p, H] bf16 and probabilities fp32 [N_p], N_p = T*K = 96 (no alignment).
TEST(Activations, HybridEpDispatcherHoldsItsHandle) {
  constexpr int64_t T = 48, K = 2, E = 4, G = 2, local = 2, H = 128, N = 96;
  const auto [m, t, shard] = MakeTwoRankMoeLayer(T, K, MoeDispatcher::kHybridEp);
  ASSERT_TRUE(ValidateTrainingConfig(t, m).ok());
  const int64_t held = DispatcherBytesAfterForward(m, t, shard);
  EXPECT_EQ(held, T * E * 4 + T * G * 4 + 48 + T * G * local * (1 + 4) + G * 4 + local * 4 + 4 +
                      N * H * 2 + N * 4);
}

// HybridEP aligns each local expert's rows for quantization: T = 40 tokens give each of the
// 2 local experts 40 rows, rounded up to 48 under FP8 (16), so the experts' input is
// [96, 128], and [80, 128] in bf16.
TEST(Moe, HybridEpAlignsExpertRowsForFp8) {
  auto expert_input_rows = [](Fp8Recipe fp8) {
    auto [m, t, shard] = MakeTwoRankMoeLayer(40, 2, MoeDispatcher::kHybridEp);
    t.fp8 = fp8;
    EXPECT_TRUE(ValidateTrainingConfig(t, m).ok());
    return RunStep(m, t, shard, /*backward=*/false, [](const Recorder& r) {
      for (const StorageInfo& s : r.storages()) {
        if (r.names().Name(s.module) == "decoder.layers.0.mlp.token_dispatcher" &&
            s.dtype == at::kBFloat16 && r.ShapeOf(s).size() == 2 && r.ShapeOf(s)[1] == 128) {
          return r.ShapeOf(s)[0];
        }
      }
      return int64_t{-1};
    });
  };
  EXPECT_EQ(expert_input_rows(Fp8Recipe::kNone), 80);
  EXPECT_EQ(expert_input_rows(Fp8Recipe::kTensorwise), 96);
}

// Note [Router padding]: T = 40 tokens, top-2 of E = 4 experts, EP = 2 (two local experts),
// FP8 tensorwise (16 rows).
//   alltoall: the rank dispatches D = 80 rows, 20 an expert, each rounded up to 32: D = 128,
//     and it receives its 80 rows plus the same 48 of padding, so its token dispatcher's
//     rows (the permuted tokens, the all-to-all's output, the regrouped copy, all [rows, 128]
//     bf16) are 128 where they were 80, and the experts copy nothing where their Fp8Padding
//     copied 40 rows an expert into [2, 48, 128] and [2, 48]. pad_routing_map on the map
//     [40, 4]: counts and pads int64 [4] each, is_zero bool [4, 40], its int32 copy and the
//     cumsum int64 [4, 40], the mask bool [4, 40] and the 48 added entries' indices int64
//     [48, 2]; fused (--enable-experimental, --moe-permute-fusion): the bool copy [4, 40], its
//     int32 copy and the int32 output [4, 40].
//   DeepEP: N_r = ceil(2 * 40 * 5/6) = 67 rows received (Note [DeepEP dispatch]), N = 80 for
//     the experts, 40 each, rounded up to 48 <= 67: 96 rows permuted; pad_routing_map on the
//     received map [67, 2] adds 16 entries.
TEST(Moe, RouterPaddingAlignsEachExpertsShareOfTheMap) {
  using Shapes = std::vector<std::vector<int64_t>>;
  struct Recorded {
    std::multiset<int64_t> dispatcher_rows;  // of its bf16 [rows, H] storages
    Shapes copies;                           // the experts' Fp8Padding (aten::cat)
    ShapeSet padding;                        // pad_routing_map's storages
  };
  auto record = [](MoeDispatcher dispatcher, bool padding, bool fused) {
    auto [m, t, shard] = MakeTwoRankMoeLayer(40, 2, dispatcher);
    t.fp8 = Fp8Recipe::kTensorwise;
    t.moe_router_padding = padding;
    t.experimental = fused;
    t.moe_permute_fusion = fused;
    EXPECT_TRUE(ValidateTrainingConfig(t, m).ok());
    return RunStep(m, t, shard, /*backward=*/false, [](const Recorder& r) {
      Recorded out;
      for (const StorageInfo& s : r.storages()) {
        const std::string& module = r.names().Name(s.module);
        const std::vector<int64_t> shape = r.ShapeOf(s).vec();
        if (module == "decoder.layers.0.mlp.token_dispatcher" && s.dtype == at::kBFloat16 &&
            shape.size() == 2 && shape[1] == 128) {
          out.dispatcher_rows.insert(shape[0]);
        }
        if (r.names().Name(s.op) == "aten::cat" && module.rfind("decoder.layers.0.mlp", 0) == 0) {
          out.copies.push_back(shape);
        }
        if (module == "decoder.layers.0.mlp.token_dispatcher.pad_routing_map") {
          out.padding.emplace(shape, s.dtype);
        }
      }
      return out;
    });
  };
  const Recorded unpadded = record(MoeDispatcher::kAllToAll, false, false);
  EXPECT_EQ(unpadded.dispatcher_rows, (std::multiset<int64_t>{80, 80, 80}));
  EXPECT_EQ(unpadded.copies, (Shapes{{2, 48, 128}, {2, 48}}));
  EXPECT_TRUE(unpadded.padding.empty());
  const Recorded padded = record(MoeDispatcher::kAllToAll, true, false);
  EXPECT_EQ(padded.dispatcher_rows, (std::multiset<int64_t>{128, 128, 128}));
  EXPECT_TRUE(padded.copies.empty());
  EXPECT_EQ(padded.padding, (ShapeSet{{{4}, at::kLong},
                                      {{4}, at::kLong},
                                      {{4, 40}, at::kBool},
                                      {{4, 40}, at::kInt},
                                      {{4, 40}, at::kLong},
                                      {{4, 40}, at::kBool},
                                      {{48, 2}, at::kLong}}));
  const Recorded fused = record(MoeDispatcher::kAllToAll, true, true);
  EXPECT_EQ(fused.dispatcher_rows, (std::multiset<int64_t>{128, 128, 128}));
  EXPECT_EQ(fused.padding,
            (ShapeSet{{{4, 40}, at::kBool}, {{4, 40}, at::kInt}, {{4, 40}, at::kInt}}));
  const Recorded deepep = record(MoeDispatcher::kDeepEp, true, false);
  EXPECT_TRUE(deepep.copies.empty());
  EXPECT_EQ(deepep.padding.count({{2, 67}, at::kLong}), 1U);
  EXPECT_EQ(deepep.padding.count({{16, 2}, at::kLong}), 1U);
  EXPECT_EQ(deepep.dispatcher_rows.count(96), 1U);  // the permuted rows
}

// HybridEPBuffer's buffers (Note [HybridEP dispatch]): T = 4096 tokens of H = 7168, E = 256
// experts over G = 8 ranks of one NVLink domain: M = 4096 * 8 rows; tokens M*H*2 =
// 469,762,048, probabilities M * 32 * 8 * 4 = 33,554,432, scales M * 56 * 4 = 7,340,032,
// flags 2 * 64 * 8 * 4 = 4,096, the maps' all-gather 256 * 4096 * 8 = 8,388,608 bytes. Few
// tokens still size 512 rows a rank; over 64 ranks of a 72-GPU domain the probabilities take
// every rank.
TEST(Moe, HybridEpBuffersOutsideTheAllocator) {
  EXPECT_EQ(HybridEpBufferBytes(4096, 7168, 256, 8, 8), 519'049'216);
  EXPECT_EQ(HybridEpBufferBytes(100, 7168, 256, 8, 8), HybridEpBufferBytes(512, 7168, 256, 8, 8));
  const int64_t M = 4096 * 64;
  EXPECT_EQ(HybridEpBufferBytes(4096, 7168, 256, 64, 72),
            M * 7168 * 2 + M * 4 * 64 * 4 + M * 56 * 4 + 2 * 64 * 64 * 4 + 256 * M);
}

// Rows DeepEP delivers to a rank from G ranks of T = 48 tokens, K = 2 of E = 8 experts:
//   EP 4 (2 experts a rank), uniform: 1 - C(6, 2)/C(8, 2) = 13/28 of 192 rows -> 90;
//   the same with 2 groups of 4 and group top-1: the rank's group is chosen with chance 1/2,
//     then both experts come from its 4: 1 - C(2, 2)/C(4, 2) = 5/6; 192 * 5/12 = 80;
//   EP 2 (4 experts, two whole groups of 2 of 4 groups), group top-2: one of its groups
//     chosen with chance 4/6 (then 1 - C(2, 2)/C(4, 2) = 5/6), both with 1/6 (then 1):
//     13/18 of 96 rows -> 70.
TEST(Moe, DeepEpRowsCountTheTokensGroups) {
  ModelConfig m = test::Llama(1, 128, 4, 2, 256, 512);
  m.num_experts = 8;
  m.moe_router_topk = 2;
  m.moe_ffn_hidden_size = 64;
  ASSERT_TRUE(FinalizeModelConfig(&m).ok());
  EXPECT_EQ(DeepEpReceivedRows(m, {4, 1, 1}, 48), 90);
  m.moe_router_num_groups = 2;
  m.moe_router_group_topk = 1;
  EXPECT_EQ(DeepEpReceivedRows(m, {4, 1, 1}, 48), 80);
  m.moe_router_num_groups = 4;
  m.moe_router_group_topk = 2;
  EXPECT_EQ(DeepEpReceivedRows(m, {2, 1, 1}, 48), 70);
}

// DeepEP's buffers outside the allocator for DeepSeek-V3's hidden size (7168, bf16: 14,336
// hidden bytes) and 20 SMs (10 channels), from DeepEP's Config hints: a received token
// takes 14,336 + 8 (source meta) + 128 * 8 + 128 * 4 + 128 * 4 (top-K indices, weights,
// scales) = 16,392 bytes.
//   8 ranks: NVL 10 * 8 * (2 + 3) * 4 + 10 * 8 * 256 * 16,392 = 335,709,760, aligned to 128
//     335,709,824; no RDMA; the 32 MiB workspace: 369,264,256.
//   16 ranks (2 RDMA ranks): NVL 10 * 8 * 7 * 4 + 10 * 8 * 288 * 16,392 -> 377,673,984;
//     RDMA with the dispatch config (recv 128 aligned to send 20: 140, above combine's 132)
//     10 * 2 * 18 * 2 * 4 + 2^20 + 10 * 2 * 140 * (2 * 16,392 + 32) -> 92,936,320;
//     with the workspace 504,164,736.
TEST(Moe, DeepEpBuffersOutsideTheAllocator) {
  EXPECT_EQ(DeepEpBufferBytes(7168, 2, 8, 20), 369'264'256);
  EXPECT_EQ(DeepEpBufferBytes(7168, 2, 16, 20), 504'164'736);
}

// Note [Delayed weight gradients]: fc1 [M, I] then fc2 [O, M] on R rows under a store, in
// bf16 without gradient accumulation fusion (each weight gradient a new [out, in] tensor
// added to main_grad). Delayed, both GEMMs wait until the gradient reaches the group's
// input: fc2's weight gradient is allocated after fc1's input gradient, then fc1's after
// fc2's is gone (queue order, one at a time); fc2's input h [R, M], which autograd lets go
// after fc2's backward, and fc1's output gradient dh [R, M] stay until their own GEMM has
// run. Undelayed, fc2's weight gradient comes first, inside its backward.
struct LinearChainEvents {
  int64_t dw2_alloc = -1, dw2_free = -1, dw1_alloc = -1, dx_alloc = -1;
  int64_t h_free = -1, dh_free = -1;
};

LinearChainEvents RunLinearChain(bool delay, bool checkpointed = false) {
  constexpr int64_t R = 8, I = 16, M = 24, O = 40;  // every [a, b] below has its own size
  Session session;
  ActiveSession active(session);
  ParameterStore store(Precision::kBf16, /*gradient_accumulation_fusion=*/false);
  Parameter* w1 = store.Add("fc1.weight", {M, I});
  Parameter* w2 = store.Add("fc2.weight", {O, M});
  store.AllocateGradBuffer();
  const at::TensorOptions bf16 = at::TensorOptions().device(at::kMeta).dtype(at::kBFloat16);
  session.SetPhase(Phase::kForward);
  at::Tensor x = at::empty({R, I}, bf16).requires_grad_(true);
  const c10::intrusive_ptr<WeightGradStore> wgrad = NewWgradStore(delay);
  at::Tensor y;
  {
    DelayedWgradScope scope(wgrad);
    const at::Tensor input = wgrad ? RunOnBackward(x, wgrad) : x;
    auto chain = [w1, w2](const std::vector<at::Tensor>& in) {
      return Linear(Linear(in[0], *w1, nullptr), *w2, nullptr);
    };
    y = checkpointed ? Checkpoint(chain, {input}) : chain({input});
  }
  session.SetPhase(Phase::kBackward);
  y.backward(at::empty({R, O}, bf16));
  const Recorder& r = session.recorder();
  LinearChainEvents events;
  for (const StorageInfo& s : r.storages()) {
    const int64_t elements = s.size_bytes / 2;
    const bool forward = s.phase == Phase::kForward;
    if (elements == O * M && !forward) {
      events.dw2_alloc = s.alloc_event;
      events.dw2_free = s.free_event;
    }
    if (elements == M * I && !forward) events.dw1_alloc = s.alloc_event;
    if (elements == R * I && !forward) events.dx_alloc = s.alloc_event;
    if (elements == R * M) (forward ? events.h_free : events.dh_free) = s.free_event;
  }
  return events;
}

// The host time of Transformer Engine's module calls (Note [Virtual clock]): the clock
// with 1 s a module call less the clock with none counts the calls. Two layers, one
// microbatch, two iterations; per layer linear_qkv (its input norm fused), core_attention,
// linear_proj and the MLP's two linears (the first with the pre-MLP norm fused), and the
// final norm; under the local spec all are Megatron's own.
double ModuleCalls(const ModelConfig& m, const TrainingConfig& t) {
  auto clock = [&](double module_call_s) {
    GpuSpec gpu = *FindGpu("H100");
    gpu.module_call_s = module_call_s;
    return test::RecordRank(test::Validated(m, t), 0, &gpu)->recorder().now_s();
  };
  return clock(1) - clock(0);
}

TEST(HostTime, EachTransformerEngineModuleCallCostsTheHost) {
  TrainingConfig t;
  t.seq_length = 64;
  t.precision = Precision::kBf16;
  ModelConfig m = test::Llama(2, 128, 4, 4, 256, 1024);
  ASSERT_TRUE(FinalizeModelConfig(&m).ok());
  EXPECT_NEAR(ModuleCalls(m, t), 0, 1e-9);  // the local spec
  t.profile = ProfileKind::kTransformerEngine;
  EXPECT_NEAR(ModuleCalls(m, t), 2 * (2 * 5 + 1), 1e-9);
  // MoE layers: attention's three, the pre-MLP norm (a module of its own), then
  // TEGroupedMLP's two GroupedLinears, or SequentialMLP's two linears for each of the 4
  // local experts.
  m.num_experts = 4;
  m.moe_ffn_hidden_size = 128;
  ASSERT_TRUE(FinalizeModelConfig(&m).ok());
  t.moe_grouped_gemm = true;
  EXPECT_NEAR(ModuleCalls(m, t), 2 * (2 * (3 + 1 + 2) + 1), 1e-9);
  t.moe_grouped_gemm = false;
  EXPECT_NEAR(ModuleCalls(m, t), 2 * (2 * (3 + 1 + 2 * 4) + 1), 1e-9);
}

// The clock of rank 0 on a GPU where every op costs 1 s of host time, kernels and module
// calls nothing: the ops it ran.
double HostOpsOfARank(const ModelConfig& m, const TrainingConfig& t) {
  GpuSpec gpu = *FindGpu("H100");
  gpu.half_flops = gpu.fp32_flops = gpu.bandwidth_bytes_per_s = 1e30;
  gpu.min_op_s = 1;
  gpu.module_call_s = 0;
  return test::RecordRank(test::Validated(m, t), 0, &gpu)->recorder().now_s();
}

// SequentialMLP runs each of the 4 local experts' MLP alone where memsim runs one grouped
// GEMM (ChargeUnmodelledOps): per MoE layer and microbatch, for each further expert two
// GEMMs and the activation in forward, four GEMMs and the activation's backward, and the
// backward's 2 cats, beside the torch.cat of the experts' outputs memsim runs: 27 more ops
// than TEGroupedMLP, on a GPU where every op costs 1 s of host time (and a module call
// nothing). The local spec runs SequentialMLP whatever --moe-grouped-gemm says: only
// memsim's cat differs.
TEST(HostTime, SequentialMlpRunsEachExpertsOps) {
  TrainingConfig t;
  t.seq_length = 64;
  t.precision = Precision::kBf16;
  ModelConfig m = test::Llama(2, 128, 4, 4, 256, 1024);
  m.num_experts = 4;
  m.moe_ffn_hidden_size = 128;
  ASSERT_TRUE(FinalizeModelConfig(&m).ok());
  auto clock = [&](bool grouped) {
    t.moe_grouped_gemm = grouped;
    return HostOpsOfARank(m, t);
  };
  t.profile = ProfileKind::kTransformerEngine;
  EXPECT_NEAR(clock(false) - clock(true), 2 * 2 * (3 * 8 + 2 + 1), 1e-6);
  t.profile = ProfileKind::kMegatronLocal;
  EXPECT_NEAR(clock(false) - clock(true), 2 * 2 * 1, 1e-6);
}

// Note [Muon]: Megatron orthogonalizes linear_qkv's q, k and v apart. Each
// orthogonalization is 24 ops (the gather and the concatenation of newton_schulz_tp, the
// norm, clamp_min and division of F.normalize, the casts to bf16 and back, 3 GEMMs in each
// of 5 iterations, two scalings); with 4 query groups each part is gathered over the
// groups by a reshape that copies, and the three results are concatenated: 2 * 24 + 3 + 1
// more ops per layer and step than one orthogonalization of the whole, on a GPU where
// every op costs 1 s of host time.
TEST(HostTime, MuonOrthogonalizesQkvInThreeParts) {
  TrainingConfig t;
  t.seq_length = 64;
  t.precision = Precision::kBf16;
  t.optimizer = OptimizerKind::kMuon;
  const int64_t layers = 2, steps = 2;
  t.iterations = steps;
  ModelConfig m = test::Gpt(layers, 128, 4);
  auto clock = [&](bool split) {
    t.muon_split_qkv = split;
    return HostOpsOfARank(m, t);
  };
  EXPECT_NEAR(clock(true) - clock(false), steps * layers * (2 * 24 + 3 + 1), 1e-6);
}

TEST(DelayedWgrad, GemmsWaitForTheGroupsBackward) {
  const LinearChainEvents delayed = RunLinearChain(/*delay=*/true);
  ASSERT_GE(delayed.dx_alloc, 0);
  EXPECT_GT(delayed.dw2_alloc, delayed.dx_alloc);
  EXPECT_GT(delayed.dw1_alloc, delayed.dw2_free);
  EXPECT_GT(delayed.h_free, delayed.dw2_alloc);
  EXPECT_LT(delayed.h_free, delayed.dw1_alloc);
  EXPECT_GT(delayed.dh_free, delayed.dw1_alloc);

  const LinearChainEvents undelayed = RunLinearChain(/*delay=*/false);
  EXPECT_LT(undelayed.dw2_alloc, undelayed.dx_alloc);
  EXPECT_LT(undelayed.dw1_alloc, undelayed.dh_free);
  EXPECT_LT(undelayed.h_free, undelayed.dx_alloc);
}

// Recomputed linears (a checkpoint: Megatron's recompute modules) queue into the store of
// the forward that checkpointed them, as TE's modules own their store: fc2's weight
// gradient still comes after fc1's input gradient, then fc1's after fc2's is gone.
TEST(DelayedWgrad, RecomputedLinearsStillWait) {
  const LinearChainEvents events = RunLinearChain(/*delay=*/true, /*checkpointed=*/true);
  ASSERT_GE(events.dx_alloc, 0);
  EXPECT_GT(events.dw2_alloc, events.dx_alloc);
  EXPECT_GT(events.dw1_alloc, events.dw2_free);
}

// transformer_layer.py's can_recompute_pre_mlp_layernorm_for_cudagraph, case by case from
// the source: only MoE layers under a moe_router graph lose the pre-MLP norm's recompute,
// unless the alltoall dispatcher's preprocessing is captured too and no shared experts run
// overlapped (the switch without shared experts does nothing).
TEST(Recomputation, PreMlpNormUnderTheRouterGraph) {
  ModelConfig m;
  TrainingConfig t;
  t.cuda_graphs = true;
  const uint32_t router = CudaGraphModuleBit(CudaGraphModule::kMoeRouter);
  const uint32_t preprocess = CudaGraphModuleBit(CudaGraphModule::kMoePreprocess);
  t.cuda_graph_modules = router;
  EXPECT_TRUE(PreMlpNormRecomputable(m, t, /*moe_layer=*/false));
  EXPECT_FALSE(PreMlpNormRecomputable(m, t, true));
  t.cuda_graph_modules = CudaGraphModuleBit(CudaGraphModule::kAttn);
  EXPECT_TRUE(PreMlpNormRecomputable(m, t, true));
  t.cuda_graph_modules = router | preprocess;
  t.moe_dispatcher = MoeDispatcher::kAllGather;
  EXPECT_FALSE(PreMlpNormRecomputable(m, t, true));
  t.moe_dispatcher = MoeDispatcher::kAllToAll;
  EXPECT_TRUE(PreMlpNormRecomputable(m, t, true));
  t.moe_shared_expert_overlap = true;
  EXPECT_TRUE(PreMlpNormRecomputable(m, t, true));
  m.moe_shared_expert_size = 64;
  EXPECT_FALSE(PreMlpNormRecomputable(m, t, true));
  t.cuda_graphs = false;
  EXPECT_TRUE(PreMlpNormRecomputable(m, t, true));
}

}  // namespace
}  // namespace memsim
