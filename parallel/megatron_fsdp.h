// Megatron-FSDP: Megatron-Core's own fully sharded data parallelism (--use-megatron-fsdp
// with --data-parallel-sharding-strategy optim_grads_params).
//
// Note [Megatron-FSDP]
// Megatron-Core 0.20 (megatron/core/distributed/fsdp/src/megatron_fsdp/: megatron_fsdp.py,
// param_and_grad_buffer.py; version 1, the default) shards parameters, gradients and the
// optimizer over the data-parallel ranks (DP*CP; routed experts over expert DP) in buckets:
//   buckets: one per decoder layer (its FSDP unit, TransformerLayer) and kind (dense,
//            routed experts: ".experts." in the name), plus one for the parameters outside
//            every layer (embedding, final norm, output layer: "non-unit"), in the order
//            the parameters first appear. A bucket of N elements whose largest row (the
//            product of a parameter's trailing dimensions) is c holds
//            S = ceil(N / (d * c)) * d * c elements, d the ranks it is sharded over, and
//            this rank s = S / d of them (build_data_parallel_buffer_index; memsim pads
//            the bucket as a whole, not each parameter).
//   persistent, from setup: per bucket the 16-bit weight shard [s] and the fp32 main
//            weight shard [s] (--megatron-fsdp-main-params-dtype fp32, the default; the
//            optimizer's masters); one gradient shard buffer [sum of s] in the main-grads
//            dtype (--megatron-fsdp-main-grads-dtype, auto: the parameters'). The model's
//            own full parameters are freed once their shards are copied out (each bucket
//            passes through a temporary full copy), then the cache is emptied.
//   gather:  a bucket's full [S] weights are allocated when all-gathered and freed when
//            released (storage resize). Before a layer's forward its buckets are gathered,
//            with the buckets after them ("prefetch") until the prefetched ones hold at
//            least P = max(1e9, 2 * mean layer elements) / 2 elements; the layer's are
//            released after its forward. Backward does the same in reverse order from the
//            layer whose output gradient arrives, releasing each after its backward. The
//            non-unit buckets, once gathered, are never released (PRESERVED, since
//            Megatron-LM #4717, 2026-05-30). Not modelled: start_param_sync's gather of the
//            first bucket and its prefetch at the end of the optimizer step, which the
//            memory measured after the step in five real runs does not show (unexplained).
//   gradients: a bucket's full gradient [S] (--megatron-fsdp-grad-comm-dtype, auto: the
//            main-grads dtype) is allocated at the first gradient of its parameters (the
//            layer's backward; the non-unit bucket's at the output layer's, the first of
//            the backward, else the embedding's, the last) and the weight-gradient GEMMs
//            write into it. After the layer's backward it is reduce-scattered in place and
//            added to the gradient shard, then queued; before each reduce-scatter the
//            oldest queued buckets are freed while the queue holds more than
//            C = max(1e9, 2 * mean layer elements) elements, and the end of each backward
//            frees them all.
//   optimizer: Adam on the fp32 main weight shards with the gradient shards (an fp32 copy
//            of each when they are 16-bit, kept until the next zero_grad: update_main_grads),
//            then the 16-bit weight shards copied from the masters in place.
// Not modelled (refused): PP > 1, full recomputation (it changes prefetch and release),
// FP8 parameters, the double buffers of --fsdp-double-buffer and --nccl-ub (a fixed pool,
// partly outside the caching allocator), other sharding strategies, version 2.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <deque>
#include <vector>

#include "models/parameters.h"
#include "parallel/layer_hooks.h"

namespace memsim {

struct MegatronFsdpOptions {
  int64_t shards = 1;         // DP * CP: dense buckets are sharded over them
  int64_t expert_shards = 1;  // expert data parallelism: routed experts' buckets
  at::ScalarType main_grads = at::kBFloat16;
  at::ScalarType grad_comm = at::kBFloat16;
};

class MegatronFsdp : public LayerHooks {
 public:
  // Buckets every parameter of `store`, allocates the shards and frees the full
  // parameters (Note [Megatron-FSDP]); each parameter's shard_data and shard_grad view its
  // share of its bucket's shards, for the optimizer.
  // REQUIRES: every parameter added to `store`, which outlives this object; in setup.
  MegatronFsdp(ParameterStore* store, const MegatronFsdpOptions& options);
  MegatronFsdp(const MegatronFsdp&) = delete;
  MegatronFsdp& operator=(const MegatronFsdp&) = delete;

  void PreForward(int64_t unit) override;
  void PostForward(int64_t unit, bool recomputing) override;
  void PreBackward(int64_t unit) override;
  void PostBackward(int64_t unit) override;

  // Around each pipeline step: the non-unit buckets' gather before a forward, and the
  // non-unit gradient and the end of backward (_root_post_backward) after a backward.
  // (The caller empties the cache after construction, as Megatron-FSDP's setup does.)
  void BeforeForwardStep();
  void AfterBackwardStep();

 private:
  struct Bucket {
    int64_t unit = -1;  // -1: outside every layer
    bool expert = false;
    std::vector<Parameter*> params;
    int64_t full_elements = 0;  // S
    at::Tensor weights;         // [S], storage only while gathered; params' data view it
    at::Tensor grads;           // [S], storage only while its gradients are pending
    at::Tensor grad_shard;      // [S / shards], in the gradient shard buffer
    bool gathered = false;
    bool grads_allocated = false;
  };
  enum class Order { kForward, kBackward };
  // The buckets of layer `unit` (-1: the non-unit ones), by index.
  std::vector<size_t> BucketsOf(int64_t unit) const;
  // Gathers buckets `wanted` and prefetches past them in `order`, as
  // AllGatherPipeline.all_gather_params does.
  void GatherWithPrefetch(std::vector<size_t> wanted, Order order);
  void Gather(Bucket& bucket);
  void Release(int64_t unit);
  void AllocateGrads(Bucket& bucket);
  // Reduce-scatters the bucket's gradient into its shard and queues the bucket.
  void ReduceScatter(Bucket& bucket);
  void FreeOldestQueued();

  std::vector<Bucket> buckets_;          // in Megatron's bucket order
  int64_t prefetch_elements_ = 0;        // P
  int64_t queue_capacity_elements_ = 0;  // C
  std::deque<Bucket*> queue_;            // reduce-scattered buckets whose gradients are still held
  int64_t queued_elements_ = 0;
  std::vector<at::Tensor> shards_;  // the persistent weight and gradient shard buffers
};

}  // namespace memsim
