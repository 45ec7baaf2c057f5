// Google Benchmark cases for memsim's engine (benchmarks/run_benchmarks.py runs these
// with the command-line and Python measurements and prints one table).
#include <ATen/ATen.h>
#include <benchmark/benchmark.h>
#include <torch/csrc/autograd/autograd.h>

#include "models/parameters.h"
#include "models/transformer.h"
#include "ops/ops.h"
#include "simulator/session.h"

namespace memsim {
namespace {

// Forward + backward of one GPT layer (hidden 4096, sequence 2048, 32 heads, bf16, micro
// batch 1, flash attention) as a middle pipeline stage, so nothing but the layer runs.
void BM_GptLayer(benchmark::State& state) {
  const bool attribute = state.range(0) != 0;
  ModelConfig model;
  model.num_layers = 1;
  model.hidden_size = 4096;
  model.num_attention_heads = 32;
  (void)FinalizeModelConfig(&model);
  TrainingConfig training;
  training.seq_length = 2048;
  training.micro_batch_size = 1;
  training.precision = Precision::kBf16;
  ModelShard shard = ModelShard::Whole(model);
  shard.first_stage = shard.last_stage = false;
  RegisterOps();
  Session session(FindGpu("H100-80GB"));
  ActiveSession active(session, attribute);
  ParameterStore store(training.precision);
  TransformerModel layer(model, training, shard, &store);
  store.AllocateGradBuffer();
  const auto options = at::TensorOptions().device(at::kMeta).dtype(at::kBFloat16);
  for (auto _ : state) {
    at::Tensor input = at::empty(layer.HiddenShape(), options).requires_grad_(true);
    at::Tensor output = layer.ForwardChunk(0, input);
    torch::autograd::backward({output}, {at::empty(layer.HiddenShape(), options)});
    benchmark::DoNotOptimize(input.grad());
  }
  state.counters["events_per_layer"] =
      benchmark::Counter(static_cast<double>(session.recorder().events().size()) /
                         static_cast<double>(state.iterations()));
}
BENCHMARK(BM_GptLayer)
    ->Arg(1)
    ->Arg(0)
    ->ArgName("attribution")
    ->Unit(benchmark::kMillisecond)
    ->MinTime(1.0)
    ->Repetitions(5)
    ->ReportAggregatesOnly(true);

}  // namespace
}  // namespace memsim

BENCHMARK_MAIN();
