#include "parallel/rank_training.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>

#include <algorithm>
#include <map>
#include <memory>
#include <stdexcept>
#include <utility>

#include "models/optimizer.h"
#include "models/parameters.h"
#include "models/transformer.h"
#include "ops/collectives.h"
#include "ops/library_workspaces.h"
#include "ops/ops.h"
#include "parallel/cuda_graphs.h"
#include "parallel/ddp_buffers.h"
#include "parallel/megatron_fsdp.h"
#include "parallel/pipeline_schedule.h"
#include "parallel/sharded_data_parallel.h"
#include "simulator/check.h"
#include "simulator/status.h"
#include "simulator/tracking_allocator.h"

namespace memsim {
namespace {

// Note [Precision-aware optimizer] in models/optimizer.h, from the run's settings.
std::optional<PrecisionAwareStates> PrecisionAwareStatesOf(const TrainingConfig& t) {
  if (!t.precision_aware_optimizer) return std::nullopt;
  return PrecisionAwareStates{ScalarTypeOf(t.exp_avg_dtype), ScalarTypeOf(t.exp_avg_sq_dtype),
                              t.store_param_remainders};
}

// Note [Microbatch replication]
// Every microbatch of an iteration runs the same ops on tensors of the same shapes, so
// after the first two (the first pays one-off costs such as growing Megatron's global
// buffer; the second is the steady state) a stage's forward and backward steps record
// the same allocations and frees. memsim runs microbatches 0 and 1 for real and appends
// copies of microbatch 1's steps for the rest (Recorder::AppendReplica), mapping each
// copied backward's frees to the storages its copied forward allocated. The event log,
// and so every number derived from it, is what running them all would record (a test
// compares the two); the cost no longer grows with ops times microbatches. A forward
// step whose copy would refer to storages it cannot map runs for real instead (and so
// does its backward); a backward whose forward was copied must be copied too. What the
// schedule receives and keeps between steps stays real (Note [Tensors the schedule keeps]).
constexpr int64_t kTemplateMicrobatch = 1;

struct StepTemplate {
  int64_t begin_event, end_event;
  int64_t storages;  // how many it allocates (a copy allocates as many)
  double begin_s, duration_s;
  int64_t input_grad_id;  // a backward's: the storage of its input's gradient (-1: none)
};

// Note [Tensors the schedule keeps]
// Megatron-Core keeps three references from one pipeline step into later ones (0.20,
// pipeline_parallel/schedules.py and transformer/transformer_block.py), and what they
// hold stays allocated until the reference moves on:
//   a chunk's input: forward_step hands each received input to set_input_tensor, and the
//     chunk's TransformerBlock keeps it (self.input_tensor) until its next forward replaces
//     it; backward_step retains the input's gradient (x.grad), which the input then holds
//     too. So every chunk that receives its input keeps the last one and its gradient
//     through the optimizer step until the next iteration's first forward of the chunk:
//     2 x [S/cp (/tp with SP), B, H] per such chunk after the step;
//   input_tensor_grad: the schedule's local keeps each input gradient from the end of its
//     backward step to the end of the next backward step (of any chunk);
//   output_tensor (1F1B without interleaving): the output popped for a backward step stays
//     bound until the next forward step returns a new one, and its spent autograd graph
//     still ends in the AccumulateGrad node that holds the step's input (a leaf): the
//     input stays until that forward ends (a real run's allocator history shows it at the
//     last stage's peak, validation/fake_pg: [S, B, H] more in the loss's forward);
//   input_tensor (interleaved, overlapped p2p): the schedule's outer local is bound only in
//     warm-up, so the input received at the last warm-up step (the first steady forward's;
//     none on the first stage) and the gradient retain_grad hangs on it stay until the
//     schedule returns; and each steady step receives the next forward's input right
//     after its forward, before its backward (pp_post_forward), not when that forward
//     starts. Without the overlap
//     (--no-overlap-p2p-communication) the steady loop rebinds input_tensor and receives
//     after the backward, as memsim does by default: a real run's peak was 2 [S, B, H]
//     lower than the overlapped run's, as memsim reads it (validation/fake_pg). Not
//     modelled: the warm-up flush, and the overlapped path's later deallocation of sent
//     outputs, at the next step's pp_pre_forward;
//   output_tensor_grad (1F1B without interleaving): the received output gradient stays
//     from its receive to the next one, through the next forward step. The interleaved
//     schedule receives it one step early, with the input of the forward step that runs
//     before its backward (send_forward_backward_recv_forward_backward; the default
//     overlapped p2p path receives at the same points), unless every forward is warm-up
//     (or the combined 1F1B schedule runs the backward first: Note [Combined 1F1B]), and
//     lets it go at the end of the backward step. On the last stage with microbatch groups
//     larger than PP, Megatron receives up to g - pp + 1 gradients ahead into a queue:
//     memsim holds one.
// Whether letting go of a reference frees anything depends on the schedule around it (is
// the input still in flight, does its chunk still hold it), which differs between a
// step and its copy (Note [Microbatch replication]). So the inputs, their gradients and
// the received output gradients are real tensors for copied steps too, received and let
// go outside the span of events a copy replays: a copy holds only the step's own work.
struct ScheduleReferences {
  std::vector<at::Tensor> chunk_inputs;  // TransformerBlock.input_tensor, per chunk
  at::Tensor input_grad;                 // input_tensor_grad
  at::Tensor output_grad;                // output_tensor_grad (1F1B without interleaving)
  at::Tensor popped_input;               // held by output_tensor (1F1B without interleaving)
  at::Tensor warmup_input;               // the interleaved schedule's stale input_tensor
};

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

// Megatron-FSDP's settings for this run (Note [Megatron-FSDP]).
MegatronFsdpOptions MegatronFsdpOptionsOf(const TrainingConfig& t, const ParallelLayout& layout) {
  MegatronFsdpOptions o;
  o.shards = OptimizerShards(layout, false);
  o.expert_shards = OptimizerShards(layout, true);
  if (t.fsdp_main_grads_dtype) o.main_grads = ScalarTypeOf(*t.fsdp_main_grads_dtype);
  if (t.fsdp_grad_comm_dtype) o.grad_comm = ScalarTypeOf(*t.fsdp_grad_comm_dtype);
  o.log_params_norm = t.log_params_norm;
  o.final_norm_gathers_every_forward = t.fsdp_final_norm_gathers_every_forward;
  o.reset_releases_non_unit = t.fsdp_reset_releases_non_unit;
  o.double_buffer = t.fsdp_double_buffer;
  o.persistent_fallback = t.fsdp_double_buffer_persistent_fallback;
  o.meta_init = t.fsdp_meta_init;
  return o;
}

// Where global rank `rank` sits in its stage's data-parallel x context-parallel group and in
// its expert data-parallel group (ranks ordered tp, cp, dp; the stage's ranks regrouped etp,
// ep, edp: Note [Rank classes]).
struct DataParallelPlace {
  int64_t dense, expert;
};
DataParallelPlace DataParallelPlaceOf(const ParallelLayout& layout, int64_t rank) {
  const RankCoordinates c = CoordinatesOf(layout, rank);
  const int64_t in_stage = rank % (layout.world_size / layout.pp);
  return {c.dp_rank * layout.cp + c.cp_rank, in_stage / (layout.etp * layout.ep)};
}

// The distributed optimizer's buffers on stage `pp_rank`, for the simulated rank's data-
// parallel place (TrainingConfig::simulated_rank; unset: the fullest).
DdpBufferOptions DdpBufferOptionsOf(const ParallelLayout& layout, const TrainingConfig& training,
                                    int64_t pp_rank) {
  DdpBufferOptions o;
  o.buckets = layout.ddp_buckets;
  o.dp_cp = layout.dp * layout.cp;
  o.dense_shards = OptimizerShards(layout, false);
  o.expert_shards = OptimizerShards(layout, true);
  o.pp_rank = pp_rank;
  o.experts_apart = ExpertsApart(layout);
  if (training.simulated_rank) {
    // Intra-instance groups are consecutive slices of the data-parallel ranks.
    const DataParallelPlace place = DataParallelPlaceOf(layout, *training.simulated_rank);
    o.dense_rank = place.dense % o.dense_shards;
    o.expert_rank = place.expert % o.expert_shards;
  }
  return o;
}

// The CUDA libraries' GEMM workspaces (Note [Library workspaces]), allocated where the
// real run first needs each and kept to the end: PyTorch's cuBLAS workspace of the forward
// thread at the first forward step and of autograd's backward thread at the first
// backward step, when the stage runs a GEMM through PyTorch at all; Transformer Engine's
// (and its userbuffer GEMMs') at the first forward step of a stage with TE layers or MoE
// routers.
class LibraryWorkspaces {
 public:
  LibraryWorkspaces(const GpuSpec* gpu, const ModelConfig& model, const TrainingConfig& training,
                    const ModelShard& shard) {
    if (gpu == nullptr) return;  // no GPU, no libraries (unit tests of the model alone)
    cuda_graphs_ = training.cuda_graphs;
    // PyTorch GEMMs: every linear layer in the local implementation; under TE, the output
    // layer (Megatron's ColumnParallelLinear) and unfused attention's bmm. TE's GEMMs: its
    // layers, the MoE router's in either implementation, and the output layer's forward
    // when it writes the logits in another dtype (--output-logit-dtype; its backward GEMMs
    // stay PyTorch's).
    const bool has_layers = std::any_of(shard.chunks.begin(), shard.chunks.end(),
                                        [](const auto& c) { return c.second > 0; });
    const bool logits_through_te = shard.last_stage && training.output_logit_dtype.has_value() &&
                                   *training.output_logit_dtype != training.precision;
    const bool torch_gemms_besides_logits =
        training.profile == ProfileKind::kMegatronLocal ||
        (has_layers && training.attention == AttentionKind::kEager);
    const int64_t cublas_bytes = training.cublas_workspace_bytes >= 0
                                     ? training.cublas_workspace_bytes
                                     : DefaultCublasWorkspaceBytes(*gpu);
    const bool torch_forward_gemms =
        torch_gemms_besides_logits || (shard.last_stage && !logits_through_te);
    forward_cublas_bytes_ = torch_forward_gemms ? cublas_bytes : 0;
    // The main thread's GEMMs after the schedule: the output layer's deferred weight
    // gradients (drain_embedding_wgrad_compute) and Muon's Newton-Schulz iterations in the
    // optimizer step; the forward thread's workspace is made then if no forward GEMM made it.
    main_thread_cublas_bytes_ = cublas_bytes;
    deferred_wgrad_gemms_ = shard.last_stage && training.defer_embedding_wgrad;
    optimizer_gemms_ = training.optimizer == OptimizerKind::kMuon;
    backward_cublas_bytes_ = torch_gemms_besides_logits || shard.last_stage ? cublas_bytes : 0;
    // --moe-shared-expert-overlap: the local implementation's shared experts run their
    // GEMMs on SharedExpertMLP.stream, one stream for all layers, in forward and (autograd
    // keeping each op's stream) in backward: a workspace for each thread on it. (Measured
    // on an H200: two more 32 MiB blocks, at the shared expert's first linear_fc1 and in
    // backward; validation/fake_pg.) TE's layers use TE's one workspace on every stream.
    bool moe_layers = false;  // the stage's: dense first layers have no shared experts
    for (const auto& [first, count] : shard.chunks) {
      for (int64_t l = first; l < first + count; ++l) moe_layers = moe_layers || model.moe_layer(l);
    }
    const bool shared_expert_stream = training.SharedExpertsOverlap(model) && moe_layers &&
                                      training.profile == ProfileKind::kMegatronLocal;
    shared_expert_cublas_bytes_ = shared_expert_stream ? cublas_bytes : 0;
    const bool te_gemms =
        logits_through_te || (has_layers && (training.profile == ProfileKind::kTransformerEngine ||
                                             model.num_experts > 0));
    te_bytes_ = te_gemms ? TransformerEngineWorkspaceBytes(*gpu) : 0;
    const bool grouped_gemms = training.moe_grouped_gemm && model.num_experts > 0 && has_layers;
    te_grouped_.resize(grouped_gemms ? kTeGroupedGemmStreams : 0);
    if (UsesUserbuffers(training, shard) && has_layers) {
      te_userbuffer_bytes_ = kTeUserbufferStreams * TransformerEngineWorkspaceBytes(*gpu);
    }
  }
  LibraryWorkspaces(const LibraryWorkspaces&) = delete;
  LibraryWorkspaces& operator=(const LibraryWorkspaces&) = delete;

