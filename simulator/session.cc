#include "simulator/session.h"

#include <stdexcept>

#include "simulator/check.h"
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
  recorder_.BeginIteration(iteration);
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

KernelTimeOnlyScope::KernelTimeOnlyScope() : recorder_(CurrentRecorder()) {
  if (recorder_ != nullptr) recorder_->PushKernelTimeOnly();
}

KernelTimeOnlyScope::~KernelTimeOnlyScope() {
  if (recorder_ != nullptr) recorder_->PopKernelTimeOnly();
}

namespace {

// The recorder whose clock host time advances now: null without a GPU or in a replay.
Recorder* HostClock() {
  Recorder* recorder = CurrentRecorder();
  if (recorder == nullptr || recorder->gpu() == nullptr || recorder->in_graph_replay()) {
    return nullptr;
  }
  return recorder;
}

}  // namespace

void ChargeUnmodelledOps(int64_t forward_ops, int64_t backward_ops) {
  Recorder* recorder = HostClock();
  if (recorder == nullptr) return;
  const bool recomputing = recorder->phase() == Phase::kBackward;
  const int64_t ops = recomputing ? forward_ops : forward_ops + backward_ops;
  recorder->AdvanceClock(static_cast<double>(ops) * recorder->gpu()->min_op_s);
}

void ChargeMemoryBoundKernel(double bytes) {
  MEMSIM_DCHECK(bytes >= 0);
  Recorder* recorder = CurrentRecorder();
  if (recorder == nullptr || recorder->gpu() == nullptr) return;
  recorder->ChargeKernel(MemoryBoundKernelSeconds(*recorder->gpu(), bytes));
}

void ChargeModuleCalls(int64_t calls) {
  MEMSIM_DCHECK(calls >= 0);
  Recorder* recorder = HostClock();
  if (recorder == nullptr) return;
  const double share = recorder->phase() == Phase::kBackward ? 0.5 : 1.0;
  recorder->AdvanceClock(share * static_cast<double>(calls) * recorder->gpu()->module_call_s);
}

}  // namespace memsim
