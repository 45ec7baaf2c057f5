#include "tools/lib/sweep.h"

#include <boost/program_options.hpp>
#include <nlohmann/json.hpp>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <utility>

#include "parallel/parallel_for.h"
#include "simulator/atomic_file.h"
#include "simulator/checked_math.h"
#include "simulator/format.h"
#include "simulator/trace_writer.h"
#include "tools/lib/command_line.h"
#include "tools/lib/exit_codes.h"
#include "tools/lib/json_reader.h"
#include "tools/lib/layout_point.h"
#include "tools/lib/run_config.h"
#include "tools/lib/simulate.h"

namespace memsim {
namespace {
namespace fs = std::filesystem;
namespace po = boost::program_options;
using nlohmann::json;

struct SweepPoint : LayoutPoint {
  int64_t index = 0;  // "Config K"
  int64_t seq_length = 0;
};

std::string TraceName(const RunSpec& spec, int64_t rank) {
  const ParallelLayout& l = spec.layout;
  const ModelConfig& m = spec.model;
  const TrainingConfig& t = spec.training;
  std::ostringstream name;
  name << "memory_trace_rank" << rank << "_wd" << l.world_size << "_tp" << l.tp << "_pp" << l.pp
       << "_dp" << l.dp << "_exp" << l.ep << "_expNum"
       << (m.num_experts > 0 ? std::to_string(m.num_experts) : "None") << "_l" << m.num_layers
       << "_mbs" << t.micro_batch_size << "_nmbs" << t.num_microbatches << "_gbs"
       << t.num_microbatches * t.micro_batch_size * l.dp << "_ts" << t.seq_length;
  // Beyond the seeds' fields, only when not the default, so the seeds' names stay as they
  // are and layouts that differ in these do not overwrite each other.
  if (l.vpp > 1) name << "_vpp" << l.vpp;
  if (l.cp > 1) name << "_cp" << l.cp;
  if (t.recompute != RecomputeKind::kNone) name << "_rc" << RecomputeName(t.recompute);
  name << ".json";
  return name.str();
}

// The fields of a layout's result record that say which layout it is.
json PointRecord(const SweepPoint& point) {
  return {{"config", point.index},
          {"tp", point.tp},
          {"pp", point.pp},
          {"vpp", point.vpp},
          {"cp", point.cp},
          {"ep", point.ep},
          {"micro_batch_size", point.micro_batch},
          {"seq_length", point.seq_length},
          {"recompute", RecomputeName(point.recompute)}};
}

// The file under .sweep/ that holds a layout's record: named by the layout itself, so a
// resumed sweep over a changed grid never takes one layout's result for another's.
std::string RecordName(const SweepPoint& p) {
  return "layout_tp" + std::to_string(p.tp) + "_pp" + std::to_string(p.pp) + "_vpp" +
         std::to_string(p.vpp) + "_cp" + std::to_string(p.cp) + "_ep" + std::to_string(p.ep) +
         "_mbs" + std::to_string(p.micro_batch) + "_seq" + std::to_string(p.seq_length) + "_rc" +
         RecomputeName(p.recompute) + ".json";
}

// What every layout of one sweep shares (model, cluster, batch, precision; the sequence
// lengths are the points'): records of another run in the same folder are refused, not
// mixed in.
std::string RunIdentity(const RunSpec& spec, int64_t microbatches_per_pp) {
  const ModelConfig& m = spec.model;
  const TrainingConfig& t = spec.training;
  std::ostringstream id;
  id << spec.model_source << " L" << m.num_layers << " H" << m.hidden_size << " V" << m.vocab_size
     << " E" << m.num_experts << " on " << spec.layout.world_size << "x" << spec.gpu->name << " "
     << PrecisionName(t.precision)
     << (microbatches_per_pp > 0 ? " microbatches/pp " + std::to_string(microbatches_per_pp)
                                 : " gbs " + std::to_string(spec.global_batch_size))
     << " " << DataParallelName(spec.layout.data_parallel) << " iterations " << t.iterations;
  return id.str();
}

// The records in `dir`/.sweep, by file name.
Status LoadSweepRecords(const std::string& dir, std::map<std::string, json>* records) {
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir + "/.sweep", ec)) {
    if (entry.path().extension() != ".json") continue;
    json record;
    MEMSIM_RETURN_IF_ERROR(LoadSweepRecord(entry.path().string(), &record));
    (*records)[entry.path().filename().string()] = std::move(record);
  }
  if (ec) return Status::Error("cannot list '" + dir + "/.sweep': " + ec.message());
  return Status::OK();
}

