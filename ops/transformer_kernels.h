// Custom ops (namespace memsim) for fused CUDA kernels that have no ATen equivalent with
// the same memory behaviour. Each Meta kernel allocates exactly the outputs, and the
// temporaries, of the CUDA kernel it names.
//
//   memsim::wgrad_gemm_accum_(Tensor(a!) main_grad, Tensor input, Tensor grad_output) -> ()
//       Megatron's gradient_accumulation_fusion (fused_weight_gradient_mlp_cuda
//       wgrad_gemm_accum_fp32/fp16): main_grad += grad_output^T @ input, in place.
//   memsim::fp8_gemm(Tensor a, Tensor b, ScalarType out_dtype) -> Tensor
//       Transformer Engine's FP8 GEMM (general_gemm on quantized operands held as uint8):
//       a [M, K] times b [K, N] into a new [M, N] of out_dtype.
//   memsim::fp8_gemm_out(Tensor a, Tensor b, Tensor(a!) out) -> Tensor(a!)
//       the same into `out` (a userbuffer: Note [Userbuffers] in collectives.h).
//   memsim::te_gemm(Tensor a, Tensor b, ScalarType out_dtype) -> Tensor
//       Transformer Engine's general_gemm on 16-bit operands into another dtype (Megatron's
//       output_dtype: --output-logit-dtype): a [M, K] times b [K, N] into a new [M, N].
//   memsim::flash_attention_forward(Tensor q, Tensor k, Tensor v, float dropout_p,
//       bool causal) -> (Tensor out, Tensor softmax_lse, Tensor rng_state)
//   memsim::flash_attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out,
//       Tensor softmax_lse, float dropout_p, bool causal) -> (Tensor dq, Tensor dk, Tensor dv)
//       FlashAttention-2 (flash_attn 2.x, csrc/flash_attn/flash_api.cpp mha_fwd/mha_bwd),
//       layout [B, S, heads, D].
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

namespace memsim {

void RegisterTransformerKernels();

void WgradGemmAccumulate(const at::Tensor& main_grad, const at::Tensor& input,
                         const at::Tensor& grad_output);
at::Tensor Fp8Gemm(const at::Tensor& a, const at::Tensor& b, at::ScalarType out_dtype);
void Fp8GemmInto(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out);
at::Tensor TeGemm(const at::Tensor& a, const at::Tensor& b, at::ScalarType out_dtype);
std::tuple<at::Tensor, at::Tensor, at::Tensor> FlashAttentionForward(const at::Tensor& q,
                                                                     const at::Tensor& k,
                                                                     const at::Tensor& v,
                                                                     double dropout_p, bool causal);
std::tuple<at::Tensor, at::Tensor, at::Tensor> FlashAttentionBackward(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& softmax_lse, double dropout_p, bool causal);

}  // namespace memsim
