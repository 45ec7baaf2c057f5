// Megatron-Core's DDP buffers under the distributed optimizer: where each parameter and its
// gradient sit, how buckets cut them, and which slice of each parameter a data-parallel
// rank's optimizer updates.
//
// Note [Distributed optimizer buffers]
// Megatron-Core 0.20 (d98e8a64; docs/source-notes/distributed-optimizer-buckets.md has the
// line references) wraps each model chunk in its own DDP, with one buffer per kind of
// parameter (dtype, routed expert or not), in the order the kinds first appear in
// named_parameters(). A buffer lays its parameters out in reverse order (backward's), each
// starting at a multiple of 64 elements; it closes a bucket when the bucket reaches the
// bucket size, and pads the bucket's end to a multiple of lcm(dp, 128) (lcm(dp, 128, 2^16)
// with --ddp-pad-buckets-for-high-nccl-busbw), dp being the buffer's intra-instance
// data-parallel size. A shared embedding (Parameter::shared_embedding: PP > 1 with tied
// embeddings or MTP) sits alone in its bucket. Data-parallel rank r owns
// [r S/dp, (r+1) S/dp) of every bucket of padded size S, and its optimizer holds, per
// parameter that range meets, an fp32 master and Adam's state of just the elements it
// meets: so ranks differ in how their shards are cut (and by the padding, which falls in
// the last rank's range and holds no state), and a parameter the range misses has none
// on that rank. Routed experts have buffers of their own only when expert-parallel
// (ExpertsApart: Megatron's allreduce = False).
//
// The bucket size: --ddp-num-buckets splits the rank's parameters evenly, else
// --ddp-bucket-size, else max(40M, 1M x dp x cp) (the full data-parallel group); none (one
// bucket a buffer, but for a shared embedding's) without --overlap-grad-reduce, on pipeline
// stages after the first, for chunks after the first, and with
// --overlap-param-gather-with-optimizer-step.
//
// What the buffers allocate, per chunk and buffer in that order: param_data (the parameter
// dtype, the whole padded buffer), grad_data (the gradient dtype), then every parameter in
// reverse order moves into its place in param_data and its own storage is freed. Not
// modelled: FP8 parameters stay outside param_data (their 16-bit data has no storage), the
// NCCL user-buffer pool (--nccl-ub), MXFP8's shared buffer, the side stream DDP builds the
// buffers on (whose pool the default stream's later blocks cannot use; nothing is freed
// into it), local experts as separate parameters (memsim's weights hold all of a layer's
// local experts: buckets cut them as one tensor), and the parameter groups of --decoupled-lr.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "models/parameters.h"
#include "parallel/layout.h"

namespace memsim {

// One parameter as a buffer's layout sees it.
struct BufferParameter {
  int64_t numel = 0;
  bool shared_embedding = false;  // closes the bucket before and after it
};

// A buffer's layout: where each parameter of it starts and the buckets that cut it.
struct BufferLayout {
  struct Bucket {
    int64_t start = 0;
    int64_t end = 0;  // padded: (end - start) is a multiple of the divisor
  };
  std::vector<int64_t> starts;   // per parameter, in the order given
  std::vector<int64_t> buckets;  // per parameter: its bucket's index
  std::vector<Bucket> bucket_ranges;
  int64_t numel = 0;  // the whole buffer, padded
};

// Megatron's _compute_per_buffer_param_layout over `params` in named_parameters() order.
// REQUIRES: dp >= 1; bucket_size, if set, > 0; every numel >= 0.
BufferLayout LayOutBuffer(const std::vector<BufferParameter>& params,
                          std::optional<int64_t> bucket_size, int64_t dp,
                          bool pad_for_high_nccl_busbw);

// Data-parallel rank `rank`'s slice of each parameter of `layout` (the order given to
// LayOutBuffer): its bucket's rank range met with the parameter's elements.
// REQUIRES: 0 <= rank < dp, the dp `layout` was made with; `params` as given to it.
std::vector<ParameterSlice> RankSlices(const std::vector<BufferParameter>& params,
                                       const BufferLayout& layout, int64_t dp, int64_t rank);

// The bucket size of a chunk: unset means one bucket a buffer.
// REQUIRES: dp_cp >= 1; num_parameters >= 0; num_buckets, bucket_size > 0 if set.
std::optional<int64_t> ChunkBucketSize(const DdpBucketOptions& options, int64_t dp_cp,
                                       int64_t num_parameters, int64_t pp_rank, int64_t chunk);

// Everything AllocateDistributedOptimizerBuffers needs to know about the rank.
struct DdpBufferOptions {
  DdpBucketOptions buckets;
  int64_t dp_cp = 1;         // the full data-parallel x context-parallel group
  int64_t dense_shards = 1;  // intra-instance groups (OptimizerShards)
  int64_t expert_shards = 1;
  // This rank's place in each; unset: the one whose slices hold the most elements.
  std::optional<int64_t> dense_rank, expert_rank;
  int64_t pp_rank = 0;
  // Whether routed experts are expert-parallel, in buffers and an optimizer of their own
  // (Megatron's allreduce = False: EP > 1 or ETP != TP); else they sit among the dense
  // parameters.
  bool experts_apart = true;
};

// Allocates every chunk's buffers as the Note says, moves the parameters into them,
// points every main_grad into them and sets every parameter's optimizer_slice.
// REQUIRES: every parameter added to `store` and no gradient buffer allocated; the ranks
// within their shards.
void AllocateDistributedOptimizerBuffers(ParameterStore* store, const DdpBufferOptions& options);

}  // namespace memsim
