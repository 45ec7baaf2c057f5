// Note [Distributed optimizer buffers]: layouts and rank slices worked out by hand from
// Megatron-Core 0.20's rules (docs/source-notes/distributed-optimizer-buckets.md, section 4).
#include "parallel/ddp_buffers.h"

#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

namespace memsim {
namespace {

// (offset, elements) of each parameter's slice.
std::vector<std::pair<int64_t, int64_t>> Pairs(const std::vector<ParameterSlice>& slices) {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const ParameterSlice& s : slices) out.emplace_back(s.offset, s.elements);
  return out;
}

using Slices = std::vector<std::pair<int64_t, int64_t>>;

// named_parameters order p0 = 1000, p1 = 3000, p2 = 500 elements; laid out in reverse.
const std::vector<BufferParameter> kThree = {{1000}, {3000}, {500}};

TEST(DdpBuffers, OneBucketPadsStartsTo64AndTheEndToLcmOfDpAnd128) {
  const BufferLayout layout = LayOutBuffer(kThree, std::nullopt, /*dp=*/4, false);
  // p2 [0, 500), p1 from 512 (500 rounded up to 64) to 3512, p0 from 3520 to 4520;
  // the bucket's end 4520 rounded up to 128: 4608.
  EXPECT_EQ(layout.starts, (std::vector<int64_t>{3520, 512, 0}));
  ASSERT_EQ(layout.bucket_ranges.size(), 1u);
  EXPECT_EQ(layout.bucket_ranges[0].start, 0);
  EXPECT_EQ(layout.bucket_ranges[0].end, 4608);
  EXPECT_EQ(layout.numel, 4608);
  // Each rank owns 1152 elements of the bucket.
  EXPECT_EQ(Pairs(RankSlices(kThree, layout, 4, 0)), (Slices{{0, 0}, {0, 640}, {0, 500}}));
  EXPECT_EQ(Pairs(RankSlices(kThree, layout, 4, 1)), (Slices{{0, 0}, {640, 1152}, {0, 0}}));
  EXPECT_EQ(Pairs(RankSlices(kThree, layout, 4, 2)), (Slices{{0, 0}, {1792, 1152}, {0, 0}}));
  EXPECT_EQ(Pairs(RankSlices(kThree, layout, 4, 3)), (Slices{{0, 1000}, {2944, 56}, {0, 0}}));
}

TEST(DdpBuffers, ABucketClosesOnceItReachesTheBucketSize) {
  const BufferLayout layout = LayOutBuffer(kThree, /*bucket_size=*/2000, /*dp=*/4, false);
  // Bucket 0: p2 and p1 (its end 3512 >= 2000), padded to 3584; bucket 1: p0 at 3584.
  EXPECT_EQ(layout.starts, (std::vector<int64_t>{3584, 512, 0}));
  EXPECT_EQ(layout.buckets, (std::vector<int64_t>{1, 0, 0}));
  ASSERT_EQ(layout.bucket_ranges.size(), 2u);
  EXPECT_EQ(layout.bucket_ranges[0].end, 3584);
  EXPECT_EQ(layout.bucket_ranges[1].start, 3584);
  EXPECT_EQ(layout.bucket_ranges[1].end, 4608);
  // 896 elements of bucket 0 and 256 of bucket 1 per rank.
  EXPECT_EQ(Pairs(RankSlices(kThree, layout, 4, 0)), (Slices{{0, 256}, {0, 384}, {0, 500}}));
  EXPECT_EQ(Pairs(RankSlices(kThree, layout, 4, 1)), (Slices{{256, 256}, {384, 896}, {0, 0}}));
  EXPECT_EQ(Pairs(RankSlices(kThree, layout, 4, 2)), (Slices{{512, 256}, {1280, 896}, {0, 0}}));
  EXPECT_EQ(Pairs(RankSlices(kThree, layout, 4, 3)), (Slices{{768, 232}, {2176, 824}, {0, 0}}));
}

TEST(DdpBuffers, ASharedEmbeddingSitsAloneInItsBucket) {
  // named order: embedding 1000 (shared), a 300, b 200; dp 2, no bucket size.
  const std::vector<BufferParameter> params = {{1000, true}, {300}, {200}};
  const BufferLayout layout = LayOutBuffer(params, std::nullopt, /*dp=*/2, false);
  // b [0, 200), a [256, 556); the embedding would start at 576, which closes the bucket
  // there (padded to 640) and starts its own: [640, 1640), padded to 1664.
  EXPECT_EQ(layout.starts, (std::vector<int64_t>{640, 256, 0}));
  ASSERT_EQ(layout.bucket_ranges.size(), 2u);
  EXPECT_EQ(layout.bucket_ranges[0].end, 640);
  EXPECT_EQ(layout.bucket_ranges[1].end, 1664);
  // Rank 1: [320, 640) of bucket 0 and [1152, 1664) of bucket 1.
  EXPECT_EQ(Pairs(RankSlices(params, layout, 2, 1)), (Slices{{512, 488}, {64, 236}, {0, 0}}));
}

TEST(DdpBuffers, BucketEndsArePaddedForTheDataParallelSizeAndNcclBusBandwidth) {
  const std::vector<BufferParameter> one = {{1000}};
  EXPECT_EQ(LayOutBuffer(one, std::nullopt, /*dp=*/3, false).numel, 1152);  // lcm(3, 128) = 384
  EXPECT_EQ(LayOutBuffer(one, std::nullopt, /*dp=*/4, true).numel, 65536);  // lcm(4, 128, 2^16)
}

TEST(DdpBuffers, BucketSizeFollowsMegatronLmsResolution) {
  DdpBucketOptions o;
  EXPECT_EQ(ChunkBucketSize(o, 64, 1'000'000, 0, 0), std::nullopt);  // no --overlap-grad-reduce
  o.overlap_grad_reduce = true;
  EXPECT_EQ(ChunkBucketSize(o, 8, 1'000'000, 0, 0), 40'000'000);  // max(40M, 1M x 8)
  EXPECT_EQ(ChunkBucketSize(o, 64, 1'000'000, 0, 0), 64'000'000);
  EXPECT_EQ(ChunkBucketSize(o, 64, 1'000'000, /*pp_rank=*/1, 0), std::nullopt);
  EXPECT_EQ(ChunkBucketSize(o, 64, 1'000'000, 0, /*chunk=*/1), std::nullopt);
  o.bucket_size = 1234;
  EXPECT_EQ(ChunkBucketSize(o, 64, 1'000'000, 0, 0), 1234);
  o.num_buckets = 4;  // wins over the bucket size
  EXPECT_EQ(ChunkBucketSize(o, 64, 1'000'000, 0, 0), 250'000);
  o.overlap_param_gather_with_optimizer_step = true;
  EXPECT_EQ(ChunkBucketSize(o, 64, 1'000'000, 0, 0), std::nullopt);
}

// Without a given rank the buffers take the fullest: in the one-bucket layout above, rank 0
// has the 12-element gap before p1 in its range, rank 3 the 8 before p0 and the 88 of
// padding; ranks 1 and 2 hold 1152 elements each, and the later of them is taken.
TEST(DdpBuffers, WithoutARankTheFullestIsSimulated) {
  ParameterStore store(Precision::kBf16);
  for (int64_t numel : {1000, 3000, 500}) store.Add("w" + std::to_string(numel), {numel});
  DdpBufferOptions options;
  options.dense_shards = 4;
  AllocateDistributedOptimizerBuffers(&store, options);
  std::vector<std::pair<int64_t, int64_t>> slices;
  for (const Parameter& p : store.parameters()) {
    ASSERT_TRUE(p.optimizer_slice.has_value());
    slices.emplace_back(p.optimizer_slice->offset, p.optimizer_slice->elements);
  }
  EXPECT_EQ(slices, (Slices{{0, 0}, {1792, 1152}, {0, 0}}));
  ASSERT_EQ(store.grad_buffers().size(), 1u);
  EXPECT_EQ(store.grad_buffers()[0].numel(), 4608);
}

}  // namespace
}  // namespace memsim
