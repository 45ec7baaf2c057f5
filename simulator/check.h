// MEMSIM_DCHECK: internal invariants that only a programming error can break.
//
// Checked in builds without NDEBUG (the Debug build CI runs under the sanitizers, see
// tools/dev.sh sanitize); compiled out of release builds, where the condition is not
// evaluated. A failed check prints the condition and its place and aborts, so that the
// sanitizers and ctest report the broken invariant rather than a wrong number later.
// User input never reaches a DCHECK: it is rejected with a Status first (simulator/status.h).
#pragma once

namespace memsim::internal {

// Prints "memsim: internal check failed: <condition> (<file>:<line>)" and aborts.
[[noreturn]] void DcheckFailed(const char* condition, const char* file, int line);

}  // namespace memsim::internal

#ifdef NDEBUG
// sizeof keeps the condition type-checked (and its variables used) without evaluating it.
#define MEMSIM_DCHECK(condition) static_cast<void>(sizeof(static_cast<bool>(condition)))
#else
#define MEMSIM_DCHECK(condition)      \
  ((condition) ? static_cast<void>(0) \
               : ::memsim::internal::DcheckFailed(#condition, __FILE__, __LINE__))
#endif
