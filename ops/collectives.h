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

}  // namespace memsim
