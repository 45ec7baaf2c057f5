// Everything ops/ adds to the dispatcher, registered in one call.
#pragma once

namespace memsim {

// Registers the Meta kernels LibTorch lacks (meta_kernels.h), the memsim:: transformer
// kernels (transformer_kernels.h), fused optimizers (fused_optimizers.h) and fake
// collectives (collectives.h), with their OpTraits for the interceptor. Idempotent and
// thread-safe.
// REQUIRES: called before a model runs on meta tensors. Session does not call it: the
// engine core (simulator/) sits below ops/, so the code that builds and runs a model
// (parallel/rank_training.h, tests' main, benchmarks) does.
void RegisterOps();

}  // namespace memsim
