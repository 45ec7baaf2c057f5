#include "models/delayed_wgrad.h"

#include <utility>

#include "models/backward_call.h"
#include "simulator/check.h"

namespace memsim {
namespace {

thread_local c10::intrusive_ptr<WeightGradStore> current_wgrad_store;

}  // namespace

void WeightGradStore::Run() {
  for (std::function<void()>& gemm : gemms_) {
    gemm();
    gemm = nullptr;  // its operands go before the next GEMM runs
  }
  gemms_.clear();
}

DelayedWgradScope::DelayedWgradScope(c10::intrusive_ptr<WeightGradStore> store)
    : previous_(std::exchange(current_wgrad_store, std::move(store))) {}

DelayedWgradScope::~DelayedWgradScope() { current_wgrad_store = std::move(previous_); }

const c10::intrusive_ptr<WeightGradStore>& CurrentWgradStore() { return current_wgrad_store; }

c10::intrusive_ptr<WeightGradStore> NewWgradStore(bool delay) {
  return delay ? c10::make_intrusive<WeightGradStore>() : c10::intrusive_ptr<WeightGradStore>();
}

at::Tensor RunOnBackward(const at::Tensor& x, c10::intrusive_ptr<WeightGradStore> store) {
  MEMSIM_DCHECK(x.requires_grad());
  return CallOnBackward(x, [store = std::move(store)] { store->Run(); });
}

}  // namespace memsim
