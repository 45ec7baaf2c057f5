#include "models/fp8.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "ops/collectives.h"
#include "ops/transformer_kernels.h"
#include "simulator/check.h"
#include "simulator/session.h"

namespace memsim {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::Function;
using torch::autograd::variable_list;

constexpr int64_t kBlock = 128;      // blockwise scaling's block length
constexpr int64_t kMxfp8Block = 32;  // MXFP8's block length (one E8M0 scale per 32 values)

int64_t CeilDiv(int64_t x, int64_t d) { return (x + d - 1) / d; }
int64_t RoundUp(int64_t x, int64_t m) { return CeilDiv(x, m) * m; }
int64_t Rows(const at::Tensor& t) { return t.numel() / t.size(-1); }

at::Tensor Fp8Bytes(int64_t rows, int64_t cols) {
  return at::empty({rows, cols}, at::TensorOptions().device(at::kMeta).dtype(at::kByte));
}
at::Tensor Fp32(std::vector<int64_t> shape) {
  return at::empty(shape, at::TensorOptions().device(at::kMeta).dtype(at::kFloat));
}
// MXFP8's E8M0 scales: one byte each.
at::Tensor Uint8(std::vector<int64_t> shape) {
  return at::empty(shape, at::TensorOptions().device(at::kMeta).dtype(at::kByte));
}

// MXFP8's scale shapes for `groups` tensors of rows/groups rows each (GroupedLinear's
// experts, each quantized alone): rowwise 1x32 blocks padded to 128 rows and 4 blocks,
// columnwise 32x1 blocks padded to 4 blocks and 128 columns (quantizer.cpp get_scale_shape).
at::Tensor Mxfp8RowwiseScales(int64_t rows, int64_t cols, int64_t groups = 1) {
  return Uint8(
      {groups * RoundUp(CeilDiv(rows, groups), 128), RoundUp(CeilDiv(cols, kMxfp8Block), 4)});
}
at::Tensor Mxfp8ColumnwiseScales(int64_t rows, int64_t cols, int64_t groups = 1) {
  return Uint8(
      {groups * RoundUp(CeilDiv(CeilDiv(rows, groups), kMxfp8Block), 4), RoundUp(cols, 128)});
}

// The copy of compact MXFP8 scales that te_general_gemm swizzles into the GEMM's layout
// after making its output, alive until the GEMM returns (swizzle_scales_for_gemm): called
// right after the GEMM that reads them, it is made and freed there. Scales quantized for a
// GEMM are written swizzled already; those of an all-gather (compact, so that rows
// concatenate) are not. Does nothing for an undefined tensor.
void SwizzleForGemm(const at::Tensor& compact_scales) {
  if (compact_scales.defined()) Uint8(compact_scales.sizes().vec());
}

// Whether `fp8`'s columnwise data is a tensor of its own: not for a per-tensor recipe on a
// GPU whose FP8 GEMMs read any layout (Float8Quantizer::create_tensor: the rowwise data
// serves both), always for blockwise (its columnwise scales differ) and MXFP8.
bool HasTransposes(const Fp8Module& fp8) {
  const bool per_tensor = fp8.recipe == Fp8Recipe::kDelayed || fp8.recipe == Fp8Recipe::kTensorwise;
  return !per_tensor || !fp8.any_layout_gemm;
}

// A quantized [rows, cols] tensor as Transformer Engine's storage classes hold it (Note
// [FP8 training]); a part is undefined when its usage was not asked for or was dropped.
struct Fp8Tensor {
  at::Tensor data;        // rowwise [rows, cols]
  at::Tensor columnwise;  // the transpose [cols, rows]; MXFP8: [rows, cols], not transposed
  at::Tensor scale_inv;   // per-tensor: the one scale; blockwise, MXFP8: the rowwise scales
  at::Tensor columnwise_scale_inv;  // blockwise and MXFP8 only

