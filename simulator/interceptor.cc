#include "simulator/interceptor.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/util/SmallVector.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <mutex>
#include <string>

#include "simulator/op_traits.h"
#include "simulator/recorder.h"
#include "simulator/status.h"
#include "simulator/tracking_allocator.h"

namespace memsim {
namespace {

// The op a dispatcher error says has no Meta kernel (it may be one the failing op
// decomposes into), or "" when the error is about something else. LibTorch 1.x says
// "Could not run 'aten::index_select' with arguments from the 'Meta' backend"; 2.x says
// "aten::flip: attempted to run this operator with Meta tensors, but there was no fake
// impl or Meta kernel registered".
std::string OpWithoutMetaKernel(const std::string& what, const std::string& failing_op) {
  if (what.find("'Meta' backend") != std::string::npos) {
    const size_t open = what.find('\'');
    const size_t close = open == std::string::npos ? open : what.find('\'', open + 1);
    return close == std::string::npos ? failing_op : what.substr(open + 1, close - open - 1);
  }
  // (Earlier 2.x releases say "no abstract impl" where later ones say "no fake impl".)
  const size_t colon = what.find(": attempted to run this operator with Meta tensors");
  if (colon != std::string::npos) return what.substr(0, colon);
  return "";
}

// Ops that allocate their output and write nothing.
bool IsAllocationOnly(const std::string& name) {
  return name == "aten::empty" || name == "aten::empty_strided" || name == "aten::empty_like";
}

// Ops whose first result aliases an input without writing it are views, or may be: `to`,
// `contiguous` and `reshape` return their input when they can and a copy when they cannot.
bool ReturnsView(const c10::FunctionSchema& schema) {
  return !schema.returns().empty() && schema.returns()[0].alias_info() != nullptr &&
         !schema.returns()[0].alias_info()->isWrite();
}

// Operators without registered traits (ATen's own, and ops/ ones with default traits).
OpCostKind ClassifyAtenOp(const c10::FunctionSchema& schema) {
  const std::string& name = schema.name();
  if (name == "aten::mm" || name == "aten::bmm" || name == "aten::addmm" ||
      name == "aten::baddbmm" || name == "aten::addbmm" || name == "aten::matmul" ||
      name == "aten::linear") {
    return OpCostKind::kMatmul;
  }
  // _unsafe_view is a view whose schema says nothing of aliasing (matmul's own reshape of
  // its mm's output, for one): no kernel, and no Python either.
  if (IsAllocationOnly(name) || name == "aten::detach" || name == "aten::lift_fresh" ||
      name == "aten::_unsafe_view") {
    return OpCostKind::kFree;
  }
  if (ReturnsView(schema)) return OpCostKind::kFree;
  return OpCostKind::kMemoryBound;
}

const OpInfo& LookupOp(Recorder& recorder, const c10::OperatorHandle& op) {
  const c10::FunctionSchema& schema = op.schema();
  if (const OpInfo* info = recorder.FindOp(&schema)) return *info;
  std::string name = schema.name();
  if (!schema.overload_name().empty()) name += "." + schema.overload_name();
  const OpTraits* traits = FindOpTraits(schema.name());
  const OpTraits aten{ClassifyAtenOp(schema)};
  const OpTraits& t = traits != nullptr ? *traits : aten;
  return recorder.AddOp(
      &schema, {recorder.names().Intern(name), t.is_collective, t.cost_kind, t.is_attention,
                t.is_attention_backward, schema.name() == "aten::linear",
                IsAllocationOnly(schema.name()), traits == nullptr && ReturnsView(schema)});
}

int64_t TensorBytes(const at::Tensor& t) {
  return t.defined() ? static_cast<int64_t>(t.numel()) * static_cast<int64_t>(t.element_size()) : 0;
}

template <typename Fn>
void ForEachTensor(c10::ArrayRef<c10::IValue> values, Fn&& fn) {
  for (const c10::IValue& v : values) {
    if (v.isTensor()) {
      fn(v.toTensor());
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList().vec()) fn(t);
    }
  }
}

// What an op costs on the recorder's GPU (Note [Virtual clock]).
struct LeafCost {
  double bytes = 0;
  double flops = 0;
  GemmPrecision precision = GemmPrecision::kFp32;
};

GemmPrecision PrecisionOf(const at::Tensor& operand) {
  switch (operand.scalar_type()) {
    case at::kHalf:
    case at::kBFloat16:
      return GemmPrecision::kHalf;
    case at::kByte:  // FP8 data is held as uint8
      return GemmPrecision::kFp8;
    default:
      return GemmPrecision::kFp32;
  }
}

void InterceptorFallback(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                         torch::jit::Stack* stack) {
  const c10::DispatchKeySet below =
      keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kInterceptKey);
  Recorder* recorder = CurrentRecorder();
  if (recorder == nullptr) {
    op.redispatchBoxed(below, stack);
    return;
  }
  const OpInfo& info = LookupOp(*recorder, op);
  // Note [Stand-in kernels]: an allocation standing for a kernel's output costs the kernel.
  OpCostKind cost_kind = info.is_allocation_only && recorder->charges_stand_ins()
                             ? OpCostKind::kMemoryBound
                             : info.cost_kind;
  // A maybe-view's inputs, to tell afterwards whether it copied (a view has one or two),
  // and what a copy reads: its first tensor argument. The caller keeps the inputs alive
  // (redispatching consumes the stack's references), so their storages stay comparable.
  c10::SmallVector<const c10::StorageImpl*, 4> input_storages;
  double copy_read_bytes = 0;
  if (info.may_copy && recorder->gpu() != nullptr) {
    ForEachTensor(torch::jit::last(*stack, op.schema().arguments().size()),
                  [&](const at::Tensor& t) {
                    if (!t.defined() || !t.has_storage()) return;
                    if (input_storages.empty())
                      copy_read_bytes = static_cast<double>(TensorBytes(t));
                    input_storages.push_back(t.storage().unsafeGetStorageImpl());
                  });
  }
  LeafCost cost;
  if (recorder->gpu() != nullptr && cost_kind != OpCostKind::kFree) {
    const auto args = torch::jit::last(*stack, op.schema().arguments().size());
    const at::Tensor* a = nullptr;
    const at::Tensor* b = nullptr;
    for (const c10::IValue& v : args) {
      if (!v.isTensor()) continue;
      a = b;
      b = &v.toTensor();
    }
    if (info.is_attention && a != nullptr) {
      // Causal fused attention over q [B, S, heads, D]: 4*B*S^2*heads*D FLOPs, halved by
      // the causal mask; backward does 2.5x the forward's work.
      const at::Tensor& q = args[info.is_attention_backward ? 1 : 0].toTensor();
      cost.flops = 2.0 * static_cast<double>(q.numel()) * static_cast<double>(q.size(1)) *
                   (info.is_attention_backward ? 2.5 : 1.0);
      cost.precision = PrecisionOf(q);
    } else if (info.is_linear && args.size() >= 2 && args[0].isTensor() && args[1].isTensor()) {
      // aten::linear(input [.., K], weight [N, K], bias): 2 * numel(input) * N.
      const at::Tensor& input = args[0].toTensor();
      cost.flops = 2.0 * static_cast<double>(input.numel()) *
                   static_cast<double>(args[1].toTensor().size(0));
      cost.precision = PrecisionOf(input);
    } else if (cost_kind == OpCostKind::kMatmul && a != nullptr && b->dim() > 0) {
      cost.flops = 2.0 * static_cast<double>(a->numel()) * static_cast<double>(b->sizes().back());
      cost.precision = PrecisionOf(*a);
    } else if (!info.is_allocation_only) {  // a stand-in kernel writes its output only
      ForEachTensor(args, [&](const at::Tensor& t) { cost.bytes += TensorBytes(t); });
    }
  }

