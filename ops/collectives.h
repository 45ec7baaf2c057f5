// Fake collectives (namespace memsim, ops named comm_*): they allocate exactly what the
// NCCL-backed torch.distributed call and its caller allocate, and move no data. Megatron
// calls the tensor variants (all_gather_into_tensor, reduce_scatter_tensor, all_to_all_
// single, isend/irecv) whose outputs the caller allocates and NCCL writes in place: no
// staging buffer from the caching allocator. Allocations made inside them are recorded
// as communication (Note [Memory categories]).
//
//   memsim::comm_all_reduce_(Tensor(a!) t, int group) -> Tensor(a!)        in place
//   memsim::comm_all_gather(Tensor t, int group) -> Tensor                 [group * d0, ...]
//   memsim::comm_reduce_scatter(Tensor t, int group) -> Tensor             [d0 / group, ...]
//   memsim::comm_all_to_all(Tensor t, int group, int rows) -> Tensor       [rows, ...]
//   memsim::comm_send(Tensor t) -> ()
//   memsim::comm_recv_(Tensor(a!) t) -> Tensor(a!)                         in place
#pragma once

#include <ATen/core/Tensor.h>

namespace memsim {

void RegisterCollectives();

at::Tensor AllReduceInPlace(const at::Tensor& t, int64_t group_size);
at::Tensor AllGather(const at::Tensor& t, int64_t group_size);
at::Tensor ReduceScatter(const at::Tensor& t, int64_t group_size);
// Token exchange: this rank sends t's rows and receives `output_rows` rows.
at::Tensor AllToAll(const at::Tensor& t, int64_t group_size, int64_t output_rows);
void Send(const at::Tensor& t);
void ReceiveInto(const at::Tensor& t);

// Note [Userbuffers]
// Transformer Engine's TP communication overlap (--tp-comm-overlap; TE 2.18 initialize_ub
// in pytorch/module/base.py, common/comm_gemm_overlap/, Megatron-Core 0.20
// training/initialize.py) runs the sequence-parallel all-gathers and reduce-scatters of
// linear_qkv, linear_proj, linear_fc1 and linear_fc2 through "userbuffers": one global
// buffer per GEMM name and direction, [S*B/cp, H] each, made once with cuMemCreate or
// cudaMalloc and wrapped with torch::from_blob, so PyTorch's caching allocator never sees
// them (nor torch.cuda.memory_allocated). What the allocator does see:
//   + one cuBLAS workspace for the overlap streams, 3 * (32 MiB + 1 KiB) on compute
//     capability >= 9 (3 * 4 MiB before), made at the first userbuffer GEMM and kept;
//   - the all-gathered input of a column-parallel forward (ub_overlap_ag) and of its
//     backward (bulk dgrad), and a row-parallel backward's all-gathered output gradient
//     (ub_overlap_ag), which land in userbuffers instead of fresh tensors (16-bit, or FP8
//     data: an FP8 transpose is still allocated);
//   - a column-parallel backward's full input gradient (bulk wgrad), computed into a
//     userbuffer and reduce-scattered from it (the local share is a fresh tensor, as
//     without overlap).
// Row-parallel outputs are reduce-scattered into a fresh local tensor either way. The
// buffers themselves (16 * S*B/cp * H bytes with FP8, 24 with 16 bits, by TE's default
// methods; the --tp-comm-overlap-cfg file changes them) and ~4 MiB of control memory sit
// outside the allocator: memsim does not count them.

// The userbuffers of TE's initialize_ub with its default methods, for `rows` = S*B/cp tokens
// of `hidden` values, one set per quantization mode: FP8 (8 uint8 all-gather buffers and 4
// 16-bit reduce-scatter ones: 16 bytes a token value) and/or 16-bit (12 16-bit buffers:
// 24), plus the communicator's control memory (3,223,808 + 131,072 bytes), before the
// driver's granularity rounding. Outside PyTorch's caching allocator.
int64_t UserbufferBytes(int64_t rows, int64_t hidden, bool fp8_mode, bool sixteen_bit_mode);

// A [sizes] tensor of `dtype` viewing a userbuffer: no allocation memsim records.
at::Tensor UserbufferView(at::IntArrayRef sizes, at::ScalarType dtype);
// `t` [d0, ...] all-gathered over the group into a userbuffer view [group * d0, ...].
at::Tensor AllGatherIntoUserbuffer(const at::Tensor& t, int64_t group_size);

}  // namespace memsim
