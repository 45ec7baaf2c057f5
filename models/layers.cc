#include "models/layers.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>
#include <functional>
#include <utility>

#include "models/fp8.h"
#include "ops/collectives.h"
#include "ops/transformer_kernels.h"
#include "parallel/regions/context_parallel.h"
#include "parallel/regions/tensor_parallel.h"
#include "simulator/check.h"
#include "simulator/session.h"

namespace memsim {

void AccumulateIntoMainGrad(const at::Tensor& main_grad, const at::Tensor& grad) {
  if (main_grad.defined() && grad.defined()) main_grad.add_(grad);
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::Function;
using torch::autograd::variable_list;

bool IsHalf(const at::Tensor& t) {
  return t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16;
}

// What a linear layer's backward needs besides the saved input and weight.
// The main_grads a parameterized layer's backward accumulates into, kept out of the
// Function's tensor inputs (autograd would track them as inputs for nothing).
struct MainGrads : public torch::CustomClassHolder {
  MainGrads(at::Tensor w, at::Tensor b) : weight(std::move(w)), bias(std::move(b)) {}
  at::Tensor weight;
  at::Tensor bias;  // undefined without a bias
};

c10::intrusive_ptr<MainGrads> MainGradsOf(Parameter& weight, Parameter* bias) {
  return c10::make_intrusive<MainGrads>(weight.main_grad,
                                        bias != nullptr ? bias->main_grad : at::Tensor());
}

c10::intrusive_ptr<MainGrads> SavedMainGrads(AutogradContext* ctx) {
  return c10::static_intrusive_pointer_cast<MainGrads>(ctx->saved_data["main_grads"].toCapsule());
}

// The sequence-parallel all-gather into the workspace's buffer `slot`
// (all_gather_into_tensor), or into a userbuffer; the input itself without sequence
// parallelism.
at::Tensor GatherSequence(const at::Tensor& input, const LinearParallelism& parallelism, int slot,
                          bool into_userbuffer = false) {
  if (parallelism.gather_input_group <= 1) return input;
  if (into_userbuffer) return AllGatherIntoUserbuffer(input, parallelism.gather_input_group);
  std::vector<int64_t> sizes = input.sizes().vec();
  sizes[0] *= parallelism.gather_input_group;
  at::Tensor buffer = parallelism.workspace->Get(sizes, input.scalar_type(), slot);
  ReceiveInto(buffer);  // stands in for NCCL writing the gathered shards in place
  return buffer;
}

struct LinearState : public torch::CustomClassHolder {
  // The weight's store: how dW reaches main_grad (Note [Weight gradients]); null: fused.
  ParameterStore* store = nullptr;
  at::Tensor weight_main_grad;
  at::Tensor bias_main_grad;  // undefined without a bias
  LinearParallelism parallelism;
  // Where the weight-gradient GEMM goes (Note [Delayed weight gradients]); null: runs now.
  c10::intrusive_ptr<WeightGradStore> delayed;
};

// The weight (and bias) gradients of a 16-bit linear from its [rows, in] input and
// [rows, out] output gradient; an undefined input: the GEMM is deferred (DeferredWgrad),
// only the bias gradient and the dummy weight gradient are made.
void LinearWgrad(const LinearState& state, at::IntArrayRef weight_sizes, const at::Tensor& input,
                 const at::Tensor& grad_output) {
  ParameterStore* store = state.store;
  if (store == nullptr || store->gradient_accumulation_fusion()) {
    if (input.defined()) WgradGemmAccumulate(state.weight_main_grad, input, grad_output);
    if (store != nullptr && state.weight_main_grad.defined()) {
      // The dummy autograd receives as this weight's gradient: the cached one.
      store->DummyWgrad(weight_sizes);
    }
  } else {  // ValidateTrainingConfig: deferring needs gradient accumulation fusion
    AccumulateIntoMainGrad(state.weight_main_grad, grad_output.t().mm(input));
  }
  if (state.bias_main_grad.defined()) {
    AccumulateIntoMainGrad(state.bias_main_grad, grad_output.sum(0));
  }
}

// Megatron's _linear_forward: torch.matmul (and an out-of-place bias add, as Megatron
// writes it), or with another output dtype Transformer Engine's general_gemm on the 2-D
// input, the bias in its epilogue.
at::Tensor LinearForward(const at::Tensor& input, const at::Tensor& weight,
                         const c10::optional<at::Tensor>& bias, at::ScalarType output_dtype) {
  if (output_dtype == at::ScalarType::Undefined || output_dtype == input.scalar_type()) {
    at::Tensor out = at::matmul(input, weight.t());
    if (bias.has_value()) out = out + *bias;
    return out;
  }
  std::vector<int64_t> sizes = input.sizes().vec();
  sizes.back() = weight.size(0);
  return TeGemm(input.reshape({-1, input.size(-1)}), weight.t(), output_dtype).view(sizes);
}

struct LinearFunction : public Function<LinearFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            const c10::optional<at::Tensor>& bias,
                            c10::intrusive_ptr<LinearState> state) {
    ctx->save_for_backward({input, weight});
    const at::Tensor total_input =
        GatherSequence(input, state->parallelism, /*slot=*/0, state->parallelism.userbuffer_gather);
    const at::ScalarType output_dtype = state->parallelism.output_dtype;
    ctx->saved_data["state"] = c10::IValue::make_capsule(std::move(state));
    return LinearForward(total_input, weight, bias, output_dtype);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& input = saved[0];
    const at::Tensor& weight = saved[1];
    const auto state =
        c10::static_intrusive_pointer_cast<LinearState>(ctx->saved_data["state"].toCapsule());
    const LinearParallelism& parallelism = state->parallelism;
    const at::Tensor grad_output = grads[0].to(input.scalar_type()).contiguous();
    // A deferred weight gradient (DeferredWgrad) keeps the output gradient instead.
    DeferredWgrad* deferred = parallelism.deferred.get();
    const bool defer = deferred != nullptr && deferred->Accepts(deferred->grad_outputs);
    if (defer) deferred->grad_outputs.push_back(grad_output);
    const at::Tensor total_input =
        defer ? at::Tensor()
              : GatherSequence(input, parallelism, /*slot=*/0, parallelism.userbuffer_bulk_dgrad);
    at::Tensor grad_input;
    if (parallelism.userbuffer_bulk_wgrad && parallelism.gather_input_group > 1) {
      // Into a userbuffer, reduce-scattered from there during the wgrad GEMM.
      std::vector<int64_t> sizes = grad_output.sizes().vec();
      sizes.back() = weight.size(1);
      grad_input = UserbufferView(sizes, grad_output.scalar_type());
      at::Tensor grad_input_2d = grad_input.view({-1, sizes.back()});
      at::mm_out(grad_input_2d, grad_output.view({-1, grad_output.size(-1)}), weight);
    } else {
      grad_input = grad_output.matmul(weight);
    }
    if (parallelism.gather_input_group > 1) {
      grad_input = ReduceScatter(grad_input, parallelism.gather_input_group);
    } else if (parallelism.all_reduce_input_grad_group > 1) {
      AllReduceInPlace(grad_input, parallelism.all_reduce_input_grad_group);
    }
    const at::Tensor grad_2d = grad_output.view({-1, grad_output.size(-1)});
    const at::Tensor input_2d =
        defer ? at::Tensor() : total_input.reshape({-1, total_input.size(-1)});
    // Taken out of the state, which the queued GEMM holds: no store-closure-state cycle.
    if (const c10::intrusive_ptr<WeightGradStore> delayed = std::move(state->delayed)) {
      // The operands wait in the store (Note [Delayed weight gradients]).
      delayed->Push([state, sizes = weight.sizes().vec(), input_2d, grad_2d] {
        LinearWgrad(*state, sizes, input_2d, grad_2d);
      });
    } else {
      LinearWgrad(*state, weight.sizes(), input_2d, grad_2d);
    }
    return {grad_input, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

struct LayerNormFunction : public Function<LayerNormFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            const c10::optional<at::Tensor>& bias,
                            c10::intrusive_ptr<MainGrads> main_grads) {
    auto [out, mean, rstd] =
        at::native_layer_norm(input, {input.size(-1)}, weight, bias, /*eps=*/1e-5);
    ctx->save_for_backward({input, weight, bias.value_or(at::Tensor()), mean, rstd});
    ctx->saved_data["main_grads"] = c10::IValue::make_capsule(std::move(main_grads));
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    auto [grad_input, grad_weight, grad_bias] = at::native_layer_norm_backward(
        grads[0], s[0], {s[0].size(-1)}, s[3], s[4], s[1], s[2], {true, true, s[2].defined()});
    const auto main_grads = SavedMainGrads(ctx);
    AccumulateIntoMainGrad(main_grads->weight, grad_weight);
    grad_weight.reset();
    AccumulateIntoMainGrad(main_grads->bias, grad_bias);
    return {grad_input, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

struct RmsNormFunction : public Function<RmsNormFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            c10::intrusive_ptr<MainGrads> main_grads) {
    const int64_t rows = input.numel() / input.size(-1);
    at::Tensor invvar = at::empty({rows}, input.options().dtype(at::kFloat));
    at::Tensor out = at::empty_like(input);
    ctx->save_for_backward({input, weight, invvar});
    ctx->saved_data["main_grads"] = c10::IValue::make_capsule(std::move(main_grads));
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    at::Tensor grad_input = at::empty_like(s[0]);
    AccumulateIntoMainGrad(SavedMainGrads(ctx)->weight, at::empty_like(s[1]));
    return {grad_input, at::Tensor(), at::Tensor()};
  }
};

struct EmbeddingFunction : public Function<EmbeddingFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& indices,
                            const at::Tensor& weight, c10::intrusive_ptr<MainGrads> main_grads) {
    ctx->save_for_backward({indices});
    ctx->saved_data["main_grads"] = c10::IValue::make_capsule(std::move(main_grads));
    ctx->saved_data["num_weights"] = weight.size(0);
    return at::embedding(weight, indices);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor indices = ctx->get_saved_variables()[0];
    at::Tensor grad_weight = at::embedding_dense_backward(
        grads[0], indices, ctx->saved_data["num_weights"].toInt(), /*padding_idx=*/-1,
        /*scale_grad_by_freq=*/false);
    AccumulateIntoMainGrad(SavedMainGrads(ctx)->weight, grad_weight);
    return {at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

struct AddBiasFunction : public Function<AddBiasFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& bias,
                            c10::intrusive_ptr<MainGrads> main_grads) {
    ctx->saved_data["main_grads"] = c10::IValue::make_capsule(std::move(main_grads));
    return x + bias;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor& grad = grads[0];
    AccumulateIntoMainGrad(SavedMainGrads(ctx)->weight, grad.reshape({-1, grad.size(-1)}).sum(0));
    return {grad, at::Tensor(), at::Tensor()};
  }
};

// Megatron's fused gated activations (SwiGLUFunction, the quick-GeGLU functions of
// fused_bias_geglu.py): [.., 2F] -> a new [.., F]; saves the input only.
struct FusedGluFunction : public Function<FusedGluFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input) {
    ctx->save_for_backward({input});
    auto sizes = input.sizes().vec();
    sizes.back() /= 2;
    return at::empty(sizes, input.options());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {at::empty_like(ctx->get_saved_variables()[0])};
  }
};

