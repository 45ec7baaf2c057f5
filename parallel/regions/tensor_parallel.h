// Megatron-LM's tensor- and sequence-parallel regions (megatron/core/tensor_parallel/
// mappings.py) as autograd Functions over the fake collectives: what each allocates in
// forward and backward.
//
// With sequence parallelism the hidden state between blocks is [S/tp, B, H]:
//   ScatterToSequenceParallelRegion   fwd: this rank's slice, made contiguous (new)
//                                     bwd: all-gather (new [S, ...])
//   ReduceScatterToSequenceParallel   fwd: reduce-scatter (new [S/tp, ...])
//                                     bwd: all-gather (new [S, ...])
//   GatherFromSequenceParallelRegion  fwd: all-gather (new [S, ...]); bwd: reduce-scatter
//   ReduceFromTensorParallelRegion    fwd: all-reduce in place; bwd: identity
//   GatherFromTensorParallel     fwd: all-gather [tp*S, ..., X] (new), concatenated
//                                          along the last dim (new [S, ..., tp*X])
//                                     bwd: this rank's last-dim slice, contiguous (new)
// Column-parallel linears gather their input themselves (LinearParallelism in layers.h).
#pragma once

#include <ATen/core/Tensor.h>

namespace memsim {

at::Tensor ScatterToSequenceParallelRegion(const at::Tensor& input, int64_t tp);
// `grad_into_userbuffer`: the backward's all-gather lands in a userbuffer (Note
// [Userbuffers] in ops/collectives.h), not a new tensor.
at::Tensor ReduceScatterToSequenceParallelRegion(const at::Tensor& input, int64_t tp,
                                                 bool grad_into_userbuffer = false);
at::Tensor GatherFromSequenceParallelRegion(const at::Tensor& input, int64_t tp);
at::Tensor ReduceFromTensorParallelRegion(const at::Tensor& input, int64_t tp);
at::Tensor GatherFromTensorParallelRegion(const at::Tensor& input, int64_t tp);

}  // namespace memsim