  recorder->PushOp(info);
  try {
    // Ops nested inside this one (a composite's decomposition) are not intercepted: the
    // allocations they make belong to this op, and its cost is charged as a whole.
    c10::impl::ExcludeDispatchKeyGuard no_nested(kInterceptKey);
    op.redispatchBoxed(below, stack);
  } catch (const c10::Error& e) {
    const std::string module = recorder->names().Name(recorder->current_module());
    const std::string where = "(called from module '" + (module.empty() ? "<top>" : module) +
                              "' in " + std::string(PhaseName(recorder->phase())) + ")";
    const std::string& op_name = recorder->names().Name(info.name);
    recorder->PopOp(info);
    const std::string what = e.what_without_backtrace();
    const std::string missing = OpWithoutMetaKernel(what, op_name);
    if (!missing.empty()) {
      throw UserError(missing + " has no Meta kernel " + where +
                      "; add one in ops/meta_kernels.cc");
    }
    throw UserError(op_name + " failed on meta tensors " + where + ": " +
                    what.substr(0, what.find('\n')));
  }
  recorder->PopOp(info);

  const auto outputs = torch::jit::last(*stack, op.schema().returns().size());
  bool copied = false;
  ForEachTensor(outputs, [&](const at::Tensor& t) {
    if (!t.defined() || !t.has_storage()) return;
    const int64_t id = TrackingAllocator::StorageIdOf(t.storage().data_ptr(), recorder);
    if (id >= 0) recorder->NoteTensorShape(id, t.sizes(), t.scalar_type());
    if (cost_kind == OpCostKind::kMemoryBound) cost.bytes += TensorBytes(t);
    // A maybe-view that returned a new storage copied its input into it.
    if (info.may_copy && recorder->gpu() != nullptr &&
        std::find(input_storages.begin(), input_storages.end(),
                  t.storage().unsafeGetStorageImpl()) == input_storages.end()) {
      copied = true;
      cost.bytes += copy_read_bytes + static_cast<double>(TensorBytes(t));
    }
  });
  if (copied) cost_kind = OpCostKind::kMemoryBound;
  if (recorder->gpu() == nullptr || cost_kind == OpCostKind::kFree) return;
  const GpuSpec& gpu = *recorder->gpu();
  const double kernel_s = cost_kind == OpCostKind::kMatmul
                              ? MatmulKernelSeconds(gpu, cost.flops, cost.precision)
                              : MemoryBoundKernelSeconds(gpu, cost.bytes);
  recorder->ChargeKernel(kernel_s);
}

