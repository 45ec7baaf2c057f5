// Google Benchmark cases for memsim's engine (benchmarks/run_benchmarks.py runs these
// with the command-line and Python measurements and prints one table).
#include <ATen/ATen.h>
#include <benchmark/benchmark.h>
#include <torch/csrc/autograd/autograd.h>

#include <cstdio>
#include <cstdlib>

#include "models/parameters.h"
#include "models/transformer.h"
#include "ops/ops.h"
#include "parallel/rank_simulation.h"
#include "simulator/session.h"
#include "tools/lib/command_line.h"
#include "tools/lib/heap_tuning.h"

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

// One layout simulated in-process, every rank class (SimulateAllClasses on `jobs`
// threads, as `memsim simulate` and `memsim sweep` do), without the process start (about
// 1 s of loading LibTorch's shared libraries) or any file written: what a search pays
// per layout. Args: microbatches, jobs.
ValidatedRun Llama70bLayout(int64_t microbatches) {
  SpecOptions options;
  options.model = "llama3-70b";
  options.world_size = 128;
  options.seq_length = 8192;
  options.sequence_parallel = true;
  options.data_parallel = "distributed-optimizer";
  options.iterations = 2;
  RunSpec spec;
  Status status = BuildRunSpec(options, false, "memsim_bench", &spec);
  spec.layout.tp = 8;
  spec.layout.pp = 4;
  spec.training.micro_batch_size = 1;
  spec.training.num_microbatches = microbatches;
  spec.training.recompute = RecomputeKind::kSelective;
  std::optional<ValidatedRun> run;
  if (status.ok()) status = FinalizeRunSpec(spec, &run);
  if (!status.ok()) {
    std::fprintf(stderr, "memsim_bench: %s\n", status.message().c_str());
    std::exit(1);
  }
  return *run;
}

// Simulates `run`'s rank classes on `jobs` threads per iteration; counts the events.
void SimulateLayout(benchmark::State& state, const ValidatedRun& run, int jobs) {
  size_t events = 0;
  for (auto _ : state) {
    std::vector<RankResult> results;
    if (!SimulateAllClasses(run, jobs, &results).ok()) state.SkipWithError("simulation failed");
    events = 0;
    for (const RankResult& r : results) events += r.session->recorder().events().size();
  }
  state.counters["events"] = static_cast<double>(events);
}

void BM_Llama70bLayout(benchmark::State& state) {
  SimulateLayout(state, Llama70bLayout(state.range(0)), static_cast<int>(state.range(1)));
}
BENCHMARK(BM_Llama70bLayout)
    ->Args({8, 1})  // small enough for callgrind (instruction counts are repeatable)
    ->Args({128, 1})
    ->Args({128, 2})
    ->Args({512, 2})
    ->ArgNames({"microbatches", "jobs"})
    ->Unit(benchmark::kMillisecond)
    ->Iterations(1)
    ->Repetitions(3)
    ->ReportAggregatesOnly(true);

// The seeds' 485B GPT (fp16, sequence 2048, distributed optimizer) on 8,192 GPUs, TP8
// PP8, 96 microbatches, with its 96 layers or cut to `layers`: layer replication makes
// the cost grow with the layers far less than in proportion. Two jobs.
void BM_Gpt485bLayers(benchmark::State& state) {
  SpecOptions options;
  options.model = "gpt-485b";
  options.world_size = 8192;
  options.seq_length = 2048;
  options.precision = "fp16";
  options.data_parallel = "distributed-optimizer";
  RunSpec spec;
  Status status = BuildRunSpec(options, false, "memsim_bench", &spec);
  spec.model.num_layers = state.range(0);
  spec.layout.tp = 8;
  spec.layout.pp = 8;
  spec.training.num_microbatches = 96;
  std::optional<ValidatedRun> run;
  if (status.ok()) status = FinalizeRunSpec(spec, &run);
  if (!status.ok()) {
    state.SkipWithError(status.message().c_str());
    return;
  }
  SimulateLayout(state, *run, 2);
}
BENCHMARK(BM_Gpt485bLayers)
    ->Arg(24)
    ->Arg(96)
    ->ArgName("layers")
    ->Unit(benchmark::kMillisecond)
    ->Iterations(1)
    ->Repetitions(3)
    ->ReportAggregatesOnly(true);

}  // namespace
}  // namespace memsim

// BENCHMARK_MAIN's body, with the heap tuned as memsim's own main tunes it.
int main(int argc, char** argv) {
  memsim::KeepFreedMemoryMapped();  // Note [Keeping freed memory]
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
