// Context parallelism's attention: ring attention over the sequence split across cp
// ranks, as Transformer Engine's AttnFuncWithCPAndKVP2P runs it with FlashAttention
// (transformer_engine/pytorch/attention.py), causal.
//
// Memory, per layer, with q [B, S/cp, A, D] and k, v [B, S/cp, G, D] local:
//   forward: k and v stacked into one [2, B, S/cp, G, D] send buffer, cp - 1 receive
//     buffers like it (all held until the forward ends), each step's flash output and
//     float32 log-sum-exp (merged at the end); saves q, the stacked kv, the output and
//     the log-sum-exp;
//   backward: dq like q, two double buffers each holding kv and its gradient
//     ([2, 2, B, S/cp, G, D]), and each step's flash-backward temporaries.
// memsim models the buffers' sizes and lifetimes, not TE's exact per-step split of
// causal chunks (each step is charged a full-size flash call).
#pragma once

#include <ATen/core/Tensor.h>

namespace memsim {

// q, k, v [B, S/cp, heads, D] contiguous; returns [B, S/cp, A, D].
at::Tensor ContextParallelAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    int64_t cp, double dropout_p);

}  // namespace memsim
