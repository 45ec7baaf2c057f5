#include "simulator/summary_writer.h"

#include "simulator/atomic_file.h"
#include "simulator/trace_writer.h"

namespace memsim {

nlohmann::json SummaryJson(const Recorder& recorder, const Timeline& timeline,
                           const PeakAnalysis& peak, const SummaryContext& context) {
  using nlohmann::json;
  const auto& names = recorder.names();
  json iterations = json::array();
  for (const IterationSummary& it : timeline.iterations()) {
    iterations.push_back({{"iteration", it.iteration},
                          {"static_memory_MB", BytesToMiB(it.static_allocated_bytes)},
                          {"allocated_after_step_MB", BytesToMiB(it.end_allocated_bytes)},
                          {"peak_allocated_MB", BytesToMiB(it.peak_allocated_bytes)},
                          {"peak_reserved_MB", BytesToMiB(it.peak_reserved_bytes)},
                          {"duration_s", it.end_time_s - it.begin_time_s}});
  }
  json phases = json::object();
  for (const PhasePeak& pp : peak.phases) {
    phases[std::string(PhaseName(pp.phase))] = {
        {"peak_allocated_MB", BytesToMiB(pp.peak_allocated_bytes)}};
  }
  json categories = json::object();
  for (int c = 1; c < kNumCategories; ++c) {
    categories[std::string(CategoryName(static_cast<Category>(c)))] =
        BytesToMiB(peak.bytes_by_category[static_cast<size_t>(c)]);
  }
  categories["allocator_rounding"] = BytesToMiB(peak.allocated_bytes - peak.requested_bytes);
  json tensors = json::array();
  for (int64_t id : peak.largest_storages) {
    const StorageInfo& s = recorder.storages()[static_cast<size_t>(id)];
    const std::string& module = names.Name(s.module);
    tensors.push_back({{"size_bytes", s.size_bytes},
                       {"size_MB", BytesToMiB(s.size_bytes)},
                       {"tensor", StorageShapeString(recorder, s)},
                       {"op", names.Name(s.op)},
                       {"module", module.empty() ? "<top>" : module},
                       {"phase", PhaseName(s.phase)},
                       {"category", CategoryName(s.category)},
                       {"iteration", s.iteration},
                       {"microbatch", s.microbatch}});
  }
  json modules = json::array();
  for (size_t i = 0; i < peak.modules.size(); ++i) {
    modules.push_back(
        {{"module", peak.modules[i].module}, {"MB", BytesToMiB(peak.modules[i].bytes)}});
  }
  const IterationSummary& last = timeline.iterations().back();
  json summary = {
      {"rank", context.rank},
      {"gpu", context.gpu_name},
      {"peak_allocated_MB", BytesToMiB(timeline.peak_allocated_bytes())},
      {"peak_reserved_MB", BytesToMiB(timeline.peak_reserved_bytes())},
      {"static_memory_MB", BytesToMiB(last.static_allocated_bytes)},
      {"allocated_after_step_MB", BytesToMiB(last.end_allocated_bytes)},
      {"theoretical_memory_MB", context.theoretical_memory_mb},
      {"peak_phase", PhaseName(peak.phase)},
      {"peak_time_s", peak.event >= 0 ? timeline.time_s(peak.event) : 0.0},
      {"iterations", iterations},
      {"phases", phases},
      {"breakdown_at_peak_MB", categories},
      {"modules_at_peak", modules},
      {"largest_tensors_at_peak", tensors},
      // The names of phases and categories in the engine's order (Note [Enum names]): the
      // Python tools read their order here instead of keeping a copy.
      {"enum_names",
       {{"phase", PrintedNames(kPhaseNames)}, {"category", PrintedNames(kCategoryNames)}}},
  };
  if (context.gpu_usable_bytes > 0) {
    summary["gpu_usable_MB"] = BytesToMiB(context.gpu_usable_bytes);
  }
  return summary;
}

Status WriteSummary(const std::string& path, const nlohmann::json& summary) {
  return WriteFileAtomically(path, summary.dump(2));
}

}  // namespace memsim
