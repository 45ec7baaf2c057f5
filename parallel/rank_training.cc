#include "parallel/rank_training.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>

#include <map>
#include <utility>

#include "models/optimizer.h"
#include "models/parameters.h"
#include "models/transformer.h"
#include "ops/collectives.h"
#include "parallel/pipeline_schedule.h"

namespace memsim {
namespace {

// What a microbatch-chunk keeps between its forward and its backward.
struct InFlight {
  at::Tensor input;   // received from the previous stage (requires grad); undefined first
  at::Tensor output;  // sent on (data freed after sending) or the loss
  torch::autograd::Edge output_edge;
};

// Megatron's deallocate_output_tensor: the sent output keeps its autograd graph but its
// storage is replaced by a one-element tensor.
void DeallocateOutput(InFlight& f) {
  f.output_edge = torch::autograd::impl::gradient_edge(f.output);
  f.output.set_data(at::empty({1}, f.output.options()));
}

// Megatron's custom_backward: runs the engine from the output's graph, whatever the
// output's (deallocated) data now is.
void BackwardFrom(const InFlight& f, const at::Tensor& grad) {
  torch::autograd::Engine::get_default_engine().execute(
      {f.output_edge}, {grad}, /*keep_graph=*/false, /*create_graph=*/false,
      /*accumulate_grad=*/true, /*outputs=*/{});
}

}  // namespace

ModelShard ShardFor(const ParallelLayout& layout, const ModelConfig& model, int64_t pp_rank) {
  ModelShard shard;
  shard.tp = layout.tp;
  shard.sequence_parallel = layout.sequence_parallel;
  shard.cp = layout.cp;
  shard.ep = layout.ep;
  shard.etp = layout.etp;
  shard.first_stage = pp_rank == 0;
  shard.last_stage = pp_rank == layout.pp - 1;
  for (int64_t chunk = 0; chunk < layout.vpp; ++chunk) {
    shard.chunks.emplace_back(FirstLayerOfStage(layout, model, pp_rank, chunk),
                              LayersOnStage(layout, model, pp_rank, chunk));
  }
  return shard;
}

void RunRankTraining(const ModelConfig& model_config, const TrainingConfig& training,
                     const ParallelLayout& layout, int64_t pp_rank, Session& session) {
  session.SetPhase(Phase::kSetup);
  ParameterStore store(training.precision);
  const ModelShard shard = ShardFor(layout, model_config, pp_rank);
  TransformerModel model(model_config, training, shard, &store);
  store.AllocateGradBuffer();
  const bool sharded_optimizer = layout.data_parallel != DataParallelKind::kDdp;
  MixedPrecisionOptimizer optimizer(&store, training.optimizer, sharded_optimizer ? layout.dp : 1,
                                    sharded_optimizer ? layout.edp : 1);
  const std::vector<PipelineStep> schedule =
      PipelineSchedule(layout.pp, layout.vpp, pp_rank, training.num_microbatches);
  const auto hidden_options = at::TensorOptions().device(at::kMeta).dtype(model.activation_dtype());

  for (int32_t it = 0; it < training.iterations; ++it) {
    {
      at::NoGradGuard no_grad;
      store.grad_buffer().zero_();  // model.zero_grad_buffer()
    }
    optimizer.ZeroGrad();
    session.BeginIteration(it);
    std::map<std::pair<int64_t, int64_t>, InFlight> in_flight;
    for (const PipelineStep& step : schedule) {
      session.SetMicrobatch(static_cast<int32_t>(step.microbatch));
      const auto key = std::make_pair(step.microbatch, step.chunk);
      if (step.forward) {
        session.SetPhase(Phase::kForward);
        InFlight& f = in_flight[key];
        if (!model.ChunkHasEmbedding(step.chunk)) {
          f.input = at::empty(model.HiddenShape(), hidden_options).requires_grad_(true);
          ReceiveInto(f.input);
        }
        f.output = model.ForwardChunk(step.chunk, f.input);
        if (!model.ChunkHasLoss(step.chunk)) {
          Send(f.output);
          if (layout.deallocate_pipeline_outputs) DeallocateOutput(f);
        }
      } else {
        session.SetPhase(Phase::kBackward);
        InFlight f = std::move(in_flight.at(key));
        in_flight.erase(key);
        if (model.ChunkHasLoss(step.chunk)) {
          torch::autograd::backward({f.output});
        } else {
          at::Tensor grad = at::empty(model.HiddenShape(), hidden_options);
          ReceiveInto(grad);
          if (!layout.deallocate_pipeline_outputs) {
            f.output_edge = torch::autograd::impl::gradient_edge(f.output);
          }
          BackwardFrom(f, grad);
        }
        if (f.input.defined()) Send(f.input.grad());
      }
    }
    session.SetPhase(Phase::kOptimizer);
    optimizer.Step();
    session.EndIteration();
  }
}

void RunTraining(const ModelConfig& model, const TrainingConfig& training, Session& session) {
  ParallelLayout layout;
  ModelConfig finalized = model;
  (void)FinalizeLayout(&layout, finalized);
  RunRankTraining(model, training, layout, 0, session);
}

}  // namespace memsim
