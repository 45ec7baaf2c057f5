#include "parallel/ddp_buffers.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

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

namespace {

// One DDP buffer: its parameters (in named_parameters() order) and their layout.
struct Buffer {
  bool fp8 = false;     // FP8 parameters (no 16-bit storage to move)
  bool expert = false;  // expert-parallel parameters, sharded over expert data parallelism
  std::vector<Parameter*> members;
  std::vector<BufferParameter> layout_params;
  BufferLayout layout;
};

// The data-parallel rank among `shards` whose slices of `buffers` (those of one group) hold
// the most elements; the last of equals. Every rank owns as many elements of each bucket;
// what it holds state for is that less the holes in its range (the gaps that align each
// parameter to 64 elements, and the bucket's end padding, in the last ranks' ranges), so
// the fullest is the one with the fewest holes. Each group's fullest: no one GPU need be
// both the dense and the expert fullest, a bound on the safe side.
int64_t FullestRank(const std::vector<Buffer>& buffers, bool expert, int64_t shards) {
  std::vector<int64_t> holes(static_cast<size_t>(shards), 0);
  auto add_hole = [&](const BufferLayout::Bucket& bucket, int64_t begin, int64_t end) {
    const int64_t share = (bucket.end - bucket.start) / shards;
    while (begin < end) {  // over the ranks the hole spans
      const int64_t rank = (begin - bucket.start) / share;
      const int64_t rank_end = bucket.start + (rank + 1) * share;
      holes[static_cast<size_t>(rank)] += std::min(end, rank_end) - begin;
      begin = std::min(end, rank_end);
    }
  };
  for (const Buffer& b : buffers) {
    if (b.expert != expert) continue;
    // Parameters by start (the reverse of the given order), then the holes between them.
    int64_t covered = 0;  // where the current bucket's parameters reach
    int64_t bucket = -1;
    for (size_t k = b.layout_params.size(); k-- > 0;) {
      const int64_t start = b.layout.starts[k];
      if (b.layout.buckets[k] != bucket) {
        if (bucket >= 0) {
          const auto& previous = b.layout.bucket_ranges[static_cast<size_t>(bucket)];
          add_hole(previous, covered, previous.end);
        }
        bucket = b.layout.buckets[k];
        covered = b.layout.bucket_ranges[static_cast<size_t>(bucket)].start;
      }
      add_hole(b.layout.bucket_ranges[static_cast<size_t>(bucket)], covered, start);
      covered = start + b.layout_params[k].numel;
    }
    if (bucket >= 0) {
      const auto& last = b.layout.bucket_ranges[static_cast<size_t>(bucket)];
      add_hole(last, covered, last.end);
    }
  }
  int64_t best = shards - 1;
  for (int64_t rank = shards - 1; rank >= 0; --rank) {
    if (holes[static_cast<size_t>(rank)] < holes[static_cast<size_t>(best)]) best = rank;
  }
  return best;
}

}  // namespace

void AllocateDistributedOptimizerBuffers(ParameterStore* store, const DdpBufferOptions& options) {
  std::deque<Parameter>& all = store->parameters();
  int64_t num_parameters = 0, chunks = 0;
  for (const Parameter& p : all) {
    num_parameters = CheckedAdd(num_parameters, p.data.numel());
    chunks = std::max(chunks, p.chunk + 1);
  }
  // Each chunk's buffers, one per (FP8, expert-parallel) kind in the order the kinds first
  // appear, laid out.
  std::vector<Buffer> buffers;
  for (int64_t chunk = 0; chunk < chunks; ++chunk) {
    const size_t first = buffers.size();
    for (Parameter& p : all) {
      if (p.chunk != chunk) continue;
      const bool expert = p.expert && options.experts_apart;
      auto it = std::find_if(
          buffers.begin() + static_cast<std::ptrdiff_t>(first), buffers.end(),
          [&](const Buffer& b) { return b.fp8 == p.fp8.fp8_param && b.expert == expert; });
      if (it == buffers.end()) {
        buffers.push_back({p.fp8.fp8_param, expert, {}, {}, {}});
        it = buffers.end() - 1;
      }
      it->members.push_back(&p);
      it->layout_params.push_back({p.data.numel(), p.shared_embedding});
    }
    const std::optional<int64_t> bucket_size =
        ChunkBucketSize(options.buckets, options.dp_cp, num_parameters, options.pp_rank, chunk);
    for (size_t i = first; i < buffers.size(); ++i) {
      Buffer& b = buffers[i];
      b.layout = LayOutBuffer(b.layout_params, bucket_size,
                              b.expert ? options.expert_shards : options.dense_shards,
                              options.buckets.pad_for_high_nccl_busbw);
    }
  }
  const int64_t dense_rank =
      options.dense_rank ? *options.dense_rank : FullestRank(buffers, false, options.dense_shards);
  const int64_t expert_rank = options.expert_rank
                                  ? *options.expert_rank
                                  : FullestRank(buffers, true, options.expert_shards);
  const auto meta = at::TensorOptions().device(at::kMeta);
  std::vector<at::Tensor> param_buffers, grad_buffers;
  for (const Buffer& b : buffers) {
    const std::vector<ParameterSlice> slices = RankSlices(
        b.layout_params, b.layout, b.expert ? options.expert_shards : options.dense_shards,
        b.expert ? expert_rank : dense_rank);
    at::Tensor param_data;
    if (!b.fp8) {
      CategoryScope category(Category::kParameter);
      ModuleScope scope(ModuleScope::Absolute{"ddp.param_buffer"});
      param_data = at::zeros({b.layout.numel}, meta.dtype(store->param_dtype()));
    }
    at::Tensor grad_data;
    {
      CategoryScope category(Category::kGradient);
      ModuleScope scope(ModuleScope::Absolute{"ddp.grad_buffer"});
      grad_data = at::zeros({b.layout.numel}, meta.dtype(store->grad_dtype()));
    }
    for (size_t k = b.members.size(); k-- > 0;) {
      Parameter& p = *b.members[k];
      const int64_t numel = p.data.numel();
      if (param_data.defined()) {
        // param.data = param_data's view: the parameter's own storage goes.
        at::NoGradGuard no_grad;
        p.data.set_data(param_data.narrow(0, b.layout.starts[k], numel).view(p.data.sizes()));
      }
      p.main_grad = grad_data.narrow(0, b.layout.starts[k], numel).view(p.data.sizes());
      p.optimizer_slice = slices[k];
    }
    if (param_data.defined()) param_buffers.push_back(std::move(param_data));
    grad_buffers.push_back(std::move(grad_data));
  }
  store->AdoptBuffers(std::move(param_buffers), std::move(grad_buffers));
}

}  // namespace memsim
