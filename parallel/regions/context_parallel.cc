#include "parallel/regions/context_parallel.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <vector>

#include "ops/collectives.h"
#include "ops/transformer_kernels.h"

namespace memsim {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::Function;
using torch::autograd::variable_list;

struct RingAttentionFunction : public Function<RingAttentionFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, int64_t cp, double dropout_p) {
    const at::Tensor kv = at::stack({k, v});  // the send buffer of step 0
    std::vector<at::Tensor> received;
    std::vector<at::Tensor> step_outputs;
    std::vector<at::Tensor> step_lse;
    at::Tensor current = kv;
    for (int64_t step = 0; step < cp; ++step) {
      if (step + 1 < cp) {
        received.push_back(at::empty_like(kv));
        Send(current);
        ReceiveInto(received.back());
      }
      auto [out, lse, rng] = FlashAttentionForward(q, current[0], current[1], dropout_p, true);
      step_outputs.push_back(out);
      step_lse.push_back(lse);
      if (step + 1 < cp) current = received.back();
    }
    // Merge the steps' outputs with their log-sum-exps.
    at::Tensor out = at::empty_like(q);
    at::Tensor lse = at::empty_like(step_lse[0]);
    ctx->save_for_backward({q, kv, out, lse});
    ctx->saved_data["cp"] = cp;
    ctx->saved_data["dropout_p"] = dropout_p;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const at::Tensor& q = s[0];
    const at::Tensor& kv = s[1];
    const int64_t cp = ctx->saved_data["cp"].toInt();
    const double dropout_p = ctx->saved_data["dropout_p"].toDouble();
    at::Tensor dq = at::empty_like(q);
    // Two double buffers, each carrying kv and its gradient around the ring.
    std::vector<int64_t> buffer_shape = {2};
    for (int64_t d : kv.sizes()) buffer_shape.push_back(d);
    at::Tensor buffers[2] = {at::empty(buffer_shape, kv.options()),
                             at::empty(buffer_shape, kv.options())};
    const at::Tensor grad = grads[0].contiguous();
    for (int64_t step = 0; step < cp; ++step) {
      const at::Tensor& current = step == 0 ? kv : buffers[step % 2][0];
      if (step + 1 < cp) {
        Send(buffers[step % 2]);
        ReceiveInto(buffers[(step + 1) % 2]);
      }
      auto [dq_step, dk_step, dv_step] =
          FlashAttentionBackward(grad, q, current[0], current[1], s[2], s[3], dropout_p, true);
      dq.add_(dq_step);
    }
    const at::Tensor dkv = buffers[(cp - 1) % 2][1];
    return {dq, dkv[0].contiguous(), dkv[1].contiguous(), at::Tensor(), at::Tensor()};
  }
};

// flash_attn_a2a_communicate (Note [All-to-all context parallelism]) on tensors [S, B, heads,
// D] in sequence-first layout: each is copied (staged before attention, reordered after),
// received into a new tensor that lives until the next copy is made, and copied into its
// output, [S * factor, B, heads / factor, D]; the first copies live until all are done.
// `factor` is cp before attention and 1/cp after it (given as cp and `before`).
std::vector<at::Tensor> Exchange(const std::vector<at::Tensor>& xs, int64_t cp, bool before) {
  std::vector<at::Tensor> copies, outputs;
  for (const at::Tensor& x : xs) {
    copies.push_back(at::empty_like(x, at::MemoryFormat::Contiguous));
    at::Tensor received = AllToAll(copies.back(), cp, copies.back().size(0));
    const int64_t seq = before ? x.size(0) * cp : x.size(0) / cp;
    const int64_t heads = before ? x.size(2) / cp : x.size(2) * cp;
    outputs.push_back(at::empty({seq, x.size(1), heads, x.size(3)}, x.options()));
  }
  return outputs;
}

struct AllToAllQkvFunction : public Function<AllToAllQkvFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, int64_t cp) {
    ctx->saved_data["cp"] = cp;
    return Exchange({q, k, v}, cp, /*before=*/true);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list out = Exchange(grads, ctx->saved_data["cp"].toInt(), /*before=*/false);
    out.emplace_back();
    return out;
  }
};

struct AllToAllOutFunction : public Function<AllToAllOutFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& out, int64_t cp) {
    ctx->saved_data["cp"] = cp;
    return Exchange({out}, cp, /*before=*/false)[0];
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {Exchange(grads, ctx->saved_data["cp"].toInt(), /*before=*/true)[0], at::Tensor()};
  }
};

}  // namespace

std::vector<at::Tensor> AllToAllBeforeAttention(const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& v, int64_t cp) {
  return AllToAllQkvFunction::apply(q, k, v, cp);
}

at::Tensor AllToAllAfterAttention(const at::Tensor& out, int64_t cp) {
  return AllToAllOutFunction::apply(out, cp);
}

at::Tensor ContextParallelAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    int64_t cp, double dropout_p) {
  return RingAttentionFunction::apply(q, k, v, cp, dropout_p);
}

}  // namespace memsim
