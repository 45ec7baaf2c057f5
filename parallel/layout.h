// ParallelLayout: how a training job is split over GPUs, with Megatron-LM's rank order.
//
// world = tp * cp * dp * pp ranks. Megatron-LM's default order "tp-cp-ep-dp-pp" puts the
// tensor-parallel index fastest:
//   rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))
// Expert layers regroup the same ranks as etp * ep * edp (expert-data-parallel) within
// each pipeline stage: tp * cp * dp = etp * ep * edp.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "models/model_config.h"
#include "simulator/enum_names.h"
#include "simulator/status.h"

namespace memsim {

// How data parallelism shards model state (Megatron DDP and its distributed optimizer,
// or FSDP).
enum class DataParallelKind {
  kDdp,                   // every rank holds everything
  kDistributedOptimizer,  // ZeRO-1: fp32 master weights and Adam states sharded over dp
  kZero2,                 // ... and gradients
  kFsdp,                  // ZeRO-3: parameters too, gathered around each layer
  kMegatronFsdp,          // Megatron-Core's FSDP, optim_grads_params (megatron_fsdp.h)
};
// zero1 and zero3 are aliases parsing accepts (Note [Enum names]).
inline constexpr EnumName<DataParallelKind> kDataParallelNames[] = {
    {DataParallelKind::kDdp, "ddp"},
    {DataParallelKind::kDistributedOptimizer, "distributed-optimizer"},
    {DataParallelKind::kDistributedOptimizer, "zero1"},
    {DataParallelKind::kZero2, "zero2"},
    {DataParallelKind::kFsdp, "fsdp"},
    {DataParallelKind::kFsdp, "zero3"},
    {DataParallelKind::kMegatronFsdp, "megatron-fsdp"}};

// How Megatron-LM sizes its DDP gradient buckets (its resolve_ddp_bucket_size; Note
// [Distributed optimizer buffers] in parallel/ddp_buffers.h).
struct DdpBucketOptions {
  bool overlap_grad_reduce = false;    // --overlap-grad-reduce
  std::optional<int64_t> bucket_size;  // --ddp-bucket-size (elements)
  std::optional<int64_t> num_buckets;  // --ddp-num-buckets
  bool overlap_param_gather_with_optimizer_step = false;
  bool pad_for_high_nccl_busbw = false;  // --ddp-pad-buckets-for-high-nccl-busbw
};

struct ParallelLayout {
  int64_t world_size = 1;
  int64_t tp = 1;  // tensor parallel
  bool sequence_parallel = false;
  int64_t pp = 1;   // pipeline parallel
  int64_t vpp = 1;  // virtual pipeline stages (model chunks) per pipeline rank
  // Interleaving runs microbatches through each chunk in groups of this many; 0: pp.
  int64_t microbatch_group_size = 0;
  // --overlap-moe-expert-parallel-comm: Megatron-Core's combined 1F1B schedule (Note
  // [Combined 1F1B] in parallel/pipeline_schedule.h).
  bool combined_1f1b = false;
  // The interleaved schedule's overlapped p2p path (Megatron-LM's default; off with
  // --no-overlap-p2p-communication, which then needs PP > 2): Note [Tensors the schedule
  // keeps] in parallel/rank_training.cc.
  bool overlap_p2p_comm = true;
  int64_t cp = 1;   // context parallel
  int64_t ep = 1;   // expert parallel
  int64_t etp = 0;  // expert tensor parallel; 0: = tp
  // Uneven pipelines: layers on the first and last stage (0: even split).
  int64_t first_stage_layers = 0;
  int64_t last_stage_layers = 0;
  // --account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split: the
  // even split counts the embedding (loss) as one more layer, which the first chunk of the
  // first stage (the last chunk of the last stage) then builds one decoder layer fewer for
  // (get_num_layers_to_build in Megatron-Core's transformer_block.py).
  bool embedding_in_split = false;
  bool loss_in_split = false;
  // --pipeline-model-parallel-layout (Note [Pipeline layout]): Megatron-Core's layout
  // string, e.g. "Et*3|(tt|)*6mL"; empty: the split above. It sets vpp.
  std::string pipeline_layout;
  DataParallelKind data_parallel = DataParallelKind::kDdp;
  // Distributed optimizer: replicas of the optimizer state (--num-distributed-optimizer-
  // instances); each shards over data-parallel (x context-parallel) ranks / instances.
  int64_t distributed_optimizer_instances = 1;
  // How its gradient buffers are cut into buckets (Note [Distributed optimizer buffers] in
  // parallel/ddp_buffers.h).
  DdpBucketOptions ddp_buckets;
  bool deallocate_pipeline_outputs = true;  // Megatron-LM sets it for every run

