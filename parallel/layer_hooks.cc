#include "parallel/layer_hooks.h"

#include <torch/csrc/autograd/custom_function.h>

#include "simulator/recorder.h"

namespace memsim {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::Function;
using torch::autograd::variable_list;

// Autograd's saved data holds IValues: the hooks travel in a typed capsule (the one IValue
// that carries a C++ object without registering a TorchScript class). It does not own
// them; they outlive every backward of the step.
struct HooksCapsule : torch::CustomClassHolder {
  explicit HooksCapsule(LayerHooks* hooks) : hooks(hooks) {}
  LayerHooks* const hooks;
};

// The layer's boundaries, around its forward: identity there; in backward, the output
// side runs first (the pre-backward hook), the input side last (post-backward).
template <bool kPreBackward>
struct BackwardHook : public Function<BackwardHook<kPreBackward>> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, LayerHooks* hooks,
                            int64_t unit) {
    ctx->saved_data["hooks"] = c10::IValue::make_capsule(c10::make_intrusive<HooksCapsule>(hooks));
    ctx->saved_data["unit"] = unit;
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    LayerHooks* hooks =
        c10::static_intrusive_pointer_cast<HooksCapsule>(ctx->saved_data["hooks"].toCapsule())
            ->hooks;
    const int64_t unit = ctx->saved_data["unit"].toInt();
    if (kPreBackward) {
      hooks->PreBackward(unit);
    } else {
      hooks->PostBackward(unit);
    }
    return {grads[0], at::Tensor(), at::Tensor()};
  }
};
using PreBackwardHook = BackwardHook<true>;
using PostBackwardHook = BackwardHook<false>;

}  // namespace

at::Tensor RunHookedLayer(LayerHooks* hooks, int64_t unit, const at::Tensor& input,
                          const ModelShard::LayerFn& run) {
  hooks->PreForward(unit);
  const bool recomputing =
      CurrentRecorder() != nullptr && CurrentRecorder()->phase() == Phase::kBackward;
  at::Tensor x = input.requires_grad() ? PostBackwardHook::apply(input, hooks, unit) : input;
  at::Tensor out = run(x);
  hooks->PostForward(unit, recomputing);
  return out.requires_grad() ? PreBackwardHook::apply(out, hooks, unit) : out;
}

}  // namespace memsim
