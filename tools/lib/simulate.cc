#include "tools/lib/simulate.h"

#include <boost/program_options.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <utility>

#include "models/moe.h"
#include "models/transformer.h"
#include "parallel/layout.h"
#include "parallel/parallel_for.h"
#include "parallel/theoretical_memory.h"
#include "simulator/atomic_file.h"
#include "simulator/format.h"
#include "simulator/snapshot_writer.h"
#include "simulator/summary_writer.h"
#include "simulator/trace_writer.h"
#include "tools/lib/advice.h"
#include "tools/lib/command_line.h"
#include "tools/lib/exit_codes.h"

namespace memsim {
namespace po = boost::program_options;

namespace {

// "4-7 (4)", or "4" for a class of one rank (Note [Rank classes]: its ranks are contiguous).
std::string RankRange(const RankClass& c) {
  if (c.num_ranks == 1) return std::to_string(c.representative);
  return std::to_string(c.representative) + "-" + std::to_string(c.last_rank()) + " (" +
         std::to_string(c.num_ranks) + ")";
}

// Ranks first..last, all of one class, that get files.
struct RankSpan {
  int64_t first, last;
  const RankResult* result;
  int64_t size() const { return last - first + 1; }
};

int64_t RanksIn(const std::vector<RankSpan>& spans) {
  int64_t ranks = 0;
  for (const RankSpan& span : spans) ranks += span.size();
  return ranks;
}

}  // namespace

std::string DescribeOutOfMemory(const RankResult& r, const RunSpec& spec) {
  const Recorder& rec = r.session->recorder();
  const MemoryEvent& event = rec.events()[static_cast<size_t>(r.on_gpu.oom_event)];
  const StorageInfo& s = rec.storages()[static_cast<size_t>(event.storage_id)];
  const std::string& module = rec.names().Name(s.module);
  char text[512];
  std::snprintf(text, sizeof(text),
                "Out of memory on stage %lld (rank %lld): the first allocation that fails is %s "
                "(%s) by %s in %s, %s of iteration %d, microbatch %d, with %s allocated and %s "
                "reserved of %s the allocator can reserve",
                static_cast<long long>(r.rank_class.pp_rank),
                static_cast<long long>(r.rank_class.representative),
                FormatBytes(s.size_bytes).c_str(), StorageShapeString(rec, s).c_str(),
                rec.names().Name(s.op).c_str(), module.empty() ? "<top>" : module.c_str(),
                std::string(PhaseName(s.phase)).c_str(), s.iteration, s.microbatch,
                FormatBytes(r.on_gpu.allocated_bytes_at_oom).c_str(),
                FormatBytes(r.on_gpu.reserved_bytes_at_oom).c_str(),
                FormatBytes(AllocatorCapacityBytes(spec)).c_str());
  return text;
}

namespace {

void PrintAdvice(const std::vector<Advice>& advice, int64_t current_bytes) {
  std::printf(
      "\nWhat would cut the peak (each switch re-simulated; fullest stage, Note [Advice]):\n");
  std::printf("  %-40s %14s %12s %10s  %-4s %s\n", "change", "peak reserved", "change", "step time",
              "fits", "what it does");
  for (const Advice& a : advice) {
    char step[32];
    std::snprintf(step, sizeof(step), "%+.1f%%", (a.step_time_ratio - 1) * 100);
    std::printf("  %-40s %14s %12s %10s  %-4s %s\n", a.change.c_str(),
                FormatBytes(a.peak_reserved_bytes).c_str(),
                FormatBytes(a.peak_reserved_bytes - current_bytes).c_str(), step,
                a.fits ? "yes" : "no", a.effect.c_str());
  }
}

nlohmann::json AdviceJson(const std::vector<Advice>& advice) {
  nlohmann::json out = nlohmann::json::array();
  for (const Advice& a : advice) {
    out.push_back({{"change", a.change},
                   {"effect", a.effect},
                   {"peak_reserved_MB", BytesToMiB(a.peak_reserved_bytes)},
                   {"fits", a.fits},
                   {"step_time_ratio", a.step_time_ratio}});
  }
  return out;
}

// The names of `table`'s values that `keep` accepts, comma-separated.
template <typename E, size_t N, typename Keep>
std::string NamesWhere(const EnumName<E> (&table)[N], Keep keep) {
  std::string names;
  for (const EnumName<E>& entry : table) {
    if (keep(entry.value)) names += (names.empty() ? "" : ", ") + std::string(entry.name);
  }
  return names;
}

void PrintReport(const ValidatedRun& run, const std::vector<RankResult>& results, int64_t top_n) {
  const RunSpec& spec = run.spec();
  const GpuSpec& gpu = *spec.gpu;
  const TrainingConfig& t = spec.training;
  const ParallelLayout& l = spec.layout;
  std::string precision = PrecisionName(t.precision);
  if (t.fp8 != Fp8Recipe::kNone) {
    precision += " with FP8 (" + std::string(NameOf(kFp8RecipeNames, t.fp8)) +
                 (t.fp8_param_gather ? ", FP8 parameters)" : ")");
  }
  std::printf(
      "memsim: %s on %lld x %s (usable %s), %s, seq %lld, micro-batch %lld, %lld microbatch%s, "
      "%d iterations\n",
      spec.model_source.c_str(), static_cast<long long>(l.world_size), gpu.name.c_str(),
      FormatBytes(gpu.usable_bytes()).c_str(), precision.c_str(),
      static_cast<long long>(t.seq_length), static_cast<long long>(t.micro_batch_size),
      static_cast<long long>(t.num_microbatches), t.num_microbatches == 1 ? "" : "es",
      t.iterations);
  const ModelConfig& m = spec.model;
  std::string stages;
  if (!l.pipeline_layout.empty()) {
    stages = ", stages " + l.pipeline_layout;
  } else if (l.first_stage_layers > 0) {  // FinalizeLayout named both ends
    stages = ", layers per stage: first " + std::to_string(l.first_stage_layers);
    if (l.pp > 2) {
      stages += ", middle " + std::to_string(LayersOnStage(l, m, 1, 0) * l.vpp);
    }
    stages += ", last " + std::to_string(l.last_stage_layers);
  }
  std::printf(
      "layout: TP=%lld%s PP=%lld%s DP=%lld CP=%lld EP=%lld, %s%s\n", static_cast<long long>(l.tp),
      l.sequence_parallel ? " (SP)" : "", static_cast<long long>(l.pp),
      l.vpp > 1 ? (" VPP=" + std::to_string(l.vpp)).c_str() : "", static_cast<long long>(l.dp),
      static_cast<long long>(l.cp), static_cast<long long>(l.ep),
      DataParallelName(l.data_parallel).c_str(), stages.c_str());
  std::string per_class;
  for (size_t i = 0; i < results.size(); ++i) {
    per_class += (i == 0 ? "" : ", ") + std::string("class ") + std::to_string(i) + " " +
                 FormatCount(results[i].parameters);
  }
  std::printf("parameters: %s in the model (Megatron's padded vocabulary); per rank: %s\n",
              FormatCount(ParameterCount(m, t, ModelShard::Whole(m))).c_str(), per_class.c_str());
  if (m.num_experts > 0) {
    // What the experts' row counts assume (moe.h): routing is not known before the run.
    std::string routing =
        m.moe_capacity_factor > 0
            ? "capacity factor " + FormatNumber(m.moe_capacity_factor) + " (" +
                  std::to_string(ExpertCapacityPerRank(spec)) + " tokens an expert" +
                  (m.moe_pad_to_capacity ? ", inputs padded to it)" : ", dropping the rest)")
            : "dropless";
    if (!m.moe_pad_to_capacity) {
      routing += m.moe_imbalance_factor > 1
                     ? ", busiest expert " + FormatNumber(m.moe_imbalance_factor) +
                           "x the mean load (--moe-imbalance)"
                     : ", experts evenly loaded (--moe-imbalance to assume otherwise)";
    }
    std::printf("MoE routing: %s\n", routing.c_str());
  }
  if (t.optimizer_offload_fraction > 0) {
    std::printf(
        "optimizer CPU offload: %s of the optimizer's shards keep their masters and states on "
        "the host\n",
        FormatNumber(t.optimizer_offload_fraction).c_str());
  }
  if (t.cuda_graphs) {
    const std::string modules =
        NamesWhere(kCudaGraphModuleNames, [&t](CudaGraphModule m) { return t.Graphs(m); });
    std::printf(
        "CUDA graphs: %s, captured before iteration %d (the capture counts only them; replayed "
        "iterations count only the rest, and the graphs' static buffers)\n",
        modules.c_str(), t.CudaGraphCaptureIteration());
  }
  if (t.offload_modules != 0) {
    // What leaves the device, and the policy's effect a reader might not expect.
    const std::string regions =
        NamesWhere(kOffloadModuleNames, [&t](OffloadModule m) { return t.Offloads(m); });
    std::printf(
        "activation offloading: %s (tensors of at least %lld elements); the first iteration "
        "offloads every layer, later ones keep one layer per rank on the GPU\n",
        regions.c_str(), static_cast<long long>(t.min_offloaded_tensor_elements));
  }
  std::printf("\n%-6s %-18s %-6s %11s %11s %14s %11s %13s  %s\n", "class", "ranks", "stage",
              "static", "peak alloc", "peak reserved", "headroom", "Megatron est.", "fits");
  for (size_t i = 0; i < results.size(); ++i) {
    const RankResult& r = results[i];
    // On the GPU when it fits (never above its memory); else what the step would reserve.
    const int64_t reserved =
        r.fits() ? r.on_gpu.peak_reserved_bytes : r.timeline.peak_reserved_bytes();
    const double estimate_mb = TheoreticalMemoryMB(run, r.rank_class.pp_rank);
    std::printf("%-6zu %-18s %-6lld %11s %11s %14s %11s %13s  %s\n", i,
                RankRange(r.rank_class).c_str(), static_cast<long long>(r.rank_class.pp_rank),
                FormatBytes(r.timeline.iterations().back().static_allocated_bytes).c_str(),
                FormatBytes(r.timeline.peak_allocated_bytes()).c_str(),
                FormatBytes(reserved).c_str(),
                r.fits() ? FormatBytes(r.headroom_bytes(spec)).c_str() : "-",
                FormatBytes(static_cast<int64_t>(estimate_mb * (1 << 20))).c_str(),
                r.fits() ? "yes" : "NO (out of memory)");
  }
  // Where Megatron-LM's formula is known not to cover this run, once per caveat.
  std::vector<std::string> caveats;
  for (const RankResult& r : results) {
    for (const std::string& c : TheoreticalMemoryCaveats(run, r.rank_class.pp_rank)) {
      if (std::find(caveats.begin(), caveats.end(), c) == caveats.end()) caveats.push_back(c);
    }
  }
  std::printf("Megatron est.: Megatron-LM's theoretical_memory_usage formula per stage%s",
              caveats.empty() ? ".\n" : "; it does not cover:\n");
  for (const std::string& c : caveats) std::printf("  - %s\n", c.c_str());
  // What the ranks hold outside PyTorch's allocator: not in the figures, but in the verdict.
  const std::pair<int64_t, const char*> outside[] = {
      {UserbufferBytes(spec), "Userbuffers (TP communication overlap)"},
      {DeepEpBufferBytes(spec), t.moe_dispatcher == MoeDispatcher::kHybridEp
                                    ? "HybridEP buffers (flex dispatcher)"
                                    : "DeepEP buffers (flex dispatcher)"}};
  for (const auto& [bytes, what] : outside) {
    if (bytes == 0) continue;
    std::printf(
        "%s: %s per rank outside PyTorch's allocator: not in the figures above, but the verdict "
        "and headroom leave them room (the allocator can reserve %s)\n",
        what, FormatBytes(bytes).c_str(), FormatBytes(AllocatorCapacityBytes(spec)).c_str());
  }
  for (const RankResult& r : results) {
    if (!r.fits()) std::printf("\n%s\n", DescribeOutOfMemory(r, spec).c_str());
  }
  // Why: the class with the highest peak.
  const RankResult* worst = &results[0];
  for (const RankResult& r : results) {
    if (r.timeline.peak_reserved_bytes() > worst->timeline.peak_reserved_bytes()) worst = &r;
  }
  const Recorder& rec = worst->session->recorder();
  std::printf("\nAt the peak of stage %lld (rank %lld, %s, %s allocated):\n",
              static_cast<long long>(worst->rank_class.pp_rank),
              static_cast<long long>(worst->rank_class.representative),
              std::string(PhaseName(worst->peak.phase)).c_str(),
              FormatBytes(worst->peak.allocated_bytes).c_str());
  for (int c = 1; c < kNumCategories; ++c) {
    const int64_t bytes = worst->peak.bytes_by_category[static_cast<size_t>(c)];
    if (bytes > 0) {
      std::printf("  %-18s %12s\n", std::string(CategoryName(static_cast<Category>(c))).c_str(),
                  FormatBytes(bytes).c_str());
    }
  }
  std::printf("  %-18s %12s\n", "allocator rounding",
              FormatBytes(worst->peak.allocated_bytes - worst->peak.requested_bytes).c_str());
  std::printf("\nLargest tensors alive at that peak:\n");
  for (size_t i = 0; i < worst->peak.largest_storages.size() && static_cast<int64_t>(i) < top_n;
       ++i) {
    const StorageInfo& s = rec.storages()[static_cast<size_t>(worst->peak.largest_storages[i])];
    const std::string& module = rec.names().Name(s.module);
    std::printf("  %10s  %-28s %-10s %-44s %s\n", FormatBytes(s.size_bytes).c_str(),
                StorageShapeString(rec, s).c_str(), std::string(PhaseName(s.phase)).c_str(),
                (module.empty() ? std::string("<top>") : module).c_str(),
                rec.names().Name(s.op).c_str());
  }
}

// Which ranks get files: "all", "first-per-class" or a comma-separated list, as spans of
// ranks (Note [Rank classes]), so that "all" on any world size costs one span per class.
Status SelectRanks(const std::string& text, const std::vector<RankResult>& results,
                   int64_t world_size, std::vector<RankSpan>* out) {
  if (text == "all") {
    for (const RankResult& r : results) {
      out->push_back({r.rank_class.representative, r.rank_class.last_rank(), &r});
    }
  } else if (text == "first-per-class") {
    for (const RankResult& r : results) {
      out->push_back({r.rank_class.representative, r.rank_class.representative, &r});
    }
  } else {
    std::stringstream list(text);
    std::string item;
    std::set<int64_t> seen;
    while (std::getline(list, item, ',')) {
      char* end = nullptr;
      const long long rank = std::strtoll(item.c_str(), &end, 10);
      if (item.empty() || *end != '\0' || rank < 0 || rank >= world_size) {
        return Status::Error("--ranks: '" + item + "' is not a rank in [0, " +
                             std::to_string(world_size) +
                             "); use all, first-per-class or a list like 0,8,16");
      }
      if (!seen.insert(rank).second) continue;
      for (const RankResult& r : results) {
        if (r.rank_class.Contains(rank)) out->push_back({rank, rank, &r});
      }
    }
  }
  return Status::OK();
}

SummaryContext ContextFor(const ValidatedRun& run, const RankClass& rank_class) {
  const RunSpec& spec = run.spec();
  SummaryContext context;
  context.rank = rank_class.representative;
  context.gpu_name = spec.gpu->name;
  context.gpu_usable_bytes = spec.gpu->usable_bytes();
  context.theoretical_memory_mb = TheoreticalMemoryMB(run, rank_class.pp_rank);
  return context;
}

nlohmann::json ClassSummary(const ValidatedRun& run, const RankResult& r,
                            const std::vector<Advice>& advice) {
  const RunSpec& spec = run.spec();
  nlohmann::json summary =
      SummaryJson(r.session->recorder(), r.timeline, r.peak, ContextFor(run, r.rank_class));
  if (!advice.empty()) summary["advice"] = AdviceJson(advice);
  summary["theoretical_memory_caveats"] = TheoreticalMemoryCaveats(run, r.rank_class.pp_rank);
  summary["pp_stage"] = r.rank_class.pp_rank;
  summary["parameters"] = r.parameters;
  summary["userbuffers_outside_allocator_MB"] = BytesToMiB(UserbufferBytes(spec));
  summary["deepep_buffers_outside_allocator_MB"] = BytesToMiB(DeepEpBufferBytes(spec));
  // The ranks the class stands for, as [first, last] spans.
  summary["ranks"] = nlohmann::json::array(
      {nlohmann::json::array({r.rank_class.representative, r.rank_class.last_rank()})});
  summary["fits"] = r.fits();
  if (r.fits()) {
    summary["peak_reserved_on_gpu_MB"] = BytesToMiB(r.on_gpu.peak_reserved_bytes);
    summary["headroom_MB"] = BytesToMiB(r.headroom_bytes(spec));
  } else {
    summary["out_of_memory"] = DescribeOutOfMemory(r, spec);
  }
  return summary;
}

// The files of one rank class, built once and published for each of its selected ranks.
// The trace and the snapshots (tens of MB each) are written once into temporaries in the
// output folder as they are made (Note [Streaming pickle] in
// simulator/pickle_writer.h), so no class holds them in memory: each rank gets a copy, the
// last one the temporary itself, and an unpublished temporary is removed.
struct ClassFiles {
  nlohmann::json summary;
  std::unique_ptr<AtomicFileWriter> trace, snapshot, peak_snapshot;
  int64_t ranks_left = 0;  // selected ranks whose files are not yet published
  int64_t size_bytes() const {
    return trace->size_bytes() + snapshot->size_bytes() + peak_snapshot->size_bytes();
  }
};

// Builds `f`, named after the class's first selected rank, `rank`.
Status BuildClassFiles(const std::string& out_dir, int64_t rank, const ValidatedRun& run,
                       const RankResult& result, TraceOptions trace_options,
                       const ReportOptions& options, const std::vector<Advice>& advice,
                       ClassFiles* f) {
  const std::string suffix = "_rank" + std::to_string(rank);
  const std::string prefix = out_dir + "/snapshot" + suffix;
  trace_options.theoretical_memory_mb = TheoreticalMemoryMB(run, result.rank_class.pp_rank);
  MEMSIM_RETURN_IF_ERROR(
      AtomicFileWriter::Open(out_dir + "/memory_trace" + suffix + ".json", &f->trace));
  f->trace->stream() << TraceText(result.timeline, trace_options);
  // As torch.cuda.memory._dump_snapshot after the last step, with the history recorded
  // from its start; and the allocator at the peak in the format every PyTorch reads
  // (Note [Snapshot formats] in simulator/snapshot_writer.h).
  const IterationSummary& last = result.timeline.iterations().back();
  SnapshotOptions step;
  step.first_traced_event = options.snapshot_history == "run" ? 0 : last.begin_event;
  MEMSIM_RETURN_IF_ERROR(AtomicFileWriter::Open(prefix + ".pickle", &f->snapshot));
  MEMSIM_RETURN_IF_ERROR(AtomicFileWriter::Open(prefix + "_peak.pickle", &f->peak_snapshot));
  StreamSnapshotAndPeak(result.session->recorder(), last.end_event - 1, step,
                        &f->snapshot->stream(), result.timeline.peak_event(),
                        &f->peak_snapshot->stream());
  f->summary = ClassSummary(run, result, advice);
  return Status::OK();
}

// Publishes a staged file as `path`: a copy while other ranks still need it, else itself.
Status PublishStaged(AtomicFileWriter* file, const std::string& path, bool last) {
  return last ? file->Publish(path) : file->PublishCopy(path);
}

Status WriteRankFilesOf(const std::string& out_dir, int64_t rank, ClassFiles* f) {
  const std::string suffix = "_rank" + std::to_string(rank);
  const bool last = --f->ranks_left == 0;
  MEMSIM_RETURN_IF_ERROR(
      PublishStaged(f->trace.get(), out_dir + "/memory_trace" + suffix + ".json", last));
  f->summary["rank"] = rank;
  MEMSIM_RETURN_IF_ERROR(WriteSummary(out_dir + "/summary" + suffix + ".json", f->summary));
  MEMSIM_RETURN_IF_ERROR(
      PublishStaged(f->snapshot.get(), out_dir + "/snapshot" + suffix + ".pickle", last));
  return PublishStaged(f->peak_snapshot.get(), out_dir + "/snapshot" + suffix + "_peak.pickle",
                       last);
}

Status WriteRankFiles(const std::string& out_dir, const ValidatedRun& run,
                      const std::vector<RankSpan>& ranks, const ReportOptions& options,
                      const std::vector<Advice>& advice) {
  TraceOptions trace_options;
  trace_options.sample_interval_s = options.sample_interval_s;
  trace_options.max_intervals_per_iteration = 5000;  // unless --sample-interval says otherwise
  // Ranks of a class share one simulation: build each class's files once, named after its
  // first selected rank, the classes on up to --jobs threads (each reads only its own
  // recording and writes only its own files).
  std::map<const RankResult*, ClassFiles> files;
  std::vector<std::pair<const RankResult*, int64_t>> classes;  // (class, first selected rank)
  for (const RankSpan& span : ranks) {
    ClassFiles& f = files[span.result];
    if (f.ranks_left == 0) classes.emplace_back(span.result, span.first);
    f.ranks_left += span.size();
  }
  std::vector<Status> statuses(classes.size());
  ParallelFor(classes.size(), options.jobs, [&](size_t i) {
    const auto& [result, rank] = classes[i];
    try {
      statuses[i] = BuildClassFiles(out_dir, rank, run, *result, trace_options, options, advice,
                                    &files.at(result));
    } catch (const std::exception& e) {
      statuses[i] = Status::Error("writing the files of rank " + std::to_string(rank) +
                                  " failed: " + e.what());
    }
  });
  for (const Status& s : statuses) MEMSIM_RETURN_IF_ERROR(s);
  double total_bytes = 0;
  for (const RankSpan& span : ranks) {
    total_bytes += (static_cast<double>(files.at(span.result).size_bytes()) + 4096) *
                   static_cast<double>(span.size());
  }
  // Say no before publishing anything (the staged temporaries are removed): --ranks all
  // on a million GPUs would fill a disk.
  const double limit_bytes = options.max_output_gib * (1 << 30);
  if (total_bytes > limit_bytes) {
    char message[256];
    std::snprintf(message, sizeof(message),
                  "the files of %lld ranks would take %.1f GiB, above --max-output %.1f GiB; "
                  "choose fewer --ranks (first-per-class) or raise --max-output",
                  static_cast<long long>(RanksIn(ranks)), total_bytes / (1 << 30),
                  options.max_output_gib);
    return Status::Error(message);
  }
  for (const RankSpan& span : ranks) {
    for (int64_t rank = span.first; rank <= span.last; ++rank) {
      MEMSIM_RETURN_IF_ERROR(WriteRankFilesOf(out_dir, rank, &files[span.result]));
    }
  }
  return Status::OK();
}

}  // namespace

void AddReportOptions(po::options_description* options, ReportOptions* report) {
  options->add_options()("jobs,j", PositiveValue(&report->jobs, "jobs"),
                         "rank classes simulated at once (default 2)")(
      "out", po::value(&report->out_dir),
      "output folder for traces, summaries, snapshots (default memsim_out)")(
      "ranks", po::value(&report->ranks),
      "ranks to write files for: all, first-per-class (default) or 0,8,16")(
      "sample-interval", po::value(&report->sample_interval_s),
      "thin trace samples to this many seconds of virtual time (peaks are kept)")(
      "top", PositiveValue(&report->top_n, "top"),
      "largest tensors to print (default 10, at most 50)")("json", po::bool_switch(&report->json),
                                                           "print the result as JSON")(
      "check", po::bool_switch(&report->check), "exit with code 3 if any rank does not fit")(
      "advise", po::bool_switch(&report->advise),
      "re-simulate with each switch that could cut the peak and report by how much")(
      "max-output", PositiveValue(&report->max_output_gib, "max-output"),
      "most GiB of files to write (default 4); more is refused before writing")(
      "snapshot-history", po::value(&report->snapshot_history),
      "allocator history in snapshot_rank{R}.pickle: last-iteration (default) or run (every "
      "event from the start, to replay the run through a real allocator)");
}

Status CheckReportOptions(const ReportOptions& report) {
  if (report.top_n > static_cast<int64_t>(kLargestTensorsKept)) {
    return Status::Error("--top must be at most " + std::to_string(kLargestTensorsKept));
  }
  if (!(report.sample_interval_s >= 0 && std::isfinite(report.sample_interval_s))) {
    return Status::Error("--sample-interval must be a non-negative number of seconds");
  }
  if (report.snapshot_history != "last-iteration" && report.snapshot_history != "run") {
    return Status::Error("--snapshot-history must be last-iteration or run, not '" +
                         report.snapshot_history + "'");
  }
  return Status::OK();
}

int SimulateCommand(int argc, const char* const* argv) {
  po::options_description options(
      "memsim simulate [options]\n\n"
      "Simulates a training configuration on meta tensors and reports each rank's GPU memory:\n"
      "one simulation per pipeline stage, reported for every rank. With no options it runs the\n"
      "built-in default example (configs/runs/default.yaml).\n\n"
      "Examples:\n"
      "  memsim simulate\n"
      "  memsim simulate --model llama3-8b --world-size 2 --tp 2 --seq-length 8192 --recompute "
      "selective\n"
      "  memsim simulate --model llama3-70b --world-size 128 --tp 8 --pp 4 --sp \\\n"
      "      --data-parallel distributed-optimizer --global-batch-size 512 --check\n"
      "  memsim simulate --hf-config Mixtral-8x7B/config.json --world-size 64 --tp 2 --pp 4 --ep "
      "8\n"
      "  memsim simulate --config configs/runs/default.yaml --gpu A100-80GB --json\n\n"
      "Options");
  SpecOptions spec_options;
  std::string recompute;
  std::string recompute_modules;
  std::string offload_modules;
  std::string cuda_graph_modules;
  std::string fp8;
  bool fp8_param_gather = false;
  bool tp_comm_overlap = false;
  int64_t micro_batch = 0, microbatches = 0, tp = 0, pp = 0, vpp = 0, cp = 0, ep = 0;
  int64_t first_stage_layers = 0, last_stage_layers = 0;
  ReportOptions report;
  options.add_options()("help,h", "show this help");
  AddSpecOptions(&options, &spec_options);
  options.add_options()("micro-batch-size", PositiveValue(&micro_batch, "micro-batch-size"),
                        "micro-batch size")(
      "num-microbatches", PositiveValue(&microbatches, "num-microbatches"),
      "microbatches per iteration")("recompute", po::value(&recompute), "none, selective or full")(
      "recompute-modules", po::value(&recompute_modules),
      "what selective recomputation recomputes, comma-separated (default core_attn): "
      "core_attn, layernorm, mlp, moe, moe_act, shared_experts, mla_up_proj")(
      "offload-modules", po::value(&offload_modules),
      "fine-grained activation offloading of these regions, comma-separated: attn_norm, "
      "qkv_linear, core_attn, attn_proj, mlp_norm, expert_fc1, moe_act (needs --profile "
      "transformer_engine)")(
      "cuda-graphs", po::value(&cuda_graph_modules),
      "Transformer Engine's CUDA graphs of these modules, comma-separated: attn, mlp, "
      "moe_router, moe_preprocess (needs --profile transformer_engine; captured before the "
      "first iteration)")(
      "fp8", po::value(&fp8),
      "FP8 training with Transformer Engine's recipe: delayed, tensorwise, blockwise or "
      "mxfp8 (needs --profile transformer_engine; mxfp8 a Blackwell --gpu)")(
      "fp8-param-gather", po::bool_switch(&fp8_param_gather),
      "FP8 parameters (needs --fp8 and --data-parallel distributed-optimizer)")(
      "tp-comm-overlap", po::bool_switch(&tp_comm_overlap),
      "Transformer Engine's TP communication overlap (userbuffers; needs --sp and --profile "
      "transformer_engine)")("tp", PositiveValue(&tp, "tp"), "tensor-parallel size")(
      "pp", PositiveValue(&pp, "pp"), "pipeline-parallel size")(
      "vpp", PositiveValue(&vpp, "vpp"), "virtual pipeline stages per rank (interleaved 1F1B)")(
      "cp", PositiveValue(&cp, "cp"), "context-parallel size")("ep", PositiveValue(&ep, "ep"),
                                                               "expert-parallel size")(
      "first-stage-layers", PositiveValue(&first_stage_layers, "first-stage-layers"),
      "layers on the first pipeline stage (uneven split; the other stages share the rest "
      "evenly, as Megatron-LM's --decoder-first-pipeline-num-layers; with VPP each stage's "
      "layers split evenly over its virtual stages)")(
      "last-stage-layers", PositiveValue(&last_stage_layers, "last-stage-layers"),
      "layers on the last pipeline stage (uneven split, alone or with --first-stage-layers)");
  AddReportOptions(&options, &report);
  po::variables_map vm;
  if (auto exit_code = ParseCommandLine(argc, argv, options, "simulate", &vm)) return *exit_code;
  RunSpec spec;
  Status status = BuildRunSpec(spec_options, /*default_run=*/true, "simulate", &spec);
  if (status.ok() && !recompute.empty())
    status = ParseRecompute(recompute, &spec.training.recompute);
  auto split_names = [](const std::string& text, std::vector<std::string>* names) {
    return ParseNameList<std::string>(  // comma-separated
        text,
        +[](const std::string& name, std::string* out) {
          *out = name;
          return Status::OK();
        },
        names);
  };
  if (status.ok() && vm.count("recompute-modules") != 0) {
    std::vector<std::string> names;
    status = split_names(recompute_modules, &names);
    if (status.ok()) status = ParseRecomputeModules(names, &spec.training.recompute_modules);
    if (status.ok() && spec.training.recompute != RecomputeKind::kSelective) {
      status = Status::Error("--recompute-modules needs --recompute selective");
    }
  }
  if (status.ok() && vm.count("cuda-graphs") != 0) {
    std::vector<std::string> names;
    status = split_names(cuda_graph_modules, &names);
    if (status.ok()) status = ParseCudaGraphModules(names, &spec.training.cuda_graph_modules);
    spec.training.cuda_graphs = true;
    spec.training.cuda_graph_warmup_steps = 0;
  }
  if (status.ok() && vm.count("offload-modules") != 0) {
    std::vector<std::string> names;
    status = split_names(offload_modules, &names);
    if (status.ok()) status = ParseOffloadModules(names, &spec.training.offload_modules);
  }
  if (status.ok() && !fp8.empty()) status = ParseFp8Recipe(fp8, &spec.training.fp8);
  if (fp8_param_gather) spec.training.fp8_param_gather = true;
  if (tp_comm_overlap) spec.training.tp_comm_overlap = true;
  if (micro_batch) spec.training.micro_batch_size = micro_batch;
  if (microbatches) spec.training.num_microbatches = microbatches;
  if (status.ok()) status = CheckReportOptions(report);
  if (tp) spec.layout.tp = tp;
  if (pp) spec.layout.pp = pp;
  if (vpp) spec.layout.vpp = vpp;
  if (cp) spec.layout.cp = cp;
  if (ep) spec.layout.ep = ep;
  if (first_stage_layers) spec.layout.first_stage_layers = first_stage_layers;
  if (last_stage_layers) spec.layout.last_stage_layers = last_stage_layers;
  if (!status.ok()) {
    std::fprintf(stderr, "memsim simulate: %s\n", status.message().c_str());
    return kExitError;
  }
  return SimulateAndReport(spec, report, "simulate");
}

Status WriteFilesOfRank(const ValidatedRun& run, const RankResult& result, int64_t rank,
                        const ReportOptions& options) {
  return WriteRankFiles(options.out_dir, run, {RankSpan{rank, rank, &result}}, options, {});
}

int SimulateAndReport(const RunSpec& unfinalized, const ReportOptions& options,
                      const char* command) {
  std::optional<ValidatedRun> run;
  Status status = FinalizeRunSpec(unfinalized, &run);
  if (status.ok()) status = EnsureWritableDirectory(options.out_dir);
  std::vector<RankResult> results;
  if (status.ok()) status = SimulateAllClasses(*run, options.jobs, &results);
  std::vector<RankSpan> selected;
  if (status.ok()) {
    status = SelectRanks(options.ranks, results, run->spec().layout.world_size, &selected);
  }
  std::vector<Advice> advice;
  if (status.ok() && options.advise)
    advice = AdviseOnPeak(unfinalized, *run, results, options.jobs);
  if (status.ok()) {
    status = WriteRankFiles(options.out_dir, *run, selected, options, advice);
  }
  if (!status.ok()) {
    std::fprintf(stderr, "memsim %s: %s\n", command, status.message().c_str());
    return kExitError;
  }
  const RunSpec& spec = run->spec();
  bool all_fit = true;
  int64_t fullest_bytes = 0;
  for (const RankResult& r : results) {
    all_fit = all_fit && r.fits();
    fullest_bytes = std::max(fullest_bytes, r.timeline.peak_reserved_bytes());
  }
  if (options.json) {
    nlohmann::json classes = nlohmann::json::array();
    for (const RankResult& r : results) classes.push_back(ClassSummary(*run, r, {}));
    nlohmann::json out = {{"model", spec.model_source},
                          {"gpu", spec.gpu->name},
                          {"world_size", spec.layout.world_size},
                          {"fits", all_fit},
                          {"theoretical_memory_MB", TheoreticalMemoryMB(*run, 0)},
                          {"parameters_total", ParameterCount(spec.model, spec.training,
                                                              ModelShard::Whole(spec.model))},
                          {"rank_classes", classes}};
    if (options.advise) out["advice"] = AdviceJson(advice);
    if (const ModelConfig& m = spec.model; m.num_experts > 0) {
      // What the experts' row counts assume (moe.h).
      out["moe_routing"] = {{"capacity_factor", m.moe_capacity_factor},
                            {"expert_capacity", ExpertCapacityPerRank(spec)},
                            {"pad_to_capacity", m.moe_pad_to_capacity},
                            {"imbalance", m.moe_imbalance_factor}};
    }
    std::cout << out.dump(2) << "\n";
  } else {
    PrintReport(*run, results, options.top_n);
    if (options.advise) PrintAdvice(advice, fullest_bytes);
    const int64_t written = RanksIn(selected);
    std::printf("\nWrote traces, summaries and snapshots of %lld rank%s to %s/\n",
                static_cast<long long>(written), written == 1 ? "" : "s", options.out_dir.c_str());
  }
  return options.check && !all_fit ? kExitDoesNotFit : kExitOk;
}

}  // namespace memsim
