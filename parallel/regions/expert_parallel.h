// Expert parallelism's token exchange (Megatron-Core's MoEAlltoAllTokenDispatcher): an
// all-to-all that sends this rank's routed tokens to the experts' ranks and receives the
// tokens routed to its own experts; backward sends the gradients back the same way.
#pragma once

#include <ATen/core/Tensor.h>

namespace memsim {

// input [rows_sent, H] -> output [rows_received, H] (new buffers both ways).
at::Tensor AllToAllTokens(const at::Tensor& input, int64_t ep, int64_t rows_received);

}  // namespace memsim
