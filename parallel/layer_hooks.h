// LayerHooks: what sharded data parallelism does around each decoder layer (its wrapping
// unit) in forward and in backward, and the one function that runs a layer between them.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "models/transformer.h"

namespace memsim {

// Implemented by data parallelism that gathers a layer's parameters around it (PyTorch's
// FSDP, Megatron-FSDP). Threading: called on the thread running the step.
class LayerHooks {
 public:
  virtual ~LayerHooks() = default;
  // Before layer `unit`'s forward, and after it (`recomputing`: the forward is a
  // recomputation inside backward, whose backward follows at once).
  virtual void PreForward(int64_t unit) = 0;
  virtual void PostForward(int64_t unit, bool recomputing) = 0;
  // When the gradient of the layer's output arrives, and when its backward is done.
  virtual void PreBackward(int64_t unit) = 0;
  virtual void PostBackward(int64_t unit) = 0;
};

// Runs `run` on `input` as layer `unit` of `hooks` (ModelShard::wrap_layer): PreForward,
// the layer, PostForward; in backward, the output's side calls PreBackward first and the
// input's side PostBackward last.
// REQUIRES: `hooks` outlives every backward of the step.
at::Tensor RunHookedLayer(LayerHooks* hooks, int64_t unit, const at::Tensor& input,
                          const ModelShard::LayerFn& run);

}  // namespace memsim