  // update_usage(rowwise_usage=False, columnwise_usage=True): a per-tensor scale stays, the
  // transpose needs it; without transposes the data itself is the columnwise data.
  void DropRowwise(const Fp8Module& fp8) {
    if (!HasTransposes(fp8)) return;
    data.reset();
    if (fp8.recipe == Fp8Recipe::kBlockwise || fp8.recipe == Fp8Recipe::kMxfp8) scale_inv.reset();
  }
  // The tensor as a [rows, cols] GEMM operand, for its shape.
  at::Tensor Operand(Fp8Recipe recipe) const {
    if (data.defined()) return data;
    return recipe == Fp8Recipe::kMxfp8 ? columnwise : columnwise.t();
  }
};

// What TE's quantizer allocates for a [rows, cols] tensor with these usages; `weight`:
// blockwise 128x128 blocks instead of 1x128; `groups`: MXFP8 scales per group of rows.
Fp8Tensor Quantize(int64_t rows, int64_t cols, const Fp8Module& fp8, bool rowwise, bool columnwise,
                   bool weight = false, int64_t groups = 1) {
  const Fp8Recipe recipe = fp8.recipe;
  Fp8Tensor q;
  if (recipe == Fp8Recipe::kMxfp8) {
    // Both usages in the same layout, each with its own scales; no amax, no scale.
    if (rowwise) {
      q.data = Fp8Bytes(rows, cols);
      q.scale_inv = Mxfp8RowwiseScales(rows, cols, groups);
    }
    if (columnwise) {
      q.columnwise = Fp8Bytes(rows, cols);
      q.columnwise_scale_inv = Mxfp8ColumnwiseScales(rows, cols, groups);
    }
    return q;
  }
  if (!HasTransposes(fp8)) {
    rowwise = rowwise || columnwise;
    columnwise = false;
  }
  if (rowwise) q.data = Fp8Bytes(rows, cols);
  if (columnwise) q.columnwise = Fp8Bytes(cols, rows);
  if (recipe != Fp8Recipe::kBlockwise) {
    q.scale_inv = Fp32({1});
    // Tensorwise: the amax and scale of this quantization, dropped after it.
    [[maybe_unused]] const at::Tensor amax_and_scale =
        recipe == Fp8Recipe::kTensorwise ? Fp32({2}) : at::Tensor();
    return q;
  }
  if (rowwise) {
    q.scale_inv = weight ? Fp32({CeilDiv(rows, kBlock), RoundUp(CeilDiv(cols, kBlock), 4)})
                         : Fp32({CeilDiv(cols, kBlock), RoundUp(rows, 4)});
  }
  if (columnwise) {
    q.columnwise_scale_inv = weight
                                 ? Fp32({CeilDiv(cols, kBlock), RoundUp(CeilDiv(rows, kBlock), 4)})
                                 : Fp32({CeilDiv(rows, kBlock), RoundUp(cols, 4)});
  }
  return q;
}

// A tensor's own bytes (not its storage's); 0 for an undefined one.
double BytesOf(const at::Tensor& t) { return t.defined() ? static_cast<double>(t.nbytes()) : 0; }

// An activation's or gradient's quantization, with its kernels on the clock (Note [FP8
// kernels on the clock]).
Fp8Tensor Quantize(const at::Tensor& x, const Fp8Module& fp8, bool rowwise, bool columnwise,
                   int64_t groups = 1) {
  Fp8Tensor q = Quantize(Rows(x), x.size(-1), fp8, rowwise, columnwise, /*weight=*/false, groups);
  // The cast reads the input and writes the quantized tensor; current scaling's amax
  // reads the input once more.
  const double input_reads = fp8.recipe == Fp8Recipe::kTensorwise ? 2 : 1;
  ChargeMemoryBoundKernel(input_reads * BytesOf(x) + BytesOf(q.data) + BytesOf(q.columnwise) +
                          BytesOf(q.scale_inv) + BytesOf(q.columnwise_scale_inv));
  return q;
}

// gather_along_first_dim of a quantized shard's rowwise data into a fresh tensor, or
// into a userbuffer (Note [Userbuffers]; per-tensor recipes only).
Fp8Tensor GatherRowwise(const Fp8Tensor& shard, Fp8Recipe recipe, int64_t group,
                        bool into_userbuffer = false) {
  Fp8Tensor total;
  if (into_userbuffer) {
    MEMSIM_DCHECK(recipe != Fp8Recipe::kBlockwise && recipe != Fp8Recipe::kMxfp8);
    total.data = AllGatherIntoUserbuffer(shard.data, group);
    total.scale_inv = shard.scale_inv;
    return total;
  }
  total.data = AllGather(shard.data, group);
  if (recipe == Fp8Recipe::kMxfp8) {
    // _all_gather_mxfp8: the scales gathered straight into the output's compact scales.
    total.scale_inv = Mxfp8RowwiseScales(total.data.size(0), total.data.size(1));
  } else if (recipe == Fp8Recipe::kBlockwise) {
    // The full rowwise scales, gathered through a temporary of the same size.
    [[maybe_unused]] const at::Tensor interleaved = AllGather(shard.scale_inv, group);
    total.scale_inv = Fp32({shard.scale_inv.size(0), shard.scale_inv.size(1) * group});
  } else {
    // make_empty's scale_inv, replaced by the shard's.
    [[maybe_unused]] const at::Tensor replaced_scale = Fp32({1});
    total.scale_inv = shard.scale_inv;
  }
  return total;
}

// MXFP8's columnwise data of a sequence-parallel shard gathered along the rows, with its
// compact scales (_all_gather_mxfp8).
Fp8Tensor GatherMxfp8Columnwise(const Fp8Tensor& shard, int64_t group) {
  Fp8Tensor total;
  total.columnwise = AllGather(shard.columnwise, group);
  total.columnwise_scale_inv =
      Mxfp8ColumnwiseScales(total.columnwise.size(0), total.columnwise.size(1));
  return total;
}

// The columnwise data a GEMM reads the other way (update_usage(columnwise_usage=True));
// nothing where the rowwise data serves (HasTransposes).
// REQUIRES: not MXFP8 (its columnwise data is quantized, not transposed).
void AddTranspose(Fp8Tensor& q, const Fp8Module& fp8) {
  const Fp8Recipe recipe = fp8.recipe;
  MEMSIM_DCHECK(recipe != Fp8Recipe::kMxfp8);
  if (!HasTransposes(fp8)) return;
  const int64_t rows = q.data.size(0), cols = q.data.size(1);
  q.columnwise = Fp8Bytes(cols, rows);
  ChargeMemoryBoundKernel(2 * BytesOf(q.data));  // the transpose (Note [FP8 kernels on the clock])
  if (recipe == Fp8Recipe::kBlockwise) {
    q.columnwise_scale_inv = Fp32({CeilDiv(rows, kBlock), RoundUp(cols, 4)});
  }
}

// The module's FP8 weight, [rows, cols] with its transpose and scales: the FP8
// parameter, or TE's cached FP8 copy.
void CreateFp8Weight(Fp8Module& module, int64_t rows, int64_t cols) {
  CategoryScope category(Category::kParameter);
  const Fp8Tensor q = Quantize(rows, cols, module, true, true, /*weight=*/true);
  module.weight = {q.data, q.columnwise, q.scale_inv};
  if (q.columnwise_scale_inv.defined()) module.weight.push_back(q.columnwise_scale_inv);
}

// The delayed recipe's state (init_fp8_metadata; forward slots for input, weight and
// output, backward slots for two gradients).
void InitScalingState(Fp8Module& module) {
  if (module.recipe != Fp8Recipe::kDelayed) return;
  CategoryScope category(Category::kParameter);
  for (int64_t slots : {3, 2}) {
    module.scaling_state.push_back(Fp32({slots}));
    module.scaling_state.push_back(Fp32({module.amax_history_len, slots}));
  }
}

// Copies of what the layer's backward needs: a linear's Parameter may not outlive its
// forward (GroupedLinear's expert block).
struct Fp8LinearState : public torch::CustomClassHolder {
  Fp8Module fp8;  // the FP8 weight's tensors (made with the parameter)
  ParameterStore* store = nullptr;
  at::Tensor weight_main_grad;
  at::Tensor bias_main_grad;  // undefined without a bias
  LinearParallelism parallelism;
  Fp8LinearOptions options;
  at::ScalarType dtype = at::kBFloat16;  // the 16-bit weight's: GEMM outputs and gradients
  std::vector<int64_t> input_sizes;
};

struct Fp8LinearFunction : public Function<Fp8LinearFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            const c10::optional<at::Tensor>& bias,
                            c10::intrusive_ptr<Fp8LinearState> state) {
    const Fp8Module& fp8 = state->fp8;
    const Fp8Recipe recipe = fp8.recipe;
    const bool blockwise = recipe == Fp8Recipe::kBlockwise;
    const bool mxfp8 = recipe == Fp8Recipe::kMxfp8;
    const Fp8LinearOptions& options = state->options;
    const int64_t groups = options.row_groups;
    const int64_t gather = state->parallelism.gather_input_group;
    const at::Tensor weight_operand = state->fp8.weight[0].t();  // [K, N]
    const auto release_norm_output = [&] {
      if (!options.input_is_fused_norm_output) return;
      MEMSIM_DCHECK(input.storage().nbytes() == input.nbytes());  // the norm's own output
      FreeStorage(input.storage());
    };
    Fp8Tensor kept;
    at::Tensor out;
    // The GEMM on the gathered rowwise data of a quantized shard (the gather dies with it).
    const auto gather_and_gemm = [&](const Fp8Tensor& shard) {
      const Fp8Tensor total =
          GatherRowwise(shard, recipe, gather, state->parallelism.userbuffer_gather);
      at::Tensor result = Fp8Gemm(total.data, weight_operand, input.scalar_type());
      if (mxfp8) SwizzleForGemm(total.scale_inv);
      return result;
    };
    // Megatron keeps the 16-bit input of linear_proj, the experts' fc2, the shared experts'
    // fc1 (which gathers it under sequence parallelism: Transformer Engine quantizes the
    // shard, gathers that for the GEMM and keeps the 16-bit shard) and MLA's down projections.
    if (options.save_original_input) {
      const Fp8Tensor q = Quantize(input, fp8, /*rowwise=*/true, /*columnwise=*/false, groups);
      out = gather > 1 ? gather_and_gemm(q) : Fp8Gemm(q.data, weight_operand, input.scalar_type());
    } else if (gather > 1) {
      // MXFP8 cannot make columnwise data from gathered rowwise data: the shard is
      // quantized both ways, as blockwise does.
      kept = Quantize(input, fp8, true, /*columnwise=*/blockwise || mxfp8);
      release_norm_output();
      out = gather_and_gemm(kept);
      if (blockwise || mxfp8) kept.DropRowwise(fp8);
    } else {
      kept = Quantize(input, fp8, true, true, groups);
      release_norm_output();
      out = Fp8Gemm(kept.data, weight_operand, input.scalar_type());
      kept.DropRowwise(fp8);
    }
    // The GEMM adds the bias in its epilogue.
    std::vector<int64_t> out_sizes = input.sizes().vec();
    out_sizes[0] *= gather;
    out_sizes.back() = weight.size(0);
    // Not a view: the caller may reduce it in place (as matmul's own reshape).
    out = at::_unsafe_view(out, out_sizes);
    if (options.reduce_scatter_output_group > 1) {
      out = ReduceScatter(out, options.reduce_scatter_output_group);
    }
    state->input_sizes = input.sizes().vec();
    ctx->save_for_backward({kept.data, kept.columnwise, kept.scale_inv, kept.columnwise_scale_inv,
                            options.save_original_input ? input : at::Tensor()});
    ctx->saved_data["state"] = c10::IValue::make_capsule(std::move(state));
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto state =
        c10::static_intrusive_pointer_cast<Fp8LinearState>(ctx->saved_data["state"].toCapsule());
    const Fp8Module& fp8 = state->fp8;
    const Fp8Recipe recipe = fp8.recipe;
    const bool blockwise = recipe == Fp8Recipe::kBlockwise;
    const bool mxfp8 = recipe == Fp8Recipe::kMxfp8;
    const Fp8LinearOptions& options = state->options;
    const int64_t groups = options.row_groups;
    const LinearParallelism& parallelism = state->parallelism;
    const int64_t gather = parallelism.gather_input_group;
    // Autograd holds the saved tensors and the 16-bit output gradient until this returns.
    const variable_list saved = ctx->get_saved_variables();
    const Fp8Tensor kept{saved[0], saved[1], saved[2], saved[3]};
    const at::Tensor& original_input = saved[4];

    // The output gradient, quantized both ways. MXFP8 gathers both usages of the shard
    // (compact scales, swizzled at each GEMM) instead of building a transpose.
    const at::Tensor& grad_output = grads[0];
    const int64_t scatter = options.reduce_scatter_output_group;
    Fp8Tensor go;
    if (scatter > 1 && mxfp8) {
      Fp8Tensor local = Quantize(grad_output, fp8, true, true);
      go = GatherRowwise(local, recipe, scatter, /*into_userbuffer=*/false);
      Fp8Tensor columnwise = GatherMxfp8Columnwise(local, scatter);
      go.columnwise = std::move(columnwise.columnwise);
      go.columnwise_scale_inv = std::move(columnwise.columnwise_scale_inv);
      local = {};
    } else if (scatter > 1) {
      Fp8Tensor local = Quantize(grad_output, fp8, true, false);
      go = GatherRowwise(local, recipe, scatter, parallelism.userbuffer_gather);
      local = {};
      AddTranspose(go, fp8);
    } else {
      go = Quantize(grad_output, fp8, true, true, groups);
    }
    const bool go_compact = mxfp8 && scatter > 1;
    const int64_t N = go.data.size(1);

    // The input the weight gradient reads, columnwise. A kept 16-bit input is quantized
    // again, and with a gather its shard is gathered as a quantized shard would be.
    Fp8Tensor total_input;
    bool input_compact = false;
    Fp8Tensor requantized;
    if (original_input.defined() && gather > 1) {
      requantized = Quantize(original_input, fp8, /*rowwise=*/true,
                             /*columnwise=*/blockwise || mxfp8, groups);
    }
    const Fp8Tensor& shard = requantized.data.defined() ? requantized : kept;
    if (original_input.defined() && gather == 1) {
      total_input = Quantize(original_input, fp8, /*rowwise=*/!blockwise && !mxfp8, true, groups);
    } else if (gather > 1 && mxfp8) {
      // Straight into columnwise data; waited for after the dgrad GEMM.
      total_input = GatherMxfp8Columnwise(shard, gather);
      input_compact = true;
    } else if (gather > 1 && !blockwise) {
      // Waited for after the dgrad GEMM.
      total_input = GatherRowwise(shard, recipe, gather, parallelism.userbuffer_bulk_dgrad);
    } else if (gather > 1) {
      // The columnwise shards and their scales gathered through interleaved temporaries
      // (the gathered shards lie along the columns of [K, M]).
      [[maybe_unused]] const at::Tensor interleaved = AllGather(shard.columnwise, gather);
      [[maybe_unused]] const at::Tensor interleaved_scales =
          AllGather(shard.columnwise_scale_inv, gather);
      const int64_t K = shard.columnwise.size(0), M = shard.columnwise.size(1) * gather;
      total_input.columnwise = Fp8Bytes(K, M);
      total_input.columnwise_scale_inv = Fp32({CeilDiv(M, kBlock), RoundUp(K, 4)});
    } else {
      total_input = kept;
    }
    requantized = {};  // the gathered copy is what the GEMM reads

    // dgrad [M, K], reduced over the tensor-parallel group as in 16 bits.
    const at::Tensor& weight_data = state->fp8.weight[0];  // [N, K]
    std::vector<int64_t> total_sizes = state->input_sizes;
    total_sizes[0] *= gather;
    at::Tensor dgrad;
    if (parallelism.userbuffer_bulk_wgrad && gather > 1) {
      // Into a userbuffer, reduce-scattered from there during the wgrad GEMM.
      dgrad = UserbufferView({go.data.size(0), weight_data.size(1)}, state->dtype);
      Fp8GemmInto(go.data, weight_data, dgrad);
    } else {
      dgrad = Fp8Gemm(go.data, weight_data, state->dtype);
      if (go_compact) SwizzleForGemm(go.scale_inv);
    }
    dgrad = dgrad.view(total_sizes);
    if (gather > 1 && !blockwise && !mxfp8) AddTranspose(total_input, fp8);
    at::Tensor grad_input = dgrad;
    if (gather > 1) {
      grad_input = ReduceScatter(dgrad, gather);
    } else if (parallelism.all_reduce_input_grad_group > 1) {
      AllReduceInPlace(dgrad, parallelism.all_reduce_input_grad_group);
    }

    // wgrad: into main_grad in place, or a new 16-bit gradient the DDP hook adds.
    const at::Tensor input_operand = total_input.Operand(recipe);  // [M, K]
    const at::Tensor go_operand = go.Operand(recipe);              // [M, N]
    // A linear gathers its input or its output gradient, not both: at most one copy.
    const at::Tensor compact = go_compact      ? go.columnwise_scale_inv
                               : input_compact ? total_input.columnwise_scale_inv
                                               : at::Tensor();
    if (state->store->gradient_accumulation_fusion()) {
      WgradGemmAccumulate(state->weight_main_grad, input_operand, go_operand);
      SwizzleForGemm(compact);
      if (state->weight_main_grad.defined()) {
        state->store->DummyWgrad({weight_data.size(0), weight_data.size(1)});
      }
    } else {
      const at::Tensor wgrad = Fp8Gemm(go_operand.t(), input_operand, state->dtype);
      SwizzleForGemm(compact);
      AccumulateIntoMainGrad(state->weight_main_grad, wgrad);
    }
    if (state->bias_main_grad.defined()) {
      AccumulateIntoMainGrad(
          state->bias_main_grad,
          at::empty({N}, at::TensorOptions().device(at::kMeta).dtype(state->dtype)));
    }
    return {grad_input, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

void MakeFp8Weight(Parameter* weight, const TrainingConfig& training) {
  MEMSIM_DCHECK(training.fp8 != Fp8Recipe::kNone && weight->fp8.recipe == Fp8Recipe::kNone);
  weight->fp8.recipe = training.fp8;
  weight->fp8.fp8_param = training.fp8_param_gather;
  weight->fp8.amax_history_len = training.fp8_amax_history_len;
  weight->fp8.any_layout_gemm = training.fp8_gemm_any_layout;
  // Made here rather than in the module's first forward (Note [FP8 training]).
  CreateFp8Weight(weight->fp8, weight->data.size(0), weight->data.size(1));
  InitScalingState(weight->fp8);
  // quantized_model_init: the 16-bit weight TE initialised (a host copy is kept for the
  // optimizer's masters) quantized with its transpose, then freed on the GPU.
  if (training.fp8_param_gather) FreeStorage(weight->data.storage());
}

at::Tensor Fp8Linear(const at::Tensor& input, Parameter& weight, Parameter* bias,
                     const LinearParallelism& parallelism, const Fp8LinearOptions& options) {
  MEMSIM_DCHECK(weight.fp8.recipe != Fp8Recipe::kNone);
  MEMSIM_DCHECK(!weight.fp8.weight.empty());  // made with the parameter (MakeFp8Weight)
  auto state = c10::make_intrusive<Fp8LinearState>();
  state->fp8 = weight.fp8;
  state->store = weight.store;
  state->weight_main_grad = weight.main_grad;
  state->dtype = weight.data.scalar_type();
  if (bias != nullptr) state->bias_main_grad = bias->main_grad;
  state->parallelism = parallelism;
  state->options = options;
  // Transformer Engine refuses save_original_input with the delayed recipe, and Megatron
  // asks for it only with the others.
  state->options.save_original_input =
      options.save_original_input && weight.fp8.recipe != Fp8Recipe::kDelayed;
  return Fp8LinearFunction::apply(
      input, weight.data, bias != nullptr ? c10::optional<at::Tensor>(bias->data) : c10::nullopt,
      std::move(state));
}

void CastMastersToFp8Parameters(const std::vector<at::Tensor>& masters, const Fp8Module& fp8) {
  if (masters.empty()) return;
  CategoryScope category(Category::kTemporary);
  std::vector<at::Tensor> copies;  // held until every shard is cast
  for (const at::Tensor& master : masters) copies.push_back(master.to(at::kBFloat16));
  const int64_t count = static_cast<int64_t>(masters.size());
  [[maybe_unused]] const at::Tensor packed_amaxes = Fp32({count});
  std::vector<at::Tensor> scales;
  if (fp8.recipe == Fp8Recipe::kTensorwise) {
    for (int64_t i = 0; i < count; ++i) scales.push_back(Fp32({1}));
  }
  // Each shard's cast writes its FP8 bytes into the parameter buffer and makes a transpose
  // of the shard it drops (the full transpose is rebuilt in place after the all-gather);
  // none where the GPU needs no transposes (update_quantized's convert_and_update_tensor).
  if (!HasTransposes(fp8)) return;
  for (const at::Tensor& copy : copies) {
    [[maybe_unused]] const at::Tensor shard_transpose = Fp8Bytes(1, copy.numel());
  }
}

}  // namespace memsim
