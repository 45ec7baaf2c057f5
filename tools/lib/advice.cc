#include "tools/lib/advice.h"

#include <algorithm>
#include <functional>

#include "parallel/parallel_for.h"

namespace memsim {
namespace {

struct Switch {
  std::string change, effect;
  std::function<void(RunSpec*)> apply;
};

// The switches that differ from `run` (Note [Advice]).
std::vector<Switch> SwitchesFor(const RunSpec& run) {
  std::vector<Switch> switches;
  const TrainingConfig& t = run.training;
  const ParallelLayout& l = run.layout;
  if (t.recompute == RecomputeKind::kNone) {
    switches.push_back({"--recompute selective", "recompute attention's core in backward",
                        [](RunSpec* s) { s->training.recompute = RecomputeKind::kSelective; }});
  }
  if (t.recompute != RecomputeKind::kFull) {
    switches.push_back({"--recompute full", "keep only each layer's input, recompute the rest",
                        [](RunSpec* s) { s->training.recompute = RecomputeKind::kFull; }});
  }
  if (l.tp > 1 && !l.sequence_parallel) {
    switches.push_back({"--sp", "split norms, dropout and residuals over TP",
                        [](RunSpec* s) { s->layout.sequence_parallel = true; }});
  }
  if (l.data_parallel == DataParallelKind::kDdp && l.world_size / (l.tp * l.pp * l.cp) > 1) {
    switches.push_back(
        {"--data-parallel distributed-optimizer", "shard master weights and Adam states over DP",
         [](RunSpec* s) { s->layout.data_parallel = DataParallelKind::kDistributedOptimizer; }});
  }
  switches.push_back({"--pp " + std::to_string(l.pp * 2), "half the layers per stage",
                      [](RunSpec* s) { s->layout.pp *= 2; }});
  switches.push_back({"--tp " + std::to_string(l.tp * 2) + " --sp",
                      "split every layer over twice the GPUs", [](RunSpec* s) {
                        s->layout.tp *= 2;
                        s->layout.sequence_parallel = true;
                      }});
  switches.push_back({"--cp " + std::to_string(l.cp * 2),
                      "split each sequence over twice the GPUs (context parallelism)",
                      [](RunSpec* s) { s->layout.cp *= 2; }});
  if (run.model.num_experts > 0) {
    switches.push_back({"--ep " + std::to_string(l.ep * 2),
                        "split the experts over twice the GPUs (expert parallelism)",
                        [](RunSpec* s) { s->layout.ep *= 2; }});
  }
  if (t.micro_batch_size > 1 && run.global_batch_size > 0) {
    switches.push_back({"--micro-batch-size " + std::to_string(t.micro_batch_size / 2),
                        "half the activations per microbatch, twice the microbatches",
                        [](RunSpec* s) { s->training.micro_batch_size /= 2; }});
  }
  if (t.attention == AttentionKind::kEager) {
    switches.push_back({"--attention flash", "no S x S attention scores",
                        [](RunSpec* s) { s->training.attention = AttentionKind::kFlash; }});
  }
  return switches;
}

int64_t FullestStage(const std::vector<RankResult>& stages) {
  int64_t bytes = 0;
  for (const RankResult& r : stages) bytes = std::max(bytes, r.timeline.peak_reserved_bytes());
  return bytes;
}

double StepSeconds(const ValidatedRun& run, const std::vector<RankResult>& stages) {
  const RunSpec& spec = run.spec();
  return EstimateStepTime(spec.model, spec.training, spec.layout, *spec.gpu,
                          MeasuredClocks(stages, spec.training.num_microbatches))
      .total_s;
}

}  // namespace

std::vector<Advice> AdviseOnPeak(const RunSpec& unfinalized, const ValidatedRun& run,
                                 const std::vector<RankResult>& current, int jobs) {
  const double current_step_s = StepSeconds(run, current);
  const std::vector<Switch> switches = SwitchesFor(run.spec());
  std::vector<Advice> found(switches.size());
  std::vector<bool> valid(switches.size(), false);
  ParallelFor(switches.size(), jobs, [&](size_t i) {
    RunSpec changed = unfinalized;
    switches[i].apply(&changed);
    std::optional<ValidatedRun> changed_run;
    if (!FinalizeRunSpec(changed, &changed_run).ok()) return;
    std::vector<RankResult> stages;
    if (!SimulateAllClasses(*changed_run, /*jobs=*/1, &stages).ok()) return;
    Advice& a = found[i];
    a.change = switches[i].change;
    a.effect = switches[i].effect;
    a.peak_reserved_bytes = FullestStage(stages);
    a.fits =
        std::all_of(stages.begin(), stages.end(), [](const RankResult& r) { return r.fits(); });
    a.step_time_ratio = StepSeconds(*changed_run, stages) / current_step_s;
    valid[i] = true;
  });
  std::vector<Advice> advice;
  for (size_t i = 0; i < found.size(); ++i) {
    if (valid[i]) advice.push_back(std::move(found[i]));
  }
  std::stable_sort(advice.begin(), advice.end(), [](const Advice& a, const Advice& b) {
    return a.peak_reserved_bytes < b.peak_reserved_bytes;
  });
  return advice;
}

}  // namespace memsim