// One layout's outcome: its record, unless writing its traces failed (then `io` says why
// and no record is kept, so that --resume redoes it).
struct PointOutcome {
  json record;
  Status io;
};

// How a sweep simulates each layout and writes its traces.
struct PointSettings {
  std::string out_dir;
  double sample_interval_s = 0;  // TraceOptions::sample_interval_s
  // Rule out a layout whose setup alone exceeds the GPU without simulating its steps
  // (SimulateSetup): its record says so and has no stages, peaks or traces.
  bool prune = false;
};

// Simulates one layout, writes its traces, returns its result record.
PointOutcome SimulatePoint(RunSpec spec, const SweepPoint& point, int64_t microbatches_per_pp,
                           const PointSettings& settings) {
  spec = WithLayoutPoint(std::move(spec), point);
  spec.training.seq_length = point.seq_length;
  json result = PointRecord(point);
  result["run"] = RunIdentity(spec, microbatches_per_pp);
  Status status;
  if (microbatches_per_pp > 0) {
    spec.global_batch_size = 0;
    try {
      spec.training.num_microbatches = CheckedMul(microbatches_per_pp, point.pp);
    } catch (const std::overflow_error&) {
      status = Status::Error("--microbatches-per-pp x PP overflows 64 bits");
    }
  }
  std::optional<ValidatedRun> run;
  if (status.ok()) status = FinalizeRunSpec(spec, &run);
  if (!status.ok()) {
    int64_t model_parallel = 0;
    try {
      model_parallel = CheckedMul(CheckedMul(point.tp, point.pp), point.cp);
    } catch (const std::overflow_error&) {
    }
    const int64_t dp = model_parallel > 0 && spec.layout.world_size % model_parallel == 0
                           ? spec.layout.world_size / model_parallel
                           : 0;
    // As FinalizeRunSpec derives them, where the layout allows.
    int64_t per_step = 0;
    if (__builtin_mul_overflow(point.micro_batch, dp, &per_step)) per_step = 0;
    const int64_t microbatches =
        spec.global_batch_size > 0 && per_step > 0 && spec.global_batch_size % per_step == 0
            ? spec.global_batch_size / per_step
            : spec.training.num_microbatches;
    result["dp"] = dp;
    result["status"] = "invalid";
    result["reason"] = "invalid layout: " + status.message();
    result["num_microbatches"] = microbatches;
    result["global_batch_size"] =
        spec.global_batch_size > 0 ? spec.global_batch_size : microbatches * point.micro_batch * dp;
    return {result, Status::OK()};
  }
  spec = run->spec();
  result["dp"] = spec.layout.dp;
  result["num_microbatches"] = spec.training.num_microbatches;
  result["global_batch_size"] =
      spec.training.num_microbatches * spec.training.micro_batch_size * spec.layout.dp;
  result["theoretical_memory_MB"] = TheoreticalMemoryMB(*run, 0);  // Megatron-LM's own
  if (settings.prune) {
    SetupMemory setup;
    status = SimulateSetup(*run, &setup);
    if (status.ok() && setup.peak_allocated_bytes > AllocatorCapacityBytes(spec)) {
      char reason[256];
      std::snprintf(reason, sizeof(reason),
                    "pruned (not simulated): parameters, gradient buffers and master weights "
                    "alone take %.1f MB on stage %lld, over the %.1f MB the allocator can reserve",
                    BytesToMiB(setup.peak_allocated_bytes), static_cast<long long>(setup.pp_rank),
                    BytesToMiB(AllocatorCapacityBytes(spec)));
      result["status"] = "oom";
      result["pruned"] = true;
      result["reason"] = reason;
      return {result, Status::OK()};
    }
  }
  std::vector<RankResult> classes;
  if (status.ok()) status = SimulateAllClasses(*run, /*jobs=*/1, &classes);
  if (!status.ok()) {
    result["status"] = "error";
    result["reason"] = status.message();
    return {result, Status::OK()};
  }
  json stages = json::array();
  double worst_mb = 0;
  const RankResult* failing = nullptr;  // the first stage that runs out of memory
  for (const RankResult& r : classes) {
    const double peak_mb = BytesToMiB(r.timeline.peak_allocated_bytes());
    const double reserved_mb = BytesToMiB(r.timeline.peak_reserved_bytes());
    stages.push_back(
        {{"stage", r.rank_class.pp_rank},
         {"first_rank", r.rank_class.representative},
         {"static_MB", BytesToMiB(r.timeline.iterations().back().static_allocated_bytes)},
         {"peak_allocated_MB", peak_mb},
         {"peak_reserved_MB", reserved_mb},
         {"fits", r.fits()}});
    worst_mb = std::max(worst_mb, reserved_mb);
    if (failing == nullptr && !r.fits()) failing = &r;
    const Status write = WriteTrace(
        settings.out_dir + "/" + TraceName(spec, r.rank_class.representative), r.timeline,
        TraceOptions{settings.sample_interval_s, TheoreticalMemoryMB(*run, r.rank_class.pp_rank),
                     5000});
    if (!write.ok()) return {json(), write};
  }
  result["stages"] = stages;
  result["max_peak_reserved_MB"] = worst_mb;
  result["status"] = failing == nullptr ? "success" : "oom";
  if (failing != nullptr) {
    // "peak X MB" as the seeds' logs (and the heatmap) read it, then why.
    char peak[160];
    std::snprintf(
        peak, sizeof(peak),
        "predicted out of memory: peak %.1f MB > allocator capacity %.1f MB on stage %lld; ",
        BytesToMiB(failing->timeline.peak_reserved_bytes()),
        BytesToMiB(AllocatorCapacityBytes(spec)),
        static_cast<long long>(failing->rank_class.pp_rank));
    result["reason"] = peak + DescribeOutOfMemory(*failing, spec);
  }
  return {result, Status::OK()};
}

