#include "ops/transformer_kernels.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <mutex>

#include "simulator/op_traits.h"

namespace memsim {
namespace {

int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

void WgradGemmAccumMeta(const at::Tensor& main_grad, const at::Tensor& input,
                        const at::Tensor& grad_output) {
  TORCH_CHECK(main_grad.dim() == 2 && main_grad.size(0) == grad_output.size(-1) &&
                  main_grad.size(1) == input.size(-1),
              "wgrad_gemm_accum_: main_grad ", main_grad.sizes(), " does not match grad_output ",
              grad_output.sizes(), " and input ", input.sizes());
}

// general_gemm into a new output, for fp8_gemm and te_gemm.
at::Tensor GeneralGemmMeta(const at::Tensor& a, const at::Tensor& b, at::ScalarType out_dtype) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0), "general_gemm: a ", a.sizes(),
              " and b ", b.sizes(), " do not multiply");
  return at::empty({a.size(0), b.size(1)}, a.options().dtype(out_dtype));
}

at::Tensor& Fp8GemmOutMeta(const at::Tensor& a, const at::Tensor& b, at::Tensor& out) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0) && out.dim() == 2 &&
                  out.size(0) == a.size(0) && out.size(1) == b.size(1),
              "fp8_gemm_out: a ", a.sizes(), " and b ", b.sizes(), " do not multiply into out ",
              out.sizes());
  return out;
}

// mha_fwd: out like q; softmax_lse float32 [B, heads, S]; rng_state int64 [2] (dropout).
std::tuple<at::Tensor, at::Tensor, at::Tensor> FlashForwardMeta(const at::Tensor& q,
                                                                const at::Tensor& k,
                                                                const at::Tensor& v,
                                                                double dropout_p, bool causal) {
  const int64_t batch = q.size(0), seq = q.size(1), heads = q.size(2);
  auto meta = at::TensorOptions().device(at::kMeta);
  // The output has v's head width (multi-latent attention's differs from q's), laid out
  // like q (or like v, which then has every head).
  at::Tensor out = v.size(3) == q.size(3) ? at::empty_like(q) : at::empty_like(v);
  return {out, at::empty({batch, heads, seq}, meta.dtype(at::kFloat)),
          at::empty({2}, meta.dtype(at::kLong))};
}

// mha_bwd: dq, dk, dv like q, k, v; temporaries softmax_d float32 [B, heads, S rounded to
// 128] and dq_accum float32 [B, S rounded to 128, heads, D rounded]; with grouped-query
// attention dk and dv are first computed per query head ([B, S, heads, D]) and summed.
std::tuple<at::Tensor, at::Tensor, at::Tensor> FlashBackwardMeta(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& softmax_lse, double dropout_p, bool causal) {
  const int64_t batch = q.size(0), seq = q.size(1), heads = q.size(2), head_dim = q.size(3);
  auto meta_float = at::TensorOptions().device(at::kMeta).dtype(at::kFloat);
  at::Tensor dq = at::empty_like(q);
  const int64_t seq_rounded = RoundUp(seq, 128);
  const int64_t head_dim_rounded = RoundUp(head_dim, head_dim <= 128 ? 32 : 64);
  at::Tensor softmax_d = at::empty({batch, heads, seq_rounded}, meta_float);
  at::Tensor dq_accum = at::empty({batch, seq_rounded, heads, head_dim_rounded}, meta_float);
  if (k.size(2) != heads) {
    at::Tensor dk_expanded = at::empty_like(q);
    at::Tensor dv_expanded = at::empty_like(q);
    return {dq, at::sum(dk_expanded.view({batch, seq, k.size(2), -1, head_dim}), {3}),
            at::sum(dv_expanded.view({batch, seq, k.size(2), -1, head_dim}), {3})};
  }
  return {dq, at::empty_like(k), at::empty_like(v)};
}

}  // namespace

