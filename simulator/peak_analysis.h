// What was alive at the peak, and why: the breakdown the run summary and the command
// line print.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "simulator/recorder.h"
#include "simulator/timeline.h"

namespace memsim {

struct PhasePeak {
  Phase phase;
  int64_t peak_allocated_bytes = 0;  // highest allocated memory while the phase ran
  int64_t peak_event = -1;
};

struct ModuleBytes {
  std::string module;  // "<top>" for allocations outside any module
  int64_t bytes;
};

struct PeakAnalysis {
  int64_t event = -1;  // the timeline's peak event
  int64_t allocated_bytes = 0;
  int64_t requested_bytes = 0;  // exact sizes of live storages; the rest is rounding
  std::array<int64_t, kNumCategories> bytes_by_category{};  // exact sizes, by Category
  std::vector<int64_t> largest_storages;                    // ids, largest first
  std::vector<ModuleBytes> modules;                         // largest first
  std::vector<PhasePeak> phases;                            // phases that ran, in Phase order
  Phase phase = Phase::kSetup;                              // phase running at the peak
};

// REQUIRES: `timeline` was replayed from `recorder`.
PeakAnalysis AnalyzePeak(const Recorder& recorder, const Timeline& timeline, size_t top_n);

// "BFloat16[8192, 1, 4096]" or "untyped[N bytes]".
std::string StorageShapeString(const Recorder& recorder, const StorageInfo& storage);

}  // namespace memsim