// A torch.compile'd elementwise activation (Megatron's squared_relu, pow(relu(x), 2), and
// quick_gelu, x * sigmoid(1.702 x); jit_fuser is torch.compile on PyTorch 2.2 and later):
// a new output like the input; saves one tensor like it (the input: the compiled backward
// recomputes the rest); backward: the input's gradient.
struct CompiledActivationFunction : public Function<CompiledActivationFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input) {
    ctx->save_for_backward({input});
    return at::empty_like(input);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {at::empty_like(ctx->get_saved_variables()[0])};
  }
};

struct L2NormFunction : public Function<L2NormFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input) {
    auto sizes = input.sizes().vec();
    sizes.back() = 1;
    ctx->save_for_backward({input, at::empty(sizes, input.options().dtype(at::kFloat))});
    return at::empty(input.sizes(), input.options());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {at::empty(ctx->get_saved_variables()[0].sizes(), grads[0].options())};
  }
};

// Attention._apply_output_gate, torch.compile'd (see AttentionOutputGate in layers.h).
struct AttentionOutputGateFunction : public Function<AttentionOutputGateFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& gate) {
    ctx->save_for_backward({x, gate});
    return at::empty(x.sizes(), x.options());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    at::Tensor grad_x = at::empty(saved[0].sizes(), grads[0].options());
    return {grad_x, at::empty(saved[1].sizes(), grads[0].options())};
  }
};

// The learnable softmax offset's round trip through Transformer Engine's fused attention
// (DotProductAttention.forward, fused_attn_fwd/bwd, TE 2.18): forward passes the offset as
// a float32 [1, A/tp, 1, 1] copy, which the kernel keeps among its auxiliary tensors for
// backward; backward writes dSoftmaxOffset, a new float32 tensor of that shape, which
// autograd casts to the parameter's dtype and Megatron's gradient hook adds to main_grad.
// The attention output passes through (a view).
struct AttentionSinkFunction : public Function<AttentionSinkFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& out, const at::Tensor& offset,
                            c10::intrusive_ptr<MainGrads> main_grads) {
    ctx->save_for_backward({offset.reshape({1, -1, 1, 1}).to(at::kFloat)});
    ctx->saved_data["main_grads"] = c10::IValue::make_capsule(std::move(main_grads));
    ctx->saved_data["dtype"] = offset.scalar_type();
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor d_offset = at::empty_like(ctx->get_saved_variables()[0]);
    AccumulateIntoMainGrad(SavedMainGrads(ctx)->weight,
                           d_offset.to(ctx->saved_data["dtype"].toScalarType()).view({-1}));
    return {grads[0], at::Tensor(), at::Tensor()};
  }
};

