// Megatron-FSDP: Megatron-Core's own fully sharded data parallelism (--use-megatron-fsdp
// with --data-parallel-sharding-strategy optim_grads_params).
//
// Note [Megatron-FSDP]
// Megatron-Core 0.20 (megatron/core/distributed/fsdp/src/megatron_fsdp/: megatron_fsdp.py,
// param_and_grad_buffer.py; version 1, the default) shards parameters, gradients and the
// optimizer over the data-parallel ranks (DP*CP; routed experts over expert DP) in buckets:
//   buckets: one per decoder layer (its FSDP unit, TransformerLayer; an MTP layer's inner
//            transformer layer is one too, its norms and projection are non-unit), kind (dense,
//            routed experts: ".experts." in the name) and dtype (FP8 parameters apart),
//            plus one per kind and dtype for the parameters outside every layer (embedding,
//            final norm, output layer: "non-unit"), in the order the parameters first
//            appear. A bucket of N elements whose largest row (the
//            product of a parameter's trailing dimensions) is c holds
//            S = ceil(N / (d * c)) * d * c elements, d the ranks it is sharded over, and
//            this rank s = S / d of them (build_data_parallel_buffer_index; memsim pads
//            the bucket as a whole, not each parameter).
//   persistent, from setup: per bucket the weight shard [s] in the parameters' dtype
//            (FP8 parameters: their uint8 data, a 1-element scale each besides) and the
//            fp32 main weight shard [s] (--megatron-fsdp-main-params-dtype fp32, the
//            default; the optimizer's masters, made in fp32 training too); one gradient
//            shard buffer [sum of s] per main-grads dtype (--megatron-fsdp-main-grads-dtype,
//            auto: bf16 for FP8 parameters, else the parameters' own; param_and_grad_
//            buffer.py's _get_main_grad_dtype). The model's
//            own full parameters are freed once their shards are copied out (each bucket
//            passes through a temporary full copy), then the cache is emptied. With
//            --init-model-with-meta-device the model was built on the meta device and is
//            never whole on the GPU: each parameter is made (to_empty, reset_parameters)
//            while its bucket is filled and goes once copied in (memsim makes them one at a
//            time where Megatron makes a module's at once).
//   gather:  a bucket's full [S] weights are allocated when all-gathered and freed when
//            released (storage resize). Before a layer's forward its buckets are gathered,
//            with the buckets after them ("prefetch") until the prefetched ones hold at
//            least P = max(1e9, 2 * mean layer elements) / 2 elements; the layer's are
//            released after its forward. Backward does the same in reverse order from the
//            layer whose output gradient arrives, releasing each after its backward. The
//            non-unit buckets, once gathered, are never released (PRESERVED, since
//            Megatron-LM #4717, 2026-05-30). Every module outside the layers prefetches
//            so too. The final norm's hook, which comes after every layer's release,
//            gathers the layers again from the first one, held until each layer's
//            backward: before 41f3b6f308 (2026-04-02) on every forward, which the two MoE
//            cases recorded then confirm (within 1.4% from 4-6% low); since, in the run's
//            first forward only (the modules outside the layers stay PRE_BACKWARD from the
//            first backward on). Not modelled: that first forward's gather, which as read
//            puts the three dense cases' peaks 35 MiB above their measured values (their
//            first-iteration peak is the steady one: when the gathered buckets go in that
//            first step is not understood). After the optimizer step start_param_sync
//            gathers the first bucket (the non-unit one) with prefetch, and
//            --log-params-norm's stop_communication resets the buckets, releasing all but
//            the non-unit ones (before #4717 those too), before the memory is logged.
//   load:    a checkpoint load in fsdp_dtensor format (--load, --ckpt-format fsdp_dtensor)
//            runs a dummy optimizer step (_init_optimizer_states_with_dummy_values), even
//            when no checkpoint is there: the optimizer's states exist from the setup.
//   gradients: a bucket's full gradient [S] (--megatron-fsdp-grad-comm-dtype, auto: the
//            main-grads dtype) is allocated at the first gradient of its parameters (the
//            layer's backward; the non-unit bucket's at the output layer's, the first of
//            the backward, else the embedding's, the last) and the weight-gradient GEMMs
//            write into it. Without gradient accumulation fusion the output layer's weight
//            gradient is param.grad, which the post-accumulate hook copies in once the
//            output layer's backward has returned: the non-unit bucket comes after it. After the
//            layer's backward it is reduce-scattered in place and added to the gradient shard, then
//            queued; before each reduce-scatter the oldest queued buckets are freed while the queue
//            holds more than C = max(1e9, 2 * mean layer elements) elements, and the end of each
//            backward frees them all.
//   optimizer: Adam on the fp32 main weight shards with the gradient shards (an fp32 copy
//            of each when they are 16-bit, kept until the next zero_grad: update_main_grads),
//            then the 16-bit weight shards copied from the masters in place.
// FP8 parameters (--fp8-param-gather) are modelled where the GPU's FP8 GEMMs read any
// layout (Blackwell): elsewhere Transformer Engine makes a transpose cache after each
// gather in backward (fp8_create_transpose_cache).
// Not modelled (refused): PP > 1, full recomputation (it changes prefetch and release),
// FP8 parameters before Blackwell, --nccl-ub (its buffers in NCCL's memory pool),
// --megatron-fsdp-max-pool-double-buffer (MaxPoolAllocator), other sharding strategies,
// version 2.
//
// Note [Megatron-FSDP double buffers]
// --fsdp-double-buffer (Megatron-Core 0.20, param_and_grad_buffer.py: FixedPoolAllocator,
// size 2, for the gathered weights and, in the gradients' communication dtype, the full
// gradient buckets):
//   units:   the largest set of layers whose buckets match in order, dtype and size (the
//            first such set found in layer order; for DeepSeek-V3 the MoE layers, not the
//            three dense ones) is double-buffered; other layers' and the non-unit buckets
//            are allocated and freed as above (or, with --fsdp-db-use-persist-buf-on-alloc-
//            fail, each kept in a persistent buffer of its own from its first use).
//   buffers: a double-buffered layer's k-th bucket lives in one of two persistent buffers
//            for offset k, taken from Megatron's global memory buffer the first time it is
//            needed and never freed: 2 x (sum of a layer's buckets) for the weights and as
//            many elements again, in the gradients' communication dtype, for the gradients.
//            Setup fills each bucket through the same pool (fetch_bucket without a fixed
//            assignment), so the first layer's weight buffers, and with the fallback every
//            other bucket's, are made then. A gather takes an idle one (the one the bucket
//            had before if idle, else the lowest); a release gives it back.
//   limits:  a gather's prefetch stops before a third layer (any unit, the non-unit buckets
//            counting as one) would join the wanted ones, and the non-unit buckets'
//            gathers prefetch nothing; before a layer's gradient buckets are taken and
//            before each reduce-scatter, the oldest queued gradient buckets are released
//            until the queue and the new ones span at most two units
//            (_enforce_double_buffer_limit).
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "models/parameters.h"
#include "parallel/layer_hooks.h"
#include "simulator/attribution.h"

