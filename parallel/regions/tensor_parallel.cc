#include "parallel/regions/tensor_parallel.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "ops/collectives.h"

namespace memsim {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::Function;
using torch::autograd::variable_list;

struct ScatterToSequenceParallel : public Function<ScatterToSequenceParallel> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, int64_t tp) {
    ctx->saved_data["tp"] = tp;
    return input.narrow(0, 0, input.size(0) / tp).contiguous();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {AllGather(grads[0].contiguous(), ctx->saved_data["tp"].toInt()), at::Tensor()};
  }
};

struct ReduceScatterToSequenceParallel : public Function<ReduceScatterToSequenceParallel> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, int64_t tp,
                            bool grad_into_userbuffer) {
    ctx->saved_data["tp"] = tp;
    ctx->saved_data["userbuffer"] = grad_into_userbuffer;
    return ReduceScatter(input.contiguous(), tp);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const int64_t tp = ctx->saved_data["tp"].toInt();
    const at::Tensor grad = grads[0].contiguous();
    return {ctx->saved_data["userbuffer"].toBool() ? AllGatherIntoUserbuffer(grad, tp)
                                                   : AllGather(grad, tp),
            at::Tensor(), at::Tensor()};
  }
};

struct GatherFromSequenceParallel : public Function<GatherFromSequenceParallel> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, int64_t tp) {
    ctx->saved_data["tp"] = tp;
    return AllGather(input.contiguous(), tp);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {ReduceScatter(grads[0].contiguous(), ctx->saved_data["tp"].toInt()), at::Tensor()};
  }
};

struct ReduceFromTensorParallel : public Function<ReduceFromTensorParallel> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, int64_t tp) {
    at::Tensor out = input;
    AllReduceInPlace(out, tp);
    ctx->mark_dirty({out});
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {grads[0], at::Tensor()};
  }
};

// mappings.py's _gather_along_last_dim: all_gather_into_tensor along the first dim, then
// the tp pieces concatenated along the last; backward _split_along_last_dim.
struct GatherFromTensorParallel : public Function<GatherFromTensorParallel> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, int64_t tp) {
    ctx->saved_data["tp"] = tp;
    return at::cat(AllGather(input.contiguous(), tp).chunk(tp, 0), -1);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const int64_t tp = ctx->saved_data["tp"].toInt();
    return {grads[0].narrow(-1, 0, grads[0].size(-1) / tp).contiguous(), at::Tensor()};
  }
};

}  // namespace

at::Tensor ScatterToSequenceParallelRegion(const at::Tensor& input, int64_t tp) {
  return tp > 1 ? ScatterToSequenceParallel::apply(input, tp) : input;
}

at::Tensor ReduceScatterToSequenceParallelRegion(const at::Tensor& input, int64_t tp,
                                                 bool grad_into_userbuffer) {
  return tp > 1 ? ReduceScatterToSequenceParallel::apply(input, tp, grad_into_userbuffer) : input;
}

at::Tensor GatherFromSequenceParallelRegion(const at::Tensor& input, int64_t tp) {
  return tp > 1 ? GatherFromSequenceParallel::apply(input, tp) : input;
}

at::Tensor ReduceFromTensorParallelRegion(const at::Tensor& input, int64_t tp) {
  return tp > 1 ? ReduceFromTensorParallel::apply(input, tp) : input;
}

at::Tensor GatherFromTensorParallelRegion(const at::Tensor& input, int64_t tp) {
  return tp > 1 ? GatherFromTensorParallel::apply(input, tp) : input;
}

}  // namespace memsim
