#include "ops/collectives.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <mutex>

#include "simulator/checked_math.h"
#include "simulator/op_traits.h"
#include "simulator/portable_allocator.h"

namespace memsim {
namespace {

at::Tensor& AllReduceMeta(at::Tensor& t, int64_t) { return t; }

at::Tensor AllGatherMeta(const at::Tensor& t, int64_t group) {
  std::vector<int64_t> sizes = t.sizes().vec();
  sizes[0] *= group;
  return at::empty(sizes, t.options());
}

at::Tensor ReduceScatterMeta(const at::Tensor& t, int64_t group) {
  TORCH_CHECK(t.size(0) % group == 0, "reduce_scatter: dim 0 (", t.size(0),
              ") is not divisible by the group size ", group);
  std::vector<int64_t> sizes = t.sizes().vec();
  sizes[0] /= group;
  return at::empty(sizes, t.options());
}

at::Tensor AllToAllMeta(const at::Tensor& t, int64_t, int64_t rows) {
  std::vector<int64_t> sizes = t.sizes().vec();
  sizes[0] = rows;
  return at::empty(sizes, t.options());
}
void SendMeta(const at::Tensor&) {}
at::Tensor& RecvMeta(at::Tensor& t) { return t; }

template <typename Signature>
c10::TypedOperatorHandle<Signature> Op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

}  // namespace

void RegisterCollectives() {
  static std::once_flag once;
  std::call_once(once, [] {
    static auto* def =
        new torch::Library(torch::Library::FRAGMENT, "memsim", c10::nullopt, __FILE__, __LINE__);
    def->def("comm_all_reduce_(Tensor(a!) t, int group) -> Tensor(a!)");
    def->def("comm_all_gather(Tensor t, int group) -> Tensor");
    def->def("comm_reduce_scatter(Tensor t, int group) -> Tensor");
    def->def("comm_all_to_all(Tensor t, int group, int rows) -> Tensor");
    def->def("comm_send(Tensor t) -> ()");
    def->def("comm_recv_(Tensor(a!) t) -> Tensor(a!)");
    for (const char* op : {"comm_all_reduce_", "comm_all_gather", "comm_reduce_scatter",
                           "comm_all_to_all", "comm_send", "comm_recv_"}) {
      OpTraits traits;
      traits.is_collective = true;
      RegisterOpTraits(std::string("memsim::") + op, traits);
    }
    static auto* meta = new torch::Library(torch::Library::IMPL, "memsim", c10::DispatchKey::Meta,
                                           __FILE__, __LINE__);
    meta->impl("comm_all_reduce_", TORCH_FN(AllReduceMeta));
    meta->impl("comm_all_gather", TORCH_FN(AllGatherMeta));
    meta->impl("comm_reduce_scatter", TORCH_FN(ReduceScatterMeta));
    meta->impl("comm_all_to_all", TORCH_FN(AllToAllMeta));
    meta->impl("comm_send", TORCH_FN(SendMeta));
    meta->impl("comm_recv_", TORCH_FN(RecvMeta));
    // Their gradients are the parallel layers' business (parallel/regions/tensor_parallel.cc).
    static auto* autograd = new torch::Library(torch::Library::IMPL, "memsim",
                                               c10::DispatchKey::Autograd, __FILE__, __LINE__);
    for (const char* op : {"comm_all_reduce_", "comm_all_gather", "comm_reduce_scatter",
                           "comm_all_to_all", "comm_send", "comm_recv_"}) {
      autograd->impl(op, torch::CppFunction::makeFallthrough());
    }
  });
}

at::Tensor AllReduceInPlace(const at::Tensor& t, int64_t group_size) {
  static const auto op = Op<at::Tensor&(at::Tensor&, int64_t)>("memsim::comm_all_reduce_");
  at::Tensor out = t;
  return op.call(out, group_size);
}

at::Tensor AllGather(const at::Tensor& t, int64_t group_size) {
  static const auto op = Op<at::Tensor(const at::Tensor&, int64_t)>("memsim::comm_all_gather");
  return op.call(t, group_size);
}

at::Tensor ReduceScatter(const at::Tensor& t, int64_t group_size) {
  static const auto op = Op<at::Tensor(const at::Tensor&, int64_t)>("memsim::comm_reduce_scatter");
  return op.call(t, group_size);
}

at::Tensor AllToAll(const at::Tensor& t, int64_t group_size, int64_t output_rows) {
  static const auto op =
      Op<at::Tensor(const at::Tensor&, int64_t, int64_t)>("memsim::comm_all_to_all");
  return op.call(t, group_size, output_rows);
}

void Send(const at::Tensor& t) {
  static const auto op = Op<void(const at::Tensor&)>("memsim::comm_send");
  op.call(t);
}

void ReceiveInto(const at::Tensor& t) {
  static const auto op = Op<at::Tensor&(at::Tensor&)>("memsim::comm_recv_");
  at::Tensor out = t;
  op.call(out);
}

// Hands out userbuffer views' storages: none is ever dereferenced (meta), and a DataPtr
// without a context is never reported freed.
class UserbufferAllocator final : public PortableAllocator {
 public:
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }

 private:
  c10::DataPtr Allocate(size_t) const override { return {Address(), c10::Device(at::kMeta)}; }
  static void* Address() {
    static char userbuffer;
    return &userbuffer;
  }
};

at::Tensor UserbufferView(at::IntArrayRef sizes, at::ScalarType dtype) {
  // A storage that no tracked allocator made, as torch::from_blob wraps the userbuffer.
  static UserbufferAllocator allocator;
  const auto options = at::TensorOptions().device(at::kMeta).dtype(dtype);
  std::vector<int64_t> strides(sizes.size(), 1);
  int64_t numel = 1;
  for (size_t d = sizes.size(); d-- > 0;) {
    strides[d] = numel;
    numel = CheckedMul(numel, sizes[d]);
  }
  const int64_t nbytes = CheckedMul(numel, static_cast<int64_t>(c10::elementSize(dtype)));
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes,
                       allocator.allocate(static_cast<size_t>(nbytes)), &allocator,
                       /*resizable=*/true);
  return at::empty({0}, options).set_(storage, 0, sizes, strides);
}

int64_t UserbufferBytes(int64_t rows, int64_t hidden, bool fp8_mode, bool sixteen_bit_mode) {
  constexpr int64_t kControlBytes = 3223808 + 131072;  // LOCALSIZE region, flags
  const int64_t per_value = (fp8_mode ? 16 : 0) + (sixteen_bit_mode ? 24 : 0);
  return CheckedAdd(CheckedMul(CheckedMul(rows, hidden), per_value), kControlBytes);
}

at::Tensor AllGatherIntoUserbuffer(const at::Tensor& t, int64_t group_size) {
  std::vector<int64_t> sizes = t.sizes().vec();
  sizes[0] *= group_size;
  at::Tensor gathered = UserbufferView(sizes, t.scalar_type());
  ReceiveInto(gathered);  // stands for the ring exchange writing the shards in place
  return gathered;
}

}  // namespace memsim