void RegisterTransformerKernels() {
  static std::once_flag once;
  std::call_once(once, [] {
    static auto* def =
        new torch::Library(torch::Library::FRAGMENT, "memsim", c10::nullopt, __FILE__, __LINE__);
    def->def("wgrad_gemm_accum_(Tensor(a!) main_grad, Tensor input, Tensor grad_output) -> ()");
    def->def("fp8_gemm(Tensor a, Tensor b, ScalarType out_dtype) -> Tensor");
    def->def("fp8_gemm_out(Tensor a, Tensor b, Tensor(a!) out) -> Tensor(a!)");
    def->def("te_gemm(Tensor a, Tensor b, ScalarType out_dtype) -> Tensor");
    def->def(
        "flash_attention_forward(Tensor q, Tensor k, Tensor v, float dropout_p, bool causal) -> "
        "(Tensor, Tensor, Tensor)");
    def->def(
        "flash_attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, "
        "Tensor softmax_lse, float dropout_p, bool causal) -> (Tensor, Tensor, Tensor)");
    OpTraits gemm;
    gemm.cost_kind = OpCostKind::kMatmul;
    RegisterOpTraits("memsim::wgrad_gemm_accum_", gemm);
    RegisterOpTraits("memsim::fp8_gemm", gemm);
    RegisterOpTraits("memsim::fp8_gemm_out", gemm);
    RegisterOpTraits("memsim::te_gemm", gemm);
    OpTraits attention = gemm;
    attention.is_attention = true;
    RegisterOpTraits("memsim::flash_attention_forward", attention);
    attention.is_attention_backward = true;
    RegisterOpTraits("memsim::flash_attention_backward", attention);
    static auto* meta = new torch::Library(torch::Library::IMPL, "memsim", c10::DispatchKey::Meta,
                                           __FILE__, __LINE__);
    meta->impl("wgrad_gemm_accum_", TORCH_FN(WgradGemmAccumMeta));
    meta->impl("fp8_gemm", TORCH_FN(GeneralGemmMeta));
    meta->impl("te_gemm", TORCH_FN(GeneralGemmMeta));
    meta->impl("fp8_gemm_out", TORCH_FN(Fp8GemmOutMeta));
    meta->impl("flash_attention_forward", TORCH_FN(FlashForwardMeta));
    meta->impl("flash_attention_backward", TORCH_FN(FlashBackwardMeta));
    // Called from custom autograd Functions (layers.cc), which do their own backward.
    static auto* autograd = new torch::Library(torch::Library::IMPL, "memsim",
                                               c10::DispatchKey::Autograd, __FILE__, __LINE__);
    for (const char* op : {"wgrad_gemm_accum_", "fp8_gemm", "fp8_gemm_out", "te_gemm",
                           "flash_attention_forward", "flash_attention_backward"}) {
      autograd->impl(op, torch::CppFunction::makeFallthrough());
    }
  });
}

void WgradGemmAccumulate(const at::Tensor& main_grad, const at::Tensor& input,
                         const at::Tensor& grad_output) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("memsim::wgrad_gemm_accum_", "")
          .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  op.call(main_grad, input, grad_output);
}

namespace {

using GeneralGemmOp =
    c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, at::ScalarType)>;

// fp8_gemm's or te_gemm's handle, looked up once by each caller.
GeneralGemmOp FindGeneralGemm(const char* name) {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow(name, "")
      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, at::ScalarType)>();
}

}  // namespace

at::Tensor Fp8Gemm(const at::Tensor& a, const at::Tensor& b, at::ScalarType out_dtype) {
  static const GeneralGemmOp op = FindGeneralGemm("memsim::fp8_gemm");
  return op.call(a, b, out_dtype);
}

at::Tensor TeGemm(const at::Tensor& a, const at::Tensor& b, at::ScalarType out_dtype) {
  static const GeneralGemmOp op = FindGeneralGemm("memsim::te_gemm");
  return op.call(a, b, out_dtype);
}

void Fp8GemmInto(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("memsim::fp8_gemm_out", "")
          .typed<at::Tensor&(const at::Tensor&, const at::Tensor&, at::Tensor&)>();
  at::Tensor target = out;
  op.call(a, b, target);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> FlashAttentionForward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double dropout_p, bool causal) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("memsim::flash_attention_forward", "")
          .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
              const at::Tensor&, const at::Tensor&, const at::Tensor&, double, bool)>();
  return op.call(q, k, v, dropout_p, causal);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> FlashAttentionBackward(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& softmax_lse, double dropout_p, bool causal) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("memsim::flash_attention_backward", "")
          .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
              const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
              const at::Tensor&, const at::Tensor&, double, bool)>();
  return op.call(dout, q, k, v, out, softmax_lse, dropout_p, causal);
}

}  // namespace memsim
