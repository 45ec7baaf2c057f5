#include "tools/lib/plan.h"

#include <boost/program_options.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <map>
#include <mutex>
#include <sstream>
#include <tuple>

#include "parallel/layout.h"
#include "parallel/parallel_for.h"
#include "simulator/atomic_file.h"
#include "simulator/format.h"
#include "simulator/timeline.h"
#include "tools/lib/command_line.h"
#include "tools/lib/exit_codes.h"
#include "tools/lib/megatron_command.h"
#include "tools/lib/plots_runner.h"
#include "tools/lib/simulate.h"

namespace memsim {
namespace {
namespace po = boost::program_options;
using nlohmann::json;

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

double GiB(int64_t bytes) { return static_cast<double>(bytes) / kGiB; }

// The fullest stage's peak reserved memory; -1 when the entry was not simulated.
int64_t FullestStage(const PlanEntry& e) {
  const auto& peaks = e.stage_peak_reserved_bytes;
  return peaks.empty() ? -1 : *std::max_element(peaks.begin(), peaks.end());
}

// `base` with `layout` applied, not yet finalized.
RunSpec Apply(const RunSpec& base, const PlanLayout& layout) {
  RunSpec spec = WithLayoutPoint(base, layout);
  spec.layout.etp = layout.etp;
  spec.layout.sequence_parallel = layout.tp > 1;
  spec.layout.data_parallel = layout.data_parallel;
  if (layout.first_stage_layers > 0) {
    spec.layout.first_stage_layers = layout.first_stage_layers;
    spec.layout.last_stage_layers = layout.last_stage_layers;
  }
  return spec;
}

// Whether the plan may choose uneven stages for `base` (Note [Plan's uneven stages]).
bool PlanChoosesStages(const RunSpec& base) {
  const ParallelLayout& l = base.layout;
  return l.first_stage_layers == 0 && l.last_stage_layers == 0 && l.pipeline_layout.empty() &&
         !l.embedding_in_split && !l.loss_in_split;
}

// Microbatches that hold as many in flight as any larger count (Note [Plan search] 4).
int64_t ScreeningMicrobatches(const ParallelLayout& layout, int64_t microbatches) {
  const int64_t saturating = layout.vpp > 1 ? 2 * layout.pp : layout.pp + 1;
  return std::min(microbatches, saturating);
}

// Note [Plan search] 2: whether the memory that lives through the whole step already
// exceeds the GPU; `reason` says where.
Status SetupExceedsGpu(const ValidatedRun& run, bool* exceeds, std::string* reason) {
  const int64_t capacity_bytes = AllocatorCapacityBytes(run.spec());
  SetupMemory setup;
  MEMSIM_RETURN_IF_ERROR(SimulateSetup(run, &setup));
  *exceeds = setup.peak_allocated_bytes > capacity_bytes;
  if (*exceeds) {
    *reason = "parameters, gradient buffers and master weights alone take " +
              FormatBytes(setup.peak_allocated_bytes) + " on stage " +
              std::to_string(setup.pp_rank) + ", over the " + FormatBytes(capacity_bytes) +
              " the allocator can reserve";
  }
  return Status::OK();
}

// Ranked: fits by PlanRanksBefore, then the other verdicts in enum order, then grid order.
void Rank(std::vector<PlanEntry>* entries) {
  std::stable_sort(entries->begin(), entries->end(), [](const PlanEntry& a, const PlanEntry& b) {
    if (a.verdict != b.verdict) return static_cast<int>(a.verdict) < static_cast<int>(b.verdict);
    return a.verdict == PlanVerdict::kFits && PlanRanksBefore(a, b);
  });
}

// A layout that fitted when screened did not fit with every microbatch: the layouts of its
// group with more recomputation were marked dominated by it, so they are simulated now, in
// order, until one fits (which then dominates the rest).
void ReviveDominated(const RunSpec& base, const PlanGrid& grid, const PlanLayout& failed,
                     std::vector<PlanEntry>* entries) {
  auto same_group = [&](const PlanLayout& l) {
    return l.tp == failed.tp && l.pp == failed.pp && l.vpp == failed.vpp && l.cp == failed.cp &&
           l.ep == failed.ep && l.etp == failed.etp && l.micro_batch == failed.micro_batch &&
           l.data_parallel == failed.data_parallel;
  };
  std::string fitting;
  for (RecomputeKind recompute : grid.recompute) {
    for (PlanEntry& e : *entries) {
      if (!same_group(e.layout) || e.layout.recompute != recompute ||
          e.verdict != PlanVerdict::kDominated) {
        continue;
      }
      if (!fitting.empty()) {
        e.reason = fitting + " fits with less recomputation and is no slower";
        continue;
      }
      e = SimulatePlanLayout(base, e.layout, /*screen=*/true);
      if (e.verdict == PlanVerdict::kFits) fitting = PlanLayoutName(e.layout);
    }
  }
}

}  // namespace

bool PlanUnevenStages(int64_t layers, int64_t pp, int64_t* first_stage_layers,
                      int64_t* last_stage_layers) {
  if (pp < 2 || layers % pp == 0) return false;
  const int64_t middle = (layers + pp - 1) / pp;
  const int64_t excess = pp * middle - layers;  // in [1, pp - 1]
  const int64_t first = middle - (excess + 1) / 2;
  if (first < 1) return false;
  *first_stage_layers = first;
  *last_stage_layers = middle - excess / 2;
  return true;
}

std::string PlanLayoutName(const PlanLayout& l) {
  std::ostringstream name;
  name << "TP" << l.tp << " PP" << l.pp;
  if (l.first_stage_layers > 0) {
    name << " (first " << l.first_stage_layers << ", last " << l.last_stage_layers << " layers)";
  }
  name << " VPP" << l.vpp << " CP" << l.cp << " EP" << l.ep;
  if (l.etp != 0) name << " ETP" << l.etp;
  name << " mbs" << l.micro_batch << " recompute=" << RecomputeName(l.recompute) << " "
       << DataParallelName(l.data_parallel);
  return name.str();
}

bool PlanRanksBefore(const PlanEntry& a, const PlanEntry& b) {
  if (a.step.total_s != b.step.total_s) return a.step.total_s < b.step.total_s;
  if (a.headroom_bytes != b.headroom_bytes) return a.headroom_bytes > b.headroom_bytes;
  return PlanLayoutName(a.layout) < PlanLayoutName(b.layout);
}

PlanGrid DefaultPlanGrid(const RunSpec& base) {
  PlanGrid grid;
  const ModelConfig& m = base.model;
  const int64_t node = base.gpu->gpus_per_node;
  for (int64_t tp = 1; tp <= node; tp *= 2) grid.tp.push_back(tp);
  for (int64_t pp = 1; pp <= std::min<int64_t>(m.num_layers, 64); ++pp) {
    if (base.layout.world_size % pp != 0) continue;
    bool splits = false;
    if (PlanChoosesStages(base)) {
      int64_t first = 0, last = 0;
      splits = m.num_layers % pp == 0 || PlanUnevenStages(m.num_layers, pp, &first, &last);
    } else {
      // The run's own split (first/last stage layers) on pp stages, as FinalizeLayout takes it.
      ParallelLayout split = base.layout;
      split.world_size = pp;
      split.pp = pp;
      split.tp = split.cp = split.ep = split.vpp = 1;
      split.etp = 0;
      splits = FinalizeLayout(&split, m).ok();
    }
    if (splits) grid.pp.push_back(pp);
  }
  grid.vpp = {1, 2};
  grid.cp = base.training.seq_length >= 8192 ? std::vector<int64_t>{1, 2} : std::vector<int64_t>{1};
  grid.ep = {1};
  for (int64_t ep = 2; m.num_experts > 0 && ep <= std::min<int64_t>(m.num_experts, 64); ep *= 2) {
    if (m.num_experts % ep == 0) grid.ep.push_back(ep);
  }
  grid.micro_batch = {1};
  grid.recompute = {RecomputeKind::kNone, RecomputeKind::kSelective, RecomputeKind::kFull};
  grid.data_parallel = {DataParallelKind::kDistributedOptimizer};
  return grid;
}

PlanEntry SimulatePlanLayout(const RunSpec& base, const PlanLayout& layout, bool screen) {
  PlanEntry entry;
  entry.layout = layout;
  std::optional<ValidatedRun> full;
  Status status = FinalizeRunSpec(Apply(base, layout), &full);
  if (!status.ok()) {
    entry.verdict = PlanVerdict::kInvalid;
    entry.reason = status.message();
    return entry;
  }
  const RunSpec& spec = full->spec();
  entry.dp = spec.layout.dp;
  entry.microbatches = spec.training.num_microbatches;
  const ValidatedRun* run = &*full;
  std::optional<ValidatedRun> screened_run;
  if (screen) {
    const int64_t fewer = ScreeningMicrobatches(spec.layout, spec.training.num_microbatches);
    if (fewer < spec.training.num_microbatches) {
      RunSpec screened = Apply(base, layout);
      screened.global_batch_size = 0;
      screened.training.num_microbatches = fewer;
      if (FinalizeRunSpec(screened, &screened_run).ok()) run = &*screened_run;
    }
  }
  const int64_t simulated_microbatches = run->spec().training.num_microbatches;
  entry.verified = simulated_microbatches == spec.training.num_microbatches;
  std::vector<RankResult> stages;
  status = SimulateAllClasses(*run, /*jobs=*/1, &stages);
  if (!status.ok()) {
    entry.verdict = PlanVerdict::kError;
    entry.reason = status.message();
    return entry;
  }
  entry.headroom_bytes = AllocatorCapacityBytes(spec);
  for (const RankResult& r : stages) {
    entry.stage_peak_reserved_bytes.push_back(r.timeline.peak_reserved_bytes());
    if (!r.fits() && entry.oom_stage < 0) {
      entry.oom_stage = r.rank_class.pp_rank;
      entry.over_bytes = r.timeline.peak_reserved_bytes() - AllocatorCapacityBytes(spec);
      entry.reason = DescribeOutOfMemory(r, spec);
    }
    if (r.fits()) entry.headroom_bytes = std::min(entry.headroom_bytes, r.headroom_bytes(spec));
  }
  if (entry.oom_stage >= 0) {
    entry.verdict = PlanVerdict::kOutOfMemory;
    return entry;
  }
  entry.verdict = PlanVerdict::kFits;
  entry.step = EstimateStepTime(spec.model, spec.training, spec.layout, *spec.gpu,
                                MeasuredClocks(stages, simulated_microbatches));
  return entry;
}

Status RunPlan(const RunSpec& base, const PlanGrid& grid, const PlanSettings& settings,
               std::vector<PlanEntry>* entries) {
  if (base.gpu == nullptr || base.global_batch_size <= 0) {
    return Status::Error("plan needs a GPU and a global batch size (--global-batch-size)");
  }
  // Layouts that differ only in recomputation form one group (Note [Plan search] 3).
  std::vector<PlanLayout> groups;
  for (DataParallelKind d : grid.data_parallel)
    for (int64_t tp : grid.tp)
      for (int64_t pp : grid.pp)
        for (int64_t vpp : grid.vpp)
          for (int64_t cp : grid.cp)
            for (int64_t ep : grid.ep)
              for (int64_t etp : grid.etp)
                for (int64_t mbs : grid.micro_batch) {
                  PlanLayout l;
                  l.tp = tp, l.pp = pp, l.vpp = vpp, l.cp = cp, l.ep = ep, l.micro_batch = mbs;
                  l.etp = etp;
                  l.data_parallel = d;
                  if (vpp == 1 && PlanChoosesStages(base)) {
                    PlanUnevenStages(base.model.num_layers, pp, &l.first_stage_layers,
                                     &l.last_stage_layers);
                  }
                  groups.push_back(l);
                }
  std::vector<std::vector<PlanEntry>> results(groups.size());
  std::atomic<size_t> finished{0};
  std::mutex progress;
  const auto start = std::chrono::steady_clock::now();
  ParallelFor(groups.size(), settings.jobs, [&](size_t g) {
    std::vector<PlanEntry>& out = results[g];
    bool pruned = false, fits = false;
    std::string pruned_reason, fitting_name;
    for (RecomputeKind recompute : grid.recompute) {
      PlanLayout layout = groups[g];
      layout.recompute = recompute;
      PlanEntry entry;
      entry.layout = layout;
      std::optional<ValidatedRun> run;
      const Status valid = FinalizeRunSpec(Apply(base, layout), &run);
      if (!valid.ok()) {
        entry.verdict = PlanVerdict::kInvalid;
        entry.reason = valid.message();
      } else if (fits) {
        entry.verdict = PlanVerdict::kDominated;
        entry.reason = fitting_name + " fits with less recomputation and is no slower";
      } else {
        if (!pruned && pruned_reason.empty()) {
          const Status setup = SetupExceedsGpu(*run, &pruned, &pruned_reason);
          if (!setup.ok()) pruned_reason = "setup: " + setup.message();
        }
        if (pruned) {
          entry.verdict = PlanVerdict::kPruned;
          entry.reason = pruned_reason;
        } else {
          entry = SimulatePlanLayout(base, layout, /*screen=*/true);
          if (entry.verdict == PlanVerdict::kFits) {
            fits = true;
            fitting_name = PlanLayoutName(layout);
          }
        }
      }
      if (entry.dp == 0 && valid.ok()) {
        entry.dp = run->spec().layout.dp;
        entry.microbatches = run->spec().training.num_microbatches;
      }
      out.push_back(std::move(entry));
    }
    if (settings.progress) {
      std::lock_guard<std::mutex> lock(progress);
      ShowProgress("layout groups", ++finished, groups.size(),
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
  });
  entries->clear();
  for (auto& group : results) {
    for (PlanEntry& e : group) entries->push_back(std::move(e));
  }
  // Note [Plan search] 5: verify the best until the top `verify` are all verified.
  for (;;) {
    Rank(entries);
    std::vector<size_t> unverified;
    for (size_t i = 0; i < entries->size() && static_cast<int64_t>(i) < settings.verify; ++i) {
      const PlanEntry& e = (*entries)[i];
      if (e.verdict == PlanVerdict::kFits && !e.verified) unverified.push_back(i);
    }
    if (unverified.empty()) break;
    ParallelFor(unverified.size(), settings.jobs, [&](size_t k) {
      PlanEntry& e = (*entries)[unverified[k]];
      e = SimulatePlanLayout(base, e.layout, /*screen=*/false);
      e.verified = true;
    });
    for (size_t i : unverified) {
      if ((*entries)[i].verdict != PlanVerdict::kFits) {
        ReviveDominated(base, grid, (*entries)[i].layout, entries);
      }
    }
  }
  return Status::OK();
}

namespace {

std::string Fixed(double value, int digits) {
  char text[64];
  std::snprintf(text, sizeof(text), "%.*f", digits, value);
  return text;
}

// The largest micro batch of `entry`'s layout that fits (doubling while the global batch
// divides), with its entry; `entry` itself when no larger one fits.
PlanEntry LargestMicroBatch(const RunSpec& base, const PlanEntry& entry) {
  PlanEntry best = entry;
  for (PlanLayout next = entry.layout;;) {
    next.micro_batch *= 2;
    if (base.global_batch_size % (next.micro_batch * entry.dp) != 0) break;
    PlanEntry tried = SimulatePlanLayout(base, next, /*screen=*/false);
    if (tried.verdict != PlanVerdict::kFits) break;
    best = std::move(tried);
  }
  return best;
}

struct SequencePoint {
  int64_t seq_length;
  PlanEntry entry;
};

// Memory of `layout` from a quarter of the target sequence length, doubling, up to the
// first length that does not fit (at most 16x the target).
std::vector<SequencePoint> SequenceCurve(const RunSpec& base, const PlanLayout& layout, int jobs) {
  std::vector<SequencePoint> points;
  const int64_t target = base.training.seq_length;
  for (int64_t seq = std::max<int64_t>(target / 4, 128); seq <= 16 * target; seq *= 2) {
    points.push_back({seq, PlanEntry()});
  }
  // `jobs` lengths at a time, shortest first: none longer than the first that does not
  // fit is simulated (the longest are the most expensive).
  const size_t batch = static_cast<size_t>(std::max(jobs, 1));
  for (size_t begin = 0; begin < points.size(); begin += batch) {
    const size_t end = std::min(points.size(), begin + batch);
    ParallelFor(end - begin, jobs, [&](size_t k) {
      RunSpec spec = base;
      spec.training.seq_length = points[begin + k].seq_length;
      points[begin + k].entry = SimulatePlanLayout(spec, layout, /*screen=*/true);
    });
    for (size_t i = begin; i < end; ++i) {
      if (points[i].entry.verdict != PlanVerdict::kFits) {
        points.resize(i + 1);
        return points;
      }
    }
  }
  return points;
}

// The step-time component where `slower` loses most to `faster`, in words.
std::string WhyFaster(const StepTime& faster, const StepTime& slower) {
  const std::pair<const char*, double> parts[] = {
      {"compute on the slowest stage (with recomputation)", slower.compute_s - faster.compute_s},
      {"tensor/expert-parallel communication",
       slower.model_parallel_comm_s - faster.model_parallel_comm_s},
      {"pipeline bubble", slower.bubble_s - faster.bubble_s},
      {"data-parallel communication", slower.data_parallel_comm_s - faster.data_parallel_comm_s},
      {"optimizer step", slower.optimizer_s - faster.optimizer_s}};
  const auto* most =
      std::max_element(std::begin(parts), std::end(parts),
                       [](const auto& a, const auto& b) { return a.second < b.second; });
  return std::string("mostly less ") + most->first + " (" + Fixed(most->second, 3) + " s)";
}

// An invalid layout's rule: its reason with the numbers taken out, so that layouts that
// break the same rule are counted together.
std::string RuleOf(const std::string& reason) {
  std::string rule;
  for (char c : reason) {
    const bool digit = c >= '0' && c <= '9';
    if (digit && !rule.empty() && rule.back() == 'N') continue;
    rule += digit ? 'N' : c;
  }
  return rule;
}

std::string StepRow(size_t rank, const PlanEntry& e) {
  std::ostringstream row;
  row << "| " << rank << " | " << PlanLayoutName(e.layout) << " | " << e.dp << " | "
      << e.microbatches << " | " << Fixed(e.step.total_s, 3) << " | "
      << Fixed(e.step.tokens_per_s_per_gpu, 0) << " | "
      << Fixed(100.0 * e.step.bubble_s / e.step.total_s, 1) << "% | "
      << Fixed(GiB(e.headroom_bytes), 2) << " GiB | " << (e.verified ? "yes" : "screened")
      << " |\n";
  return row.str();
}

struct PlanReport {
  std::string title;
  std::string markdown;  // RenderMarkdown's
  bool figures = false;  // drawn
  std::vector<PlanEntry> entries;
  std::vector<PlanEntry> largest_micro_batch;  // for the best layouts, in rank order
  std::vector<SequencePoint> sequence_curve;   // for the best layout
  int64_t shown = 10;
  double seconds = 0;
};

std::string RenderMarkdown(const PlanReport& report, const GpuSpec& gpu) {
  std::map<PlanVerdict, int64_t> counts;
  for (const PlanEntry& e : report.entries) ++counts[e.verdict];
  std::ostringstream md;
  md << "# memsim plan: " << report.title << "\n\n"
     << report.entries.size() << " layouts searched in " << Fixed(report.seconds, 1) << " s ("
     << Fixed(report.seconds > 0 ? static_cast<double>(report.entries.size()) / report.seconds : 0,
              1)
     << " layouts/s): " << counts[PlanVerdict::kFits] << " fit, "
     << counts[PlanVerdict::kOutOfMemory] << " out of memory, " << counts[PlanVerdict::kPruned]
     << " pruned (setup alone over the GPU), " << counts[PlanVerdict::kDominated]
     << " dominated (fit with less recomputation), " << counts[PlanVerdict::kInvalid]
     << " invalid, " << counts[PlanVerdict::kError] << " failed.\n\n";
  std::vector<const PlanEntry*> fitting;
  for (const PlanEntry& e : report.entries) {
    if (e.verdict == PlanVerdict::kFits) fitting.push_back(&e);
  }
  if (fitting.empty()) {
    md << "**No layout fits.**\n\n";
  } else {
    md << "## Layouts that fit, fastest first\n\n"
       << "Step time from the virtual clock (Note [Step time] in parallel/step_time.h): it ranks "
          "layouts; as a prediction it is rough (median error 20% against Megatron-LM's "
          "functional tests on H100, VALIDATION.md). Headroom: what the allocator can reserve "
          "(usable memory less TP overlap's userbuffers) minus the peak reserved of the "
          "fullest stage. Screened: simulated with fewer microbatches (the same allocated "
          "memory; the reserved may miss a segment that fragmentation adds late in a long "
          "run, Note [Plan search]).\n\n"
       << "| # | layout | DP | microbatches | step (s) | tokens/s/GPU | bubble | headroom | "
          "verified |\n|---|---|---|---|---|---|---|---|---|\n";
    for (size_t i = 0; i < fitting.size() && static_cast<int64_t>(i) < report.shown; ++i) {
      md << StepRow(i + 1, *fitting[i]);
    }
    md << "\n";
    for (size_t i = 0; i + 1 < fitting.size() && i < 3; ++i) {
      const StepTime& a = fitting[i]->step;
      const StepTime& b = fitting[i + 1]->step;
      md << "- #" << i + 1 << " beats #" << i + 2 << " by "
         << Fixed(100.0 * (b.total_s - a.total_s) / b.total_s, 1) << "% ("
         << Fixed(b.total_s - a.total_s, 3) << " s per step): " << WhyFaster(a, b) << ".\n";
    }
    md << "\n";
  }
  if (!report.largest_micro_batch.empty()) {
    md << "## Largest micro batch that fits\n\n| # | layout | micro batch | step (s) | "
          "tokens/s/GPU | headroom |\n|---|---|---|---|---|---|\n";
    for (size_t i = 0; i < report.largest_micro_batch.size(); ++i) {
      const PlanEntry& e = report.largest_micro_batch[i];
      md << "| " << i + 1 << " | " << PlanLayoutName(fitting[i]->layout) << " | "
         << e.layout.micro_batch << " | " << Fixed(e.step.total_s, 3) << " | "
         << Fixed(e.step.tokens_per_s_per_gpu, 0) << " | " << Fixed(GiB(e.headroom_bytes), 2)
         << " GiB |\n";
    }
    md << "\n";
  }
  if (!report.sequence_curve.empty()) {
    md << "## Memory versus sequence length (#1, same global batch in sequences)\n\n"
       << "| sequence length | peak reserved (fullest stage) | fits |\n|---|---|---|\n";
    for (const SequencePoint& p : report.sequence_curve) {
      const int64_t fullest = FullestStage(p.entry);
      md << "| " << p.seq_length << " | "
         << (fullest < 0 ? std::string("-") : Fixed(GiB(fullest), 2) + " GiB") << " | "
         << (p.entry.verdict == PlanVerdict::kFits
                 ? std::string("yes")
                 : std::string("no, ") + PlanVerdictName(p.entry.verdict) + ": " + p.entry.reason)
         << " |\n";
    }
    md << "\n(usable: " << Fixed(GiB(gpu.usable_bytes()), 2) << " GiB)\n\n";
  }
  // Why the others do not run, grouped.
  struct Group {
    int64_t count = 0;
    int64_t min_over = INT64_MAX, max_over = 0;
    std::string example;
  };
  std::map<std::string, Group> groups;
  for (const PlanEntry& e : report.entries) {
    std::string key;
    switch (e.verdict) {
      case PlanVerdict::kFits:
        continue;
      case PlanVerdict::kOutOfMemory:
        key = "out of memory on stage " + std::to_string(e.oom_stage);
        break;
      case PlanVerdict::kPruned:
        key = "pruned: setup alone (parameters, gradient buffers, master weights) exceeds the GPU";
        break;
      case PlanVerdict::kDominated:
        key = "not simulated: the same layout with less recomputation fits and is no slower";
        break;
      case PlanVerdict::kInvalid:
        key = "invalid: " + RuleOf(e.reason);
        break;
      case PlanVerdict::kError:
        key = "failed: " + e.reason;
        break;
    }
    Group& g = groups[key];
    if (g.count++ == 0) g.example = PlanLayoutName(e.layout) + ": " + e.reason;
    if (e.verdict == PlanVerdict::kOutOfMemory) {
      g.min_over = std::min(g.min_over, e.over_bytes);
      g.max_over = std::max(g.max_over, e.over_bytes);
    }
  }
  if (!groups.empty()) {
    md << "## Why the others do not run\n\n";
    for (const auto& [key, g] : groups) {
      md << "- " << key << ": " << g.count << " layout" << (g.count == 1 ? "" : "s");
      if (g.max_over > 0) {
        md << ", over by " << Fixed(GiB(g.min_over), 2) << "-" << Fixed(GiB(g.max_over), 2)
           << " GiB";
      }
      md << ". E.g. " << g.example << "\n";
    }
  }
  return md.str();
}

json EntryJson(const PlanEntry& e) {
  json j = {{"tp", e.layout.tp},
            {"pp", e.layout.pp},
            {"first_stage_layers", e.layout.first_stage_layers},
            {"last_stage_layers", e.layout.last_stage_layers},
            {"vpp", e.layout.vpp},
            {"cp", e.layout.cp},
            {"ep", e.layout.ep},
            {"etp", e.layout.etp},
            {"dp", e.dp},
            {"micro_batch_size", e.layout.micro_batch},
            {"num_microbatches", e.microbatches},
            {"recompute", RecomputeName(e.layout.recompute)},
            {"data_parallel", DataParallelName(e.layout.data_parallel)},
            {"verdict", PlanVerdictName(e.verdict)},
            {"verified", e.verified}};
  if (!e.reason.empty()) j["reason"] = e.reason;
  if (!e.stage_peak_reserved_bytes.empty()) {
    json peaks = json::array();
    for (int64_t b : e.stage_peak_reserved_bytes) peaks.push_back(GiB(b));
    j["stage_peak_reserved_GiB"] = peaks;
  }
  if (e.verdict == PlanVerdict::kFits) {
    j["step_s"] = e.step.total_s;
    j["tokens_per_s_per_gpu"] = e.step.tokens_per_s_per_gpu;
    j["step_parts_s"] = {{"compute", e.step.compute_s},
                         {"model_parallel_comm", e.step.model_parallel_comm_s},
                         {"bubble", e.step.bubble_s},
                         {"data_parallel_comm", e.step.data_parallel_comm_s},
                         {"optimizer", e.step.optimizer_s}};
    j["headroom_GiB"] = GiB(e.headroom_bytes);
  }
  if (e.verdict == PlanVerdict::kOutOfMemory) {
    j["oom_stage"] = e.oom_stage;
    j["over_GiB"] = GiB(e.over_bytes);
  }
  return j;
}

std::string Csv(const std::vector<PlanEntry>& entries) {
  std::string csv =
      "rank,tp,pp,first_stage_layers,last_stage_layers,vpp,cp,ep,etp,dp,micro_batch_size,"
      "num_microbatches,recompute,data_parallel,"
      "verdict,verified,step_s,tokens_per_s_per_gpu,headroom_GiB,max_peak_reserved_GiB,reason\n";
  for (size_t i = 0; i < entries.size(); ++i) {
    const PlanEntry& e = entries[i];
    std::ostringstream row;
    row << (e.verdict == PlanVerdict::kFits ? std::to_string(i + 1) : "") << "," << e.layout.tp
        << "," << e.layout.pp << "," << e.layout.first_stage_layers << ","
        << e.layout.last_stage_layers << "," << e.layout.vpp << "," << e.layout.cp << ","
        << e.layout.ep << "," << e.layout.etp << "," << e.dp << "," << e.layout.micro_batch << ","
        << e.microbatches << "," << RecomputeName(e.layout.recompute) << ","
        << DataParallelName(e.layout.data_parallel) << "," << PlanVerdictName(e.verdict) << ","
        << (e.verified ? "yes" : "no") << ","
        << (e.verdict == PlanVerdict::kFits ? Fixed(e.step.total_s, 4) : "") << ","
        << (e.verdict == PlanVerdict::kFits ? Fixed(e.step.tokens_per_s_per_gpu, 1) : "") << ","
        << (e.verdict == PlanVerdict::kFits ? Fixed(GiB(e.headroom_bytes), 3) : "") << ","
        << (FullestStage(e) < 0 ? "" : Fixed(GiB(FullestStage(e)), 3)) << "," << CsvQuoted(e.reason)
        << "\n";
    csv += row.str();
  }
  return csv;
}

struct PlanLists {
  std::string tp, pp, vpp, cp, ep, etp, micro_batch, recompute, data_parallel;
};

// The grid for `base`'s cluster: DefaultPlanGrid, with each list the user gave instead.
Status BuildGrid(const RunSpec& base, const PlanLists& lists, PlanGrid* grid) {
  *grid = DefaultPlanGrid(base);
  const std::tuple<const std::string*, std::vector<int64_t>*, const char*> ints[] = {
      {&lists.tp, &grid->tp, "tp"},
      {&lists.pp, &grid->pp, "pp"},
      {&lists.vpp, &grid->vpp, "vpp"},
      {&lists.cp, &grid->cp, "cp"},
      {&lists.ep, &grid->ep, "ep"},
      {&lists.etp, &grid->etp, "etp"},
      {&lists.micro_batch, &grid->micro_batch, "micro-batch-size"}};
  for (const auto& [text, values, name] : ints) {
    if (!text->empty()) MEMSIM_RETURN_IF_ERROR(ParseIntList(*text, name, values));
  }
  if (!lists.recompute.empty()) {
    grid->recompute.clear();
    MEMSIM_RETURN_IF_ERROR(ParseNameList(lists.recompute, &ParseRecompute, &grid->recompute));
    // Least recomputation first (Note [Plan search] 3).
    std::sort(grid->recompute.begin(), grid->recompute.end());
    grid->recompute.erase(std::unique(grid->recompute.begin(), grid->recompute.end()),
                          grid->recompute.end());
  }
  if (!lists.data_parallel.empty()) {
    grid->data_parallel.clear();
    MEMSIM_RETURN_IF_ERROR(
        ParseNameList(lists.data_parallel, &ParseDataParallel, &grid->data_parallel));
  }
  return Status::OK();
}

// The plan for `base`'s cluster size: searched, extended for the best layouts, rendered,
// and written to `out_dir` (plan.md, plan.csv, plan.json, figures).
Status PlanCluster(const RunSpec& base, const PlanLists& lists, const PlanSettings& settings,
                   int64_t shown, const std::string& out_dir, PlanReport* report) {
  PlanGrid grid;
  MEMSIM_RETURN_IF_ERROR(BuildGrid(base, lists, &grid));
  report->shown = shown;
  report->title = base.model_source + " on " + std::to_string(base.layout.world_size) + " x " +
                  base.gpu->name + " (usable " + FormatBytes(base.gpu->usable_bytes()) + "), " +
                  PrecisionName(base.training.precision) + ", sequence " +
                  std::to_string(base.training.seq_length) + ", global batch " +
                  std::to_string(base.global_batch_size) + " sequences";
  const auto start = std::chrono::steady_clock::now();
  MEMSIM_RETURN_IF_ERROR(RunPlan(base, grid, settings, &report->entries));
  std::vector<const PlanEntry*> best;
  for (const PlanEntry& e : report->entries) {
    if (e.verdict == PlanVerdict::kFits && best.size() < 3) best.push_back(&e);
  }
  if (!best.empty()) {
    report->largest_micro_batch.resize(best.size());
    ParallelFor(best.size(), settings.jobs, [&](size_t i) {
      report->largest_micro_batch[i] = LargestMicroBatch(base, *best[i]);
    });
    report->sequence_curve = SequenceCurve(base, best[0]->layout, settings.jobs);
  }
  report->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  report->markdown = RenderMarkdown(*report, *base.gpu);
  json all = json::array();
  for (const PlanEntry& e : report->entries) all.push_back(EntryJson(e));
  json curve = json::array();
  for (const SequencePoint& p : report->sequence_curve) {
    json point = {{"seq_length", p.seq_length},
                  {"fits", p.entry.verdict == PlanVerdict::kFits},
                  {"verdict", PlanVerdictName(p.entry.verdict)}};
    if (FullestStage(p.entry) >= 0) point["peak_reserved_GiB"] = GiB(FullestStage(p.entry));
    curve.push_back(point);
  }
  MEMSIM_RETURN_IF_ERROR(WriteFileAtomically(out_dir + "/plan.md", report->markdown));
  MEMSIM_RETURN_IF_ERROR(WriteFileAtomically(out_dir + "/plan.csv", Csv(report->entries)));
  MEMSIM_RETURN_IF_ERROR(WriteFileAtomically(out_dir + "/plan.json",
                                             json({{"run", report->title},
                                                   {"world_size", base.layout.world_size},
                                                   {"usable_GiB", GiB(base.gpu->usable_bytes())},
                                                   {"layouts", all},
                                                   {"sequence_curve", curve}})
                                                 .dump(1)));
  // The figures are matplotlib's: without it the plan stands, and says so.
  std::string error;
  const int figures = RunPlotsChild("plan-figures", {out_dir}, &error);
  report->figures = figures == 0;
  if (!report->figures) {
    std::fprintf(stderr, "memsim plan: note: figures not drawn (%s); the tables are complete\n",
                 figures < 0 ? error.c_str() : "the plotting tool failed, see above");
  }
  return Status::OK();
}

}  // namespace

int PlanCommand(int argc, const char* const* argv) {
  po::options_description options(
      "memsim plan [options] [-- <pretrain_gpt.py arguments>]\n\n"
      "Which layout to run: searches TP, PP, VPP, CP, EP, micro batch, recomputation and the\n"
      "data-parallel kind for a model on a cluster, ranks the layouts that fit by step time\n"
      "(virtual clock, pipeline bubble, recomputation and communication counted), gives the\n"
      "largest micro batch and memory versus sequence length for the best, and says why the\n"
      "others fail. Writes plan.md, plan.csv, plan.json and figures into --out. The model may\n"
      "come from a Megatron-LM launch line after -- (its layout is what the plan searches).\n\n"
      "Examples:\n"
      "  memsim plan --model llama3-70b --gpu H100 --world-size 64 --seq-length 8192 \\\n"
      "      --global-batch-size 512\n"
      "  memsim plan --model gpt3-1.3b --world-size 8 --seq-length 2048 --global-batch-size 64 \\\n"
      "      --tp 1,2 --pp 1,2 --recompute none,full --out plan_small\n"
      "  memsim plan --model llama3-8b --gpus 8,16,32 --seq-length 8192 --global-batch-size 128 "
      "\\\n"
      "      --out plan_sizes    (a plan per cluster size, compared)\n"
      "  memsim plan --world-size 16 --out plan_launch -- --num-layers 32 --hidden-size 4096 \\\n"
      "      --num-attention-heads 32 --seq-length 4096 --max-position-embeddings 4096 \\\n"
      "      --micro-batch-size 1 --global-batch-size 64 --bf16 --vocab-size 50257\n\n"
      "Options");
  SpecOptions spec_options;
  spec_options.iterations = 2;
  std::string out_dir = "memsim_plan", gpus_list;
  PlanLists lists;
  PlanSettings settings;
  int64_t shown = 10;
  options.add_options()("help,h", "show this help");
  AddSpecOptions(&options, &spec_options);
  options.add_options()(
      "gpus", po::value(&gpus_list),
      "cluster sizes to plan for instead of --world-size, e.g. 32,64,128: a plan per size")(
      "tp", po::value(&lists.tp), "TP values (default: powers of 2 up to a node)")(
      "pp", po::value(&lists.pp),
      "PP values (default: divisors of the GPUs, to 64, that divide the layers or get uneven "
      "first and last stages: Note [Plan's uneven stages])")("vpp", po::value(&lists.vpp),
                                                             "VPP values (default 1,2)")(
      "cp", po::value(&lists.cp), "CP values (default 1, and 2 from sequence 8192)")(
      "ep", po::value(&lists.ep), "EP values (default: powers of 2 dividing the experts, to 64)")(
      "etp", po::value(&lists.etp), "expert TP values (default: the layout's TP)")(
      "micro-batch-size", po::value(&lists.micro_batch), "micro-batch sizes (default 1)")(
      "recompute", po::value(&lists.recompute),
      "recomputation kinds (default none,selective,full)")(
      "jobs,j", PositiveValue(&settings.jobs, "jobs"), "simulations at once (default 2)")(
      "verify", PositiveValue(&settings.verify, "verify"),
      "best layouts simulated with every microbatch (default 3)")(
      "top", PositiveValue(&shown, "top"), "layouts listed (default 10)")(
      "out", po::value(&out_dir), "output folder (default memsim_plan)");
  // A Megatron-LM launch line may follow "--" (as for memsim megatron).
  const int separator = LaunchLineSeparator(argc, argv);
  po::variables_map vm;
  if (auto exit_code = ParseCommandLine(separator, argv, options, "plan", &vm)) return *exit_code;
  // --data-parallel is a list here, applied per layout.
  lists.data_parallel = spec_options.data_parallel;
  spec_options.data_parallel.clear();
  RunSpec base;
  Status status;
  // A range of cluster sizes (--gpus) stands in for --world-size, the first size included.
  std::vector<int64_t> cluster_sizes;
  if (!gpus_list.empty()) {
    status = vm.count("world-size") ? Status::Error("give either --world-size or --gpus")
                                    : ParseIntList(gpus_list, "gpus", &cluster_sizes);
  }
  const int64_t world_size = cluster_sizes.empty() ? spec_options.world_size : cluster_sizes[0];
  if (status.ok() && separator < argc) {
    if (!spec_options.model.empty() || !spec_options.config.empty() ||
        !spec_options.hf_config.empty()) {
      status = Status::Error(
          "give the model either with --model/--config/--hf-config or as a launch line after "
          "--, not both");
    }
    MegatronArgsResult parsed;
    const std::vector<std::string> args(argv + separator + 1, argv + argc);
    if (status.ok()) status = ReadLaunchLine(args, world_size, &parsed);
    for (const std::string& note : parsed.notes) {
      std::fprintf(stderr, "memsim plan: %s\n", EscapeControl(note).c_str());
    }
    base = parsed.spec;
    base.gpu = FindGpu("H100-80GB");
    if (status.ok() && !spec_options.gpu.empty()) status = ParseGpu(spec_options.gpu, &base.gpu);
    if (status.ok()) status = ApplyGpuMemory(spec_options.gpu_memory_gib, &base.gpu);
    ApplySpecOverrides(spec_options, &base);
    base.model_source = "the launch line's model";
  } else if (status.ok()) {
    status = BuildRunSpec(spec_options, /*default_run=*/false, "plan", &base);
    if (status.ok() && world_size == 0) {
      status = Status::Error("give the number of GPUs with --world-size (or sizes with --gpus)");
    }
  }
  if (status.ok() && !base.layout.pipeline_layout.empty()) {
    status = Status::Error(
        "a pipeline layout fixes PP and VPP, which a plan varies: drop the layout (the plan "
        "splits the layers evenly, or unevenly where PP does not divide them)");
  }
  if (status.ok() && base.global_batch_size <= 0) {
    status = Status::Error("give the global batch (sequences per step) with --global-batch-size");
  }
  if (cluster_sizes.empty()) cluster_sizes = {base.layout.world_size};
  if (status.ok()) status = EnsureWritableDirectory(out_dir);
  if (!status.ok()) {
    std::fprintf(stderr, "memsim plan: %s\n", status.message().c_str());
    return kExitError;
  }
  if (cluster_sizes.size() == 1) {
    base.layout.world_size = cluster_sizes[0];
    PlanReport report;
    status = PlanCluster(base, lists, settings, shown, out_dir, &report);
    if (!status.ok()) {
      std::fprintf(stderr, "memsim plan: %s\n", status.message().c_str());
      return kExitError;
    }
    std::fputs(report.markdown.c_str(), stdout);
    std::printf("\nWrote %s/plan.md, plan.csv, plan.json%s\n", out_dir.c_str(),
                report.figures ? ", memory_vs_sequence_length.png and step_time.png" : "");
    return kExitOk;
  }
  // A range of cluster sizes: one plan per size in its own folder, and a comparison.
  std::ostringstream summary;
  summary << "# memsim plan: " << base.model_source << " on " << gpus_list << " x "
          << base.gpu->name << "\n\n| GPUs | best layout | step (s) | tokens/s/GPU | headroom | "
          << "layouts that fit | plan |\n|---|---|---|---|---|---|---|\n";
  for (int64_t gpus : cluster_sizes) {
    RunSpec sized = base;
    sized.layout.world_size = gpus;
    const std::string dir = out_dir + "/gpus_" + std::to_string(gpus);
    PlanReport report;
    status = EnsureWritableDirectory(dir);
    if (status.ok()) status = PlanCluster(sized, lists, settings, shown, dir, &report);
    if (!status.ok()) {
      std::fprintf(stderr, "memsim plan: %lld GPUs: %s\n", static_cast<long long>(gpus),
                   status.message().c_str());
      return kExitError;
    }
    const PlanEntry* best = nullptr;
    int64_t fitting = 0;
    for (const PlanEntry& e : report.entries) {
      if (e.verdict != PlanVerdict::kFits) continue;
      if (best == nullptr) best = &e;
      ++fitting;
    }
    summary << "| " << gpus << " | " << (best ? PlanLayoutName(best->layout) : "none fits") << " | "
            << (best ? Fixed(best->step.total_s, 3) : "-") << " | "
            << (best ? Fixed(best->step.tokens_per_s_per_gpu, 0) : "-") << " | "
            << (best ? Fixed(GiB(best->headroom_bytes), 2) + " GiB" : "-") << " | " << fitting
            << " | gpus_" << gpus << "/plan.md |\n";
  }
  status = WriteFileAtomically(out_dir + "/plan.md", summary.str());
  if (!status.ok()) {
    std::fprintf(stderr, "memsim plan: %s\n", status.message().c_str());
    return kExitError;
  }
  std::fputs(summary.str().c_str(), stdout);
  std::printf("\nWrote %s/plan.md and a plan per cluster size in %s/gpus_*/\n", out_dir.c_str(),
              out_dir.c_str());
  return kExitOk;
}

}  // namespace memsim