// SimulatePoint, with any exception (a memsim bug) turned into an error record: this runs
// on worker threads, where an escaping exception would abort the whole sweep.
PointOutcome RunPoint(const RunSpec& spec, const SweepPoint& point, int64_t microbatches_per_pp,
                      const PointSettings& settings) {
  try {
    return SimulatePoint(spec, point, microbatches_per_pp, settings);
  } catch (const std::exception& e) {
    json result = PointRecord(point);
    result.update({{"run", RunIdentity(spec, microbatches_per_pp)},
                   {"dp", 0},
                   {"num_microbatches", 0},
                   {"global_batch_size", 0},
                   {"status", "error"},
                   {"reason", std::string("internal error: ") + e.what()}});
    return {result, Status::OK()};
  }
}

// Regenerates the logs and tables from the finished layouts in `out_dir`/.sweep: those
// named in `only` (the sweep's grid), or every one when `only` is null (merge).
Status WriteReports(const std::string& out_dir, const std::set<std::string>* only) {
  std::map<std::string, json> records;
  MEMSIM_RETURN_IF_ERROR(LoadSweepRecords(out_dir, &records));
  std::vector<json> results;
  for (auto& [name, record] : records) {
    if (only == nullptr || only->count(name)) results.push_back(std::move(record));
  }
  std::sort(results.begin(), results.end(),
            [](const json& a, const json& b) { return a["config"] < b["config"]; });
  std::string success, failed;
  std::string csv =
      "config,tp,pp,vpp,dp,cp,ep,micro_batch_size,num_microbatches,global_batch_size,seq_length,"
      "recompute,"
      "status,max_peak_reserved_MB,stage_peaks_MB,reason\n";
  for (const json& r : results) {
    char head[256];
    std::snprintf(
        head, sizeof(head),
        "Config %lld: TP=%lld, PP=%lld, DP=%lld, NUM_MICBATCH=%lld, GLOBAL_BATCH_SIZE=%lld",
        r["config"].get<long long>(), r["tp"].get<long long>(), r["pp"].get<long long>(),
        r["dp"].get<long long>(), r["num_microbatches"].get<long long>(),
        r["global_batch_size"].get<long long>());
    if (r["status"] == "success") {
      success += std::string(head) + " - SUCCESS\n";
    } else {
      failed += std::string(head) + " - FAILED (" + r.value("reason", std::string()) + ")\n";
    }
    std::string stage_peaks;
    if (r.contains("stages")) {
      for (const json& s : r["stages"]) {
        char v[32];
        std::snprintf(v, sizeof(v), "%.1f", s["peak_reserved_MB"].get<double>());
        stage_peaks += (stage_peaks.empty() ? "" : ";") + std::string(v);
      }
    }
    std::ostringstream row;
    for (const char* key : {"config", "tp", "pp", "vpp", "dp", "cp", "ep", "micro_batch_size",
                            "num_microbatches", "global_batch_size", "seq_length"}) {
      row << r[key].get<long long>() << ",";
    }
    char peak[32];
    std::snprintf(peak, sizeof(peak), "%.1f", r.value("max_peak_reserved_MB", 0.0));
    row << r["recompute"].get<std::string>() << "," << r["status"].get<std::string>() << "," << peak
        << "," << stage_peaks << "," << CsvQuoted(r.value("reason", std::string())) << "\n";
    csv += row.str();
  }
  MEMSIM_RETURN_IF_ERROR(WriteFileAtomically(out_dir + "/successful_configs.log", success));
  MEMSIM_RETURN_IF_ERROR(WriteFileAtomically(out_dir + "/failed_configs.log", failed));
  MEMSIM_RETURN_IF_ERROR(WriteFileAtomically(out_dir + "/sweep_results.csv", csv));
  return WriteFileAtomically(out_dir + "/sweep_results.json", json(results).dump(1));
}

