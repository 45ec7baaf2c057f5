// The optimizer's memory as Megatron-LM's mixed-precision optimizer has it
// (megatron/core/optimizer/optimizer.py Float16OptimizerWithFloat16Params, FP32Optimizer)
// over a fused Adam (apex/TE FusedAdam) or SGD with momentum.
//
//   setup:       fp32 master copy of every 16-bit parameter (param.detach().clone().float())
//   zero_grad:   16-bit gradients only: frees the fp32 master gradients (set_to_none)
//   step:        16-bit gradients (fp16, bf16 with --grad-reduce-in-bf16): master grad =
//                main_grad.float() (new fp32 tensor per parameter); fp32 gradients: the
//                master grad is main_grad itself;
//                first step only: Adam's exp_avg and exp_avg_sq (fp32, zeros_like master),
//                SGD's momentum buffer; one fused multi-tensor update in place; 16-bit
//                parameters copied back from the masters in place.
//
// With Megatron's distributed optimizer (ZeRO-1) the masters, master gradients and Adam
// state cover only this data-parallel rank's 1/dp of every bucket: about 6 + 12/dp bytes
// per parameter for bf16, 4 + 16/dp for fp16, 8 + 8/dp for fp32. Megatron shards one
// contiguous range of each gradient-buffer bucket per rank, so a rank's state is one
// tensor per parameter its range meets, cut where the range cuts it (Note [Distributed
// optimizer buffers] in parallel/ddp_buffers.h); memsim's other sharded data parallelism
// gives each parameter a ceil(numel/dp) shard.
//
// Note [Counting zeros in gradients]
// --log-num-zeros-in-grad (Megatron-Core 0.20: ChainedOptimizer.step calls count_zeros
// after prepare_grads and the gradient clipping, before step_with_ready_grads, so before the
// first step's lazily made states): count_zeros_fp32 (optimizer/clip_grads.py) walks the
// optimizer's parameters (the masters, or their shards, whose .grad is the master
// gradient; with the optimizer's CPU offload the device gradients of the offloaded shards
// too, as HybridDeviceOptimizer keeps the GPU parameters in its groups), skipping the later stage's
// copy of a shared embedding (`shared`) and, on tensor-parallel ranks other than 0, parameters not
// split over them, and evaluates `grad.numel() - torch.count_nonzero(grad)` into an int64 running
// total. On CUDA, count_nonzero is `(grad != 0).sum()`, and the sum of a bool tensor into int64
// first converts it: a bool tensor of N bytes and an int64 one of 8N, freed before the next
// gradient, so the step's peak gains 9 bytes per element of the largest gradient counted.
// Measured on an H200 with PyTorch 2.11 (validation/fake_pg, the gpt3_7b TP2 PP4 run with
// full recomputation): 256.5 MiB and 2052 MiB for the output layer's 268,959,744 elements
// at the run's peak. memsim skips no duplicated parameter (smaller than the split weights,
// they do not move the peak) and leaves out the reduction's few-KiB staging buffers; a
// parameter holding several experts (stacked_experts) is counted as that many gradients,
// as Megatron holds one parameter per expert: under the distributed optimizer, the overlap
// of this rank's range with each expert's part (the buffer's order taken as the stacking's). The
// loop's host time is not charged on the virtual clock: every Megatron-LM run min_op_s was fitted
// to counts zeros, so that time is already in the other ops' share (KernelTimeOnlyScope in
// simulator/session.h).
//
// Note [Muon]
// --optimizer muon (Megatron-Core 0.20's emerging optimizers, megatron/core/optimizer/
// emerging_optimizers.py over the emerging_optimizers package v0.3.0 it pins):
//   which:   2-D parameters except the word embedding and the output layer take Muon
//            (the learned position embedding, router and expert weights included); the
//            rest (embedding, output layer, norms, biases) the scalar optimizer, Adam;
//   state:   one fp32 momentum buffer (zeros_like the master) per Muon parameter instead
//            of Adam's two: 14 bytes per Muon parameter in bf16 training;
//   step:    per Muon parameter in turn (so only the largest matrix's temporaries count;
//            memsim's routed-expert tensor is its local experts' parameters, one by one):
//            decoupled weight decay and momentum.lerp_(grad) in place, then
//            TensorParallelMuon.orthogonalize: linear_qkv's momentum (Megatron tags it by
//            name) split into q, k and v, each gathered over the query groups by a reshape
//            (a copy with more than one group) and orthogonalized apart, then concatenated
//            (--muon-no-split-qkv: whole); each orthogonalization is newton_schulz_tp in
//            its default "duplicated" mode: a weight with a partition_dim (every
//            tensor-parallel linear, at any TP size; not the router) is all-gathered into
//            a list of fp32 shards and concatenated (two fp32 copies of the whole matrix,
//            alive until it returns), then newton_schulz on X = normalize(whole) (a new
//            fp32 [s, l], s = min(m, n), l = max(m, n)), cast to bf16 (the default
//            "medium" fp32 matmul precision), each of --muon-num-ns-steps iterations making
//            A = X X^T [s, s], B = b A + c A A [s, s] and a new X = a X + B X [s, l], the
//            result back in fp32, this rank's part kept and scaled twice (spectral scale,
//            extra scale factor), then added to the master. The time: the suite's one
//            clean timing of non-distributed Muon (gpt3_moe_mcore_te_ep8_resume_torch_dist_
//            muon on GB200) read -38.8% before the split, the gather and the per-op
//            counts were modelled.
// With --use-distributed-optimizer Megatron-LM swaps in its layer-wise optimizer (Note
// [Layer-wise optimizer]).
//
// Note [Layer-wise optimizer]
// Muon with --use-distributed-optimizer --no-use-layer-wise-param-layout (Megatron-Core
// 0.20: arguments.py turns the flag into use_layer_wise_distributed_optimizer and leaves DDP
// in plain all-reduce mode; optimizer/__init__.py builds LayerWiseDistributedOptimizer over
// Float16 wrappers of Muon and TE FusedAdam; layer_wise_optimizer.py
// _shard_params_ping_pong):
//   grads:   DDP's full fp32 gradient buffers, unpadded, all-reduced (memsim's ddp);
//   owners:  every parameter of both optimizers in one list, sorted by numel (a stable sort;
//            Muon's groups come before Adam's), then dealt whole: dense parameters to the
//            dp*cp ranks in the ping-pong order 0, 1, .., n-1, n-1, .., 0, 0, 1, ..; routed
//            experts' the same way over the expert data-parallel ranks, with a counter of
//            their own. Only the owner holds the parameter's fp32 master and state (Muon's
//            momentum, Adam's two moments), so ranks differ: memsim simulates the rank
//            holding the most (the dense and the expert rank with the most state bytes),
//            the one that decides whether the layout fits, or a given rank;
//   step:    each rank updates what it owns and copies it into the 16-bit parameters, then
//            allgather_params: a flat copy of its own dense parameters and a receive buffer
//            of every other rank's (the whole dense model in 16 bits, alive together),
//            freed when the values are copied in; the same over the expert data-parallel
//            group when it has more than one rank.
// Sorting by (numel, Adam after Muon) gives every rank the same bytes as Megatron's order:
// ties of one kind hold equal state. Without --no-use-layer-wise-param-layout Megatron
// places Muon parameters by LPT over padded shards of separate buffers: not modelled.
//
// Note [Precision-aware optimizer]
// --use-precision-aware-optimizer (Megatron-Core 0.20's distrib_optimizer.py with Transformer
// Engine 2.18's FusedAdam(master_weights=True, use_decoupled_grad=True)): Megatron makes no
// fp32 master shards; the optimizer's parameters are the 16-bit parameter shards and each
// gradient is the gradient buffer's shard as it is (decoupled_grad: no fp32 copy, whatever
// its dtype). In the first step FusedAdam creates per shard exp_avg and exp_avg_sq
// (zeros, --exp-avg-dtype / --exp-avg-sq-dtype) and the master weight: with
// store_param_remainders (the default) and bf16 parameters only the 16 bits an fp32 master
// has beyond the bf16 value (int16 zeros), else an fp32 master initialised from a clone of
// the parameter; each non-fp32 state also gets an fp32 [1] scale. Its kernel writes the
// 16-bit parameters itself. Bytes per parameter with d data-parallel ranks, bf16,
// defaults: 2 param + 4 grad + (2 + 4 + 4)/d = 6 + 10/d. Modelled for fp32 or bf16
// gradients, both states fp32 or both bf16 (the unscaling is fused then; one bf16 state
// beside an fp32 one gets fp32 copies in the step), and an fp32 master; the rest is refused.
//
// Note [Optimizer CPU offload]
// --optimizer-cpu-offload with --optimizer-offload-fraction F (Megatron-Core 0.20:
// optimizer/cpu_offloading/hybrid_optimizer.py HybridDeviceOptimizer, built by
// distrib_optimizer.py over the precision-aware optimizer's 16-bit parameter shards; it
// needs --use-precision-aware-optimizer): the shards are taken in order, greedily while the
// running total of elements is under F times all of them (each optimizer instance, dense and
// expert, on its own, in the optimizer's parameter order: parameter group, then the grad
// buffer's reverse order, Note [Distributed optimizer buffers] in parallel/ddp_buffers.h),
// and those live on the host: their fp32 masters, Adam states and gradient copies take no
// device memory. The rest run TE's FusedAdam with its defaults: an
// fp32 clone of each shard made when the optimizer is built, fp32 exp_avg and exp_avg_sq in
// the first step (the precision-aware dtypes and param remainders do not apply), and, with
// 16-bit gradients, an fp32 copy of each gradient that stays from step to step. A step
// copies each offloaded shard's update back through an fp32 device buffer of the shard's
// size, one at a time [inferred from PyTorch's non-blocking cross-dtype copy]. Not modelled:
// the throwaway optimizer built first over the unsharded parameters (fp32 clones of the
// device part until the first garbage collection) and host memory.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

