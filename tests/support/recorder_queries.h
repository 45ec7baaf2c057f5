// What tests read off a recording.
#pragma once

#include <cstdint>

#include "simulator/recorder.h"
#include "simulator/timeline.h"

namespace memsim::test {

// Bytes of the model's state alive right after event `event`: parameters, gradients and
// optimizer state (Note [Memory categories]).
inline int64_t ModelStateBytesAfter(const Recorder& r, int64_t event) {
  int64_t bytes = 0;
  ForEachLiveStorage(r, event, [&](int64_t id) {
    const StorageInfo& s = r.storages()[static_cast<size_t>(id)];
    if (s.category == Category::kParameter || s.category == Category::kGradient ||
        s.category == Category::kOptimizerState) {
      bytes += s.size_bytes;
    }
  });
  return bytes;
}

// Bytes of every storage alive before event `event` (its marker's event_index).
inline int64_t LiveBytesBefore(const Recorder& r, int64_t event) {
  int64_t bytes = 0;
  ForEachLiveStorage(
      r, event - 1, [&](int64_t id) { bytes += r.storages()[static_cast<size_t>(id)].size_bytes; });
  return bytes;
}

}  // namespace memsim::test
