#include "simulator/session.h"

#include <stdexcept>

#include "simulator/tracking_allocator.h"

namespace memsim {

Session::Session(const GpuSpec* gpu, c10::DeviceType device_type)
    : gpu_(gpu), recorder_(device_type) {
  InstallMetaTrackingAllocator();
  RegisterInterceptor();
  recorder_.set_gpu(gpu);
}

void Session::BeginIteration(int32_t iteration) {
  if (iteration <= recorder_.iteration()) {
    throw std::logic_error("memsim: iterations must begin in increasing order");
  }
  recorder_.SetIteration(iteration);
  recorder_.AddMarker(MarkerKind::kIterationBegin);
}

void Session::EndIteration() { recorder_.AddMarker(MarkerKind::kIterationEnd); }

void Session::Retag(const at::Tensor& tensor, Category category) {
  const int64_t id = TrackingAllocator::StorageIdOf(tensor, recorder_);
  if (id >= 0) recorder_.Retag(id, category);
}

ModuleScope::ModuleScope(std::string_view child_name) : recorder_(CurrentRecorder()) {
  if (recorder_ != nullptr) recorder_->PushChildModule(child_name);
}

ModuleScope::ModuleScope(Absolute path) : recorder_(CurrentRecorder()) {
  if (recorder_ != nullptr) recorder_->PushAbsoluteModule(recorder_->names().Intern(path.path));
}

ModuleScope::ModuleScope(NameId absolute_module) : recorder_(CurrentRecorder()) {
  if (recorder_ != nullptr) recorder_->PushAbsoluteModule(absolute_module);
}

ModuleScope::~ModuleScope() {
  if (recorder_ != nullptr) recorder_->PopModule();
}

NameId ModuleScope::Current() {
  const Recorder* recorder = CurrentRecorder();
  return recorder == nullptr ? 0 : recorder->current_module();
}

std::string ModuleScope::CurrentPath() {
  const Recorder* recorder = CurrentRecorder();
  return recorder == nullptr ? std::string() : recorder->names().Name(recorder->current_module());
}

CategoryScope::CategoryScope(Category category) : recorder_(CurrentRecorder()) {
  if (recorder_ != nullptr) recorder_->PushCategory(category);
}

CategoryScope::~CategoryScope() {
  if (recorder_ != nullptr) recorder_->PopCategory();
}

PersistentScope::PersistentScope() : recorder_(CurrentRecorder()) {
  if (recorder_ != nullptr) recorder_->PushPersistent();
}

PersistentScope::~PersistentScope() {
  if (recorder_ != nullptr) recorder_->PopPersistent();
}

GraphedScope::GraphedScope(bool active) : recorder_(active ? CurrentRecorder() : nullptr) {
  if (recorder_ != nullptr) recorder_->BeginGraphedScope();
}

GraphedScope::~GraphedScope() {
  if (recorder_ != nullptr) recorder_->EndGraphedScope();
}

StandInKernelScope::StandInKernelScope() : recorder_(CurrentRecorder()) {
  if (recorder_ != nullptr) recorder_->PushStandInKernels();
}

StandInKernelScope::~StandInKernelScope() {
  if (recorder_ != nullptr) recorder_->PopStandInKernels();
}

void ChargeUnmodelledOps(int64_t ops) {
  Recorder* recorder = CurrentRecorder();
  if (recorder != nullptr && recorder->gpu() != nullptr) {
    recorder->AdvanceClock(static_cast<double>(ops) * recorder->gpu()->min_op_s);
  }
}

void ChargeModuleCall() {
  Recorder* recorder = CurrentRecorder();
  if (recorder != nullptr && recorder->gpu() != nullptr) {
    recorder->AdvanceClock(recorder->gpu()->module_call_s);
  }
}

}  // namespace memsim
