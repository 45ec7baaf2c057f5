#include "simulator/custom_gpu.h"

#include <deque>
#include <mutex>

#include "simulator/check.h"
#include "simulator/format.h"

namespace memsim {

const GpuSpec* GpuWithMemory(const GpuSpec& base, int64_t memory_bytes) {
  MEMSIM_DCHECK(memory_bytes > base.context_bytes);
  static std::mutex mutex;
  // A deque keeps every spec's address as more are added; runs hold plain pointers.
  static std::deque<GpuSpec> specs;
  GpuSpec gpu = base;
  gpu.name = base.name + " with " + FormatBytes(memory_bytes);
  gpu.memory_bytes = memory_bytes;
  std::lock_guard<std::mutex> lock(mutex);
  for (const GpuSpec& spec : specs) {
    if (spec.name == gpu.name) return &spec;
  }
  specs.push_back(gpu);
  return &specs.back();
}

}  // namespace memsim
