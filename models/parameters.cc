#include "models/parameters.h"

#include <ATen/ATen.h>

#include "models/layers.h"
#include "simulator/check.h"
#include "simulator/checked_math.h"
#include "simulator/session.h"

namespace memsim {

at::ScalarType ScalarTypeOf(Precision precision) {
  switch (precision) {
    case Precision::kFp32:
      return at::kFloat;
    case Precision::kBf16:
      return at::kBFloat16;
    case Precision::kFp16:
      return at::kHalf;
  }
  return at::kFloat;
}

at::ScalarType ParameterStore::param_dtype() const { return ScalarTypeOf(precision_); }

at::ScalarType ParameterStore::grad_dtype() const {
  if (precision_ == Precision::kFp16) return at::kHalf;
  return precision_ == Precision::kBf16 && grad_reduce_in_bf16_ ? at::kBFloat16 : at::kFloat;
}

Parameter* ParameterStore::Add(const std::string& name, std::vector<int64_t> shape, bool expert) {
  CategoryScope category(Category::kParameter);
  const std::string module = CurrentRecorder() != nullptr
                                 ? CurrentRecorder()->names().Name(ModuleScope::Current())
                                 : std::string();
  const at::TensorOptions options = at::TensorOptions().device(at::kMeta).dtype(param_dtype());
  at::Tensor data;
  if (unmaterialized_) {
    data = EmptyWithoutBytes(shape, options);
    MapStorage(data);  // bytes that nothing counts until Megatron-FSDP lays it over a bucket
  } else {
    data = at::empty(shape, options);
  }
  data.requires_grad_(true);
  int64_t numel = 1;
  for (int64_t d : shape) numel = CheckedMul(numel, d);
  num_elements_ = CheckedAdd(num_elements_, numel);
  parameters_.push_back({module.empty() ? name : module + "." + name,
                         std::move(data),
                         {},
                         expert,
                         /*embedding_or_output=*/false,
                         unit_,
                         {},
                         {},
                         this,
                         /*fp8=*/{},
                         /*tp_partition_dim=*/-1,
                         /*stacked_experts=*/1,
                         chunk_,
                         /*optimizer_slice=*/std::nullopt,
                         /*shared_embedding=*/false,
                         /*shared=*/false});
  return &parameters_.back();
}

const at::Tensor& ParameterStore::DummyWgrad(at::IntArrayRef shape) {
  at::Tensor& dummy = dummy_wgrads_[shape.vec()];
  if (!dummy.defined()) {
    // TE's buffer, not a gradient Megatron's model-state formulas count.
    CategoryScope category(Category::kWorkspace);
    ModuleScope scope(ModuleScope::Absolute{"transformer_engine.dummy_wgrad"});
    dummy = at::empty(shape, at::TensorOptions().device(at::kMeta).dtype(param_dtype()));
  }
  return dummy;
}

void ParameterStore::AllocateGradBuffer(bool root_only) {
  CategoryScope category(Category::kGradient);
  ModuleScope scope(ModuleScope::Absolute{"ddp.grad_buffer"});
  int64_t elements = 0;
  for (const Parameter& p : parameters_) {
    if (!root_only || p.unit < 0) elements = CheckedAdd(elements, p.data.numel());
  }
  MEMSIM_DCHECK(grad_buffers_.empty());  // allocated once
  const at::Tensor& buffer = grad_buffers_.emplace_back(
      at::zeros({elements}, at::TensorOptions().device(at::kMeta).dtype(grad_dtype())));
  int64_t offset = 0;
  for (Parameter& p : parameters_) {
    if (root_only && p.unit >= 0) continue;
    const int64_t n = p.data.numel();
    p.main_grad = buffer.narrow(0, offset, n).view(p.data.sizes());
    offset += n;
  }
}

void ParameterStore::AdoptBuffers(std::vector<at::Tensor> param_buffers,
                                  std::vector<at::Tensor> grad_buffers) {
  MEMSIM_DCHECK(grad_buffers_.empty());  // allocated once
  param_buffers_ = std::move(param_buffers);
  grad_buffers_ = std::move(grad_buffers);
}

}  // namespace memsim
