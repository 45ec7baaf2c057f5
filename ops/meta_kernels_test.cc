// The meta kernels of ops/meta_kernels.cc against the CUDA kernels they mirror:
// ops/testdata/h200_torch2.11_ops.json holds what each op allocated on an H200 with
// PyTorch 2.11 (tools/gpu/measure.py ops): the bytes its outputs keep and the most it
// held at once above its inputs, both as requested (before the allocator's rounding).
// Running the same op with the same shapes on meta must give the same two numbers.
#include "ops/meta_kernels.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "simulator/session.h"

namespace memsim {
namespace {

struct OpBytes {
  int64_t retained = 0;
  int64_t peak = 0;  // above the bytes alive before the op
};

// What `op` allocates on meta: storages made before it are its inputs.
OpBytes Measure(const Recorder& recorder, size_t first_event) {
  OpBytes bytes;
  int64_t live = 0;
  const std::vector<MemoryEvent>& events = recorder.events();
  for (size_t e = first_event; e < events.size(); ++e) {
    const int64_t size = recorder.storages()[events[e].storage_id].size_bytes;
    live += events[e].is_alloc ? size : -size;
    bytes.peak = std::max(bytes.peak, live);
  }
  bytes.retained = live;
  return bytes;
}

nlohmann::json MeasuredOps() {
  std::ifstream in("ops/testdata/h200_torch2.11_ops.json");
  return nlohmann::json::parse(in)["ops"];
}

const nlohmann::json& Op(const nlohmann::json& ops, const std::string& label) {
  for (const nlohmann::json& op : ops) {
    if (op["op"] == label) return op;
  }
  throw std::runtime_error("no measurement of " + label);
}

at::TensorOptions Meta(at::ScalarType dtype) {
  return at::TensorOptions().device(at::kMeta).dtype(dtype);
}

// Runs `op` in a fresh session (inputs made by `inputs` first) and compares its bytes with
// the CUDA measurement named `label`.
void ExpectLikeCuda(const nlohmann::json& ops, const std::string& label,
                    const std::function<std::vector<at::Tensor>()>& inputs,
                    const std::function<std::vector<at::Tensor>(std::vector<at::Tensor>&)>& op) {
  Session session;
  OpBytes bytes;
  {
    ActiveSession active(session);
    std::vector<at::Tensor> in = inputs();
    const size_t first_event = session.recorder().events().size();
    std::vector<at::Tensor> out = op(in);
    bytes = Measure(session.recorder(), first_event);
  }
  const nlohmann::json& real = Op(ops, label);
  EXPECT_EQ(bytes.retained, real.at("retained_requested_bytes").get<int64_t>()) << label;
  EXPECT_EQ(bytes.peak, real.at("peak_requested_above_inputs_bytes").get<int64_t>()) << label;
}

constexpr int64_t kS = 2048, kB = 4, kH = 2048, kV = 50304;

TEST(MetaKernels, LayerNormAndDropoutAllocateLikeCuda) {
  RegisterMetaKernels();
  const nlohmann::json ops = MeasuredOps();
  auto x = [] { return at::empty({kS, kB, kH}, Meta(at::kBFloat16)); };
  auto vec = [] { return at::empty({kH}, Meta(at::kBFloat16)); };
  ExpectLikeCuda(
      ops, "native_layer_norm bf16",
      [&] {
        return std::vector<at::Tensor>{x(), vec(), vec()};
      },
      [](std::vector<at::Tensor>& in) {
        auto [y, mean, rstd] = at::native_layer_norm(in[0], {kH}, in[1], in[2], 1e-5);
        return std::vector<at::Tensor>{y, mean, rstd};
      });
  ExpectLikeCuda(
      ops, "native_layer_norm_backward bf16",
      [&] {
        return std::vector<at::Tensor>{x(),
                                       x(),
                                       at::empty({kS, kB, 1}, Meta(at::kFloat)),
                                       at::empty({kS, kB, 1}, Meta(at::kFloat)),
                                       vec(),
                                       vec()};
      },
      [](std::vector<at::Tensor>& in) {
        auto [dx, dw, db] = at::native_layer_norm_backward(in[0], in[1], {kH}, in[2], in[3], in[4],
                                                           in[5], {true, true, true});
        return std::vector<at::Tensor>{dx, dw, db};
      });
  ExpectLikeCuda(
      ops, "native_dropout p=0.1 bf16", [&] { return std::vector<at::Tensor>{x()}; },
      [](std::vector<at::Tensor>& in) {
        auto [out, mask] = at::native_dropout(in[0], 0.1, true);
        return std::vector<at::Tensor>{out, mask};
      });
  ExpectLikeCuda(
      ops, "native_dropout_backward bf16",
      [&] {
        return std::vector<at::Tensor>{x(), at::empty({kS, kB, kH}, Meta(at::kBool))};
      },
      [](std::vector<at::Tensor>& in) {
        return std::vector<at::Tensor>{at::native_dropout_backward(in[0], in[1], 1 / 0.9)};
      });
}

TEST(MetaKernels, EmbeddingAllocatesLikeCuda) {
  RegisterMetaKernels();
  const nlohmann::json ops = MeasuredOps();
  ExpectLikeCuda(
      ops, "index_select bf16",
      [] {
        return std::vector<at::Tensor>{at::empty({kV, kH}, Meta(at::kBFloat16)),
                                       at::empty({kB * kS}, Meta(at::kLong))};
      },
      [](std::vector<at::Tensor>& in) {
        return std::vector<at::Tensor>{at::index_select(in[0], 0, in[1])};
      });
  // The gradient's temporaries grow with the tokens and the hidden size.
  struct Shape {
    std::string label;
    int64_t tokens, hidden, vocab;
  };
  for (const Shape& s : std::vector<Shape>{
           {"embedding_dense_backward bf16", kB * kS, kH, kV},
           {"embedding_dense_backward bf16 tokens=4096 hidden=1024 vocab=32000", 4096, 1024, 32000},
           {"embedding_dense_backward bf16 tokens=16384 hidden=4096 vocab=128256", 16384, 4096,
            128256},
           {"embedding_dense_backward bf16 tokens=32768 hidden=1024 vocab=50304", 32768, 1024,
            50304},
           // Up to 3072 tokens CUDA takes its atomic path: the gradient alone.
           {"embedding_dense_backward bf16 tokens=3072 hidden=1024 vocab=32000", 3072, 1024, 32000},
           {"embedding_dense_backward bf16 tokens=3073 hidden=1024 vocab=32000", 3073, 1024,
            32000}}) {
    ExpectLikeCuda(
        ops, s.label,
        [&] {
          return std::vector<at::Tensor>{at::empty({s.tokens, s.hidden}, Meta(at::kBFloat16)),
                                         at::empty({s.tokens}, Meta(at::kLong))};
        },
        [&](std::vector<at::Tensor>& in) {
          return std::vector<at::Tensor>{
              at::embedding_dense_backward(in[0], in[1], s.vocab, -1, false)};
        });
  }
}

TEST(MetaKernels, ElementwiseAndRollAllocateLikeCuda) {
  RegisterMetaKernels();
  const nlohmann::json ops = MeasuredOps();
  auto x = [] { return std::vector<at::Tensor>{at::empty({kS, kB, kH}, Meta(at::kBFloat16))}; };
  ExpectLikeCuda(ops, "relu bf16", x, [](std::vector<at::Tensor>& in) {
    return std::vector<at::Tensor>{at::relu(in[0])};
  });
  ExpectLikeCuda(
      ops, "where.self bf16",
      [] {
        return std::vector<at::Tensor>{at::empty({kS, kB, kH}, Meta(at::kBool)),
                                       at::empty({kS, kB, kH}, Meta(at::kBFloat16))};
      },
      [](std::vector<at::Tensor>& in) {
        return std::vector<at::Tensor>{at::where(in[0], in[1], in[1])};
      });
  ExpectLikeCuda(ops, "roll bf16 dim 0", x, [](std::vector<at::Tensor>& in) {
    return std::vector<at::Tensor>{at::roll(in[0], {1}, {0})};
  });
  // A non-contiguous input is copied first (the copy dies with the op).
  ExpectLikeCuda(ops, "roll bf16 non-contiguous", x, [](std::vector<at::Tensor>& in) {
    return std::vector<at::Tensor>{at::roll(in[0].transpose(0, 1), {1}, {0})};
  });
}

}  // namespace
}  // namespace memsim
