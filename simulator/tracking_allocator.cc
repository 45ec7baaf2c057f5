#include "simulator/tracking_allocator.h"

#include <mutex>

namespace memsim {
namespace {

void DeleteTracked(void* context) {
  auto* record = static_cast<AllocationRecord*>(context);
  if (record->recorder != nullptr) {
    if (record->storage_id < 0) {
      record->recorder->OnDeferredFree(record);  // Note [State made during the capture]
    } else {
      record->recorder->OnFree(record->storage_id);
    }
  }
  delete record;  // frees the underlying memory, if any
}

}  // namespace

TrackingAllocator::TrackingAllocator(c10::DeviceType device_type, c10::Allocator* underlying)
    : device_type_(device_type), underlying_(underlying) {}

c10::DataPtr TrackingAllocator::Allocate(size_t n) const {
  c10::DataPtr underlying =
      underlying_ != nullptr ? underlying_->allocate(n) : c10::DataPtr(nullptr, device_type_);
  Recorder* recorder = CurrentRecorder();
  if (recorder == nullptr || recorder->device_type() != device_type_ || n == 0 ||
      !recorder->Counts()) {
    return underlying;
  }
  void* data = underlying.get();
  const c10::Device device = underlying.device();
  AllocationRecord* record = recorder->OnAlloc(static_cast<int64_t>(n));
  record->underlying = std::move(underlying);
  return c10::DataPtr(data, record, &DeleteTracked, device);
}

int64_t TrackingAllocator::StorageIdOf(const c10::DataPtr& data_ptr, const Recorder* recorder) {
  if (data_ptr.get_deleter() != &DeleteTracked) return -1;
  const auto* record = static_cast<const AllocationRecord*>(data_ptr.get_context());
  return record->recorder == recorder ? record->storage_id : -1;
}

void InstallMetaTrackingAllocator() {
  static std::once_flag once;
  std::call_once(once, [] {
    static TrackingAllocator allocator(c10::DeviceType::Meta, nullptr);
    c10::SetAllocator(c10::DeviceType::Meta, &allocator, /*priority=*/1);
  });
}

void InstallCpuTrackingAllocator() {
  static std::once_flag once;
  std::call_once(once, [] {
    static TrackingAllocator allocator(c10::DeviceType::CPU,
                                       c10::GetAllocator(c10::DeviceType::CPU));
    c10::SetAllocator(c10::DeviceType::CPU, &allocator, /*priority=*/1);
  });
}

}  // namespace memsim
