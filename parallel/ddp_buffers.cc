#include "parallel/ddp_buffers.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <numeric>
#include <utility>

#include "simulator/check.h"
#include "simulator/checked_math.h"
#include "simulator/session.h"

namespace memsim {

BufferLayout LayOutBuffer(const std::vector<BufferParameter>& params,
                          std::optional<int64_t> bucket_size, int64_t dp,
                          bool pad_for_high_nccl_busbw) {
  MEMSIM_DCHECK(dp >= 1 && (!bucket_size || *bucket_size > 0));
  const int64_t divisor =
      std::lcm(std::lcm(dp, int64_t{128}), pad_for_high_nccl_busbw ? int64_t{1} << 16 : 1);
  BufferLayout layout;
  layout.starts.assign(params.size(), 0);
  layout.buckets.assign(params.size(), 0);
  int64_t bucket_start = 0, next_start = 0, end = 0;
  bool bucket_open = false;
  auto close_bucket = [&](int64_t bucket_end) {
    layout.bucket_ranges.push_back({bucket_start, CheckedRoundUp(bucket_end, divisor)});
    bucket_start = next_start = layout.bucket_ranges.back().end;
    bucket_open = false;
  };
  for (size_t k = params.size(); k-- > 0;) {  // backward's order
    const BufferParameter& p = params[k];
    int64_t start = CheckedRoundUp(next_start, 64);
    if (p.shared_embedding && bucket_open) {
      close_bucket(start);
      start = bucket_start;
    }
    end = CheckedAdd(start, p.numel);
    layout.starts[k] = start;
    layout.buckets[k] = static_cast<int64_t>(layout.bucket_ranges.size());
    bucket_open = true;
    if ((bucket_size && end - bucket_start >= *bucket_size) || p.shared_embedding) {
      close_bucket(end);
    } else {
      next_start = end;
    }
  }
  if (bucket_open) close_bucket(end);
  layout.numel = layout.bucket_ranges.empty() ? 0 : layout.bucket_ranges.back().end;
  return layout;
}

std::vector<ParameterSlice> RankSlices(const std::vector<BufferParameter>& params,
                                       const BufferLayout& layout, int64_t dp, int64_t rank) {
  MEMSIM_DCHECK(0 <= rank && rank < dp && params.size() == layout.starts.size());
  std::vector<ParameterSlice> slices(params.size());
  for (size_t k = 0; k < params.size(); ++k) {
    const BufferLayout::Bucket& bucket =
        layout.bucket_ranges[static_cast<size_t>(layout.buckets[k])];
    const int64_t share = (bucket.end - bucket.start) / dp;
    const int64_t first = std::max(layout.starts[k], bucket.start + rank * share);
    const int64_t last =
        std::min(layout.starts[k] + params[k].numel, bucket.start + (rank + 1) * share);
    if (first < last) slices[k] = {first - layout.starts[k], last - first};
  }
  return slices;
}

std::optional<int64_t> ChunkBucketSize(const DdpBucketOptions& options, int64_t dp_cp,
                                       int64_t num_parameters, int64_t pp_rank, int64_t chunk) {
  if (!options.overlap_grad_reduce || options.overlap_param_gather_with_optimizer_step ||
      pp_rank > 0 || chunk > 0) {
    return std::nullopt;
  }
  if (options.num_buckets) return std::max<int64_t>(num_parameters / *options.num_buckets, 1);
  if (options.bucket_size) return *options.bucket_size;
  return std::max<int64_t>(40'000'000, CheckedMul(1'000'000, dp_cp));
}

void AllocateDistributedOptimizerBuffers(ParameterStore* store, const DdpBufferOptions& options) {
  std::deque<Parameter>& all = store->parameters();
  int64_t num_parameters = 0, chunks = 0;
  for (const Parameter& p : all) {
    num_parameters = CheckedAdd(num_parameters, p.data.numel());
    chunks = std::max(chunks, p.chunk + 1);
  }
  const auto meta = at::TensorOptions().device(at::kMeta);
  std::vector<at::Tensor> param_buffers, grad_buffers;
  for (int64_t chunk = 0; chunk < chunks; ++chunk) {
    // The chunk's buffers, one per (FP8 parameter, routed expert) kind, in the order the
    // kinds first appear.
    std::vector<std::pair<bool, bool>> kinds;
    for (const Parameter& p : all) {
      const std::pair<bool, bool> kind{p.fp8.fp8_param, p.expert};
      if (p.chunk == chunk && std::find(kinds.begin(), kinds.end(), kind) == kinds.end()) {
        kinds.push_back(kind);
      }
    }
    const std::optional<int64_t> bucket_size =
        ChunkBucketSize(options.buckets, options.dp_cp, num_parameters, options.pp_rank, chunk);
    for (const auto& [fp8, expert] : kinds) {
      std::vector<Parameter*> members;
      std::vector<BufferParameter> layout_params;
      for (Parameter& p : all) {
        if (p.chunk != chunk || p.fp8.fp8_param != fp8 || p.expert != expert) continue;
        members.push_back(&p);
        layout_params.push_back(
            {p.data.numel(), options.shared_embeddings && p.embedding_or_output});
      }
      const int64_t dp = expert ? options.expert_shards : options.dense_shards;
      const BufferLayout layout =
          LayOutBuffer(layout_params, bucket_size, dp, options.buckets.pad_for_high_nccl_busbw);
      const std::vector<ParameterSlice> slices =
          RankSlices(layout_params, layout, dp, expert ? options.expert_rank : options.dense_rank);
      at::Tensor param_data;
      if (!fp8) {
        CategoryScope category(Category::kParameter);
        ModuleScope scope(ModuleScope::Absolute{"ddp.param_buffer"});
        param_data = at::zeros({layout.numel}, meta.dtype(store->param_dtype()));
      }
      at::Tensor grad_data;
      {
        CategoryScope category(Category::kGradient);
        ModuleScope scope(ModuleScope::Absolute{"ddp.grad_buffer"});
        grad_data = at::zeros({layout.numel}, meta.dtype(store->grad_dtype()));
      }
      for (size_t k = members.size(); k-- > 0;) {
        Parameter& p = *members[k];
        const int64_t numel = p.data.numel();
        if (param_data.defined()) {
          // param.data = param_data's view: the parameter's own storage goes.
          at::NoGradGuard no_grad;
          p.data.set_data(param_data.narrow(0, layout.starts[k], numel).view(p.data.sizes()));
        }
        p.main_grad = grad_data.narrow(0, layout.starts[k], numel).view(p.data.sizes());
        p.optimizer_slice = slices[k];
      }
      if (param_data.defined()) param_buffers.push_back(std::move(param_data));
      grad_buffers.push_back(std::move(grad_data));
    }
  }
  store->AdoptBuffers(std::move(param_buffers), std::move(grad_buffers));
}

}  // namespace memsim
