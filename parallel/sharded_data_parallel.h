// Data parallelism that shards gradients (ZeRO-2) and parameters (ZeRO-3 / FSDP).
//
// ZeRO-2 (DeepSpeed stage 2 / FSDP SHARD_GRAD_OP): parameters stay whole; gradients are
// reduce-scattered bucket by bucket during backward, so a rank holds one bucket of full
// gradients (at least the largest parameter) plus its fp32 1/dp shard of all of them.
//
// FSDP (ZeRO-3, PyTorch FSDP with a transformer-layer wrap policy): each layer's
// parameters live as 1/dp shards; the layer's full parameters are all-gathered right
// before its forward and freed right after it (reshard_after_forward), gathered again
// before its backward (with BACKWARD_PRE prefetch, the previous layer's too, so two
// layers are whole at once in backward), and its full gradients exist only while its
// backward runs, then are reduce-scattered into the fp32 shard. Parameters outside the
// layers (embeddings, final norm, output layer: FSDP's root unit) stay whole through
// the step and keep a regular gradient buffer here, as FSDP's root does not reshard.
// Freeing and regathering go through the storage, as FSDP's resize_(0) does, so the
// tensors autograd saved keep their shapes.
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <vector>

#include "models/parameters.h"
#include "parallel/layer_hooks.h"
#include "parallel/layout.h"

namespace memsim {

// Bucket of full gradients ZeRO-2 reduce-scatters at a time (elements): Megatron's and
// DeepSpeed's common default of 40M, or the largest parameter if larger.
inline constexpr int64_t kGradientBucketElements = 40'000'000;

// ZeRO-2: the bucket every main_grad aliases and every parameter's fp32 gradient shard.
// REQUIRES: every parameter added to `store`; called instead of AllocateGradBuffer.
void AllocateZero2Gradients(ParameterStore* store, int64_t dp);

// FSDP: owns the gathered/resharded state of every layer's parameters; its LayerHooks
// run around each layer (RunHookedLayer).
class FullyShardedDataParallel : public LayerHooks {
 public:
  // Shards every layer's parameters (their full storage freed, a 1/dp shard kept) and
  // allocates the fp32 gradient shards; root parameters get a gradient buffer.
  // REQUIRES: every parameter added to `store`, which outlives this object.
  FullyShardedDataParallel(ParameterStore* store, int64_t dp);
  FullyShardedDataParallel(const FullyShardedDataParallel&) = delete;
  FullyShardedDataParallel& operator=(const FullyShardedDataParallel&) = delete;

  void PreForward(int64_t unit) override { Gather(unit); }
  // Recomputation in backward keeps the parameters for the backward that follows.
  void PostForward(int64_t unit, bool recomputing) override {
    if (!recomputing) Reshard(unit);
  }
  void PreBackward(int64_t unit) override;
  void PostBackward(int64_t unit) override;

 private:
  struct Unit {
    std::vector<Parameter*> params;
    at::Tensor full_grads;  // fp32, storage only while the layer's backward runs
    bool gathered = false;
  };
  void Gather(int64_t unit);
  void Reshard(int64_t unit);

  ParameterStore* store_;
  int64_t dp_;
  std::map<int64_t, Unit> units_;
};

}  // namespace memsim
