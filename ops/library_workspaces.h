// Workspaces the CUDA libraries allocate through PyTorch's caching allocator.
//
// Note [Library workspaces]
// GEMM libraries need scratch memory. Two kinds of it sit in torch.cuda.memory_allocated()
// for the whole run, so they are part of static memory and of every peak:
//   * PyTorch's cuBLAS/cuBLASLt workspace (aten/src/ATen/cuda/CublasHandlePool.cpp,
//     PyTorch 2.x): one allocation of getChosenWorkspaceSize() per (cuBLAS handle, CUDA
//     stream) pair, made at the first GEMM of that pair and never freed. Handles are
//     per thread, and autograd runs CUDA backward on its own device thread, so a training
//     step makes two: the forward thread's and the backward thread's. The forward
//     (main) thread's is made later where its first PyTorch GEMM comes after the schedule:
//     deferred output-layer weight gradients, Muon's iterations in the optimizer step
//     (LibraryWorkspaces in parallel/rank_training.cc). Work on another stream makes
//     its own pair: the local implementation's shared experts under
//     --moe-shared-expert-overlap (two more). cuBLASLt shares the
//     same map (TORCH_CUBLASLT_UNIFIED_WORKSPACE, on by default). The size is
//     CUBLAS_WORKSPACE_CONFIG's sum of SIZE_KiB * COUNT over its ":SIZE:COUNT" pairs, else
//     32 MiB on compute capability 9.x, 10.x and 12.x and 4096 KiB * 2 + 16 KiB * 8 on
//     older GPUs. (Measured on an H200 with PyTorch 2.11: 32 MiB at the first GEMM of the
//     main thread, of a second stream, of a new thread and of autograd's backward thread;
//     ops/library_workspaces_test.cc. Not modelled: a further 1 MiB block PyTorch keeps
//     from the first cuBLASLt GEMM with a bias epilogue, which only the local
//     implementation's biased linears reach.)
//   * Transformer Engine's GEMM workspace (transformer_engine/pytorch/cpp_extensions/
//     gemm.py, get_cublas_workspace, TE 2.18): one torch.empty of 32 MiB + 1 KiB on
//     compute capability >= 9 (4 MiB before), cached per device, at TE's first GEMM;
//     grouped GEMMs (GroupedLinear, --moe-grouped-gemm) use a separate list of
//     kTeGroupedGemmStreams more of the same size (one per compute stream,
//     transformer_engine/common/util/multi_stream.cpp), made at the first grouped GEMM;
//     with TP communication overlap one more, kTeUserbufferStreams times the size, at
//     the first userbuffer GEMM. The MoE router's gating GEMMs go through TE's
//     general_gemm whenever TE is installed, whatever --transformer-impl says
//     (Megatron-Core 0.20 moe/moe_utils.py RouterGatingLinearFunction, unless the router
//     runs in fp64), so a stage with MoE layers has TE's workspace even with the local
//     implementation, and the router runs no GEMM through PyTorch. (Measured: local-
//     implementation MoE tests hold 28 MiB more on H100 and GB200 than on A100, the
//     difference between TE's workspaces on the two, 32 MiB + 1 KiB against 4 MiB.)
#pragma once

#include <cstdint>
#include <string>

#include "simulator/cost_model.h"
#include "simulator/status.h"

namespace memsim {

// PyTorch's cuBLAS workspace for `gpu` when CUBLAS_WORKSPACE_CONFIG is unset.
int64_t DefaultCublasWorkspaceBytes(const GpuSpec& gpu);

// Parses CUBLAS_WORKSPACE_CONFIG as PyTorch does (":4096:8" -> 32 MiB). PyTorch warns and
// falls back to its default on text it cannot parse; memsim makes that an error instead,
// since the user surely meant something else.
Status ParseCublasWorkspaceConfig(const std::string& text, int64_t* bytes);

inline constexpr int kTeGroupedGemmStreams = 4;

// Transformer Engine's GEMM workspace for `gpu` (each of them).
int64_t TransformerEngineWorkspaceBytes(const GpuSpec& gpu);

// The userbuffer GEMMs' workspace (Note [Userbuffers] in collectives.h): one allocation
// of a GEMM workspace per overlap stream (_NUM_MAX_UB_STREAMS).
inline constexpr int kTeUserbufferStreams = 3;

}  // namespace memsim
