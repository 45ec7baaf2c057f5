// PortableAllocator: the c10::Allocator interface in the form every LibTorch memsim builds
// against accepts.
//
// Note [Allocator API across LibTorch versions]
// c10::Allocator::allocate is `const` in LibTorch 1.13 (Debian's, which memsim's CI builds
// against) and non-const from 2.3 on, which also made copy_data (the copy behind
// Storage clones) pure virtual. memsim must build against both: a CUDA 2.x LibTorch is
// what users of a GPU machine have. PortableAllocator declares both forms of allocate
// and a copy_data, so whichever the base declares is overridden, and a subclass
// implements Allocate once. (Checked by building against LibTorch 1.13.1 here and
// 2.11.0+cu130 on a GPU machine: tools/gpu/README.md.)
#pragma once

#include <c10/core/Allocator.h>

#include <cstddef>
#include <cstring>

namespace memsim {

class PortableAllocator : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) const { return Allocate(n); }  // LibTorch < 2.3
  c10::DataPtr allocate(size_t n) { return Allocate(n); }        // LibTorch >= 2.3

  // Meta storages have null data pointers and nothing to copy; real (CPU) ones are
  // plain host memory.
  void copy_data(void* dest, const void* src, std::size_t count) const {
    if (count > 0 && dest != nullptr && src != nullptr) std::memcpy(dest, src, count);
  }

 protected:
  virtual c10::DataPtr Allocate(size_t n) const = 0;
};

}  // namespace memsim
