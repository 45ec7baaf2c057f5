#include "models/backward_call.h"

#include <torch/csrc/autograd/custom_function.h>

#include <utility>

namespace memsim {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::Function;
using torch::autograd::variable_list;

// What an identity node calls when the gradient reaches it in backward.
struct BackwardCall : public torch::CustomClassHolder {
  std::function<void()> call;
};

struct CallOnBackwardFunction : public Function<CallOnBackwardFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x,
                            c10::intrusive_ptr<BackwardCall> call) {
    ctx->saved_data["call"] = c10::IValue::make_capsule(std::move(call));
    return x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    c10::static_intrusive_pointer_cast<BackwardCall>(ctx->saved_data["call"].toCapsule())->call();
    return {grads[0], at::Tensor()};
  }
};

}  // namespace

at::Tensor CallOnBackward(const at::Tensor& x, std::function<void()> call) {
  auto node = c10::make_intrusive<BackwardCall>();
  node->call = std::move(call);
  return CallOnBackwardFunction::apply(x, std::move(node));
}

}  // namespace memsim
