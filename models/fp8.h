// FP8 training with Transformer Engine: the FP8 weights, quantized activations and
// gradients of TE's Linear and LayerNormLinear.
//
// Note [FP8 training]
// From Transformer Engine 2.18 (pytorch/module/linear.py, layernorm_linear.py, base.py,
// distributed.py, csrc/quantizer.cpp, tensor/utils.py) and Megatron-Core 0.20
// (extensions/transformer_engine.py, fp8_utils.py, distributed/param_and_grad_buffer.py,
// optimizer/distrib_optimizer.py). On Hopper an FP8 GEMM reads both operands row-major
// ("TN"), so a quantized tensor that a backward GEMM reads the other way also keeps its
// transpose ("columnwise" data). A quantized [R, C] tensor holds:
//   delayed, tensorwise (per-tensor scaling): rowwise data R*C bytes, transpose R*C bytes,
//     one fp32 scale_inv shared by both; where the GPU's FP8 GEMMs read any layout
//     (nvte_is_non_tn_fp8_gemm_supported: compute capability 10.x, 11.x, 13 and later;
//     TrainingConfig::fp8_gemm_any_layout) no transpose at all: Float8Quantizer and
//     Float8CurrentScalingQuantizer make the rowwise data for either usage, update_usage
//     keeps it, and cached weights and FP8 parameters are their data alone (the GB200
//     FP8 cases measure 9-10 MiB less than the same tests on H100 after the step, which
//     this accounts for);
//   blockwise: rowwise data R*C and fp32 scales [ceil(C/128), roundup(R, 4)], columnwise
//     data R*C and [ceil(R/128), roundup(C, 4)] (1x128 blocks: activations, gradients);
//     a weight's 128x128 blocks: [ceil(R/128), roundup(ceil(C/128), 4)] and its mirror;
//   mxfp8 (Blackwell: compute capability 10.0 to 11.x; csrc/quantizer.cpp MXFP8Quantizer,
//     tensor/mxfp8_tensor.py): rowwise data R*C and columnwise data R*C in the same layout
//     (not a transpose: Blackwell's GEMM reads either), each with one-byte E8M0 scales per
//     32 values, rowwise [roundup(R, 128), roundup(C/32, 4)], columnwise [roundup(R/32, 4),
//     roundup(C, 128)], weights alike; no amax, no scale. R and C must be multiples of 32
//     (FinalizeRunSpec refuses others). GroupedLinear quantizes each expert alone, so each
//     expert's scales are padded (Fp8LinearOptions::row_groups). A GEMM reads scales in a
//     swizzled layout: quantizations made for a GEMM write them so, but gathered tensors
//     keep compact scales (so that ranks' rows concatenate), and each GEMM that reads them
//     makes a swizzled copy of the same size for its duration (swizzle_scales_for_gemm).
// Tensorwise scaling also makes and drops an fp32 [2] amax and scale per quantization.
//
// What runs in FP8: the decoder's TE GEMM modules outside the bf16 first/last layers
// (counted from the whole model's first and last layer, as is_first_last_bf16_layer does):
// linear_qkv and linear_fc1 (LayerNormLinear), linear_proj and linear_fc2 (Linear); MLA's
// down projections (duplicated Linears, each quantizing the norm output itself) and up
// projections (LayerNormLinears fusing q_layernorm and kv_layernorm); the routed experts
// (GroupedLinear: per expert, as one quantization of all rows here, one per-tensor scale
// where TE has one per expert; MXFP8 scales padded per expert) and the shared experts
// (Linear); MTP's eh_proj. Core attention (FP8
// attention has no Megatron-LM argument), norms, embeddings, the router and the output
// layer (Megatron's own ColumnParallelLinear) stay 16-bit. TE also asserts FP8 GEMM shapes
// (rows a multiple of 8, inner dimension of 16; MXFP8: both dimensions of every quantized
// tensor a multiple of 32): FinalizeRunSpec refuses others.
// MoE: TEGroupedMLP's Fp8Padding copies the experts' rows and probabilities into buffers
// padded to 16 rows per expert when any expert's count is off the multiple (memsim routes
// evenly: all experts or none), and Fp8Unpadding copies fc2's output back; fc2 keeps its
// 16-bit input under moe_act recomputation (which the delayed recipe refuses), the shared
// experts' fc1 its 16-bit input (but delayed, or recomputed shared experts); MLA's down
// projections keep theirs under layernorm recomputation (but delayed).
//
// Note [FP8 kernels on the clock]
// memsim makes a quantization's outputs with at::empty, which the virtual clock does not
// charge, but Transformer Engine's quantize call launches kernels (csrc/quantizer.cpp): one
// nvte_quantize_v2 cast (with the transpose when both usages are made; the delayed recipe's
// computes the amax as it goes; blockwise and MXFP8 write their scales), and for tensorwise
// current scaling first nvte_compute_amax over the input and nvte_compute_scale_from_amax.
// One call from Python is charged as one op (ChargeMemoryBoundKernel), as an ATen op is: the host's
// time per op at least, its kernels launched from C++ within it; on the GPU the bytes they
// move (the input read by the cast and, tensorwise, by the amax; the FP8 data and scales
// written). A transpose made from rowwise data (update_usage after a gather) is one more op
// reading and writing it. Megatron-LM's tensorwise tests read, on H100 and GB200: tp2_pp2
// -14.5% and -7.4% before the quantizations were charged, -5.8% and -2.2% now; tp4_cp2
// -31.4% and -32.6%, now -24.3% and -28.8% (the rest unidentified: the suite's other
// context-parallel tests read within 11% on H100); the attention-graphed MoE test -16.4%,
// now -13.1%. Charging each of current scaling's three kernels as an op overshot (tp2_pp2
// about +15% and +21%). The fp32 DeepSeek proxy, already high from its fp32 GEMMs, reads
// +29% (was +26%). Not charged:
// the amax all-reduce of current scaling under sequence parallelism (with_amax_reduction),
// the weights' re-quantization on each step's first microbatch or after the optimizer
// step (--fp8-param-gather), one call per expert where GroupedLinear quantizes experts
// apart (memsim quantizes their rows as one), and MXFP8's scale swizzles.
//
// Weights (Parameter::fp8):
//   16-bit parameters: Megatron passes is_first_microbatch, so TE caches one FP8 copy of
//     each weight with its transpose (MXFP8: its columnwise data, scales pre-swizzled),
//     made in its first forward, re-quantized in place on each step's first microbatch and
//     kept for the run: 2 bytes per weight element more than 16-bit training (MXFP8: and
//     its scales, about 2/32 of a byte). MXFP8 weights are quantized over the experts'
//     concatenated block: TE pads each expert's scales alone, so memsim counts a few
//     scale bytes too few when an expert's rows (fc1) or columns (fc2) are not a multiple
//     of 128. memsim makes it with the parameter, in the
//     setup: the same bytes from the first forward on, counted in static memory (where a planner
//     wants them), and layers stay alike for replication (Note [Layer replication]);
//   --fp8-param-gather (refused with MXFP8: Megatron-Core then has no parameter buffer and
//     gathers bf16 values through the gradient buffer, --reuse-grad-buf-for-mxfp8-param-ag,
//     param_and_grad_buffer.py): the parameter is FP8 (1 byte in the parameter buffer) and keeps
//     its transpose (1 byte), refilled in place after each parameter all-gather; the
//     16-bit value exists only while TE initialises the weight. In the optimizer step
//     (quantize_param_shard) the master shards' bf16 copies are held together, each shard's
//     cast makes a shard-sized transpose it drops, and one fp32 amax per parameter is
//     packed (tensorwise: and one fp32 scale per parameter);
//   delayed: each module keeps fp32 scales [3] and [2] and amax histories [L, 3] and
//     [L, 2] (L = fp8_amax_history_len), made in its first forward (memsim: in the setup).
//
// A linear's forward, input x of M rows (m = M/tp before a sequence-parallel gather) and
// K columns, output [M, N] 16-bit:
//   column-parallel with sequence parallelism: x quantized rowwise (blockwise, MXFP8: both
//     ways) and all-gathered in FP8 into a fresh M*K (MXFP8: with compact scales, gathered
//     straight into the output's), freed after the GEMM; kept for backward: the local
//     rowwise shard (blockwise, MXFP8: the columnwise shard);
//   otherwise: x quantized both ways; the rowwise data dropped after the GEMM, the
//     transpose kept;
//   LayerNormLinear: the norm keeps its input and statistics as in 16-bit training; its
//     16-bit output lives only until quantized (tensorwise, blockwise, MXFP8: a temporary of the
//     unfused kernel; delayed: TE's kernel writes FP8 directly, memsim still makes the
//     temporary, 2*m*K bytes that exist only until the quantization);
//   linear_proj with every recipe but delayed (Megatron's save_original_input): the
//     16-bit input is kept (the attention output, alive anyway) and quantized transiently,
//     in forward and again in backward;
//   row-parallel with sequence parallelism: TE reduce-scatters the output itself.
// Backward: the output gradient quantized both ways (M*N twice; row-parallel with sequence
// parallelism: the local shard quantized rowwise and all-gathered in FP8 into M*N data and
// an M*N transpose; MXFP8: the shard quantized both ways and both usages all-gathered);
// column-parallel with sequence parallelism: the kept shard all-gathered in FP8 (M*K) and
// its transpose built (M*K; MXFP8: the columnwise shards gathered straight into M*K
// columnwise data); dgrad [M, K] 16-bit (reduce-scattered or all-reduced as in 16 bits);
// wgrad into main_grad as in 16 bits (Note [Weight gradients]). The input quantized again
// for save_original_input is columnwise only under blockwise and MXFP8.
//
// MoE under MXFP8: Fp8Padding aligns each expert's rows to 32 (get_align_size_for_quantization).
//
// Not modelled (refused or left out): MXFP8 parameters (--fp8-param-gather) and MXFP8
// with userbuffers (refused), the fused bias-gradient quantization's fp32 workspace
// (linears with a bias), TE's bulk allocation of all experts' MXFP8 data and scales in two
// buffers, one per usage (memsim: one data and one scale tensor per usage, the same bytes,
// since 32-row multiples keep every part aligned), the cuDNN-fused norm (NVTE_NORM_FWD_USE_CUDNN),
// FP8 with the op fuser (its 256-row padding; refused), router padding
// (--moe-router-padding-for-fp8), FP8 attention, the delayed recipe's amax-reduction
// temporaries (4 bytes per module per step), per-expert per-tensor scales beyond one, and the norm
// kernels' workspaces. MLA's input norm output lives until the attention returns (in TE
// until both down projections have quantized it).
#pragma once

#include <ATen/core/Tensor.h>

#include "models/layers.h"
#include "models/parameters.h"

namespace memsim {

// Makes `weight` the weight of an FP8 module of `training`'s recipe (Note [FP8 training]):
// allocates its FP8 data, transpose and scales (and the delayed recipe's state); with
// fp8_param_gather they are the parameter and its 16-bit storage is freed.
// REQUIRES: training.fp8 != kNone; called once, before the weight is used.
void MakeFp8Weight(Parameter* weight, const TrainingConfig& training);

// TE's Linear in FP8: y = x W^T (+ b), as Note [FP8 training] says.
// REQUIRES: `weight` was made an FP8 module's by MakeFp8Weight; `options`' REQUIRES.
at::Tensor Fp8Linear(const at::Tensor& input, Parameter& weight, Parameter* bias,
                     const LinearParallelism& parallelism, const Fp8LinearOptions& options);

// The temporaries of the optimizer step's casts of the fp32 master shards `masters` into
// their FP8 parameters (quantize_param_shard).
void CastMastersToFp8Parameters(const std::vector<at::Tensor>& masters, const Fp8Module& fp8);

}  // namespace memsim