// A run killed while writing leaves its temporary files ("name.tmp.PID", never a partial
// result): a resumed run removes them.
void RemoveStaleTemporaries(const std::string& out_dir) {
  std::error_code ec;
  for (const std::string& dir : {out_dir, out_dir + "/.sweep"}) {
    for (const auto& entry : fs::directory_iterator(dir, ec)) {
      if (entry.path().filename().string().find(".tmp.") != std::string::npos) {
        fs::remove(entry.path(), ec);
      }
    }
  }
}

Status ParseShard(const std::string& text, int64_t* index, int64_t* count) {
  const char* task = std::getenv("SLURM_ARRAY_TASK_ID");
  const char* tasks = std::getenv("SLURM_ARRAY_TASK_COUNT");
  std::string shard = text;
  if (shard.empty() && task != nullptr && tasks != nullptr) shard = std::string(task) + "/" + tasks;
  if (shard.empty()) {
    *index = 0;
    *count = 1;
    return Status::OK();
  }
  long long k = -1, n = -1;
  char tail = 0;
  if (std::sscanf(shard.c_str(), "%lld/%lld%c", &k, &n, &tail) != 2 || n <= 0 || k < 0 || k >= n) {
    return Status::Error("--shard '" + shard + "' must be K/N with 0 <= K < N (e.g. 0/4)");
  }
  *index = k;
  *count = n;
  return Status::OK();
}

}  // namespace

Status LoadSweepRecord(const std::string& path, json* out) {
  MEMSIM_RETURN_IF_ERROR(ParseJsonFile(path, out));
  const json& r = *out;
  auto bad = [&](const std::string& what) {
    return Status::Error("sweep result '" + path + "': " + what +
                         "; delete it and run with --resume to redo that layout");
  };
  if (!r.is_object()) return bad("not a JSON object");
  for (const char* key : {"config", "tp", "pp", "vpp", "dp", "cp", "ep", "micro_batch_size",
                          "num_microbatches", "global_batch_size", "seq_length"}) {
    if (!r.contains(key) || !r[key].is_number_integer()) {
      return bad(std::string("missing or non-integer '") + key + "'");
    }
  }
  for (const char* key : {"recompute", "status", "run"}) {
    if (!r.contains(key) || !r[key].is_string()) return bad(std::string("missing '") + key + "'");
  }
  if (r.contains("reason") && !r["reason"].is_string()) return bad("'reason' is not text");
  if (r.contains("max_peak_reserved_MB") && !r["max_peak_reserved_MB"].is_number()) {
    return bad("'max_peak_reserved_MB' is not a number");
  }
  if (r.contains("stages")) {
    if (!r["stages"].is_array()) return bad("'stages' is not a list");
    for (const json& stage : r["stages"]) {
      if (!stage.is_object() || !stage.contains("peak_reserved_MB") ||
          !stage["peak_reserved_MB"].is_number()) {
        return bad("a stage without a numeric 'peak_reserved_MB'");
      }
    }
  }
  return Status::OK();
}

