// A GPU preset with another memory size (--gpu-memory): a GPU memsim has no preset for, run
// with the rates of the closest one, or a preset whose usable capacity differs.
#pragma once

#include <cstdint>

#include "simulator/cost_model.h"

namespace memsim {

// `base` with `memory_bytes` of device memory (the total nvidia-smi reports) and its CUDA
// context, rates and links unchanged, named "<base> with <memory>". The spec lives as long
// as the process (one per distinct size); thread-safe.
// REQUIRES: memory_bytes > base.context_bytes.
const GpuSpec* GpuWithMemory(const GpuSpec& base, int64_t memory_bytes);

}  // namespace memsim
