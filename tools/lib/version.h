// What memsim is and which releases of the real software it models. Every modelling rule
// cites these versions' source; VALIDATION.md measures memsim against runs of them.
#pragma once

namespace memsim {

inline constexpr const char* kMemsimVersion = "0.2.0";
inline constexpr const char* kModelledMegatronCore =
    "Megatron-Core 0.20.0 (NVIDIA/Megatron-LM d98e8a64, 2026-08-22)";
inline constexpr const char* kModelledTransformerEngine = "Transformer Engine 2.18";
// Models Megatron-Core itself lacks, built on it by Megatron-Bridge (Gemma-2).
inline constexpr const char* kModelledMegatronBridge =
    "Megatron-Bridge (NVIDIA-NeMo/Megatron-Bridge 067f987d, 2026-08-22) for Gemma-2";
inline constexpr const char* kModelledPyTorch =
    "PyTorch 2.x CUDA caching allocator and cuBLAS workspaces";

}  // namespace memsim
