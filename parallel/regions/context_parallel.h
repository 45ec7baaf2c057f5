// Context parallelism's attention: ring attention over the sequence split across cp
// ranks, as Transformer Engine's AttnFuncWithCPAndKVP2P runs it with FlashAttention
// (attention/dot_product_attention/context_parallel.py), causal.
//
// Memory, per layer, with q [B, S/cp, A, D] and k, v [B, S/cp, G, D] local:
//   forward: k and v flattened into one send buffer (torch.cat((k.view(-1), v.view(-1))):
//     2 * B * S/cp * G * D elements, or k's and v's sizes summed where multi-latent
//     attention makes their heads differ), cp - 1 receive buffers like it (all held until
//     the forward ends), each step's flash output and float32 log-sum-exp (merged at the
//     end); saves q, the kv buffer, the output and the log-sum-exp;
//   backward: dq like q, two double buffers each holding kv and its gradient (twice the
//     kv buffer), and each step's flash-backward temporaries.
// memsim models the buffers' sizes and lifetimes, not TE's exact per-step split of
// causal chunks (each step is charged a full-size flash call).
//
// Note [All-to-all context parallelism]
// --cp-comm-type a2a (Transformer Engine 2.18's AttnFuncWithCPAndQKVOA2A, DeepSpeed-Ulysses
// style, in attention/dot_product_attention/context_parallel.py): q, k, v [S/cp, B, heads,
// D] are exchanged so that each rank holds the whole sequence for heads/cp heads, attention
// runs there as it does without CP (and keeps what it keeps then), and its output is
// exchanged back. flash_attn_a2a_communicate, per exchange of n tensors:
//   before attention (q, k, v; in backward the output gradient): each tensor is staged
//     heads-first (a contiguous copy), received into a new tensor, whose sequence chunks are
//     reordered into another, [S, B, heads/cp, D]; the staged copies live until all n are
//     exchanged;
//   after attention (the output; in backward dq, dk, dv): each is reordered (a copy),
//     received into a new tensor and made heads-last contiguous, [S/cp, B, heads, D]; the
//     reordered copies live until all n are exchanged.
// With --cp-comm-type a2a+p2p (--hierarchical-context-parallel-sizes a p) the exchange runs
// over the a ranks of the first level and ring attention over the p of the second, on the
// exchanged tensors (AttnFuncWithCPAndKVP2P with cp_size_a2a > 1). Transformer Engine
// asserts that heads and kv heads divide by the exchange's group (FinalizeRunSpec does).
//
// Note [All-gather context parallelism]
// --cp-comm-type allgather (Transformer Engine's AttnFuncWithCPAndKVAllGather, TE 2.18-2.20,
// attention/dot_product_attention/context_parallel.py; sbhd, causal, load-balanced: each
// rank holds two sequence chunks of h = S/(2cp) rows). Forward: k and v are each all-gathered
// into a new [S, B, G, D] and reordered into sequence order (a copy; about three [S, B, G, D]
// alive while the second is made); the output [S/cp, B, A, D] and a zeroed one like it (made
// for every format, used only by thd); each chunk attends to a view of the gathered k, v
// (flash/fused outputs and float32 statistics per chunk, copied into the output). Saved: q,
// the local k and v, the output, each chunk's statistics; the gathered k, v go. Backward:
// dq, and dk, dv zeroed at full length [S, B, G, D] (16-bit); k, v gathered and reordered
// again; each chunk's dq, dk, dv (dk, dv as long as its key range) kept until the end; dk,
// dv reordered (copies) and reduce-scattered into [S/cp, B, G, D].
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace memsim {

// q, k, v [B, S/cp, heads, D] contiguous; returns [B, S/cp, A, D].
at::Tensor ContextParallelAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    int64_t cp, double dropout_p);

// Note [All-gather context parallelism]: q [S/cp, B, A, D], k, v [S/cp, B, G, D] (sbhd,
// contiguous); returns [S/cp, B, A, D].
at::Tensor AllGatherContextParallelAttention(const at::Tensor& q, const at::Tensor& k,
                                             const at::Tensor& v, int64_t cp, double dropout_p);

// Note [All-to-all context parallelism]: q, k, v [S/cp, B, heads, D] -> [S, B, heads/cp, D]
// each, and back for the output; autograd runs the opposite exchange in backward.
std::vector<at::Tensor> AllToAllBeforeAttention(const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& v, int64_t cp);
at::Tensor AllToAllAfterAttention(const at::Tensor& out, int64_t cp);

}  // namespace memsim