int SweepCommand(int argc, const char* const* argv) {
  po::options_description options(
      "memsim sweep [options]\n\n"
      "Simulates every valid layout over the given value lists and writes traces, the seeds'\n"
      "successful/failed logs, and CSV and JSON tables (see memsim heatmap to plot them).\n\n"
      "Examples:\n"
      "  memsim sweep --model gpt-485b --world-size 8192 --precision fp16 --seq-length 2048 \\\n"
      "      --tp 1,2,4,8 --pp 2,4,8,16,32,64 --microbatches-per-pp 6 --out sweep_485b\n"
      "  memsim sweep --model llama3-70b --world-size 1024 --global-batch-size 1024 --resume\n"
      "  memsim sweep --model llama3-8b --world-size 8 --global-batch-size 64 --tp 1,2 --pp 1 \\\n"
      "      --seq-length 2048,4096,8192 --micro-batch-size 1,2 --out sweep_seq    (memory vs "
      "sequence)\n"
      "  memsim sweep --model gpt3-1.3b --world-size 8 --global-batch-size 16 --tp 1,2 --pp 1,2 "
      "\\\n"
      "      --shard 0/4 --out sweep_0    (K/N, or SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_COUNT)\n\n"
      "Options");
  SpecOptions spec_options;
  spec_options.iterations = 2;  // the steady state: optimizer states exist from the second
  std::string out_dir = "memsim_sweep", shard;
  double sample_interval_s = 0;
  std::string tp_list = "1,2,4,8", pp_list = "1,2,4,8,16,32,64", vpp_list = "1", cp_list = "1",
              ep_list = "1", mbs_list = "1", recompute_list = "none", seq_list;
  int64_t microbatches_per_pp = 0;
  int jobs = 2;
  bool resume = false, prune = false;
  options.add_options()("help,h", "show this help");
  AddSpecOptions(&options, &spec_options, &seq_list);
  options.add_options()("tp", po::value(&tp_list), "TP values (default 1,2,4,8)")(
      "pp", po::value(&pp_list), "PP values (default 1,2,4,8,16,32,64)")(
      "vpp", po::value(&vpp_list), "VPP values (default 1)")(
      "cp", po::value(&cp_list), "CP values")("ep", po::value(&ep_list), "EP values")(
      "micro-batch-size", po::value(&mbs_list), "micro-batch sizes")(
      "recompute", po::value(&recompute_list), "recomputation kinds: none,selective,full")(
      "microbatches-per-pp", PositiveValue(&microbatches_per_pp, "microbatches-per-pp"),
      "microbatches = this * PP (the seeds use 6); global batch follows")(
      "jobs,j", PositiveValue(&jobs, "jobs"), "layouts simulated at once (default 2)")(
      "out", po::value(&out_dir), "output folder (default memsim_sweep)")(
      "sample-interval", po::value(&sample_interval_s),
      "thin trace samples to this many seconds of virtual time (peaks are kept)")(
      "resume", po::bool_switch(&resume), "skip layouts already finished in --out")(
      "prune", po::bool_switch(&prune),
      "rule out layouts whose setup alone exceeds the GPU without simulating their steps "
      "(faster; they get no peak or traces)")(
      "shard", po::value(&shard), "K/N: run every N-th layout starting at K (job arrays)");
  po::variables_map vm;
  if (auto exit_code = ParseCommandLine(argc, argv, options, "sweep", &vm)) return *exit_code;
  RunSpec base;
  Status status = BuildRunSpec(spec_options, /*default_run=*/false, "sweep", &base);
  const int64_t global_batch = spec_options.global_batch_size;
  if (status.ok() && global_batch > 0 && microbatches_per_pp > 0) {
    status = Status::Error("give either --global-batch-size or --microbatches-per-pp, not both");
  }
  if (status.ok() && !base.layout.pipeline_layout.empty()) {
    status = Status::Error(
        "a pipeline layout fixes PP and VPP, which a sweep varies: drop pipeline_layout");
  }
  std::vector<int64_t> tps, pps, vpps, cps, eps, mbss, seqs = {base.training.seq_length};
  std::vector<RecomputeKind> recomputes;
  if (status.ok()) status = ParseIntList(tp_list, "tp", &tps);
  if (status.ok()) status = ParseIntList(pp_list, "pp", &pps);
  if (status.ok()) status = ParseIntList(vpp_list, "vpp", &vpps);
  if (status.ok()) status = ParseIntList(cp_list, "cp", &cps);
  if (status.ok()) status = ParseIntList(ep_list, "ep", &eps);
  if (status.ok()) status = ParseIntList(mbs_list, "micro-batch-size", &mbss);
  if (status.ok() && !seq_list.empty()) status = ParseIntList(seq_list, "seq-length", &seqs);
  if (status.ok()) status = ParseNameList(recompute_list, &ParseRecompute, &recomputes);
  if (status.ok() && !(sample_interval_s >= 0 && std::isfinite(sample_interval_s))) {
    status = Status::Error("--sample-interval must be a non-negative number of seconds");
  }
  int64_t shard_index = 0, shard_count = 1;
  if (status.ok()) status = ParseShard(shard, &shard_index, &shard_count);
  if (status.ok()) status = EnsureWritableDirectory(out_dir + "/.sweep");
  if (status.ok() && resume) RemoveStaleTemporaries(out_dir);
  // A used folder holds another run's layouts: continue it only on purpose (--resume),
  // and only the same run.
  std::map<std::string, json> existing;
  if (status.ok()) status = LoadSweepRecords(out_dir, &existing);
  const std::string run = status.ok() ? RunIdentity(base, microbatches_per_pp) : "";
  if (status.ok() && !existing.empty() && !resume) {
    status =
        Status::Error("'" + out_dir + "' already holds " + std::to_string(existing.size()) +
                      " layouts of a sweep; continue it with --resume or choose another --out");
  }
  for (const auto& [name, record] : existing) {
    if (!status.ok()) break;
    if (record["run"] != run) {
      status = Status::Error("--resume: '" + out_dir + "' holds a sweep of another run (" +
                             record["run"].get<std::string>() + "); this one is " + run +
                             "; choose another --out");
    }
  }
  if (!status.ok()) {
    std::fprintf(stderr, "memsim sweep: %s\n", status.message().c_str());
    return kExitError;
  }

  std::vector<SweepPoint> points;
  std::set<std::string> grid;  // every layout of the sweep, all shards
  int64_t index = 0;
  for (int64_t t : tps)
    for (int64_t p : pps)
      for (int64_t v : vpps)
        for (int64_t c : cps)
          for (int64_t e : eps)
            for (int64_t m : mbss)
              for (int64_t seq : seqs)
                for (RecomputeKind r : recomputes) {
                  const SweepPoint point{{t, p, v, c, e, m, r}, ++index, seq};
                  grid.insert(RecordName(point));
                  if ((index - 1) % shard_count != shard_index) continue;
                  if (existing.count(RecordName(point))) continue;  // finished before --resume
                  points.push_back(point);
                }
  std::atomic<size_t> finished{0};
  std::mutex io;
  std::vector<Status> errors;
  size_t pruned = 0;
  const auto start = std::chrono::steady_clock::now();
  ParallelFor(points.size(), jobs, [&](size_t i) {
    const PointOutcome outcome =
        RunPoint(base, points[i], microbatches_per_pp, {out_dir, sample_interval_s, prune});
    Status write = outcome.io;
    if (write.ok()) {
      write =
          WriteFileAtomically(out_dir + "/.sweep/" + RecordName(points[i]), outcome.record.dump());
    }
    std::lock_guard<std::mutex> lock(io);
    if (!write.ok()) errors.push_back(write);
    if (outcome.record.value("pruned", false)) ++pruned;
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ShowProgress("layouts", ++finished, points.size(), elapsed);
  });
  if (errors.empty()) status = WriteReports(out_dir, &grid);
  if (!errors.empty() || !status.ok()) {
    // Layouts whose outputs could not be written keep no record: --resume redoes them.
    std::fprintf(stderr, "memsim sweep: %s%s\n",
                 errors.empty() ? "" : "I/O error (rerun with --resume once fixed): ",
                 (errors.empty() ? status : errors[0]).message().c_str());
    return kExitError;
  }
  const std::string pruned_note =
      prune ? ", " + std::to_string(pruned) + " of them pruned before simulating their steps" : "";
  std::printf(
      "memsim sweep: %zu layout%s simulated%s (%lld in all, shard %lld/%lld); results in %s/\n",
      points.size(), points.size() == 1 ? "" : "s", pruned_note.c_str(),
      static_cast<long long>(index), static_cast<long long>(shard_index),
      static_cast<long long>(shard_count), out_dir.c_str());
  return kExitOk;
}