// FlexAttention (layers.h). Takes and returns Megatron's [S, B, heads, D] layout, which is
// the memory layout of the [B, heads, S, D] views the compiled kernel reads and writes.
struct FlexAttentionFunction : public Function<FlexAttentionFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v) {
    const int64_t seq = q.size(0), batch = q.size(1), heads = q.size(2);
    at::Tensor out = at::empty({seq, batch, heads, v.size(3)}, q.options());
    at::Tensor logsumexp = at::empty({batch, heads, seq}, q.options().dtype(at::kFloat));
    ctx->save_for_backward({q, k, v, out, logsumexp});
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    // delta = sum(out * grad_out, -1) in float32, before the gradient kernel runs.
    const at::Tensor delta = at::empty_like(s[4]);
    return {at::empty_like(s[0]), at::empty_like(s[1]), at::empty_like(s[2])};
  }
};

// Backward: the input's gradient like the input, the weights' like the weights.
struct WeightedActivationFunction : public Function<WeightedActivationFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input,
                            const at::Tensor& weights, bool gated) {
    ctx->save_for_backward({input, weights});
    auto sizes = input.sizes().vec();
    if (gated) sizes.back() /= 2;
    return at::empty(sizes, input.options());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    return {at::empty_like(saved[0]), at::empty_like(saved[1]), at::Tensor()};
  }
};

struct RotaryFunction : public Function<RotaryFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input) {
    return at::empty_like(input);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {at::empty_like(grads[0])};
  }
};

// scaled_upper_triang_masked_softmax_cuda: forward allocates and saves the output;
// backward writes the input gradient into the incoming gradient, in place.
struct FusedCausalSoftmaxFunction : public Function<FusedCausalSoftmaxFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& scores) {
    at::Tensor probs = at::_softmax(scores, -1, false);
    ctx->save_for_backward({probs});
    return probs;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    at::Tensor grad = grads[0].contiguous();
    grad.mul_(ctx->get_saved_variables()[0]);  // stands in for the in-place kernel
    return {grad};
  }
};

struct FlashAttentionFunction : public Function<FlashAttentionFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, double dropout_p) {
    auto [out, lse, rng_state] = FlashAttentionForward(q, k, v, dropout_p, /*causal=*/true);
    ctx->save_for_backward({q, k, v, out, lse, rng_state});
    ctx->saved_data["dropout_p"] = dropout_p;
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    auto [dq, dk, dv] = FlashAttentionBackward(grads[0].contiguous(), s[0], s[1], s[2], s[3], s[4],
                                               ctx->saved_data["dropout_p"].toDouble(), true);
    return {dq, dk, dv, at::Tensor()};
  }
};