  int64_t dp = 1;   // derived: world / (tp * pp * cp)
  int64_t edp = 1;  // derived: expert data parallel = tp * cp * dp / (etp * ep)
  // Derived from pipeline_layout: decoder layers of each of its pp * vpp segments, in
  // its order (segment i is chunk i / pp of stage i % pp); empty without a layout.
  std::vector<int64_t> layout_layers;
};

// Note [Pipeline layout]
// Megatron-Core's PipelineParallelLayerLayout (megatron/core/transformer/
// pipeline_parallel_layer_layout.py, 0.20): '|' separates pp * vpp segments, segment i
// being virtual chunk i / pp of pipeline stage i % pp; 'E' is the embedding, 't' a
// decoder layer, 'm' an MTP layer, 'L' the loss; "(...)*n" and "x*n" repeat, commas are
// cosmetic. Megatron requires the embedding first and the loss last in layer order, each
// once, num_layers decoder layers and the MTP layers after them. memsim also requires the
// embedding in the first stage's first chunk, the loss and any MTP layers in the last
// stage's last chunk (where its model builds them); Megatron's standalone MTP stages are
// refused.
// Parses `text` for `pp` stages: the decoder layers per segment (and so vpp = their
// number / pp). The error names what is wrong and where.
// REQUIRES: pp > 0.
Status ParsePipelineLayout(const std::string& text, int64_t pp, const ModelConfig& model,
                           std::vector<int64_t>* layers_per_segment);

// Where one rank sits in every group.
struct RankCoordinates {
  int64_t tp_rank, cp_rank, dp_rank, pp_rank;
};

// Derives dp, edp, etp and checks every rule against the model; the error names the rule
// and the numbers ("TP=3 does not divide 32 attention heads").
// REQUIRES: `model` passed FinalizeModelConfig with this layout's tp.
Status FinalizeLayout(ParallelLayout* layout, const ModelConfig& model);

// How many ranks share one copy of the distributed optimizer's state: Megatron's
// intra-instance data-parallel group, DP x CP (dense) or expert DP (routed experts),
// over the instances. 1 without a distributed optimizer.
int64_t OptimizerShards(const ParallelLayout& layout, bool experts);

// Whether routed experts are expert-parallel (Megatron-Core's param.allreduce = False: EP > 1
// or ETP != TP), with DDP buffers and an optimizer of their own; else they are reduced and
// optimized with the dense parameters.
inline bool ExpertsApart(const ParallelLayout& layout) {
  return layout.ep > 1 || layout.etp != layout.tp;
}

RankCoordinates CoordinatesOf(const ParallelLayout& layout, int64_t rank);

// Layers each pipeline stage holds, in order (uneven first/last as configured), per
// virtual chunk: layers of (pp_rank, chunk).
// REQUIRES: `layout` passed FinalizeLayout with `model`; 0 <= pp_rank < pp, 0 <= chunk < vpp.
int64_t LayersOnStage(const ParallelLayout& layout, const ModelConfig& model, int64_t pp_rank,
                      int64_t chunk);
// The global index of the first layer of (pp_rank, chunk).
int64_t FirstLayerOfStage(const ParallelLayout& layout, const ModelConfig& model, int64_t pp_rank,
                          int64_t chunk);

inline std::string DataParallelName(DataParallelKind kind) {
  return std::string(NameOf(kDataParallelNames, kind));
}

}  // namespace memsim