#include "models/model_config.h"
#include "models/parameters.h"

namespace memsim {

// The states of Note [Precision-aware optimizer].
struct PrecisionAwareStates {
  at::ScalarType exp_avg = at::kFloat;
  at::ScalarType exp_avg_sq = at::kFloat;
  bool param_remainders = true;
};

// The groups a layer-wise optimizer deals whole parameters over (Note [Layer-wise optimizer]).
struct LayerWiseGroups {
  int64_t dense_ranks = 1;   // dp * cp
  int64_t expert_ranks = 1;  // expert data parallelism
  // This rank's place in each group; unset: the rank holding the most state there.
  std::optional<int64_t> dense_rank, expert_rank;
};

struct OptimizerOptions {
  OptimizerKind kind = OptimizerKind::kAdam;
  // The data-parallel size with a distributed optimizer, else 1; `expert_shards` the same
  // for routed experts' parameters (expert data parallelism).
  int64_t shards = 1;
  int64_t expert_shards = 1;
  int64_t muon_ns_steps = 5;  // Newton-Schulz iterations of a Muon update (Note [Muon])
  // Note [Muon]: the tensor-parallel sizes Muon gathers split weights over (routed experts:
  // expert TP), and linear_qkv's rows per query group for q, k and v, orthogonalized apart
  // (empty: --muon-no-split-qkv, or multi-latent attention).
  int64_t tp = 1;
  int64_t expert_tp = 1;
  std::vector<int64_t> muon_qkv_split_rows;
  // Transformer Engine's FusedAdam keeps the masters and states (REQUIRES: kind Adam).
  std::optional<PrecisionAwareStates> precision_aware;
  // Whole parameters dealt over the data-parallel ranks (REQUIRES: kind Muon, shards 1).
  std::optional<LayerWiseGroups> layer_wise;
  // Note [Optimizer CPU offload]: the share of the shards on the host (REQUIRES:
  // precision_aware when above 0).
  double cpu_offload_fraction = 0.0;
  // fp32 masters cloned from fp32 parameters too (Megatron-FSDP's main-weight buffer),
  // instead of updating the parameters themselves.
  bool fp32_masters_always = false;
  // Where the distributed optimizer's buckets cut the parameters (Note [Distributed
  // optimizer buffers]), the order Megatron-Core's optimizers make their state in: routed
  // experts' after the dense parameters' when they are expert-parallel (their own
  // optimizer), and with --overlap-param-gather-with-optimizer-step the first model
  // chunk's before the other chunks' (an optimizer of its own).
  bool experts_apart = true;
  bool first_chunk_apart = false;
  // Note [Counting zeros in gradients] (--log-num-zeros-in-grad).
  bool count_zeros_in_grads = false;
};

class MixedPrecisionOptimizer {
 public:
  // Allocates the master parameters (in the setup phase, as optimizer construction does;
  // with `precision_aware` the first Step() makes them).
  MixedPrecisionOptimizer(ParameterStore* store, const OptimizerOptions& options);
  MixedPrecisionOptimizer(const MixedPrecisionOptimizer&) = delete;
  MixedPrecisionOptimizer& operator=(const MixedPrecisionOptimizer&) = delete;

