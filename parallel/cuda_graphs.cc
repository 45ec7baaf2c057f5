#include "parallel/cuda_graphs.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <map>
#include <utility>

#include "simulator/session.h"

namespace memsim {

int64_t GraphedLayersInFlight(const std::vector<PipelineStep>& schedule,
                              const std::vector<int64_t>& graphed_layers) {
  std::map<std::pair<int64_t, int64_t>, int64_t> in_flight;  // (microbatch, chunk) -> layers
  int64_t now = 0, most = 0;
  for (const PipelineStep& step : schedule) {
    const int64_t layers = graphed_layers.at(static_cast<size_t>(step.chunk));
    const auto key = std::make_pair(step.microbatch, step.chunk);
    if (step.forward) {
      in_flight[key] = layers;
      now += layers;
      most = std::max(most, now);
    } else if (auto it = in_flight.find(key); it != in_flight.end()) {
      now -= it->second;
      in_flight.erase(it);
    }
  }
  return most;
}

std::vector<at::Tensor> AllocateCudaGraphStaticBuffers(const ModelConfig& model,
                                                       const TrainingConfig& training,
                                                       at::IntArrayRef hidden_shape,
                                                       at::ScalarType dtype, int64_t cp,
                                                       int64_t in_flight) {
  ModuleScope scope(ModuleScope::Absolute{"cuda_graphs.static_buffers"});
  CategoryScope category(Category::kWorkspace);
  const auto meta = at::TensorOptions().device(at::kMeta);
  std::vector<at::Tensor> buffers;
  const int64_t s = training.seq_length, b = training.micro_batch_size;
  for (int64_t i = 0; i < in_flight; ++i) {
    buffers.push_back(at::empty(hidden_shape, meta.dtype(dtype)));  // sample_args
    if (training.Graphs(CudaGraphModule::kAttn)) {
      buffers.push_back(at::empty({b, 1, s / cp, s}, meta.dtype(at::kBool)));  // the mask
    }
  }
  if (model.position == PositionKind::kRope && !model.multi_latent_attention()) {
    buffers.push_back(at::empty({s, 1, 1, model.head_dim}, meta.dtype(at::kFloat)));
  }
  buffers.push_back(at::empty(hidden_shape, meta.dtype(dtype)));  // static grad output
  buffers.push_back(at::empty(hidden_shape, meta.dtype(dtype)));  // the last graph's dX
  return buffers;
}

}  // namespace memsim