  // The graphed layers' GEMMs need the TE, userbuffer and cuBLAS workspaces during a CUDA
  // graph capture; only the routed experts, never graphed, use the grouped ones (Note [State
  // made during the capture] in simulator/recorder.h).
  void BeforeForward() {
    Allocate(te_bytes_, "transformer_engine.gemm_workspace", &te_, /*graphed_gemms=*/true);
    for (at::Tensor& w : te_grouped_) {
      Allocate(te_bytes_, "transformer_engine.grouped_gemm_workspace", &w, false);
    }
    Allocate(te_userbuffer_bytes_, "transformer_engine.userbuffer_gemm_workspace", &te_userbuffer_,
             true);
    Allocate(forward_cublas_bytes_, "cublas_workspace.forward_thread", &forward_, true);
    Allocate(shared_expert_cublas_bytes_, "cublas_workspace.shared_expert_stream.forward_thread",
             &shared_expert_forward_, false);
  }
  void BeforeBackward() {
    Allocate(backward_cublas_bytes_, "cublas_workspace.backward_thread", &backward_, true);
    Allocate(shared_expert_cublas_bytes_, "cublas_workspace.shared_expert_stream.backward_thread",
             &shared_expert_backward_, false);
  }
  void BeforeDeferredWgrad() {
    if (deferred_wgrad_gemms_) {
      Allocate(main_thread_cublas_bytes_, "cublas_workspace.forward_thread", &forward_, false);
    }
  }
  void BeforeOptimizerStep() {
    if (optimizer_gemms_) {
      Allocate(main_thread_cublas_bytes_, "cublas_workspace.forward_thread", &forward_, false);
    }
  }