std::unique_ptr<at::ObserverContext> OnBackwardNodeStart(const at::RecordFunction& fn) {
  Recorder* recorder = CurrentRecorder();
  if (recorder == nullptr) return nullptr;
  const auto seq = static_cast<uint64_t>(fn.seqNr());
  // AccumulateGrad and other engine-made nodes carry no forward sequence number.
  const bool has_seq = fn.seqNr() >= 0 && seq != std::numeric_limits<uint64_t>::max();
  recorder->PushBackwardNodeModule(has_seq ? recorder->ModuleForSequenceNr(seq)
                                           : recorder->current_module());
  // A node run inside a graphed one (a checkpoint's recomputation) is part of its graph.
  recorder->PushBackwardNodeGraphed((has_seq && recorder->IsGraphedSequenceNr(seq)) ||
                                    recorder->in_graphed_backward_node());
  return nullptr;
}

void OnBackwardNodeEnd(const at::RecordFunction&, at::ObserverContext*) {
  if (Recorder* recorder = CurrentRecorder()) {
    recorder->PopBackwardNodeModule();
    recorder->PopBackwardNodeGraphed();
  }
}

}  // namespace

void RegisterInterceptor() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Lives for the whole process: the dispatcher keeps pointing at the fallback.
    static auto* library =
        new torch::Library(torch::Library::IMPL, "_", kInterceptKey, __FILE__, __LINE__);
    library->fallback(torch::CppFunction::makeFromBoxedFunction<&InterceptorFallback>());
  });
}

InterceptionGuard::InterceptionGuard()
    : include_key_(kInterceptKey),
      backward_callback_(at::addThreadLocalCallback(
          at::RecordFunctionCallback(&OnBackwardNodeStart, &OnBackwardNodeEnd)
              .scopes({at::RecordScope::BACKWARD_FUNCTION}))) {
  RegisterInterceptor();
}

InterceptionGuard::~InterceptionGuard() { at::removeCallback(backward_callback_); }

}  // namespace memsim
