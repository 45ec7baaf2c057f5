// Delayed weight gradients: where a decoder layer's Transformer Engine linears queue their
// weight-gradient GEMMs under --delay-wgrad-compute, and when the queue runs.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/custom_class_detail.h>

#include <functional>
#include <vector>

namespace memsim {

// Note [Delayed weight gradients]
// --delay-wgrad-compute (Megatron-Core 0.20, only with --overlap-moe-expert-parallel-comm):
// the Transformer Engine linears of a decoder layer (Linear, LayerNormLinear,
// GroupedLinear; not the router, the norms or the output layer) are built with
// delay_wgrad_compute. Their backward computes the input gradient only and puts the
// weight-gradient GEMM's operands, the (gathered) input and the output gradient, into the
// module's WeightGradStore (TE's _common.py; linear.py, layernorm_linear.py,
// grouped_linear.py). The combined 1F1B schedule's backward_dw pops them and runs the GEMMs
// (model_chunk_schedule_plan.py, common/utils.py):
//   the routed experts' (fc2, fc1) right after the experts' backward, before the dispatch's;
//   a dense layer's MLP (fc2, fc1) right after the MLP's backward;
//   the rest of the layer (attention's linears, the shared experts) after the layer's
//     backward, before Megatron-FSDP's post-backward hook (which waits for them).
// The weight gradient is allocated when its GEMM runs, and the operands go then. memsim
// keeps one store per group and layer call (FIFO, as TE's queue) and runs it from an
// identity node at the group's input (CallOnBackward), which autograd reaches once the
// group's backward is done. Not modelled: GroupedLinear allocates its [experts, out, in]
// weight gradient already in backward (memsim's grouped GEMM stands for one expert's block).
class WeightGradStore : public torch::CustomClassHolder {
 public:
  // A weight-gradient GEMM; the closure holds its operands.
  void Push(std::function<void()> gemm) { gemms_.push_back(std::move(gemm)); }
  // backward_dw: runs the queued GEMMs in order, each one's operands let go before the next.
  void Run();

 private:
  std::vector<std::function<void()>> gemms_;
};

// While alive, Linear() hands the weight-gradient GEMMs of the 16-bit linears it builds to
// `store` (Note [Delayed weight gradients]); a null store turns delaying off (the router).
// Scopes nest; this thread only.
class DelayedWgradScope {
 public:
  explicit DelayedWgradScope(c10::intrusive_ptr<WeightGradStore> store);
  ~DelayedWgradScope();
  DelayedWgradScope(const DelayedWgradScope&) = delete;
  DelayedWgradScope& operator=(const DelayedWgradScope&) = delete;

 private:
  c10::intrusive_ptr<WeightGradStore> previous_;
};

// The store of the innermost DelayedWgradScope on this thread; null: none (Linear() and
// the recomputations read it).
const c10::intrusive_ptr<WeightGradStore>& CurrentWgradStore();

// A new store when `delay` (--delay-wgrad-compute), else null.
c10::intrusive_ptr<WeightGradStore> NewWgradStore(bool delay);
// `x` through an identity node (CallOnBackward) that runs `store` (backward_dw) once the
// backward of what was computed from the returned tensor is done. REQUIRES:
// x.requires_grad().
at::Tensor RunOnBackward(const at::Tensor& x, c10::intrusive_ptr<WeightGradStore> store);

}  // namespace memsim