  void ZeroGrad();
  void Step();
  // Makes the states the first Step() would (a checkpoint load's dummy step); no-op when
  // they exist.
  void CreateStates();

 private:
  // This rank's share of parameter `index` and of its gradient (the whole of them without
  // sharding): views, made on first use and kept, since every step reads them
  // (benchmarks/PROFILE.md, item 3).
  const at::Tensor& ParameterShard(size_t index) const { return CachedShard(index, false); }
  const at::Tensor& GradientShard(size_t index) const { return CachedShard(index, true); }
  const at::Tensor& CachedShard(size_t index, bool gradient) const;
  // Note [Counting zeros in gradients]: the temporaries of counting the zeros of
  // `master_grads_`. REQUIRES: master_grads_ made for this step.
  void CountZerosInGrads() const;
  // FusedAdam's first-step state (Note [Precision-aware optimizer]).
  void CreatePrecisionAwareStates();
  // Which shards go to the host (Note [Optimizer CPU offload]); sets `on_host_`.
  void SplitHostShards();
  bool hybrid() const { return options_.cpu_offload_fraction > 0; }
  // The gradients the hybrid optimizer's two parts read (Note [Optimizer CPU offload]).
  void HybridGradients();
  // Its updates back into the 16-bit parameter shards.
  void CopyUpdatedShards();
  // Which parameters this rank owns under the layer-wise optimizer; `rank_elements_`.
  void DealWholeParameters(const LayerWiseGroups& groups);
  // allgather_params of Note [Layer-wise optimizer]: every rank's parameters of one group
  // (`rank_elements` of them each, this rank's `own`) in flat 16-bit buffers together.
  void AllGatherParameters(const std::vector<int64_t>& rank_elements, int64_t own) const;

