#include "parallel/regions/context_parallel.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <utility>
#include <vector>

#include "ops/collectives.h"
#include "ops/transformer_kernels.h"
#include "simulator/checked_math.h"

namespace memsim {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::Function;
using torch::autograd::variable_list;

// The ring's buffers hold k and v flattened and concatenated (torch.cat((k.view(-1),
// v.view(-1))): multi-latent attention's differ in head width); `KeysOf` and `ValuesOf` view
// them back.
struct RingAttentionFunction : public Function<RingAttentionFunction> {
  static at::Tensor KeysOf(const at::Tensor& kv, at::IntArrayRef k_sizes) {
    return kv.narrow(0, 0, c10::multiply_integers(k_sizes)).view(k_sizes);
  }
  static at::Tensor ValuesOf(const at::Tensor& kv, at::IntArrayRef k_sizes,
                             at::IntArrayRef v_sizes) {
    const int64_t k_numel = c10::multiply_integers(k_sizes);
    return kv.narrow(0, k_numel, kv.size(0) - k_numel).view(v_sizes);
  }

  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, int64_t cp, double dropout_p) {
    const at::Tensor kv = at::cat({k.reshape(-1), v.reshape(-1)});  // the send buffer of step 0
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
      auto [out, lse, rng] = FlashAttentionForward(
          q, KeysOf(current, k.sizes()), ValuesOf(current, k.sizes(), v.sizes()), dropout_p, true);
      step_outputs.push_back(out);
      step_lse.push_back(lse);
      if (step + 1 < cp) current = received.back();
    }
    // Merge the steps' outputs with their log-sum-exps.
    at::Tensor out = at::empty_like(step_outputs[0]);
    at::Tensor lse = at::empty_like(step_lse[0]);
    ctx->save_for_backward({q, kv, out, lse});
    ctx->saved_data["cp"] = cp;
    ctx->saved_data["dropout_p"] = dropout_p;
    ctx->saved_data["k_sizes"] = k.sizes().vec();
    ctx->saved_data["v_sizes"] = v.sizes().vec();
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const at::Tensor& q = s[0];
    const at::Tensor& kv = s[1];
    const int64_t cp = ctx->saved_data["cp"].toInt();
    const double dropout_p = ctx->saved_data["dropout_p"].toDouble();
    const std::vector<int64_t> k_sizes = ctx->saved_data["k_sizes"].toIntVector();
    const std::vector<int64_t> v_sizes = ctx->saved_data["v_sizes"].toIntVector();
    at::Tensor dq = at::empty_like(q);
    // Two double buffers, each carrying kv and its gradient around the ring.
    at::Tensor buffers[2] = {at::empty({2, kv.size(0)}, kv.options()),
                             at::empty({2, kv.size(0)}, kv.options())};
    const at::Tensor grad = grads[0].contiguous();
    for (int64_t step = 0; step < cp; ++step) {
      const at::Tensor& current = step == 0 ? kv : buffers[step % 2][0];
      if (step + 1 < cp) {
        Send(buffers[step % 2]);
        ReceiveInto(buffers[(step + 1) % 2]);
      }
      auto [dq_step, dk_step, dv_step] =
          FlashAttentionBackward(grad, q, KeysOf(current, k_sizes),
                                 ValuesOf(current, k_sizes, v_sizes), s[2], s[3], dropout_p, true);
      dq.add_(dq_step);
    }
    const at::Tensor dkv = buffers[(cp - 1) % 2][1];
    return {dq, KeysOf(dkv, k_sizes), ValuesOf(dkv, k_sizes, v_sizes), at::Tensor(), at::Tensor()};
  }
};

// gather_along_first_dim of the local k and v [S/cp, B, G, D] (sbhd): each gathered into a
// new [S, B, G, D], then index_select'ed into sequence order (a new copy; the gathered
// buffer goes once its name is rebound).
std::pair<at::Tensor, at::Tensor> GatherKeysAndValues(const at::Tensor& k, const at::Tensor& v,
                                                      int64_t cp) {
  at::Tensor k_all = AllGather(k, cp), v_all = AllGather(v, cp);
  k_all = at::empty_like(k_all);
  v_all = at::empty_like(v_all);
  return {k_all, v_all};
}

