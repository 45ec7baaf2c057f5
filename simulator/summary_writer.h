// The run summary (summary_rank{R}.json): peak and static memory, the breakdown at the
// peak by category and module, the largest tensors alive at the peak, per-phase peaks.
#pragma once

#include <nlohmann/json.hpp>

#include <string>

#include "simulator/peak_analysis.h"
#include "simulator/status.h"

namespace memsim {

struct SummaryContext {
  int64_t rank = 0;
  std::string gpu_name;
  int64_t gpu_usable_bytes = 0;  // 0: unknown
  double theoretical_memory_mb = -1;
};

nlohmann::json SummaryJson(const Recorder& recorder, const Timeline& timeline,
                           const PeakAnalysis& peak, const SummaryContext& context);

Status WriteSummary(const std::string& path, const nlohmann::json& summary);

}  // namespace memsim
