#include "ops/meta_kernels.h"

#include <ATen/ATen.h>
#include <ATen/ExpandUtils.h>
#include <ATen/native/Resize.h>
#include <c10/macros/Macros.h>
#include <torch/library.h>
#ifdef C10_USE_GLOG  // LibTorch built with glog logs replaced kernels through it
#include <glog/logging.h>
#endif

#include <algorithm>
#include <mutex>
#include <tuple>

namespace memsim {
namespace {

at::TensorOptions MetaOptions(at::ScalarType dtype) {
  return at::TensorOptions().device(at::kMeta).dtype(dtype);
}

at::ScalarType AccumulateType(at::ScalarType dtype) {
  return dtype == at::kHalf || dtype == at::kBFloat16 ? at::kFloat : dtype;
}

// Mirrors layer_norm_cuda (aten/src/ATen/native/cuda/layer_norm_kernel.cu): output like
// the input; mean and rstd of shape input.shape[:axis] + [1]*len(normalized_shape) in the
// accumulate type (float32 for half inputs).
std::tuple<at::Tensor, at::Tensor, at::Tensor> NativeLayerNorm(
    const at::Tensor& input, c10::IntArrayRef normalized_shape,
    const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias, double eps) {
  const int64_t axis = input.dim() - static_cast<int64_t>(normalized_shape.size());
  std::vector<int64_t> stat_shape(input.sizes().begin(), input.sizes().begin() + axis);
  stat_shape.resize(static_cast<size_t>(input.dim()), 1);
  const auto stat_options = MetaOptions(AccumulateType(input.scalar_type()));
  return {at::empty(input.sizes(), input.options().memory_format(at::MemoryFormat::Contiguous)),
          at::empty(stat_shape, stat_options), at::empty(stat_shape, stat_options)};
}

// Mirrors layer_norm_backward_cuda: each gradient like its forward tensor, when asked.
std::tuple<at::Tensor, at::Tensor, at::Tensor> NativeLayerNormBackward(
    const at::Tensor& grad_out, const at::Tensor& input, c10::IntArrayRef normalized_shape,
    const at::Tensor& mean, const at::Tensor& rstd, const c10::optional<at::Tensor>& weight,
    const c10::optional<at::Tensor>& bias, std::array<bool, 3> output_mask) {
  auto like = [](const c10::optional<at::Tensor>& t) {
    return t.has_value() && t->defined() ? at::empty_like(*t) : at::Tensor();
  };
  return {output_mask[0] ? at::empty_like(input) : at::Tensor(),
          output_mask[1] ? like(weight) : at::Tensor(), output_mask[2] ? like(bias) : at::Tensor()};
}

at::Tensor IndexSelect(const at::Tensor& self, int64_t dim, const at::Tensor& index) {
  dim = c10::maybe_wrap_dim(dim, self.dim());
  std::vector<int64_t> sizes = self.sizes().vec();
  if (!sizes.empty()) sizes[static_cast<size_t>(dim)] = index.numel();
  return at::empty(sizes, self.options());
}

// Mirrors embedding_dense_backward_cuda (aten/src/ATen/native/cuda/Embedding.cu and
// EmbeddingBackwardKernel.cu, PyTorch 2.x), whose allocations a CUDA run records
// (ops/testdata/h200_torch2.11_ops.json): the flattened indices sorted into two int64
// tensors (values and original positions), the [num_weights, dim] gradient, three more
// int64 tensors of one entry per index (segment offsets, partial segments per segment and
// their offsets), two int64 scalars, and, sized for the most partial segments there can
// be (numel / 10 rows per thread + min(numel, num_weights) segments), their offsets in int64
// and their partial sums in the accumulate type (float32 for 16-bit gradients) of `dim`
// columns each. The temporaries die with the op; the sort's small scratch is left out.
// Up to 3072 indices (without scale_grad_by_freq) the kernel instead accumulates straight
// into the zeroed gradient with atomics and allocates nothing else (measured at 3072 and
// 3073).
at::Tensor EmbeddingDenseBackward(const at::Tensor& grad_output, const at::Tensor& indices,
                                  int64_t num_weights, int64_t padding_idx,
                                  bool scale_grad_by_freq) {
  constexpr int64_t kRowsPerThread = 10;  // NROWS_PER_THREAD in EmbeddingBackwardKernel.cu
  constexpr int64_t kAtomicPathMaxIndices = 3072;
  const int64_t num_indices = indices.numel();
  const int64_t dim = grad_output.size(-1);
  if (num_indices <= kAtomicPathMaxIndices && !scale_grad_by_freq) {
    return at::empty({num_weights, dim}, grad_output.options());
  }
  const auto index_options = MetaOptions(at::kLong);
  at::Tensor sorted_indices = at::empty({num_indices}, index_options);
  at::Tensor orig_indices = at::empty({num_indices}, index_options);
  at::Tensor grad_weight = at::empty({num_weights, dim}, grad_output.options());
  at::Tensor segment_offsets = at::empty({num_indices}, index_options);
  at::Tensor num_segments = at::empty({}, index_options);
  at::Tensor partials_per_segment = at::empty({num_indices}, index_options);
  at::Tensor partials_per_segment_offset = at::empty({num_indices}, index_options);
  at::Tensor num_partial_segments = at::empty({}, index_options);
  const int64_t max_partial_segments =
      num_indices / kRowsPerThread + std::min(num_indices, num_weights);
  at::Tensor partial_segment_offset = at::empty({max_partial_segments}, index_options);
  at::Tensor partial_sums = at::empty({max_partial_segments, dim},
                                      MetaOptions(AccumulateType(grad_output.scalar_type())));
  return grad_weight;
}

// Mirrors dropout_cuda: the mask is bool (1 byte an element), not a float noise tensor.
std::tuple<at::Tensor, at::Tensor> NativeDropout(const at::Tensor& input, double p,
                                                 c10::optional<bool> train) {
  if (train.has_value() && !*train) {
    return {input.clone(), at::empty(input.sizes(), MetaOptions(at::kBool))};
  }
  return {at::empty_like(input), at::empty(input.sizes(), MetaOptions(at::kBool))};
}

at::Tensor NativeDropoutBackward(const at::Tensor& grad_output, const at::Tensor& mask,
                                 double scale) {
  return at::empty_like(grad_output);
}

at::Tensor WhereSelf(const at::Tensor& condition, const at::Tensor& self, const at::Tensor& other) {
  const auto shape = at::infer_size(at::infer_size(condition.sizes(), self.sizes()), other.sizes());
  return at::empty(shape, self.options().dtype(at::result_type(self, other)));
}

at::Tensor Relu(const at::Tensor& self) { return at::empty_like(self); }

// Mirrors roll_cuda (aten/src/ATen/native/cuda/TensorTransformations.cu): a contiguous copy
// of a non-contiguous input, then a new contiguous output like it.
at::Tensor Roll(const at::Tensor& self, c10::IntArrayRef /*shifts*/, c10::IntArrayRef /*dims*/) {
  const at::Tensor input = self.contiguous();
  return at::empty_like(input, at::MemoryFormat::Contiguous);
}

// logical_or.out and logical_and.out (and through them the functional and in-place forms):
// the broadcast shape into `out`.
at::Tensor& LogicalOut(const at::Tensor& self, const at::Tensor& other, at::Tensor& out) {
  at::native::resize_output(out, at::infer_size(self.sizes(), other.sizes()));
  return out;
}

// abs.out (and through it abs and abs_, which torch.logsumexp calls on its maxima) and
// logical_not.out (group-limited MoE routing's negated mask): the input's shape into `out`.
at::Tensor& ElementwiseOut(const at::Tensor& self, at::Tensor& out) {
  at::native::resize_output(out, self.sizes());
  return out;
}

// Note [Meta resize_]
// LibTorch 1.13 grows a meta storage through resize_bytes_cpu, which memcpy's the old
// bytes out of a null pointer. A grown meta tensor gets a fresh storage from the meta
// allocator (so the tracker sees the new size; the old one is freed with its last
// reference) and nothing is copied: there are no bytes on meta.
const at::Tensor& MetaResize(const at::Tensor& self, c10::IntArrayRef size,
                             c10::optional<at::MemoryFormat> memory_format) {
  c10::TensorImpl* impl = self.unsafeGetTensorImpl();
  impl->set_sizes_contiguous(size);
  if (memory_format.has_value() && *memory_format != at::MemoryFormat::Preserve) {
    impl->empty_tensor_restride(*memory_format);
  }
  const int64_t needed_bytes =
      (self.storage_offset() + self.numel()) * static_cast<int64_t>(self.element_size());
  c10::StorageImpl* storage = self.storage().unsafeGetStorageImpl();
  if (needed_bytes > static_cast<int64_t>(storage->nbytes())) {
    storage->set_data_ptr_noswap(storage->allocator()->allocate(static_cast<size_t>(needed_bytes)));
    storage->set_nbytes(static_cast<size_t>(needed_bytes));
  }
  return self;
}

}  // namespace

void RegisterMetaKernels() {
  static std::once_flag once;
  std::call_once(once, [] {
    static auto* aten_meta = new torch::Library(torch::Library::IMPL, "aten",
                                                c10::DispatchKey::Meta, __FILE__, __LINE__);
    aten_meta->impl("native_layer_norm", TORCH_FN(NativeLayerNorm));
    aten_meta->impl("native_layer_norm_backward", TORCH_FN(NativeLayerNormBackward));
    aten_meta->impl("index_select", TORCH_FN(IndexSelect));
    aten_meta->impl("embedding_dense_backward", TORCH_FN(EmbeddingDenseBackward));
    aten_meta->impl("native_dropout", TORCH_FN(NativeDropout));
    aten_meta->impl("native_dropout_backward", TORCH_FN(NativeDropoutBackward));
    aten_meta->impl("where.self", TORCH_FN(WhereSelf));
    aten_meta->impl("relu", TORCH_FN(Relu));
    aten_meta->impl("roll", TORCH_FN(Roll));
    aten_meta->impl("logical_or.out", TORCH_FN(LogicalOut));
    aten_meta->impl("logical_and.out", TORCH_FN(LogicalOut));
    aten_meta->impl("abs.out", TORCH_FN(ElementwiseOut));
    aten_meta->impl("logical_not.out", TORCH_FN(ElementwiseOut));
    {
      // LibTorch built with glog logs a warning through it when a kernel is replaced; this
      // replacement is deliberate (Note [Meta resize_]), so keep the user's terminal clean.
#ifdef C10_USE_GLOG
      const int32_t saved_level = FLAGS_minloglevel;
      FLAGS_minloglevel = google::GLOG_ERROR;
#endif
      aten_meta->impl("resize_", TORCH_FN(MetaResize));
#ifdef C10_USE_GLOG
      FLAGS_minloglevel = saved_level;
#endif
    }
  });
}

}  // namespace memsim