// Note [All-gather context parallelism]: q [s, B, A, D], k, v [s, B, G, D] in sbhd; the
// rank's two chunks of h = s/2 rows attend to the first (rank+1)*h and (2cp-rank)*h rows of
// the gathered keys and values (views); rank 0's h and 2cp*h here, (2cp+1)*h in all, as on
// every rank.
struct AllGatherAttentionFunction : public Function<AllGatherAttentionFunction> {
  static int64_t KeyRows(int64_t step, int64_t cp, int64_t h) { return step == 0 ? h : 2 * cp * h; }
  // `x` [rows, B, heads, D] -> the [B, rows, heads, D] view the flash kernel reads.
  static at::Tensor Bshd(const at::Tensor& x) { return x.transpose(0, 1); }

  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, int64_t cp, double dropout_p) {
    const int64_t h = q.size(0) / 2;
    auto [k_all, v_all] = GatherKeysAndValues(k, v, cp);
    // q's rows and heads, v's head width (multi-latent attention's differs from q's).
    const std::vector<int64_t> out_shape = {q.size(0), q.size(1), q.size(2), v.size(3)};
    at::Tensor out = at::empty(out_shape, q.options());
    const at::Tensor thd_out = at::zeros(out_shape, q.options());  // used by thd only
    std::vector<at::Tensor> step_outputs, step_lse, step_rng;
    for (int64_t step = 0; step < 2; ++step) {
      const int64_t rows = KeyRows(step, cp, h);
      auto [o, lse, rng] =
          FlashAttentionForward(Bshd(q.narrow(0, step * h, h)), Bshd(k_all.narrow(0, 0, rows)),
                                Bshd(v_all.narrow(0, 0, rows)), dropout_p, true);
      step_outputs.push_back(o);  // copied into `out`
      step_lse.push_back(lse);
      step_rng.push_back(rng);
    }
    ctx->save_for_backward({q, k, v, out, step_lse[0], step_lse[1], step_rng[0], step_rng[1]});
    ctx->saved_data["cp"] = cp;
    ctx->saved_data["dropout_p"] = dropout_p;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const at::Tensor &q = s[0], &k = s[1], &v = s[2], &out = s[3];
    const int64_t cp = ctx->saved_data["cp"].toInt();
    const double dropout_p = ctx->saved_data["dropout_p"].toDouble();
    const int64_t h = q.size(0) / 2;
    const at::Tensor grad = grads[0];
    at::Tensor dq = at::empty_like(q);
    std::vector<int64_t> full_k = k.sizes().vec(), full_v = v.sizes().vec();
    full_k[0] = full_v[0] = CheckedMul(k.size(0), cp);
    at::Tensor dk = at::zeros(full_k, k.options()), dv = at::zeros(full_v, v.options());
    auto [k_all, v_all] = GatherKeysAndValues(k, v, cp);
    std::vector<at::Tensor> step_grads;  // every step's dq, dk, dv, kept until the end
    for (int64_t step = 0; step < 2; ++step) {
      const int64_t rows = KeyRows(step, cp, h);
      auto [dq_step, dk_step, dv_step] =
          FlashAttentionBackward(Bshd(grad.narrow(0, step * h, h)), Bshd(q.narrow(0, step * h, h)),
                                 Bshd(k_all.narrow(0, 0, rows)), Bshd(v_all.narrow(0, 0, rows)),
                                 Bshd(out.narrow(0, step * h, h)), s[4 + step], dropout_p, true);
      step_grads.insert(step_grads.end(), {dq_step, dk_step, dv_step});
    }
    // Back into each rank's chunk order (index_select copies), then reduce-scattered, each
    // full-length copy going once its shard is made.
    dk = at::empty_like(dk);
    dv = at::empty_like(dv);
    dk = ReduceScatter(dk, cp);
    dv = ReduceScatter(dv, cp);
    return {dq, dk, dv, at::Tensor(), at::Tensor()};
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

at::Tensor AllGatherContextParallelAttention(const at::Tensor& q, const at::Tensor& k,
                                             const at::Tensor& v, int64_t cp, double dropout_p) {
  return AllGatherAttentionFunction::apply(q, k, v, cp, dropout_p);
}

}  // namespace memsim