namespace memsim {

struct MegatronFsdpOptions {
  int64_t shards = 1;         // DP * CP: dense buckets are sharded over them
  int64_t expert_shards = 1;  // expert data parallelism: routed experts' buckets
  // Unset: auto, per bucket (bf16 for FP8 parameters, else the parameters' dtype; the
  // communication dtype then the main gradients').
  std::optional<at::ScalarType> main_grads;
  std::optional<at::ScalarType> grad_comm;
  // --log-params-norm: the norm's stop_communication resets the buckets after the step.
  bool log_params_norm = false;
  // Megatron-FSDP before 41f3b6f308 and before #4717 (TrainingConfig).
  bool final_norm_gathers_every_forward = false;
  bool reset_releases_non_unit = false;
  // Note [Megatron-FSDP double buffers]: --fsdp-double-buffer and
  // --fsdp-db-use-persist-buf-on-alloc-fail.
  bool double_buffer = false;
  bool persistent_fallback = false;
  // --init-model-with-meta-device: the parameters were never materialized (the store's
  // set_unmaterialized); each is made while its bucket is filled.
  bool meta_init = false;
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
  // The final norm's pre-forward hook: its (non-unit) bucket with prefetch, on every
  // forward with final_norm_gathers_every_forward (Megatron-FSDP before 41f3b6f308).
  void BeforeFinalNorm();
  // After the optimizer step: start_param_sync's gather with prefetch, then with
  // --log-params-norm reset(), which releases the layers' buckets.
  void AfterOptimizerStep();

