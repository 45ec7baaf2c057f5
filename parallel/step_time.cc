#include "parallel/step_time.h"

#include <algorithm>
#include <numeric>

namespace memsim {
namespace {

// Tensor-parallel collectives per decoder layer and microbatch on the critical path: the
// attention and MLP outputs' all-reduce (with sequence parallelism the same bytes as an
// all-gather before and a reduce-scatter after) in forward, their input gradients' in
// backward, and the forward's again when recomputation reruns it.
// Under full recomputation with distributed saved activations each layer's input is also
// all-gathered once more (counted per layer: checkpoints of several layers gather less).
int64_t TensorParallelCollectivesPerLayer(const TrainingConfig& training, bool moe_layer) {
  if (training.recompute == RecomputeKind::kFull) {
    return training.distribute_saved_activations ? 7 : 6;
  }
  // The MLP's output collective reruns with its recomputation: the mlp module's on dense
  // layers, the moe module's or the shared experts' (their own all-reduce) on MoE layers.
  const bool mlp_rerun = moe_layer ? training.Recomputes(RecomputeModule::kMoe) ||
                                         training.Recomputes(RecomputeModule::kSharedExperts)
                                   : training.Recomputes(RecomputeModule::kMlp);
  return mlp_rerun ? 5 : 4;
}

// Token exchanges per MoE layer and microbatch: dispatch and combine, forward and backward,
// and forward's again when the layer is recomputed.
int64_t ExpertExchangesPerLayer(const TrainingConfig& training) {
  const bool rerun =
      training.recompute == RecomputeKind::kFull || training.Recomputes(RecomputeModule::kMoe);
  return rerun ? 6 : 4;
}

int64_t ActivationBytesPerElement(const TrainingConfig& training) {
  return training.precision == Precision::kFp32 ? 4 : 2;
}

}  // namespace

double CollectiveSeconds(const GpuSpec& gpu, CollectiveKind kind, double bytes, int64_t group,
                         int64_t stride) {
  if (group <= 1) return 0;
  const double n = static_cast<double>(group);
  const double moved = (kind == CollectiveKind::kAllReduce ? 2.0 : 1.0) * (n - 1) / n * bytes;
  const bool in_node = static_cast<double>(stride) * n <= static_cast<double>(gpu.gpus_per_node);
  const double link = in_node ? gpu.nvlink_bytes_per_s : gpu.network_bytes_per_s;
  return moved / (link * gpu.link_efficiency);
}

double PipelineSeconds(const std::vector<double>& stage_s, int64_t microbatches,
                       int64_t virtual_stages) {
  const double slowest = *std::max_element(stage_s.begin(), stage_s.end());
  const double all = std::accumulate(stage_s.begin(), stage_s.end(), 0.0);
  return static_cast<double>(microbatches) * slowest +
         (all - slowest) / static_cast<double>(virtual_stages);
}

StepTime EstimateStepTime(const ModelConfig& model, const TrainingConfig& training,
                          const ParallelLayout& layout, const GpuSpec& gpu,
                          const std::vector<StageClock>& stage_clocks) {
  StepTime step;
  const int64_t m = training.num_microbatches;
  // One microbatch's activations on a rank: [S / cp, B, H] (divided by tp again for the
  // tokens an MoE layer routes, which sequence parallelism splits).
  const double tokens = static_cast<double>(training.seq_length) / static_cast<double>(layout.cp) *
                        static_cast<double>(training.micro_batch_size);
  const double activation_bytes = tokens * static_cast<double>(model.hidden_size) *
                                  static_cast<double>(ActivationBytesPerElement(training));
  const double tp_collective_s =
      CollectiveSeconds(gpu, CollectiveKind::kAllReduce, activation_bytes, layout.tp, 1);
  const double tp_dense_layer_s =
      static_cast<double>(TensorParallelCollectivesPerLayer(training, false)) * tp_collective_s;
  const double tp_moe_layer_s =
      static_cast<double>(TensorParallelCollectivesPerLayer(training, true)) * tp_collective_s;
  const double routed_bytes = activation_bytes / static_cast<double>(layout.tp) *
                              static_cast<double>(model.moe_router_topk);
  const double ep_layer_s = model.num_experts > 0
                                ? static_cast<double>(ExpertExchangesPerLayer(training)) *
                                      CollectiveSeconds(gpu, CollectiveKind::kAllToAll,
                                                        routed_bytes, layout.ep, layout.etp)
                                : 0;

  std::vector<double> stage_s, comm_s;
  std::vector<double> after_backward_s;  // data-parallel communication, then the optimizer
  std::vector<double> dp_comm_s;
  for (int64_t s = 0; s < layout.pp; ++s) {
    const StageClock& clock = stage_clocks[static_cast<size_t>(s)];
    int64_t layers = 0, moe_layers = 0;
    for (int64_t chunk = 0; chunk < layout.vpp; ++chunk) {
      const int64_t first = FirstLayerOfStage(layout, model, s, chunk);
      const int64_t count = LayersOnStage(layout, model, s, chunk);
      layers += count;
      if (model.num_experts > 0) {
        moe_layers +=
            std::max<int64_t>(0, first + count - std::max(first, model.moe_first_k_dense_layers));
      }
    }
    comm_s.push_back(static_cast<double>(layers - moe_layers) * tp_dense_layer_s +
                     static_cast<double>(moe_layers) * (tp_moe_layer_s + ep_layer_s));
    stage_s.push_back(clock.compute_s / static_cast<double>(clock.microbatches) + comm_s.back());

    // Gradients over the data-parallel group (ranks tp * cp apart), then parameters.
    const int64_t dp_stride = layout.tp * layout.cp;
    const double dp = static_cast<double>(layout.dp);
    const double grads = static_cast<double>(clock.gradient_bytes);
    const double params = static_cast<double>(clock.parameter_bytes);
    double seconds = 0;
    switch (layout.data_parallel) {
      case DataParallelKind::kDdp:
        seconds = CollectiveSeconds(gpu, CollectiveKind::kAllReduce, grads, layout.dp, dp_stride);
        break;
      case DataParallelKind::kDistributedOptimizer:
        seconds =
            CollectiveSeconds(gpu, CollectiveKind::kReduceScatter, grads, layout.dp, dp_stride) +
            CollectiveSeconds(gpu, CollectiveKind::kAllGather, params, layout.dp, dp_stride);
        break;
      case DataParallelKind::kZero2:  // the rank keeps its shard of the gradients
        seconds = CollectiveSeconds(gpu, CollectiveKind::kReduceScatter, grads * dp, layout.dp,
                                    dp_stride) +
                  CollectiveSeconds(gpu, CollectiveKind::kAllGather, params, layout.dp, dp_stride);
        break;
      case DataParallelKind::kFsdp:
      case DataParallelKind::kMegatronFsdp:
        // Shards only: every microbatch gathers the parameters for forward and again for
        // backward, and reduce-scatters the gradients.
        seconds =
            static_cast<double>(m) * (2 * CollectiveSeconds(gpu, CollectiveKind::kAllGather,
                                                            params * dp, layout.dp, dp_stride) +
                                      CollectiveSeconds(gpu, CollectiveKind::kReduceScatter,
                                                        grads * dp, layout.dp, dp_stride));
        break;
    }
    dp_comm_s.push_back(seconds);
    after_backward_s.push_back(seconds + clock.optimizer_s);
  }
  const size_t slowest =
      static_cast<size_t>(std::max_element(stage_s.begin(), stage_s.end()) - stage_s.begin());
  const size_t last =
      static_cast<size_t>(std::max_element(after_backward_s.begin(), after_backward_s.end()) -
                          after_backward_s.begin());
  const double mb = static_cast<double>(m);
  const double pipeline_s = PipelineSeconds(stage_s, m, layout.vpp);
  step.compute_s = mb * (stage_s[slowest] - comm_s[slowest]);
  step.model_parallel_comm_s = mb * comm_s[slowest];
  step.bubble_s = pipeline_s - mb * stage_s[slowest];
  step.data_parallel_comm_s = dp_comm_s[last];
  step.optimizer_s = after_backward_s[last] - dp_comm_s[last];
  step.total_s = pipeline_s + after_backward_s[last];
  const double tokens_per_step = static_cast<double>(training.seq_length) *
                                 static_cast<double>(training.micro_batch_size) * mb *
                                 static_cast<double>(layout.dp);
  step.tokens_per_s_per_gpu =
      tokens_per_step / step.total_s / static_cast<double>(layout.world_size);
  return step;
}

}  // namespace memsim