int MergeCommand(int argc, const char* const* argv) {
  const bool help = argc >= 2 && (std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h");
  if (argc < 3 || help) {
    std::printf(
        "memsim merge OUT_DIR SHARD_DIR...\n\n"
        "Joins the outputs of sweep shards (memsim sweep --shard K/N) into OUT_DIR and rewrites\n"
        "its logs and tables.\n\nExample:\n  memsim merge sweep_all sweep_0 sweep_1 sweep_2 "
        "sweep_3\n");
    return help ? kExitOk : kExitError;
  }
  const std::string out_dir = argv[1];
  // Every shard is read and checked before anything is written: a bad shard leaves the
  // output as it was, and the error names the shard's file.
  Status status;
  std::vector<std::pair<fs::path, std::string>> copies;  // (source, path under out_dir)
  std::string run;
  for (int i = 2; status.ok() && i < argc; ++i) {
    const fs::path shard = argv[i];
    std::error_code not_found;
    if (!fs::is_directory(shard / ".sweep", not_found)) {
      status = Status::Error("'" + shard.string() + "' is not a sweep output folder (no .sweep/)");
      break;
    }
    std::map<std::string, json> records;
    status = LoadSweepRecords(shard.string(), &records);
    for (const auto& [name, record] : records) {
      if (!status.ok()) break;
      if (run.empty()) run = record["run"].get<std::string>();
      if (record["run"] != run) {
        status = Status::Error("'" + (shard / ".sweep" / name).string() +
                               "' is a layout of another run (" + record["run"].get<std::string>() +
                               ", not " + run + ")");
      }
      copies.emplace_back(shard / ".sweep" / name, ".sweep/" + name);
    }
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(shard, ec)) {
      if (!status.ok()) break;
      const std::string name = entry.path().filename().string();
      if (!entry.is_regular_file() || entry.path().extension() != ".json" ||
          name.rfind("memory_trace_rank", 0) != 0) {
        continue;
      }
      json trace;
      status = ParseJsonFile(entry.path().string(), &trace);
      copies.emplace_back(entry.path(), name);
    }
    if (status.ok() && ec) {
      status = Status::Error("cannot list '" + shard.string() + "': " + ec.message());
    }
  }
  if (status.ok()) status = EnsureWritableDirectory(out_dir + "/.sweep");
  for (const auto& [source, target] : copies) {
    if (!status.ok()) break;
    // Copied atomically: a killed merge never leaves a truncated result behind.
    std::ifstream in(source, std::ios::binary);
    const std::string contents((std::istreambuf_iterator<char>(in)), {});
    status = in.bad() ? Status::Error("cannot read '" + source.string() + "'")
                      : WriteFileAtomically((fs::path(out_dir) / target).string(), contents);
  }
  if (status.ok()) status = WriteReports(out_dir, /*only=*/nullptr);
  if (!status.ok()) {
    std::fprintf(stderr, "memsim merge: %s\n", status.message().c_str());
    return kExitError;
  }
  std::printf("memsim merge: wrote %s/\n", out_dir.c_str());
  return kExitOk;
}

}  // namespace memsim
