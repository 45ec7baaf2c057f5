#include "simulator/peak_analysis.h"

#include <algorithm>
#include <map>

#include "simulator/check.h"

namespace memsim {

std::string StorageShapeString(const Recorder& recorder, const StorageInfo& s) {
  if (s.ndim < 0) return "untyped[" + std::to_string(s.size_bytes) + " bytes]";
  std::string out = std::string(c10::toString(s.dtype)) + "[";
  const c10::IntArrayRef dims = recorder.ShapeOf(s);
  for (size_t i = 0; i < dims.size(); ++i) out += (i ? ", " : "") + std::to_string(dims[i]);
  return out + "]";
}

PeakAnalysis AnalyzePeak(const Recorder& recorder, const Timeline& timeline, size_t top_n) {
  MEMSIM_DCHECK(timeline.num_points() == static_cast<int64_t>(recorder.events().size()));
  PeakAnalysis peak;
  peak.event = timeline.peak_event();
  peak.allocated_bytes = timeline.peak_allocated_bytes();

  // Phase of every event, from the phase markers.
  std::array<PhasePeak, kNumPhases> by_phase;
  for (int p = 0; p < kNumPhases; ++p)
    by_phase[static_cast<size_t>(p)].phase = static_cast<Phase>(p);
  Phase current = Phase::kSetup;
  size_t marker = 0;
  const auto& markers = recorder.markers();
  for (int64_t e = 0; e < timeline.num_points(); ++e) {
    while (marker < markers.size() && markers[marker].event_index <= e) {
      if (markers[marker].kind == MarkerKind::kPhaseBegin) current = markers[marker].phase;
      ++marker;
    }
    PhasePeak& pp = by_phase[static_cast<size_t>(current)];
    const int64_t allocated_bytes = timeline.AllocatedAfter(e);
    if (allocated_bytes > pp.peak_allocated_bytes) {
      pp.peak_allocated_bytes = allocated_bytes;
      pp.peak_event = e;
    }
    if (e == peak.event) peak.phase = current;
  }
  for (const PhasePeak& pp : by_phase) {
    if (pp.peak_event >= 0) peak.phases.push_back(pp);
  }
  if (peak.event < 0) return peak;

  std::map<NameId, int64_t> module_bytes;
  ForEachLiveStorage(recorder, peak.event, [&](int64_t id) {
    const StorageInfo& s = recorder.storages()[static_cast<size_t>(id)];
    peak.requested_bytes += s.size_bytes;
    peak.bytes_by_category[static_cast<size_t>(s.category)] += s.size_bytes;
    module_bytes[s.module] += s.size_bytes;
    peak.largest_storages.push_back(id);
  });
  const auto& storages = recorder.storages();
  const size_t n = std::min(top_n, peak.largest_storages.size());
  std::partial_sort(peak.largest_storages.begin(),
                    peak.largest_storages.begin() + static_cast<std::ptrdiff_t>(n),
                    peak.largest_storages.end(), [&](int64_t a, int64_t b) {
                      const int64_t sa = storages[static_cast<size_t>(a)].size_bytes;
                      const int64_t sb = storages[static_cast<size_t>(b)].size_bytes;
                      return sa != sb ? sa > sb : a < b;
                    });
  peak.largest_storages.resize(n);
  for (const auto& [module, bytes] : module_bytes) {
    const std::string& name = recorder.names().Name(module);
    peak.modules.push_back({name.empty() ? "<top>" : name, bytes});
  }
  std::sort(peak.modules.begin(), peak.modules.end(),
            [](const ModuleBytes& a, const ModuleBytes& b) {
              return a.bytes != b.bytes ? a.bytes > b.bytes : a.module < b.module;
            });
  return peak;
}

}  // namespace memsim