  ParameterStore* store_;
  OptimizerOptions options_;
  int64_t step_ = 0;
  // Whether this rank updates the parameter (all of them but under the layer-wise
  // optimizer, or those other ranks' buckets hold under the distributed optimizer's); the
  // others have no master, gradient copy or state here.
  std::vector<bool> owned_;
  // The parameters' indices in the order their state is made (StateOrder in optimizer.cc).
  std::vector<size_t> order_;
  // ParameterShard's and GradientShard's views, by parameter (undefined until first used).
  mutable std::vector<at::Tensor> param_shards_, grad_shards_;
  // Layer-wise: the 16-bit elements each rank owns, dense and expert groups; the rank
  // simulated in each.
  std::vector<int64_t> dense_rank_elements_, expert_rank_elements_;
  int64_t dense_rank_ = 0, expert_rank_ = 0;
  // fp32 (the parameters themselves in fp32 training), or precision-aware int16 remainders.
  std::vector<at::Tensor> masters_;
  // 16-bit gradients: owned fp32 copies, kept until ZeroGrad (Megatron-FSDP's
  // update_main_grads copies stay too); else (and precision-aware) views of main_grad.
  std::vector<at::Tensor> master_grads_;
  bool master_grads_are_copies_ = false;
  // Per parameter: Adam's m, SGD's or Muon's momentum; Adam's v (undefined for Muon's).
  std::vector<at::Tensor> exp_avgs_;
  std::vector<at::Tensor> exp_avg_sqs_;
  std::vector<at::Tensor> state_scales_;  // precision-aware bf16 states' scales
  // Note [Optimizer CPU offload]: whether each parameter's shard is on the host (all false
  // without offloading), and the device part's fp32 gradient copies (16-bit gradients).
  std::vector<bool> on_host_;
  std::vector<at::Tensor> hybrid_grads_;
  std::vector<bool> muon_;  // the parameter takes Muon (Note [Muon])
};

}  // namespace memsim
