// An identity node whose backward calls back: the hook the delayed weight gradients, the
// activation offloaders and Transformer Engine's bwd_step prehook hang on the graph.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>

namespace memsim {

// `x` through an identity node that runs `call` when the gradient reaches it in backward:
// after the backward of everything computed from the returned tensor (the delayed weight
// gradients' backward_dw; the offloading hooks' group start and commit nodes,
// FineGrainedOffloadingGroupStartFunction and ...CommitFunction; Transformer Engine's
// bwd_step prehook on a layer's output).
at::Tensor CallOnBackward(const at::Tensor& x, std::function<void()> call);

}  // namespace memsim
