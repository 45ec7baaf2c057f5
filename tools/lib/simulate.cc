#include "tools/lib/simulate.h"

#include <boost/program_options.hpp>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <iostream>

#include "parallel/rank_training.h"
#include "simulator/atomic_file.h"
#include "simulator/snapshot_writer.h"
#include "simulator/summary_writer.h"
#include "simulator/trace_writer.h"
#include "tools/lib/exit_codes.h"
#include "tools/lib/format.h"

namespace memsim {
namespace po = boost::program_options;

Status SimulateRank(RunSpec spec, RankResult* result) {
  MEMSIM_RETURN_IF_ERROR(FinalizeModelConfig(&spec.model));
  MEMSIM_RETURN_IF_ERROR(ValidateTrainingConfig(spec.training, spec.model));
  result->session = std::make_unique<Session>(spec.gpu);
  try {
    ActiveSession active(*result->session);
    RunTraining(spec.model, spec.training, *result->session);
  } catch (const UserError& e) {
    return Status::Error(e.what());
  } catch (const std::overflow_error& e) {
    return Status::Error(std::string(e.what()) + ": the configuration's sizes exceed 64 bits");
  }
  const Recorder& recorder = result->session->recorder();
  result->timeline = Timeline::Replay(recorder);
  result->peak = AnalyzePeak(recorder, result->timeline, 50);
  if (spec.gpu != nullptr && result->timeline.peak_reserved_bytes() > spec.gpu->usable_bytes()) {
    result->oom_event = FindOutOfMemoryEvent(recorder, spec.gpu->usable_bytes());
  }
  return Status::OK();
}

namespace {

void PrintReport(const RunSpec& spec, const RankResult& r, size_t top_n) {
  const GpuSpec& gpu = *spec.gpu;
  const TrainingConfig& t = spec.training;
  std::printf("memsim: %s on %s (usable %s), %s, seq %lld, micro-batch %lld, %lld microbatch%s, %d iterations\n",
              spec.model_source.c_str(), gpu.name.c_str(), FormatBytes(gpu.usable_bytes()).c_str(),
              PrecisionName(t.precision), static_cast<long long>(t.seq_length),
              static_cast<long long>(t.micro_batch_size), static_cast<long long>(t.num_microbatches),
              t.num_microbatches == 1 ? "" : "es", t.iterations);
  std::printf("\n%-6s %-6s %-6s %12s %14s %14s %12s %s\n", "class", "ranks", "stage", "static",
              "peak alloc", "peak reserved", "headroom", "fits");
  const int64_t headroom = gpu.usable_bytes() - r.timeline.peak_reserved_bytes();
  std::printf("%-6d %-6s %-6d %12s %14s %14s %12s %s\n", 0, "0", 0,
              FormatBytes(r.timeline.iterations().back().static_allocated_bytes).c_str(),
              FormatBytes(r.timeline.peak_allocated_bytes()).c_str(),
              FormatBytes(r.timeline.peak_reserved_bytes()).c_str(), FormatBytes(headroom).c_str(),
              r.fits() ? "yes" : "NO (out of memory)");

  const Recorder& rec = r.session->recorder();
  std::printf("\nAt the peak (%s, %s allocated):\n", std::string(PhaseName(r.peak.phase)).c_str(),
              FormatBytes(r.peak.allocated_bytes).c_str());
  for (int c = 1; c < kNumCategories; ++c) {
    const int64_t bytes = r.peak.bytes_by_category[static_cast<size_t>(c)];
    if (bytes > 0) {
      std::printf("  %-16s %12s\n", std::string(CategoryName(static_cast<Category>(c))).c_str(),
                  FormatBytes(bytes).c_str());
    }
  }
  std::printf("  %-16s %12s\n", "allocator rounding",
              FormatBytes(r.peak.allocated_bytes - r.peak.requested_bytes).c_str());
  std::printf("\nLargest tensors alive at the peak:\n");
  for (size_t i = 0; i < r.peak.largest_storages.size() && i < top_n; ++i) {
    const StorageInfo& s = rec.storages()[static_cast<size_t>(r.peak.largest_storages[i])];
    const std::string& module = rec.names().Name(s.module);
    std::printf("  %10s  %-28s %-10s %-44s %s\n", FormatBytes(s.size_bytes).c_str(),
                StorageShapeString(s).c_str(), std::string(PhaseName(s.phase)).c_str(),
                (module.empty() ? std::string("<top>") : module).c_str(), rec.names().Name(s.op).c_str());
  }
}

Status WriteRankFiles(const std::string& out_dir, int64_t rank, const RunSpec& spec,
                      const RankResult& r, double sample_interval_s) {
  const std::string suffix = "_rank" + std::to_string(rank);
  TraceOptions trace;
  trace.sample_interval_s = sample_interval_s;
  MEMSIM_RETURN_IF_ERROR(
      WriteTrace(out_dir + "/memory_trace" + suffix + ".json", r.timeline, trace));
  SummaryContext context;
  context.rank = rank;
  context.gpu_name = spec.gpu->name;
  context.gpu_usable_bytes = spec.gpu->usable_bytes();
  MEMSIM_RETURN_IF_ERROR(WriteSummary(out_dir + "/summary" + suffix + ".json",
                                      SummaryJson(r.session->recorder(), r.timeline, r.peak, context)));
  return WriteSnapshot(out_dir + "/snapshot" + suffix + ".pickle", r.session->recorder(),
                       r.timeline.peak_event(), SnapshotOptions{});
}

}  // namespace

int SimulateCommand(int argc, const char* const* argv) {
  po::options_description options(
      "memsim simulate [options]\n\n"
      "Simulates a training configuration on meta tensors and reports each rank's GPU memory.\n"
      "With no options it runs the built-in default example (configs/runs/default.yaml).\n\n"
      "Examples:\n"
      "  memsim simulate\n"
      "  memsim simulate --model llama3-8b --seq-length 8192 --recompute selective\n"
      "  memsim simulate --config configs/runs/default.yaml --gpu A100-80GB --json\n\n"
      "Options");
  std::string config, model, gpu, precision, attention, recompute, out_dir = "memsim_out";
  int64_t seq_length = 0, micro_batch = 0, microbatches = 0, iterations = 0;
  double sample_interval_s = 0;
  bool json = false, check = false;
  size_t top_n = 10;
  options.add_options()("help,h", "show this help")(
      "config", po::value(&config), "YAML run file (default: configs/runs/default.yaml)")(
      "model", po::value(&model), "model preset name, overriding the run file's")(
      "gpu", po::value(&gpu), ("GPU preset: " + GpuPresetNames()).c_str())(
      "seq-length", po::value(&seq_length), "sequence length")(
      "micro-batch-size", po::value(&micro_batch), "micro-batch size")(
      "num-microbatches", po::value(&microbatches), "microbatches per iteration")(
      "precision", po::value(&precision), "fp32, bf16 or fp16")(
      "attention", po::value(&attention), "flash or eager")(
      "recompute", po::value(&recompute), "none, selective or full")(
      "iterations", po::value(&iterations), "training iterations to record")(
      "out", po::value(&out_dir), "output folder for traces, summaries, snapshots (default memsim_out)")(
      "sample-interval", po::value(&sample_interval_s),
      "thin trace samples to this many seconds of virtual time (peaks are kept)")(
      "top", po::value(&top_n), "largest tensors to print (default 10)")(
      "json", po::bool_switch(&json), "print the result as JSON")(
      "check", po::bool_switch(&check), "exit with code 3 if any rank does not fit");
  po::variables_map vm;
  try {
    po::store(po::command_line_parser(argc, argv).options(options).run(), vm);
    po::notify(vm);
  } catch (const po::error& e) {
    std::fprintf(stderr, "memsim simulate: %s (see memsim simulate --help)\n", e.what());
    return kExitError;
  }
  if (vm.count("help")) {
    std::cout << options << "\n";
    return kExitOk;
  }
  RunSpec spec;
  spec.gpu = FindGpu("H100-80GB");
  Status status = config.empty() ? LoadDefaultRun(&spec) : LoadRunFile(config, &spec);
  if (status.ok() && !model.empty()) {
    spec.model_source = model;
    status = LoadModelPreset(model, &spec.model);
  }
  if (status.ok() && !gpu.empty()) status = ParseGpu(gpu, &spec.gpu);
  if (status.ok() && !precision.empty()) status = ParsePrecision(precision, &spec.training.precision);
  if (status.ok() && !attention.empty()) status = ParseAttention(attention, &spec.training.attention);
  if (status.ok() && !recompute.empty()) status = ParseRecompute(recompute, &spec.training.recompute);
  if (seq_length) spec.training.seq_length = seq_length;
  if (micro_batch) spec.training.micro_batch_size = micro_batch;
  if (microbatches) spec.training.num_microbatches = microbatches;
  if (iterations) spec.training.iterations = static_cast<int32_t>(iterations);
  if (status.ok()) status = EnsureWritableDirectory(out_dir);
  RankResult result;
  if (status.ok()) status = SimulateRank(spec, &result);
  if (status.ok()) status = WriteRankFiles(out_dir, 0, spec, result, sample_interval_s);
  if (!status.ok()) {
    std::fprintf(stderr, "memsim simulate: %s\n", status.message().c_str());
    return kExitError;
  }
  if (json) {
    SummaryContext context;
    context.gpu_name = spec.gpu->name;
    context.gpu_usable_bytes = spec.gpu->usable_bytes();
    nlohmann::json out = {
        {"model", spec.model_source},
        {"gpu", spec.gpu->name},
        {"fits", result.fits()},
        {"ranks", nlohmann::json::array({SummaryJson(result.session->recorder(), result.timeline,
                                                     result.peak, context)})}};
    std::cout << out.dump(2) << "\n";
  } else {
    PrintReport(spec, result, top_n);
    std::printf("\nWrote memory_trace_rank0.json, summary_rank0.json, snapshot_rank0.pickle to %s/\n",
                out_dir.c_str());
  }
  return check && !result.fits() ? kExitDoesNotFit : kExitOk;
}

}  // namespace memsim
