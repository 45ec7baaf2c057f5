// TrackingAllocator: a c10::Allocator that reports every storage allocation and free
// to the current thread's Recorder.
//
// Note [Seeing every allocation]
// Every meta tensor gets its storage from c10::GetAllocator(kMeta): empty tensors, op
// outputs, contiguous() copies, out= variants. Views allocate nothing. We replace that
// allocator once per process and put an AllocationRecord in each DataPtr's context:
// c10 calls a DataPtr's deleter only when the context is non-null, so the free of every
// tracked storage (including autograd-saved tensors released during backward) reaches
// us. Zero-byte storages are not tracked, as the CUDA caching allocator hands out
// nullptr for them without allocating.
#pragma once

#include <ATen/core/TensorBase.h>

#include "simulator/portable_allocator.h"
#include "simulator/recorder.h"

namespace memsim {

class TrackingAllocator final : public PortableAllocator {
 public:
  // `underlying` provides the real memory (the default CPU allocator), or null for
  // meta, where nothing is ever dereferenced and data pointers stay null.
  TrackingAllocator(c10::DeviceType device_type, c10::Allocator* underlying);

  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }

  // The storage id of a DataPtr this allocator made for `recorder`, or -1.
  static int64_t StorageIdOf(const c10::DataPtr& data_ptr, const Recorder* recorder);
  // The same for a tensor's storage; -1 for an undefined tensor.
  static int64_t StorageIdOf(const at::TensorBase& t, const Recorder& recorder) {
    return t.defined() && t.has_storage() ? StorageIdOf(t.storage().data_ptr(), &recorder) : -1;
  }

 private:
  c10::DataPtr Allocate(size_t n) const override;

  c10::DeviceType device_type_;
  c10::Allocator* underlying_;
};

// Installs the tracking allocator for meta tensors. Idempotent and thread-safe; call
// before the first meta allocation (the Session constructor does).
void InstallMetaTrackingAllocator();

// Installs the tracking allocator for CPU tensors, wrapping the current CPU allocator.
// Only tests use this, to compare fake execution with real execution on CPU.
void InstallCpuTrackingAllocator();

}  // namespace memsim
