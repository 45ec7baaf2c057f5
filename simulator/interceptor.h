// The dispatcher-level interceptor: sees every ATen op of forward, backward and the
// optimizer step while an InterceptionGuard is alive on the thread.
//
// Note [Interception]
// A boxed fallback is registered once on a dispatch key no real backend uses
// (kInterceptKey). InterceptionGuard includes that key in the thread-local dispatch key
// set, so every op called on this thread, including the ops autograd runs in backward,
// passes through the fallback before being redispatched to the keys below it. The ops a
// composite op decomposes into run with the key excluded: they belong to the composite
// (measured: intercepting them too cost a third more time per layer). For each op the
// fallback
//   * pushes the op on the recorder's op stack, so allocations know their op;
//   * charges the op to the virtual clock (cost_model.h);
//   * records the shape and dtype of output tensors whose storage is new;
//   * turns "no Meta kernel" failures into a UserError naming the op and the module.
//
// Note [Backward attribution]
// An allocation in backward belongs to the module whose forward created the autograd
// node that is running. Nodes get consecutive sequence numbers as they are created, so
// the recorder keeps (sequence number, module) change points whenever the current module
// changes; a RecordFunction callback on BACKWARD_FUNCTION scope looks the running
// node's sequence number up and makes its module current while the node runs.
#pragma once

#include <ATen/record_function.h>
#include <c10/core/DispatchKey.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

namespace memsim {

inline constexpr c10::DispatchKey kInterceptKey = c10::DispatchKey::TESTING_ONLY_GenericMode;

// Registers the fallback with the dispatcher. Idempotent and thread-safe.
void RegisterInterceptor();

// While alive, ops on this thread go through the interceptor and backward nodes are
// attributed (to the thread's current recorder; with none, ops pass through untouched).
// Keep it alive across backward(). Not copyable or movable: it is tied to the thread.
class InterceptionGuard {
 public:
  InterceptionGuard();
  ~InterceptionGuard();
  InterceptionGuard(const InterceptionGuard&) = delete;
  InterceptionGuard& operator=(const InterceptionGuard&) = delete;
  InterceptionGuard(InterceptionGuard&&) = delete;
  InterceptionGuard& operator=(InterceptionGuard&&) = delete;

 private:
  c10::impl::IncludeDispatchKeyGuard include_key_;
  at::CallbackHandle backward_callback_;
};

}  // namespace memsim