 private:
  struct Bucket {
    int64_t unit = -1;  // -1: outside every layer
    bool expert = false;
    bool fp8 = false;                        // FP8 parameters: their FP8 data, 1 byte each
    at::ScalarType main_grads = at::kFloat;  // the gradient shard's dtype
    std::vector<Parameter*> params;
    int64_t full_elements = 0;  // S
    at::Tensor weights;         // [S], storage only while gathered; params' data view it
    at::Tensor grads;           // [S], storage only while its gradients are pending
    at::Tensor grad_shard;      // [S / shards], in the gradient shard buffer
    bool gathered = false;
    bool grads_allocated = false;
    int64_t offset_in_unit = 0;  // its index among its layer's buckets
  };
  // FixedPoolAllocator (Note [Megatron-FSDP double buffers]): the buffers of the weights'
  // or the gradients' double-buffered units.
  struct FixedPool {
    std::vector<int64_t> units;                // double-buffered
    std::set<std::pair<int, int64_t>> in_use;  // (buffer group, bucket offset)
    std::map<size_t, std::pair<int, int64_t>> using_by_bucket;
    std::map<size_t, int> planned_group;                    // by bucket: where it went first
    std::map<std::pair<int, int64_t>, at::Tensor> buffers;  // persistent, by slot
    std::map<size_t, at::Tensor> persistent_fallback;       // by bucket
    bool Holds(int64_t unit) const {
      return std::find(units.begin(), units.end(), unit) != units.end();
    }
  };
  enum class Order { kForward, kBackward };
  size_t IdOf(const Bucket& bucket) const { return static_cast<size_t>(&bucket - buckets_.data()); }
  // The buckets of layer `unit` (-1: the non-unit ones), by index.
  std::vector<size_t> BucketsOf(int64_t unit) const;
  // Gathers buckets `wanted` and prefetches past them in `order`, as
  // AllGatherPipeline.all_gather_params does.
  void GatherWithPrefetch(std::vector<size_t> wanted, Order order);
  void Gather(Bucket& bucket);
  void Release(int64_t unit);
  // Gives bucket `id`'s weights (grads) their bytes, from the fixed pool where double-buffered;
  // `strict`: the buffer it gets is the one it asks for first from then on.
  void TakeStorage(FixedPool& pool, size_t id, const at::Tensor& full, Category category,
                   bool strict = true);
  void ReleaseStorage(FixedPool& pool, size_t id, const at::Tensor& full);
  // The largest set of layers whose buckets match in dtype (`dtype_of`) and size.
  std::vector<int64_t> SymmetricUnits(
      const std::function<at::ScalarType(const Bucket&)>& dtype_of) const;
  // Releases the oldest queued gradient buckets until they and `unit` span two units.
  void EnforceDoubleBufferLimit(int64_t unit);
  void AllocateGrads(Bucket& bucket);
  // Reduce-scatters the bucket's gradient into its shard and queues the bucket.
  void ReduceScatter(Bucket& bucket);
  void FreeOldestQueued();

  const bool gradient_accumulation_fusion_;
  const MegatronFsdpOptions options_;
  // Without the fusion: the non-unit gradients come once the output layer's backward is
  // done (its post-backward hook).
  bool non_unit_grads_pending_ = false;
  std::vector<Bucket> buckets_;          // in Megatron's bucket order
  int64_t prefetch_elements_ = 0;        // P
  int64_t queue_capacity_elements_ = 0;  // C
  std::deque<Bucket*> queue_;            // reduce-scattered buckets whose gradients are still held
  int64_t queued_elements_ = 0;
  std::vector<at::Tensor> shards_;     // the persistent weight and gradient shard buffers
  FixedPool weight_pool_, grad_pool_;  // with double buffers
};

}  // namespace memsim