// Megatron's vocab_parallel_cross_entropy (megatron/core/tensor_parallel/cross_entropy.py):
// logits.float(); subtract the max, exp and divide in place; save the softmax; backward
// subtracts the one-hot target and scales by the incoming gradient in place and returns
// that float32 buffer (autograd casts it to the logits' dtype).
//
// The fused version (--cross-entropy-loss-fusion, megatron/core/fusions/
// fused_cross_entropy.py) runs the same steps as @jit_fuser (torch.compile) functions.
// A compiled function that mutates its input computes the result into a new buffer and
// copies it back, so each in-place step holds a second float32 logits-sized buffer while it
// runs (seen in the validation suite: +1 such buffer at the peak); its backward casts to
// bfloat16 itself, whatever the logits' dtype.
struct VocabCrossEntropyFunction : public Function<VocabCrossEntropyFunction> {
  // `out = fn(out)` in place, as eager PyTorch (fused == false) or a compiled graph writing
  // a mutated input back (fused == true) does it.
  template <typename Fn>
  static void InPlace(at::Tensor& out, bool fused, Fn&& fn) {
    if (!fused) {
      fn(out, out);
      return;
    }
    at::Tensor result = at::empty_like(out);
    fn(out, result);
    out.copy_(result);
  }

  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits,
                            const at::Tensor& labels, int64_t tp_group, bool fused) {
    // fp32 logits are worked on in place, as Megatron's .float() returns them: an alias
    // outside autograd's view tracking, which would refuse saving a view of an input that
    // was modified in place.
    at::Tensor logits_fp32 =
        logits.scalar_type() == at::kFloat ? logits.detach() : logits.to(at::kFloat);
    at::Tensor logits_max = std::get<0>(logits_fp32.max(-1));
    if (tp_group > 1) AllReduceInPlace(logits_max, tp_group);
    // The target's logit (on the rank whose vocabulary shard holds it; all-reduced).
    at::Tensor predicted = logits_fp32.gather(-1, labels.unsqueeze(-1)).squeeze(-1);
    if (tp_group > 1) AllReduceInPlace(predicted, tp_group);
    InPlace(logits_fp32, fused, [&](const at::Tensor& in, at::Tensor& out) {
      at::sub_out(out, in, logits_max.unsqueeze(-1));
      at::exp_out(out, out);
    });
    at::Tensor sum_exp = logits_fp32.sum(-1);
    if (tp_group > 1) AllReduceInPlace(sum_exp, tp_group);
    at::Tensor loss = at::log(sum_exp).sub_(predicted);
    InPlace(logits_fp32, fused, [&](const at::Tensor& in, at::Tensor& out) {
      at::div_out(out, in, sum_exp.unsqueeze(-1));
    });
    ctx->save_for_backward({logits_fp32, labels});
    ctx->saved_data["fused"] = fused;
    return loss;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    at::Tensor softmax = ctx->get_saved_variables()[0];
    const bool fused = ctx->saved_data["fused"].toBool();
    InPlace(softmax, fused, [&](const at::Tensor& in, at::Tensor& out) {
      at::mul_out(out, in, grads[0].unsqueeze(-1));
    });
    if (fused) {
      // calculate_gradients ends in .to(torch.bfloat16) whatever the logits' dtype; autograd
      // casts that to the logits' dtype where it differs.
      return {softmax.to(at::kBFloat16), at::Tensor(), at::Tensor(), at::Tensor()};
    }
    return {softmax, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Holds the function a CheckpointFunction recomputes, and the module it runs in.
struct RecomputeClosure : public torch::CustomClassHolder {
  RecomputeFn fn;
  NameId module;
  // The delayed weight gradients' store of the forward: recomputed linears queue there too.
  c10::intrusive_ptr<WeightGradStore> wgrad_store;
  int64_t distribute_over = 1;
  std::vector<int64_t> first_input_shape;
};

struct CheckpointFunction : public Function<CheckpointFunction> {
  static at::Tensor forward(AutogradContext* ctx, at::TensorList inputs,
                            c10::intrusive_ptr<RecomputeClosure> closure) {
    ctx->save_for_backward(inputs.vec());
    at::Tensor out = closure->fn(inputs.vec());
    if (closure->distribute_over > 1) {
      // split_tensor_into_1d_equal_chunks(new_buffer=True), set as the input's data.
      const at::Tensor& first = inputs[0];
      closure->first_input_shape = first.sizes().vec();
      const int64_t share = first.numel() / closure->distribute_over;
      at::Tensor chunk = at::empty({share}, first.options());
      chunk.copy_(first.detach().reshape({-1}).narrow(0, 0, share));
      first.set_data(chunk);
    }
    ctx->saved_data["closure"] = c10::IValue::make_capsule(std::move(closure));
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto closure = c10::static_intrusive_pointer_cast<RecomputeClosure>(
        ctx->saved_data["closure"].toCapsule());
    const variable_list saved_inputs = ctx->get_saved_variables();
    if (closure->distribute_over > 1) {  // gather_split_1d_tensor, set as the input's data
      const at::Tensor& first = saved_inputs[0];
      first.set_data(
          AllGather(first.detach(), closure->distribute_over).view(closure->first_input_shape));
    }
    std::vector<at::Tensor> inputs;
    for (const at::Tensor& saved : saved_inputs) {
      // The attention mask (bool) is saved with the activations and needs no gradient.
      inputs.push_back(saved.detach().requires_grad_(saved.is_floating_point()));
    }
    at::Tensor out;
    {
      at::AutoGradMode enable_grad(true);
      ModuleScope scope(closure->module);
      DelayedWgradScope delay(closure->wgrad_store);
      out = closure->fn(inputs);
    }
    torch::autograd::backward({out}, {grads[0]});
    out.reset();
    variable_list input_grads;
    for (at::Tensor& input : inputs) input_grads.push_back(input.grad());
    input_grads.emplace_back();  // the closure
    return input_grads;
  }
};

// Points `dst`'s storage at `src`'s memory, holding `src`'s storage alive until `dst` lets
// go (Megatron's share_storage; no bytes move, so nothing is allocated or freed here).
void ShareStorage(const c10::Storage& dst, const c10::Storage& src) {
  auto* holder = new c10::Storage(src);
  c10::DataPtr shared(
      src.data_ptr().get(), holder, [](void* ctx) { delete static_cast<c10::Storage*>(ctx); },
      src.device());
  dst.unsafeGetStorageImpl()->set_data_ptr_noswap(std::move(shared));
  dst.unsafeGetStorageImpl()->set_nbytes(src.nbytes());
}

}  // namespace

// Shared by the autograd node (its saved data) and the hook; it holds the forward outputs'
// storages, never their tensors, which would hold the node itself.
// Autograd keeps a graph's nodes, and so the hook and this state, while any tensor of the
// graph lives: each member is let go as soon as its part is done.
struct CheckpointWithoutOutput::State : public torch::CustomClassHolder {
  Fn fn;
  NameId module = 0;
  c10::intrusive_ptr<WeightGradStore> wgrad_store;  // as RecomputeClosure's
  bool graphed =
      false;  // run inside a CUDA graph's scope (Note [CUDA graphs]): so is its recompute
  bool recorded = false;  // autograd recorded the node: its backward will need Recompute()
  bool recomputed = false;
  std::vector<at::Tensor> inputs;       // from Run() until the recomputation
  std::vector<c10::Storage> discarded;  // the forward outputs' storages, until then too
  std::vector<at::Tensor> recomputed_inputs, recomputed_outputs;  // until backward

  void Recompute() {
    if (recomputed) return;
    recomputed = true;
    for (const at::Tensor& input : inputs) {
      recomputed_inputs.push_back(input.detach().requires_grad_(input.requires_grad()));
    }
    inputs.clear();
    {
      at::AutoGradMode enable_grad(true);
      ModuleScope scope(module);
      GraphedScope graph(graphed);  // a tensor hook runs it outside any graphed node
      DelayedWgradScope delay(wgrad_store);
      recomputed_outputs = fn(recomputed_inputs);
    }
    MEMSIM_DCHECK(recomputed_outputs.size() == discarded.size());
    for (size_t i = 0; i < discarded.size(); ++i) {
      ShareStorage(discarded[i], recomputed_outputs[i].storage());
    }
    discarded.clear();
    fn = nullptr;
  }
};

namespace {

struct CheckpointWithoutOutputFunction : public Function<CheckpointWithoutOutputFunction> {
  static variable_list forward(AutogradContext* ctx, at::TensorList inputs,
                               c10::intrusive_ptr<CheckpointWithoutOutput::State> state) {
    state->inputs = inputs.vec();
    variable_list outputs = state->fn(state->inputs);
    ctx->saved_data["state"] = c10::IValue::make_capsule(std::move(state));
    return outputs;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto state = c10::static_intrusive_pointer_cast<CheckpointWithoutOutput::State>(
        ctx->saved_data["state"].toCapsule());
    state->Recompute();  // a no-op when the hook ran
    variable_list outputs, output_grads;
    for (size_t i = 0; i < grads.size(); ++i) {
      if (!grads[i].defined()) continue;
      outputs.push_back(state->recomputed_outputs[i]);
      output_grads.push_back(grads[i]);
    }
    if (!outputs.empty()) torch::autograd::backward(outputs, output_grads);
    outputs.clear();
    state->recomputed_outputs.clear();
    variable_list input_grads;
    for (const at::Tensor& input : state->recomputed_inputs) input_grads.push_back(input.grad());
    state->recomputed_inputs.clear();
    input_grads.emplace_back();  // the state
    return input_grads;
  }
};

c10::optional<at::Tensor> DataOf(Parameter* p) {
  return p != nullptr ? c10::optional<at::Tensor>(p->data) : c10::nullopt;
}

}  // namespace

void ChargeTeModuleCalls(const TrainingConfig& t, int64_t calls) {
  if (t.profile == ProfileKind::kTransformerEngine) ChargeModuleCalls(calls);
}

at::Tensor Linear(const at::Tensor& input, Parameter& weight, Parameter* bias,
                  const LinearParallelism& parallelism, const Fp8LinearOptions& fp8) {
  if (weight.fp8.recipe != Fp8Recipe::kNone)
    return Fp8Linear(input, weight, bias, parallelism, fp8);
  auto state = c10::make_intrusive<LinearState>();
  state->store = weight.store;
  state->weight_main_grad = weight.main_grad;
  if (bias != nullptr) state->bias_main_grad = bias->main_grad;
  state->parallelism = parallelism;
  state->delayed = CurrentWgradStore();
  if (DeferredWgrad* deferred = parallelism.deferred.get()) {
    if (deferred->Accepts(deferred->inputs)) deferred->inputs.push_back(input);
  }
  return LinearFunction::apply(input, weight.data, DataOf(bias), std::move(state));
}

namespace {

struct FrozenLinearFunction : public Function<FrozenLinearFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& total_input,
                            const at::Tensor& weight, int64_t all_reduce_input_grad_group,
                            at::ScalarType output_dtype) {
    ctx->saved_data["weight"] = weight;  // the parameter itself: no memory
    ctx->saved_data["all_reduce_group"] = all_reduce_input_grad_group;
    ctx->saved_data["input_dtype"] = total_input.scalar_type();
    return LinearForward(total_input, weight, c10::nullopt, output_dtype);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor grad_output = grads[0].to(ctx->saved_data["input_dtype"].toScalarType());
    const at::Tensor grad_input = grad_output.matmul(ctx->saved_data["weight"].toTensor());
    const int64_t group = ctx->saved_data["all_reduce_group"].toInt();
    if (group > 1) AllReduceInPlace(grad_input, group);
    return {grad_input, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor FrozenLinear(const at::Tensor& input, const Parameter& weight,
                        const LinearParallelism& parallelism) {
  MEMSIM_DCHECK(weight.fp8.recipe == Fp8Recipe::kNone && parallelism.deferred == nullptr &&
                !parallelism.userbuffer_gather);
  const int64_t gather = parallelism.gather_input_group;
  const at::Tensor total_input =
      gather > 1 ? GatherFromSequenceParallelRegion(input, gather) : input;
  return FrozenLinearFunction::apply(total_input, weight.data.detach(),
                                     parallelism.all_reduce_input_grad_group,
                                     parallelism.output_dtype);
}

void FreeStorage(const c10::Storage& storage) {
  storage.unsafeGetStorageImpl()->set_data_ptr_noswap(c10::DataPtr(nullptr, storage.device()));
  storage.unsafeGetStorageImpl()->set_nbytes(0);
}

at::Tensor LeadingSlice(const at::Tensor& t, int64_t dim, int64_t length) {
  if (t.storage().nbytes() > 0) return t.narrow(dim, 0, length);
  c10::TensorImpl* source = t.unsafeGetTensorImpl();
  c10::intrusive_ptr<c10::TensorImpl> view =
      source->shallow_copy_and_detach(source->version_counter(),
                                      /*allow_tensor_metadata_change=*/true);
  std::vector<int64_t> sizes = t.sizes().vec();
  sizes[static_cast<size_t>(dim)] = length;
  view->set_sizes_and_strides(sizes, t.strides());
  return at::Tensor(std::move(view));
}

void AllocateStorage(const at::Tensor& t) {
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  const auto bytes = static_cast<size_t>(t.numel()) * t.element_size();
  storage->set_data_ptr_noswap(storage->allocator()->allocate(bytes));
  storage->set_nbytes(bytes);
}

void MapStorage(const at::Tensor& t) {
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(c10::DataPtr(nullptr, t.device()));
  storage->set_nbytes(static_cast<size_t>(t.numel()) * t.element_size());
}

at::Tensor EmptyWithoutBytes(at::IntArrayRef shape, const at::TensorOptions& options) {
  at::Tensor t = at::empty({0}, options);  // an empty allocation records nothing
  t.unsafeGetTensorImpl()->set_sizes_contiguous(shape);
  return t;
}

void DrainDeferredWgrad(DeferredWgrad& deferred, Parameter& weight,
                        const LinearParallelism& parallelism) {
  const size_t count = deferred.inputs.size();
  if (count == 0) return;
  at::Tensor gathered[2];
  gathered[0] = GatherSequence(deferred.inputs[0], parallelism, /*slot=*/1);
  for (size_t i = 0; i < count; ++i) {
    if (i + 1 < count) {
      gathered[(i + 1) % 2] = GatherSequence(deferred.inputs[i + 1], parallelism, 1 + (i + 1) % 2);
    }
    const at::Tensor& grad_output = deferred.grad_outputs[i];
    WgradGemmAccumulate(weight.main_grad, gathered[i % 2].reshape({-1, gathered[i % 2].size(-1)}),
                        grad_output.view({-1, grad_output.size(-1)}));
    deferred.inputs[i].reset();
    deferred.grad_outputs[i].reset();
    gathered[i % 2].reset();
  }
  deferred.inputs.clear();
  deferred.grad_outputs.clear();
}

at::Tensor LayerNorm(const at::Tensor& input, Parameter& weight, Parameter* bias) {
  return LayerNormFunction::apply(input, weight.data, DataOf(bias), MainGradsOf(weight, bias));
}

at::Tensor RmsNorm(const at::Tensor& input, Parameter& weight) {
  return RmsNormFunction::apply(input, weight.data, MainGradsOf(weight, nullptr));
}

at::Tensor Embedding(const at::Tensor& indices, Parameter& weight) {
  return EmbeddingFunction::apply(indices, weight.data, MainGradsOf(weight, nullptr));
}

at::Tensor Dropout(const at::Tensor& input, double p) {
  if (p == 0) return input;
  return std::get<0>(at::native_dropout(input, p, /*train=*/true));
}

at::Tensor AddBias(const at::Tensor& x, Parameter& bias) {
  // The bias is the "weight" of its MainGrads.
  return AddBiasFunction::apply(x, bias.data, MainGradsOf(bias, nullptr));
}

at::Tensor BiasDropoutAdd(const at::Tensor& x, Parameter* bias, const at::Tensor& residual,
                          double p) {
  // _bias_dropout_add_func upcasts a 16-bit x to an fp32 residual's dtype first (Note [FP32
  // residual stream] in transformer.h); the bias then promotes in the addition.
  const at::Tensor same_dtype =
      x.scalar_type() == residual.scalar_type() ? x : x.to(residual.scalar_type());
  const at::Tensor biased = bias != nullptr ? AddBias(same_dtype, *bias) : same_dtype;
  return residual + Dropout(biased, p);
}

at::Tensor GlobalMemoryBuffer::Get(at::IntArrayRef shape, at::ScalarType dtype, int slot) {
  if (!persistent_) return at::empty(shape, at::TensorOptions().device(at::kMeta).dtype(dtype));
  const int64_t numel = c10::multiply_integers(shape);
  at::Tensor& buffer = buffers_[{dtype, slot}];
  if (!buffer.defined() || buffer.numel() < numel) {
    ModuleScope scope(ModuleScope::Absolute{"mpu.global_memory_buffer"});
    PersistentScope persistent;  // kept, so counted however CUDA graphs count the caller
    buffer = at::empty({numel}, at::TensorOptions().device(at::kMeta).dtype(dtype));
  }
  return buffer.narrow(0, 0, numel).view(shape);
}

namespace {

// mlp.py's glu() on fc1's output: Note at Activation in layers.h.
at::Tensor EagerGlu(const ModelConfig& model, const at::Tensor& input) {
  std::vector<at::Tensor> halves = input.chunk(2, -1);
  at::Tensor gate = std::move(halves[0]), linear = std::move(halves[1]);
  if (const double clamp = model.activation_clamp_value; clamp > 0) {
    gate = at::clamp(gate, c10::nullopt, clamp);
    linear = at::clamp(linear, -clamp, clamp);
  }
  gate = model.activation == ActivationKind::kSwiglu ? at::silu(gate)
                                                     : CompiledActivationFunction::apply(gate);
  // The offset (--glu-linear-offset) is added whatever its value: a new tensor either way.
  return gate * (linear + 1.0);
}

}  // namespace

at::Tensor Activation(const ModelConfig& model, bool fused, const at::Tensor& input) {
  switch (model.activation) {
    case ActivationKind::kGelu:
      return at::gelu(input);
    case ActivationKind::kSquaredRelu:
      return CompiledActivationFunction::apply(input);
    case ActivationKind::kSwiglu:
    case ActivationKind::kQuickGeglu:
      return fused ? FusedGluFunction::apply(input) : EagerGlu(model, input);
    case ActivationKind::kGeglu:
      return EagerGlu(model, input);
  }
  MEMSIM_DCHECK(false);
  return at::Tensor();
}

at::Tensor FlexAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const int64_t seq = q.size(0), batch = q.size(1);
  return FlexAttentionFunction::apply(q, k, v).view({seq, batch, -1});
}

at::Tensor AttentionSink(const at::Tensor& out, Parameter& offset) {
  return AttentionSinkFunction::apply(out, offset.data, MainGradsOf(offset, nullptr));
}

at::Tensor WeightedActivation(const at::Tensor& input, const at::Tensor& weights, bool gated) {
  return WeightedActivationFunction::apply(input, weights, gated);
}

at::Tensor L2Norm(const at::Tensor& input) { return L2NormFunction::apply(input); }

at::Tensor AttentionOutputGate(const at::Tensor& x, const at::Tensor& gate) {
  return AttentionOutputGateFunction::apply(x, gate);
}

at::Tensor RotaryEmbedding(const at::Tensor& input) { return RotaryFunction::apply(input); }

at::Tensor UnfusedRotaryEmbedding(const at::Tensor& input, const at::Tensor& freqs) {
  // Each Python temporary goes when its statement ends, as CPython drops it.
  const int64_t rot = freqs.size(-1);
  const at::Tensor t = input.narrow(-1, 0, rot);
  const at::Tensor rest = input.narrow(-1, rot, input.size(-1) - rot);
  auto scaled = [&](at::Tensor f) {
    at::Tensor times_mscale = f * 1.0;
    f.reset();
    return times_mscale.to(input.scalar_type());
  };
  const at::Tensor cos = scaled(at::cos(freqs));
  const at::Tensor sin = scaled(at::sin(freqs));
  at::Tensor rotated = t * cos;
  {
    std::vector<at::Tensor> halves = t.chunk(2, -1);  // _rotate_half
    at::Tensor turned = at::cat({-halves[1], halves[0]}, -1);
    halves.clear();
    at::Tensor turned_times_sin = turned * sin;
    turned.reset();
    rotated = rotated + turned_times_sin;
  }
  return at::cat({rotated, rest}, -1);
}

namespace {

// Note [Transformer Engine's qkv layout]
// DotProductAttention.forward runs get_qkv_layout (attention/dot_product_attention/utils.py)
// on q, k and v before any backend: it recognises them as views of one packed buffer
// (sb3hd, sbh3d), q plus a packed kv (sbhd_sb2hd, sbhd_sbh2d) or three chunks laid end to
// end (sbhd_sbhd_sbhd), from their storages, shapes, strides and storage offsets; anything
// else is "not_supported" and each of q, k, v is made contiguous (.contiguous(): a copy of
// a strided view, nothing for a contiguous tensor). The backend then saves what it got.
// Megatron-Core splits linear_qkv's [S, B, G, (A/G + 2) D] output per group; with grouped
// queries (1 < G < A) the query's reshape to [S, B, A, D] copies, so the key and value,
// strided views at offsets A/G*D and (A/G + 1)*D, fit no layout: Transformer Engine copies
// them (S*B*G*D each) and saves the copies, and the packed output dies when attention's
// forward returns. With one query per group (G = A) q, k, v are views at offsets 0, D, 2D
// of equal strides (sbh3d): no copies, and the saved views keep the whole packed output.
// RoPE's new q and k leave v a view at an offset: v is copied. Only the fused backend (and
// its ring context parallelism) is modelled so: TE's FlashAttention and unfused attention
// copy q, k, v themselves (transposes, GQA's repeat), saving those, so the layout's copies
// are transients there, and the a2a and all-gather exchanges make new tensors anyway.
bool TeRecognizesQkvLayout(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  auto same_storage = [](const at::Tensor& a, const at::Tensor& b) {
    return a.storage().unsafeGetStorageImpl() == b.storage().unsafeGetStorageImpl();
  };
  const bool ptrs_qkv = same_storage(q, k) && same_storage(q, v);
  const bool ptrs_qk = same_storage(q, k);
  const bool ptrs_kv = same_storage(k, v);
  const bool shapes_qkv = q.sizes() == k.sizes() && q.sizes() == v.sizes();
  const bool shapes_kv = k.sizes().slice(0, k.dim() - 1) == v.sizes().slice(0, v.dim() - 1);
  const bool strides_qkv = q.strides() == k.strides() && q.strides() == v.strides();
  // sk / k.shape[-1] == sv / v.shape[-1] for every stride but the last, as exact fractions.
  bool strides_kv = k.dim() == v.dim();
  for (int64_t d = 0; strides_kv && d + 1 < k.dim(); ++d) {
    strides_kv = k.stride(d) * v.size(-1) == v.stride(d) * k.size(-1);
  }
  const int64_t q_off = q.storage_offset(), k_off = k.storage_offset(), v_off = v.storage_offset();
  const int64_t q_hd = q.size(-1) * q.size(-2), q_d = q.size(-1);
  const bool offsets_3hd = q_off == 0 && k_off == q_hd && v_off == 2 * q_hd;
  const bool offsets_h3d = q_off == 0 && k_off == q_d && v_off == 2 * q_d;
  const int64_t kv_base = ptrs_qkv ? q.numel() : 0;
  const int64_t k_hd = k.size(-1) * k.size(-2);
  const bool offsets_2hd = k_off == kv_base && v_off == kv_base + k_hd;
  const bool offsets_h2d = k_off == kv_base && v_off == kv_base + k.size(-1);
  const bool offsets_hd_qkv =
      ptrs_qkv ? q_off == 0 && k_off == q.numel() && v_off == q.numel() + k.numel()
               : q_off == 0 && k_off == 0 && v_off == 0;
  const bool offsets_hd_qk =
      !ptrs_qkv && ptrs_qk ? q_off == 0 && k_off == q.numel() : q_off == 0 && k_off == 0;
  const bool offsets_hd_kv =
      !ptrs_qkv && ptrs_kv ? k_off == 0 && v_off == k.numel() : k_off == 0 && v_off == 0;
  return (ptrs_qkv && strides_qkv && shapes_qkv && (offsets_3hd || offsets_h3d)) ||
         (ptrs_kv && strides_kv && shapes_kv && (offsets_2hd || offsets_h2d)) ||
         (strides_kv && shapes_kv && (offsets_hd_qkv || offsets_hd_kv || offsets_hd_qk));
}

}  // namespace

at::Tensor CoreAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         AttentionKind kind, double dropout_p, GlobalMemoryBuffer& workspace,
                         int64_t cp, int64_t cp_all_to_all, bool cp_all_gather,
                         at::Tensor* max_logit) {
  MEMSIM_DCHECK(max_logit == nullptr || (cp == 1 && kind != AttentionKind::kFlash));
  const int64_t seq = q.size(0), batch = q.size(1), heads = q.size(2), head_dim = q.size(3);
  const int64_t groups = k.size(2);
  const int64_t v_head_dim = v.size(3);  // multi-latent attention: not q's
  if (cp_all_to_all > 1) {
    MEMSIM_DCHECK(cp % cp_all_to_all == 0 && heads % cp_all_to_all == 0 &&
                  groups % cp_all_to_all == 0);
    const std::vector<at::Tensor> exchanged = AllToAllBeforeAttention(q, k, v, cp_all_to_all);
    const at::Tensor out = CoreAttention(exchanged[0], exchanged[1], exchanged[2], kind, dropout_p,
                                         workspace, cp / cp_all_to_all);
    return AllToAllAfterAttention(
               out.view({seq * cp_all_to_all, batch, heads / cp_all_to_all, v_head_dim}),
               cp_all_to_all)
        .view({seq, batch, heads * v_head_dim});
  }
  if (cp > 1 && cp_all_gather) {
    MEMSIM_DCHECK(cp_all_to_all == 1 && kind != AttentionKind::kEager);
    return AllGatherContextParallelAttention(q.contiguous(), k.contiguous(), v.contiguous(), cp,
                                             dropout_p)
        .view({seq, batch, heads * v_head_dim});
  }
  if (kind == AttentionKind::kFused) {
    // Transformer Engine's FusedAttention (cuDNN) reads q, k, v in Megatron's [S, B, A, D]
    // layout, once get_qkv_layout has made them fit one (Note [Transformer Engine's qkv
    // layout]), and writes out in it. It keeps the same tensors for backward as
    // FlashAttention (its softmax statistics [B, A, S, 1] float32 are the size of the
    // log-sum-exp), so the flash kernel is called on [B, S, A, D] views.
    const bool fits = TeRecognizesQkvLayout(q, k, v);
    const at::Tensor qs = fits ? q : q.contiguous();
    const at::Tensor ks = fits ? k : k.contiguous();
    const at::Tensor vs = fits ? v : v.contiguous();
    at::Tensor out = cp > 1 ? ContextParallelAttention(qs.transpose(0, 1), ks.transpose(0, 1),
                                                       vs.transpose(0, 1), cp, dropout_p)
                            : FlashAttentionFunction::apply(qs.transpose(0, 1), ks.transpose(0, 1),
                                                            vs.transpose(0, 1), dropout_p);
    if (max_logit != nullptr) {
      // fused_attn_fwd (cpp_extensions/fused_attn.py): Max [B, A, S, 1] beside the
      // statistics, torch.amax over all but the heads, cast to the output's dtype.
      at::NoGradGuard no_grad;
      const at::Tensor max = at::empty({batch, heads, seq, 1}, q.options().dtype(at::kFloat));
      *max_logit = at::amax(max, {0, 2, 3}).to(q.scalar_type());
    }
    return out.transpose(0, 1).reshape({seq, batch, heads * v_head_dim});
  }
  if (kind == AttentionKind::kFlash) {
    // Megatron's FlashSelfAttention: rearrange 's b ... -> b s ...' and make contiguous.
    at::Tensor qb = q.transpose(0, 1).contiguous();
    at::Tensor kb = k.transpose(0, 1).contiguous();
    at::Tensor vb = v.transpose(0, 1).contiguous();
    at::Tensor out = cp > 1 ? ContextParallelAttention(qb, kb, vb, cp, dropout_p)
                            : FlashAttentionFunction::apply(qb, kb, vb, dropout_p);
    // 'b s h d -> s b (h d)'
    return out.transpose(0, 1).contiguous().view({seq, batch, heads * v_head_dim});
  }
  // DotProductAttention (megatron/core/transformer/dot_product_attention.py).
  at::Tensor key = k;
  at::Tensor value = v;
  if (groups != heads) {
    // Megatron's key.repeat_interleave(heads / groups, dim=2): a new [S, B, A, D] copy of
    // each kv head per query head (written as expand + reshape: the Tensor-repeats
    // overload it decomposes into has no Meta kernel).
    auto repeat = [&](const at::Tensor& t) {
      return t.unsqueeze(3)
          .expand({seq, batch, groups, heads / groups, head_dim})
          .reshape({seq, batch, heads, head_dim});
    };
    key = repeat(k);
    value = repeat(v);
  }
  const at::Tensor q3 = q.reshape({seq, batch * heads, head_dim}).transpose(0, 1);
  const at::Tensor k3 = key.reshape({seq, batch * heads, head_dim}).transpose(0, 1);
  at::Tensor buffer = workspace.Get({batch * heads, seq, seq}, q.scalar_type());
  at::Tensor scores = at::baddbmm(buffer, q3, k3.transpose(1, 2), /*beta=*/0.0,
                                  /*alpha=*/1.0 / std::sqrt(static_cast<double>(head_dim)));
  // Transformer Engine rebinds its torch.empty buffer to baddbmm's result (backends.py),
  // which lets it go; a persistent buffer stays in its workspace.
  buffer.reset();
  if (max_logit != nullptr) {
    // UnfusedDotProductAttention: the mask applied in place, then torch.amax over all but
    // the heads.
    at::NoGradGuard no_grad;
    *max_logit = at::amax(scores.view({batch, heads, seq, seq}), {0, 2, 3});
  }
  // FusedScaleMaskSoftmax takes the fused causal kernel for 16-bit inputs with
  // 16 < S <= 16384 and S, B*A divisible by 4; otherwise masked_fill_ + torch softmax.
  const bool fused =
      IsHalf(q) && seq > 16 && seq <= 16384 && seq % 4 == 0 && (batch * heads) % 4 == 0;
  at::Tensor probs;
  if (fused) {
    probs = FusedCausalSoftmaxFunction::apply(scores);
  } else {
    probs = at::softmax(scores, -1);
  }
  // The raw scores stay a local of DotProductAttention.forward (and of Transformer Engine's
  // UnfusedDotProductAttention, backends.py) until it returns: the H200 trace of a 7B local
  // run (validation/fake_pg) frees baddbmm's [B*A, S, S] after the context's bmm.
  probs = Dropout(probs, dropout_p);
  const at::Tensor v3 = value.reshape({seq, batch * heads, v_head_dim}).transpose(0, 1);
  at::Tensor context = at::bmm(probs, v3);  // [B*A, S, Dv]
  return context.view({batch, heads, seq, v_head_dim})
      .permute({2, 0, 1, 3})
      .contiguous()
      .view({seq, batch, heads * v_head_dim});
}

at::Tensor TeUnfusedAttentionMask(int64_t seq_q, int64_t seq_kv, int64_t batch_mask_rows) {
  // The Python temporaries in the order they are made and dropped (reset() where one goes).
  const auto meta = at::TensorOptions().device(at::kMeta);
  const auto int32 = meta.dtype(at::kInt), mask = meta.dtype(at::kBool);
  at::Tensor rows = at::empty({seq_q}, int32), columns = at::empty({seq_kv}, int32);
  const std::vector<int64_t> square = {1, 1, seq_q, seq_kv};
  const at::Tensor distance = at::empty(square, int32);  // rows.view(..) - columns.view(..)
  columns.reset();
  rows.reset();
  const at::Tensor left = at::empty(square, int32);   // distance - window_size[0]
  const at::Tensor right = at::empty(square, int32);  // distance + window_size[1]
  at::Tensor left_in = at::empty(square, mask);       // left <= 0
  at::Tensor right_out = at::empty(square, mask);     // right < 0
  at::Tensor right_in = at::empty(square, mask);      // ~(right < 0)
  right_out.reset();
  at::Tensor both = at::empty(square, mask);  // left_in & right_in
  right_in.reset();
  left_in.reset();
  at::Tensor window = at::empty(square, mask);  // logical_not(both)
  both.reset();
  if (batch_mask_rows == 0) return window;
  return at::empty({batch_mask_rows, 1, seq_q, seq_kv}, mask);  // logical_or(window, batch's)
}

at::Tensor VocabCrossEntropy(const at::Tensor& logits, const at::Tensor& labels, int64_t tp_group,
                             bool fused) {
  return VocabCrossEntropyFunction::apply(logits, labels, tp_group, fused);
}

namespace {

struct TeCrossEntropyFunction : public Function<TeCrossEntropyFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits,
                            const at::Tensor& labels, int64_t tp_group) {
    const int64_t rows = logits.numel() / logits.size(-1);
    const auto fp32 = logits.options().dtype(at::kFloat);
    at::Tensor loss = at::zeros({rows}, fp32);
    const at::Tensor statistics = at::zeros({3 * rows}, fp32);  // max, sum of exps, target
    at::Tensor count = at::zeros({1}, logits.options().dtype(at::kLong));
    at::Tensor grad = at::empty_like(logits, fp32);
    if (tp_group > 1) {
      [[maybe_unused]] const at::Tensor gathered = AllGather(statistics, tp_group);
    }
    count = at::clamp_min(count, 1);
    ctx->save_for_backward({grad});
    const at::IntArrayRef sizes = logits.sizes();
    return at::_unsafe_view(loss, sizes.slice(0, sizes.size() - 1));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    at::Tensor grad = ctx->get_saved_variables()[0];
    grad.mul_(grads[0].unsqueeze(-1));  // element_mul_kernel, in place
    return {grad, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor TeParallelCrossEntropy(const at::Tensor& logits, const at::Tensor& labels,
                                  int64_t tp_group) {
  return TeCrossEntropyFunction::apply(logits, labels, tp_group);
}

namespace {

struct AttachLossFunction : public Function<AttachLossFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& output,
                            const at::Tensor& loss) {
    ctx->save_for_backward({loss});
    return output;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor loss = ctx->get_saved_variables()[0];
    // The scale's value (1.0 here) does not matter on meta; the product is a new tensor.
    return {grads[0], at::ones_like(loss).mul(1.0)};
  }
};

}  // namespace

at::Tensor AttachLoss(const at::Tensor& output, const at::Tensor& loss) {
  return AttachLossFunction::apply(output, loss);
}

at::Tensor Checkpoint(const RecomputeFn& fn, const std::vector<at::Tensor>& inputs,
                      int64_t distribute_over) {
  auto closure = c10::make_intrusive<RecomputeClosure>();
  closure->fn = fn;
  closure->module = ModuleScope::Current();
  closure->wgrad_store = CurrentWgradStore();
  closure->distribute_over = distribute_over;
  return CheckpointFunction::apply(at::TensorList(inputs), std::move(closure));
}

CheckpointWithoutOutput::CheckpointWithoutOutput() = default;
CheckpointWithoutOutput::~CheckpointWithoutOutput() = default;

std::vector<at::Tensor> CheckpointWithoutOutput::Run(Fn fn, const std::vector<at::Tensor>& inputs) {
  MEMSIM_DCHECK(!state_);
  state_ = c10::make_intrusive<State>();
  state_->fn = std::move(fn);
  state_->module = ModuleScope::Current();
  state_->wgrad_store = CurrentWgradStore();
  state_->graphed = CurrentRecorder() != nullptr && CurrentRecorder()->in_graphed_scope();
  std::vector<at::Tensor> outputs =
      CheckpointWithoutOutputFunction::apply(at::TensorList(inputs), state_);
  for (const at::Tensor& output : outputs) state_->discarded.push_back(output.storage());
  state_->recorded = !outputs.empty() && outputs[0].grad_fn() != nullptr;
  return outputs;
}

void CheckpointWithoutOutput::DiscardOutputAndRegisterRecompute(const at::Tensor& hook) {
  MEMSIM_DCHECK(state_);
  for (const c10::Storage& storage : state_->discarded) FreeStorage(storage);
  if (hook.requires_grad()) {
    hook.register_hook([state = state_](const at::TensorBase&) { state->Recompute(); });
  } else if (!state_->recorded) {
    state_->inputs.clear();  // nothing will recompute
  }                          // else the node's backward recomputes, later than the hook would have
  state_.reset();
}

}  // namespace memsim
