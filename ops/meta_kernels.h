// Meta kernels that LibTorch 1.13 lacks, shaped like the CUDA kernels (not the CPU
// path): the outputs, and the temporaries the CUDA kernel allocates, have the sizes and
// dtypes a real GPU run sees. Each kernel's comment in meta_kernels.cc names the CUDA
// kernel it mirrors; Note [Meta resize_] says why resize_ is replaced.
#pragma once

namespace memsim {

// Registers every kernel in ops/meta_kernels.cc with the dispatcher. Idempotent and
// thread-safe; RegisterOps (ops.h) calls it.
void RegisterMetaKernels();

}  // namespace memsim