 private:
  void Allocate(int64_t bytes, const char* name, at::Tensor* out, bool graphed_gemms) const {
    if (bytes == 0 || out->defined()) return;
    GraphedScope graphed(cuda_graphs_ && graphed_gemms);
    ModuleScope scope(ModuleScope::Absolute{name});
    CategoryScope category(Category::kWorkspace);
    *out = at::empty({bytes}, at::TensorOptions().device(at::kMeta).dtype(at::kByte));
  }

  bool cuda_graphs_ = false;
  int64_t forward_cublas_bytes_ = 0, backward_cublas_bytes_ = 0, main_thread_cublas_bytes_ = 0,
          te_bytes_ = 0, te_userbuffer_bytes_ = 0, shared_expert_cublas_bytes_ = 0;
  bool deferred_wgrad_gemms_ = false, optimizer_gemms_ = false;
  at::Tensor forward_, backward_, te_, te_userbuffer_;
  at::Tensor shared_expert_forward_, shared_expert_backward_;  // on SharedExpertMLP.stream
  std::vector<at::Tensor> te_grouped_;  // one per TE compute stream with grouped GEMMs
};

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

int64_t RunRankTraining(const ValidatedRun& run, int64_t pp_rank, Session& session,
                        Replication replication) {
  const ModelConfig& model_config = run.spec().model;
  const TrainingConfig& training = run.spec().training;
  const ParallelLayout& layout = run.spec().layout;
  MEMSIM_DCHECK(0 <= pp_rank && pp_rank < layout.pp && model_config.padded_vocab_size > 0 &&
                training.num_microbatches > 0);
  RegisterOps();
  session.recorder().SetAllocatorSettings(training.allocator_settings);
  session.SetPhase(Phase::kSetup);
  // The gradient buffer is bf16 with --grad-reduce-in-bf16, or --main-grads-dtype bf16 in
  // the precision-aware optimizer.
  const bool bf16_gradients =
      training.grad_reduce_in_bf16 ||
      (training.precision_aware_optimizer && training.main_grads_dtype == Precision::kBf16);
  ParameterStore store(training.precision, training.gradient_accumulation_fusion, bf16_gradients);
  store.set_unmaterialized(layout.data_parallel == DataParallelKind::kMegatronFsdp &&
                           training.fsdp_meta_init);
  ModelShard shard = ShardFor(layout, model_config, pp_rank);
  // Offloading moves storages between steps and layers (a reload belongs to the layer or
  // chunk before its own), which copies cannot map: every layer and microbatch runs. So
  // do CUDA graphs' capture and replays, whose allocations count by scope.
  const bool accounts_by_scope = training.offload_modules != 0 || training.cuda_graphs ||
                                 training.cpu_offloading_num_layers > 0;
  shard.replicate_layers = replication.layers && !accounts_by_scope;
  std::unique_ptr<FullyShardedDataParallel> fsdp;
  std::unique_ptr<MegatronFsdp> megatron_fsdp;
  LayerHooks* layer_hooks = nullptr;  // set below, before any layer runs
  if (layout.data_parallel == DataParallelKind::kFsdp ||
      layout.data_parallel == DataParallelKind::kMegatronFsdp) {
    shard.wrap_layer = [&layer_hooks](int64_t unit, const at::Tensor& input,
                                      const ModelShard::LayerFn& run) {
      return RunHookedLayer(layer_hooks, unit, input, run);
    };
  }
  if (layout.data_parallel == DataParallelKind::kMegatronFsdp) {
    shard.before_final_norm = [&megatron_fsdp]() { megatron_fsdp->BeforeFinalNorm(); };
  }
  TransformerModel model(model_config, training, shard, &store);
  switch (layout.data_parallel) {
    case DataParallelKind::kZero2:
      AllocateZero2Gradients(&store, layout.dp);
      break;
    case DataParallelKind::kFsdp:
      fsdp = std::make_unique<FullyShardedDataParallel>(&store, layout.dp);
      layer_hooks = fsdp.get();
      break;
    case DataParallelKind::kMegatronFsdp:
      megatron_fsdp =
          std::make_unique<MegatronFsdp>(&store, MegatronFsdpOptionsOf(training, layout));
      layer_hooks = megatron_fsdp.get();
      session.EmptyCache();  // the end of Megatron-FSDP's setup: gc.collect(), empty_cache()
      break;
    case DataParallelKind::kDistributedOptimizer:
      AllocateDistributedOptimizerBuffers(&store, DdpBufferOptionsOf(layout, training, pp_rank));
      break;
    default:
      store.AllocateGradBuffer();
  }
  OptimizerOptions optimizer_options;
  optimizer_options.kind = training.optimizer;
  optimizer_options.shards = OptimizerShards(layout, false);
  optimizer_options.expert_shards = OptimizerShards(layout, true);
  optimizer_options.muon_ns_steps = training.muon_ns_steps;
  optimizer_options.tp = layout.tp;
  optimizer_options.expert_tp = layout.etp;
  if (training.muon_split_qkv && !model_config.multi_latent_attention()) {
    // _get_qkv_split_shapes (emerging_optimizers.py): query, [gate,] key, value per group.
    const int64_t D = model_config.head_dim;
    const int64_t query_rows = model_config.num_attention_heads / model_config.num_query_groups * D;
    optimizer_options.muon_qkv_split_rows = {query_rows, D, D};
    if (model_config.attention_output_gate) {
      optimizer_options.muon_qkv_split_rows.insert(
          optimizer_options.muon_qkv_split_rows.begin() + 1, query_rows);
    }
  }
  optimizer_options.precision_aware = PrecisionAwareStatesOf(training);
  optimizer_options.cpu_offload_fraction = training.optimizer_offload_fraction;
  // Megatron-FSDP keeps a main-weight shard whatever the parameters' dtype.
  optimizer_options.fp32_masters_always = layout.data_parallel == DataParallelKind::kMegatronFsdp;
  optimizer_options.experts_apart = ExpertsApart(layout);
  optimizer_options.first_chunk_apart = layout.ddp_buckets.overlap_param_gather_with_optimizer_step;
  optimizer_options.count_zeros_in_grads = training.log_num_zeros_in_grad;
  if (training.layer_wise_optimizer) {
    LayerWiseGroups groups;
    groups.dense_ranks = layout.dp * layout.cp;
    groups.expert_ranks = layout.edp;
    if (training.simulated_rank) {
      const DataParallelPlace place = DataParallelPlaceOf(layout, *training.simulated_rank);
      groups.dense_rank = place.dense;
      groups.expert_rank = place.expert;
    }
    optimizer_options.layer_wise = groups;
  }
  MixedPrecisionOptimizer optimizer(&store, optimizer_options);
  // Note [Megatron-FSDP]: a fsdp_dtensor checkpoint load's dummy step makes the states.
  if (megatron_fsdp && training.fsdp_states_before_training) optimizer.CreateStates();
  const std::vector<PipelineStep> schedule =
      PipelineSchedule(layout.pp, layout.vpp, pp_rank, training.num_microbatches,
                       layout.microbatch_group_size, layout.combined_1f1b);
  const auto hidden_options = at::TensorOptions().device(at::kMeta).dtype(model.hidden_dtype());
  LibraryWorkspaces workspaces(session.gpu(), model_config, training, shard);
  // Deferred output-layer weight gradients keep tensors across microbatches, which copied
  // microbatches cannot hold: the stage with the loss runs every microbatch for real.
  // So do kept batches (TrainingConfig::keeps_microbatch_batches), one per microbatch.
  const bool replicate = replication.microbatches && !accounts_by_scope &&
                         !(training.defer_embedding_wgrad && shard.last_stage) &&
                         !training.keeps_microbatch_batches;
  ScheduleReferences kept;
  kept.chunk_inputs.resize(static_cast<size_t>(model.num_chunks()));
  Recorder& recorder = session.recorder();
  // The interleaved schedule (not combined 1F1B) receives a backward's output gradient with
  // the forward before it, once there is a steady state: when every forward is warm-up,
  // the first gradient is received at its backward.
  const bool prefetch_output_grads =
      layout.vpp > 1 && !layout.combined_1f1b &&
      PipelineWarmup(layout.pp, layout.vpp, pp_rank, training.num_microbatches,
                     layout.microbatch_group_size,
                     layout.combined_1f1b) < training.num_microbatches * layout.vpp;

  // The interleaved schedule's overlapped p2p path (Note [Tensors the schedule keeps]): its
  // warm-up forwards, and whether a steady state follows them.
  const bool interleaved_p2p = layout.vpp > 1 && !layout.combined_1f1b && layout.overlap_p2p_comm;
  const int64_t warmup_forwards =
      interleaved_p2p ? PipelineWarmup(layout.pp, layout.vpp, pp_rank, training.num_microbatches,
                                       layout.microbatch_group_size, layout.combined_1f1b)
                      : 0;
  // One pass over the schedule: every step's forward or backward, with what the schedule
  // keeps between steps (Note [Tensors the schedule keeps]).
  auto run_schedule = [&](ActivationOffloader* offloader) {
    std::map<std::pair<int64_t, int64_t>, InFlight> in_flight;
    std::map<std::pair<bool, int64_t>, StepTemplate> templates;         // (forward, chunk)
    std::map<std::pair<int64_t, int64_t>, Recorder::IdShift> replicas;  // (microbatch, chunk)
    at::Tensor prefetched_output_grad;  // received for the next step, a backward
    int64_t forwards_run = 0;
    // How many templates the log's room for the copies to come was made with: a template
    // made later (microbatch 1's first backward comes after copied forwards) adds to it.
    size_t room_made_for_templates = 0;
    // Makes room in the log for the copies of steps [s, end), as their templates size them.
    auto reserve_for_copies_from = [&](size_t s) {
      int64_t events = 0, storages = 0;
      for (size_t n = s; n < schedule.size(); ++n) {
        if (schedule[n].microbatch <= kTemplateMicrobatch) continue;
        const auto t = templates.find(std::make_pair(schedule[n].forward, schedule[n].chunk));
        if (t == templates.end()) continue;
        events += t->second.end_event - t->second.begin_event;
        storages += t->second.storages;
      }
      // A sixteenth more for what runs outside the copies (the optimizer step, the real
      // steps); EndRecording leaves a spare that small where it is.
      recorder.Reserve(events + events / 16, storages + storages / 16);
      room_made_for_templates = templates.size();
    };
    // Receives the input of the forward after step `s` where a steady step's forward
    // (one a backward follows) receives it, in pp_post_forward.
    auto receive_next_input_early = [&](size_t s) {
      if (!interleaved_p2p || s + 1 >= schedule.size() || schedule[s + 1].forward) return;
      for (size_t n = s + 2; n < schedule.size(); ++n) {
        if (!schedule[n].forward) continue;
        if (model.ChunkHasEmbedding(schedule[n].chunk)) return;
        InFlight& next = in_flight[std::make_pair(schedule[n].microbatch, schedule[n].chunk)];
        MicrobatchAttribution owner(recorder, static_cast<int32_t>(schedule[n].microbatch));
        next.input = at::empty(model.HiddenShape(), hidden_options).requires_grad_(true);
        ReceiveInto(next.input);
        return;
      }
    };
    // What follows forward step `s`, run or copied: output_tensor moves on, and the
    // overlapped path receives the next forward's input.
    auto forward_returned = [&](size_t s) {
      kept.popped_input.reset();
      receive_next_input_early(s);
    };
    for (size_t s = 0; s < schedule.size(); ++s) {
      const PipelineStep& step = schedule[s];
      session.SetMicrobatch(static_cast<int32_t>(step.microbatch));
      session.SetPhase(step.forward ? Phase::kForward : Phase::kBackward);
      const auto key = std::make_pair(step.microbatch, step.chunk);
      if (offloader != nullptr) offloader->BeginStep(step.forward, key);
      const auto template_key = std::make_pair(step.forward, step.chunk);
      auto found = templates.find(template_key);
      const bool replicated_forward = replicas.count(key) > 0;
      // What the step receives, outside the span a copy replays (Note [Tensors the schedule
      // keeps]): a forward's input, handed to set_input_tensor; a backward's output gradient.
      at::Tensor output_grad;
      if (step.forward) {
        InFlight& f = in_flight[key];
        if (!model.ChunkHasEmbedding(step.chunk) && !f.input.defined()) {
          f.input = at::empty(model.HiddenShape(), hidden_options).requires_grad_(true);
          ReceiveInto(f.input);
        }
        // The first stage's last warm-up step receives nothing (its chunk vpp - 1 then).
        if (interleaved_p2p && pp_rank > 0 && forwards_run == warmup_forwards) {
          kept.warmup_input = f.input;
        }
        ++forwards_run;
        // The interleaved schedule receives the next backward's output gradient with this
        // forward's input (send_forward_backward_recv_forward_backward), before it runs.
        if (prefetch_output_grads && s + 1 < schedule.size() && !schedule[s + 1].forward &&
            !model.ChunkHasLoss(schedule[s + 1].chunk)) {
          prefetched_output_grad = at::empty(model.HiddenShape(), hidden_options);
          ReceiveInto(prefetched_output_grad);
        }
        kept.chunk_inputs[static_cast<size_t>(step.chunk)] = f.input;
      } else if (prefetched_output_grad.defined()) {
        output_grad = std::move(prefetched_output_grad);
      } else if (!model.ChunkHasLoss(step.chunk)) {
        output_grad = at::empty(model.HiddenShape(), hidden_options);
        ReceiveInto(output_grad);
        if (layout.vpp == 1) kept.output_grad = output_grad;
      }
      at::Tensor input;  // a backward's input, whose gradient it computes
      bool copied = false;
      if (replicate && step.microbatch > kTemplateMicrobatch && found != templates.end() &&
          (step.forward || replicated_forward)) {
        if (templates.size() != room_made_for_templates) reserve_for_copies_from(s);
        const StepTemplate& t = found->second;
        Recorder::IdShift ids;
        Recorder::ReplicaOuter outer;
        if (!step.forward) outer.shift = replicas[key];
        if (recorder.AppendReplica(t.begin_event, t.end_event, recorder.now_s() - t.begin_s, outer,
                                   &ids)) {
          recorder.AdvanceClock(t.duration_s);
          copied = true;
          if (step.forward) {
            replicas[key] = ids;
            forward_returned(s);
            continue;
          }
          replicas.erase(key);
          input = std::move(in_flight.at(key).input);
          in_flight.erase(key);
          if (input.defined() && t.input_grad_id >= 0) {
            // The copy's gradient of the input, which backward left in input.grad.
            if (!ids.Maps(t.input_grad_id)) {
              throw UserError("memsim bug: the copied backward of microbatch " +
                              std::to_string(step.microbatch) +
                              " has no gradient of its input; rerun without microbatch "
                              "replication");
            }
            recorder.AdoptNextAllocation(t.input_grad_id + ids.shift);
            input.mutable_grad() = at::empty(model.HiddenShape(), hidden_options);
          }
        } else if (!step.forward) {
          // Its forward was copied, so there are no tensors to run it for real.
          throw UserError("memsim bug: the backward of microbatch " +
                          std::to_string(step.microbatch) +
                          " cannot be copied; rerun without microbatch replication");
        }
      }
      if (!copied) {
        if (step.forward) {
          workspaces.BeforeForward();
        } else {
          workspaces.BeforeBackward();
        }
        const int64_t begin_event = static_cast<int64_t>(recorder.events().size());
        const int64_t begin_storages = static_cast<int64_t>(recorder.storages().size());
        const double begin_s = recorder.now_s();
        if (step.forward) {
          // Part of the step's events, so that a copied forward gathers what it releases.
          if (megatron_fsdp) megatron_fsdp->BeforeForwardStep();
          InFlight& f = in_flight[key];
          f.output = model.ForwardChunk(step.chunk, f.input);
          if (!model.ChunkHasLoss(step.chunk)) {
            Send(f.output);
            if (layout.deallocate_pipeline_outputs) DeallocateOutput(f);
          }
        } else {
          InFlight f = std::move(in_flight.at(key));
          in_flight.erase(key);
          if (model.ChunkHasLoss(step.chunk)) {
            torch::autograd::backward({f.output});
          } else {
            if (!layout.deallocate_pipeline_outputs) {
              f.output_edge = torch::autograd::impl::gradient_edge(f.output);
            }
            BackwardFrom(f, output_grad);
          }
          if (megatron_fsdp) megatron_fsdp->AfterBackwardStep();
          input = std::move(f.input);
        }
        if (step.microbatch == kTemplateMicrobatch) {
          templates[template_key] = {
              begin_event,
              static_cast<int64_t>(recorder.events().size()),
              static_cast<int64_t>(recorder.storages().size()) - begin_storages,
              begin_s,
              recorder.now_s() - begin_s,
              input.defined() ? TrackingAllocator::StorageIdOf(input.grad(), recorder) : -1};
        }
      }
      if (step.forward) {
        forward_returned(s);
      } else {
        // backward_step returned: input_tensor_grad moves on to this gradient, which is sent.
        kept.input_grad = input.defined() ? input.grad() : at::Tensor();
        if (input.defined()) Send(input.grad());
        if (layout.vpp == 1) kept.popped_input = input;
      }
    }
  };
  // The schedule returned, and its locals with it; so did the output layer's deferred weight
  // gradients (finish_embedding_wgrad_compute, before finalize_model_grads).
  auto end_schedule = [&]() {
    kept.input_grad.reset();
    kept.output_grad.reset();
    kept.popped_input.reset();
    kept.warmup_input.reset();
    workspaces.BeforeDeferredWgrad();
    model.FinishDeferredWgrad();
  };
  // Note [CUDA graphs] in parallel/cuda_graphs.h: the capture pass, counting only the graphed
  // scopes, with the static buffers the graphs keep from then on.
  std::vector<at::Tensor> graph_static_buffers;
  auto capture_cuda_graphs = [&]() {
    std::vector<int64_t> graphed_layers;
    for (int64_t c = 0; c < model.num_chunks(); ++c) {
      graphed_layers.push_back(model.LayersInChunk(c));
    }
    graph_static_buffers = AllocateCudaGraphStaticBuffers(
        model_config, training, model.HiddenShape(), model.hidden_dtype(), layout.cp,
        GraphedLayersInFlight(schedule, graphed_layers));
    recorder.set_graph_mode(Recorder::GraphMode::kCapture);
    run_schedule(nullptr);
    end_schedule();
    recorder.set_graph_mode(Recorder::GraphMode::kReplay);
  };
  auto zero_grad = [&]() {
    {
      at::NoGradGuard no_grad;
      for (const at::Tensor& buffer : store.grad_buffers()) buffer.zero_();  // zero_grad_buffer()
    }
    optimizer.ZeroGrad();
  };
  for (int32_t it = 0; it < training.iterations; ++it) {
    // Megatron captures at the top of the iteration, before train_step; memsim runs the
    // capture between iterations, whose pipeline clocks hold their own steps only.
    if (it == training.CudaGraphCaptureIteration()) capture_cuda_graphs();
    model.ReleaseKeptBatches();  // train_step's first act: the rerun state machine's advance
    zero_grad();
    session.BeginIteration(it);
    model.KeepMaxAttentionLogits();
    ActivationOffloader* offloader = model.offloader();
    if (offloader != nullptr) {
      std::vector<ActivationOffloader::ChunkKey> backward_order;
      for (const PipelineStep& step : schedule) {
        if (!step.forward) backward_order.emplace_back(step.microbatch, step.chunk);
      }
      offloader->BeginIteration(it, std::move(backward_order));
    }
    run_schedule(offloader);
    if (offloader != nullptr) offloader->EndIteration();
    end_schedule();
    if (training.empty_unused_memory_level >= 1) session.EmptyCache();  // train_step's
    session.SetPhase(Phase::kOptimizer);
    workspaces.BeforeOptimizerStep();
    optimizer.Step();
    model.ClipQk();
    if (megatron_fsdp) megatron_fsdp->AfterOptimizerStep();
    if (training.empty_unused_memory_level >= 2) session.EmptyCache();
    session.EndIteration();
  }
  return store.num_elements();
}

}  // namespace memsim
