// Overflow-checked 64-bit size arithmetic: a 10-trillion-parameter model on a million
// GPUs must fail loudly, never wrap.
#pragma once

#include <cstdint>
#include <stdexcept>

namespace memsim {

inline int64_t CheckedMul(int64_t a, int64_t b) {
  int64_t out;
  if (__builtin_mul_overflow(a, b, &out)) throw std::overflow_error("memsim: int64 size overflow");
  return out;
}

inline int64_t CheckedAdd(int64_t a, int64_t b) {
  int64_t out;
  if (__builtin_add_overflow(a, b, &out)) throw std::overflow_error("memsim: int64 size overflow");
  return out;
}

// `value` rounded up to a multiple of `multiple`. REQUIRES: value >= 0, multiple > 0.
inline int64_t CheckedRoundUp(int64_t value, int64_t multiple) {
  return CheckedMul((CheckedAdd(value, multiple - 1)) / multiple, multiple);
}

}  // namespace memsim
