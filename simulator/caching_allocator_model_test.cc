#include "simulator/caching_allocator_model.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <random>
#include <stdexcept>
#include <vector>

namespace memsim {
namespace {

using Model = CachingAllocatorModel;

constexpr int64_t kKiB = 1024;
constexpr int64_t kMiB = 1024 * kKiB;

struct SegmentEvent {
  bool alloc;  // segment_alloc or segment_map; else segment_free or segment_unmap
  int64_t address;
  int64_t size_bytes;
  PoolKind pool;
  bool mapping = false;  // segment_map or segment_unmap
  bool operator==(const SegmentEvent& other) const {
    return alloc == other.alloc && address == other.address && size_bytes == other.size_bytes &&
           pool == other.pool && mapping == other.mapping;
  }
};

class RecordingObserver : public AllocatorObserver {
 public:
  void OnSegmentAlloc(int64_t address, int64_t size_bytes, PoolKind pool) override {
    events.push_back({true, address, size_bytes, pool});
  }
  void OnSegmentFree(int64_t address, int64_t size_bytes, PoolKind pool) override {
    events.push_back({false, address, size_bytes, pool});
  }
  void OnSegmentMap(int64_t address, int64_t size_bytes, PoolKind pool) override {
    events.push_back({true, address, size_bytes, pool, true});
  }
  void OnSegmentUnmap(int64_t address, int64_t size_bytes, PoolKind pool) override {
    events.push_back({false, address, size_bytes, pool, true});
  }
  std::vector<SegmentEvent> events;
};

// Expandable segments; `fraction`: the capacity is a memory fraction.
CachingAllocatorConfig Expandable(int64_t capacity_bytes = 0, bool fraction = false) {
  CachingAllocatorConfig config(capacity_bytes);
  config.expandable_segments = true;
  config.capacity_is_fraction = fraction;
  return config;
}

// Mallocs and expects success.
Model::Allocation MustMalloc(Model& model, int64_t bytes) {
  std::optional<Model::Allocation> allocation = model.Malloc(bytes);
  EXPECT_TRUE(allocation.has_value()) << bytes;
  return allocation.value_or(Model::Allocation{-1, -1, -1});
}

// (size, allocated) of each block of the segment at `index`, in address order.
std::vector<std::pair<int64_t, bool>> BlockLayout(const Model& model, size_t index) {
  const std::vector<AllocatorSegmentView> segments = model.Segments();
  std::vector<std::pair<int64_t, bool>> layout;
  for (const AllocatorBlockView& block : segments.at(index).blocks) {
    layout.emplace_back(block.size_bytes, block.allocated);
  }
  return layout;
}

// Checks the invariants every state must satisfy, against the stats.
void ExpectConsistent(const Model& model) {
  const AllocatorStats& stats = model.stats();
  int64_t reserved = 0, allocated = 0, requested = 0, active = 0, previous_end = 0;
  const std::vector<AllocatorSegmentView> segments = model.Segments();
  for (const AllocatorSegmentView& segment : segments) {
    EXPECT_EQ(segment.address % Model::kRoundLarge, 0);
    EXPECT_GE(segment.address, previous_end);
    previous_end = segment.address + segment.size_bytes;
    reserved += segment.size_bytes;
    int64_t next_address = segment.address;
    bool previous_free = false;
    for (const AllocatorBlockView& block : segment.blocks) {
      EXPECT_EQ(block.address, next_address);
      EXPECT_EQ(block.size_bytes % Model::kMinBlockSize, 0);
      next_address += block.size_bytes;
      EXPECT_FALSE(previous_free && !block.allocated) << "unmerged free neighbours";
      previous_free = !block.allocated;
      if (block.allocated) {
        allocated += block.size_bytes;
        requested += block.requested_bytes;
        ++active;
        EXPECT_EQ(Model::PoolFor(Model::RoundSize(block.requested_bytes)), segment.pool);
      }
    }
    EXPECT_EQ(next_address, segment.address + segment.size_bytes);
  }
  EXPECT_EQ(stats.reserved_bytes, reserved);
  EXPECT_EQ(stats.allocated_bytes, allocated);
  EXPECT_EQ(stats.requested_bytes, requested);
  EXPECT_EQ(stats.num_active_blocks, active);
  EXPECT_EQ(stats.num_segments,
            std::count_if(segments.begin(), segments.end(),
                          [](const AllocatorSegmentView& s) { return !s.expandable; }));
}

TEST(CachingAllocatorModel, SizeRules) {
  EXPECT_EQ(Model::RoundSize(1), 512);
  EXPECT_EQ(Model::RoundSize(511), 512);
  EXPECT_EQ(Model::RoundSize(512), 512);
  EXPECT_EQ(Model::RoundSize(513), 1024);
  EXPECT_EQ(Model::RoundSize(1 * kMiB + 1), 1 * kMiB + 512);

  EXPECT_EQ(Model::PoolFor(1 * kMiB), PoolKind::kSmall);
  EXPECT_EQ(Model::PoolFor(1 * kMiB + 512), PoolKind::kLarge);

  EXPECT_EQ(Model::SegmentSizeFor(512), 2 * kMiB);
  EXPECT_EQ(Model::SegmentSizeFor(1 * kMiB), 2 * kMiB);
  EXPECT_EQ(Model::SegmentSizeFor(1 * kMiB + 512), 20 * kMiB);
  EXPECT_EQ(Model::SegmentSizeFor(10 * kMiB - 512), 20 * kMiB);
  EXPECT_EQ(Model::SegmentSizeFor(10 * kMiB), 10 * kMiB);
  EXPECT_EQ(Model::SegmentSizeFor(11 * kMiB + 512), 12 * kMiB);
  EXPECT_EQ(Model::SegmentSizeFor(12 * kMiB), 12 * kMiB);
}

// Note [Rounding to power-of-two divisions], worked by hand from PyTorch's round_size.
TEST(CachingAllocatorModel, RoundsToPowerOfTwoDivisions) {
  // 1200 KiB lies in [1, 2) MiB; four steps of 256 KiB: up to 1280 KiB.
  EXPECT_EQ(Model::RoundSize(1200 * kKiB, 4), 1280 * kKiB);
  EXPECT_EQ(Model::RoundSize(1 * kMiB + 1, 2), 3 * kMiB / 2);
  EXPECT_EQ(Model::RoundSize(2 * kMiB, 4), 2 * kMiB);      // a power of two stays
  EXPECT_EQ(Model::RoundSize(600 * kKiB, 4), 640 * kKiB);  // [512, 1024) KiB in 128 KiB steps
  // Up to 512 B x divisions the 512-byte rule applies: 3000 B with 8 divisions is 3072.
  EXPECT_EQ(Model::RoundSize(3000, 8), 3072);
  EXPECT_EQ(Model::RoundSize(1200 * kKiB, 1), 1200 * kKiB);  // 1 and 0: no rounding
  CachingAllocatorConfig config;
  config.roundup_power2_divisions = {1, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 8};
  EXPECT_EQ(Model::DivisionsFor(config, 600 * kKiB), 1);  // below 2 MiB: the first interval
  EXPECT_EQ(Model::DivisionsFor(config, 3 * kMiB), 2);
  EXPECT_EQ(Model::DivisionsFor(config, int64_t{64} << 30), 8);  // beyond 32 GiB: the last
  Model model(config);
  EXPECT_EQ(MustMalloc(model, 3 * kMiB + 1).block_bytes, 4 * kMiB);  // [2, 4) MiB in halves
}

// Note [Oversize blocks]: a request at or above max_split_size takes a free oversize block
// only if it wastes less than max_non_split_rounding (default 20 MiB).
TEST(CachingAllocatorModel, MaxNonSplitRoundingBoundsTheWasteOfAnOversizeBlock) {
  for (const int64_t rounding_mib : {0, 32}) {
    CachingAllocatorConfig config;
    config.max_split_size_bytes = 20 * kMiB;
    config.max_non_split_rounding_bytes = rounding_mib * kMiB;
    Model model(config);
    model.Free(MustMalloc(model, 55 * kMiB).block_id);  // one free 56 MiB segment
    // 30 MiB would waste 26 MiB of it: not under 20 MiB, under 32 MiB.
    MustMalloc(model, 30 * kMiB);
    EXPECT_EQ(model.stats().reserved_bytes, rounding_mib == 0 ? 86 * kMiB : 56 * kMiB);
  }
}

TEST(CachingAllocatorModel, AllocatedCountsRoundedSizesAndRequestedRawSizes) {
  Model model;
  const Model::Allocation a = MustMalloc(model, 1);    // 512 B block
  const Model::Allocation b = MustMalloc(model, 513);  // 1024 B block, right after a
  EXPECT_EQ(a.block_bytes, 512);
  EXPECT_EQ(b.block_bytes, 1024);
  EXPECT_EQ(b.address, a.address + 512);
  EXPECT_EQ(model.stats().allocated_bytes, 512 + 1024);
  EXPECT_EQ(model.stats().requested_bytes, 1 + 513);
  EXPECT_EQ(model.stats().reserved_bytes, 2 * kMiB);  // one small segment
  EXPECT_EQ(model.stats().num_segments, 1);
  EXPECT_EQ(model.stats().num_active_blocks, 2);

  const std::vector<AllocatorSegmentView> segments = model.Segments();
  ASSERT_EQ(segments.size(), 1u);
  EXPECT_EQ(segments[0].address, a.address);
  EXPECT_EQ(segments[0].size_bytes, 2 * kMiB);
  EXPECT_EQ(segments[0].pool, PoolKind::kSmall);
  ASSERT_EQ(segments[0].blocks.size(), 3u);
  EXPECT_EQ(segments[0].blocks[0].requested_bytes, 1);
  EXPECT_EQ(segments[0].blocks[1].requested_bytes, 513);
  // The free remainder: 2 MiB - 1536 B at a + 1536.
  EXPECT_EQ(segments[0].blocks[2].address, a.address + 1536);
  EXPECT_EQ(segments[0].blocks[2].size_bytes, 2 * kMiB - 1536);
  EXPECT_EQ(segments[0].blocks[2].requested_bytes, 0);
  EXPECT_FALSE(segments[0].blocks[2].allocated);
}

// A replay keeps only the block id of each storage and asks the model for the rest at the
// free: an allocated block must read as Malloc returned it while blocks around it are
// split, freed and merged, including a whole-block (unsplit) large allocation.
TEST(CachingAllocatorModel, AnAllocatedBlockReadsAsMallocReturnedIt) {
  Model model;
  const Model::Allocation a = MustMalloc(model, 1);
  const Model::Allocation b = MustMalloc(model, 513);
  const Model::Allocation c = MustMalloc(model, 700);
  // 19 MiB of a new 20 MiB large segment: the 1 MiB left is not split off (a large-pool
  // remainder must exceed 1 MiB), so the block is the whole segment.
  const Model::Allocation d = MustMalloc(model, 19 * kMiB);
  EXPECT_EQ(d.block_bytes, 20 * kMiB);
  model.Free(a.block_id);
  model.Free(c.block_id);  // c's block merges with the free remainder after it
  for (const Model::Allocation& kept : {b, d}) {
    const Model::Allocation read = model.AllocatedBlock(kept.block_id);
    EXPECT_EQ(read.block_id, kept.block_id);
    EXPECT_EQ(read.address, kept.address);
    EXPECT_EQ(read.block_bytes, kept.block_bytes);
  }
}
TEST(CachingAllocatorModel, SmallPoolPacksFourHalfMiBBlocksIntoOneSegment) {
  Model model;
  // 2 MiB segment: splits leave 1.5, 1, 0.5 MiB; the 4th takes the last 512 KiB whole.
  std::vector<Model::Allocation> blocks;
  for (int i = 0; i < 4; ++i) blocks.push_back(MustMalloc(model, 512 * kKiB));
  const int64_t s = blocks[0].address;
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(blocks[i].address, s + i * 512 * kKiB);
    EXPECT_EQ(blocks[i].block_bytes, 512 * kKiB);
  }
  EXPECT_EQ(model.stats().reserved_bytes, 2 * kMiB);
  EXPECT_EQ(model.stats().allocated_bytes, 2 * kMiB);
  ASSERT_EQ(model.Segments().size(), 1u);
  EXPECT_EQ(model.Segments()[0].blocks.size(), 4u);

  // The segment is full: a 5th gets a new segment right after it.
  const Model::Allocation fifth = MustMalloc(model, 512 * kKiB);
  EXPECT_EQ(fifth.address, s + 2 * kMiB);
  EXPECT_EQ(model.stats().reserved_bytes, 4 * kMiB);
  EXPECT_EQ(model.stats().num_segments, 2);
}

TEST(CachingAllocatorModel, SmallPoolSplitsOffRemaindersDownTo512Bytes) {
  Model model;
  const Model::Allocation a = MustMalloc(model, 1 * kMiB);        // leaves 1 MiB
  const Model::Allocation b = MustMalloc(model, 1 * kMiB - 512);  // leaves 512 B: split
  const Model::Allocation c = MustMalloc(model, 1);               // the last 512 B
  EXPECT_EQ(b.address, a.address + 1 * kMiB);
  EXPECT_EQ(b.block_bytes, 1 * kMiB - 512);
  EXPECT_EQ(c.address, a.address + 2 * kMiB - 512);
  EXPECT_EQ(model.stats().reserved_bytes, 2 * kMiB);
  EXPECT_EQ(model.stats().allocated_bytes, 2 * kMiB);
}

TEST(CachingAllocatorModel, LargeRequestsShareA20MiBSegment) {
  Model model;
  // 1 MiB + 1 B rounds to 1 MiB + 512 B: large pool, 20 MiB segment, 19 MiB - 512 B left.
  const Model::Allocation a = MustMalloc(model, 1 * kMiB + 1);
  EXPECT_EQ(a.block_bytes, 1 * kMiB + 512);
  EXPECT_EQ(model.stats().reserved_bytes, 20 * kMiB);
  // 5 MiB is carved from the remainder, leaving 14 MiB - 512 B (> 1 MiB, so split).
  const Model::Allocation b = MustMalloc(model, 5 * kMiB);
  EXPECT_EQ(b.address, a.address + 1 * kMiB + 512);
  EXPECT_EQ(b.block_bytes, 5 * kMiB);
  EXPECT_EQ(model.stats().allocated_bytes, 6 * kMiB + 512);
  EXPECT_EQ(model.stats().reserved_bytes, 20 * kMiB);
  ASSERT_EQ(model.Segments().size(), 1u);
  EXPECT_EQ(model.Segments()[0].pool, PoolKind::kLarge);
  const std::vector<std::pair<int64_t, bool>> expected = {
      {1 * kMiB + 512, true}, {5 * kMiB, true}, {14 * kMiB - 512, false}};
  EXPECT_EQ(BlockLayout(model, 0), expected);
}

TEST(CachingAllocatorModel, RequestsOf10MiBOrMoreGetTheirOwnSegmentRoundedTo2MiB) {
  Model model;
  const Model::Allocation a = MustMalloc(model, 12 * kMiB);  // 12 MiB segment, exact fit
  EXPECT_EQ(a.block_bytes, 12 * kMiB);
  EXPECT_EQ(model.stats().reserved_bytes, 12 * kMiB);
  // 11 MiB + 1 B -> 11 MiB + 512 B -> 12 MiB segment; the 1 MiB - 512 B left is not > 1 MiB,
  // so the whole segment is handed out.
  const Model::Allocation b = MustMalloc(model, 11 * kMiB + 1);
  EXPECT_EQ(b.address, a.address + 12 * kMiB);
  EXPECT_EQ(b.block_bytes, 12 * kMiB);
  EXPECT_EQ(model.stats().reserved_bytes, 24 * kMiB);
  EXPECT_EQ(model.stats().allocated_bytes, 24 * kMiB);
  EXPECT_EQ(model.stats().requested_bytes, 23 * kMiB + 1);
  EXPECT_EQ(model.stats().num_segments, 2);
  EXPECT_EQ(model.Segments()[1].blocks.size(), 1u);
}

TEST(CachingAllocatorModel, LargePoolSplitsOnlyWhenRemainderExceeds1MiB) {
  Model model;
  // Leaves one cached, free 20 MiB block.
  const Model::Allocation seed = MustMalloc(model, 2 * kMiB);
  model.Free(seed.block_id);
  const int64_t s = seed.address;

  // 19 MiB leaves exactly 1 MiB: not split, the whole 20 MiB counts as allocated.
  const Model::Allocation a = MustMalloc(model, 19 * kMiB);
  EXPECT_EQ(a.address, s);
  EXPECT_EQ(a.block_bytes, 20 * kMiB);
  EXPECT_EQ(model.stats().allocated_bytes, 20 * kMiB);
  EXPECT_EQ(model.stats().requested_bytes, 19 * kMiB);
  EXPECT_EQ(model.stats().reserved_bytes, 20 * kMiB);
  EXPECT_EQ(model.Segments()[0].blocks.size(), 1u);
  model.Free(a.block_id);

  // 19 MiB - 512 B leaves 1 MiB + 512 B: split.
  const Model::Allocation b = MustMalloc(model, 19 * kMiB - 512);
  EXPECT_EQ(b.address, s);
  EXPECT_EQ(b.block_bytes, 19 * kMiB - 512);
  EXPECT_EQ(model.stats().allocated_bytes, 19 * kMiB - 512);
  EXPECT_EQ(model.stats().reserved_bytes, 20 * kMiB);
  const std::vector<std::pair<int64_t, bool>> expected = {{19 * kMiB - 512, true},
                                                          {1 * kMiB + 512, false}};
  EXPECT_EQ(BlockLayout(model, 0), expected);
}

TEST(CachingAllocatorModel, FreedBlockIsReusedWithoutGrowingReserve) {
  Model model;
  const Model::Allocation a = MustMalloc(model, 4 * kMiB);
  model.Free(a.block_id);
  EXPECT_EQ(model.stats().allocated_bytes, 0);
  EXPECT_EQ(model.stats().requested_bytes, 0);
  EXPECT_EQ(model.stats().num_active_blocks, 0);
  EXPECT_EQ(model.stats().reserved_bytes, 20 * kMiB);  // cached, not returned
  // The 4 MiB block merged back with the 16 MiB remainder.
  const std::vector<std::pair<int64_t, bool>> whole = {{20 * kMiB, false}};
  EXPECT_EQ(BlockLayout(model, 0), whole);

  const Model::Allocation b = MustMalloc(model, 4 * kMiB);
  EXPECT_EQ(b.address, a.address);
  EXPECT_EQ(model.stats().reserved_bytes, 20 * kMiB);
  EXPECT_EQ(model.stats().num_segments, 1);
}

TEST(CachingAllocatorModel, AdjacentFreedBlocksMergeToServeTheirSum) {
  Model model;
  const Model::Allocation a = MustMalloc(model, 512 * kKiB);
  const Model::Allocation b = MustMalloc(model, 512 * kKiB);
  MustMalloc(model, 512 * kKiB);
  MustMalloc(model, 512 * kKiB);  // the 2 MiB segment is now full
  model.Free(a.block_id);
  model.Free(b.block_id);
  const std::vector<std::pair<int64_t, bool>> merged = {
      {1 * kMiB, false}, {512 * kKiB, true}, {512 * kKiB, true}};
  EXPECT_EQ(BlockLayout(model, 0), merged);

  // Only the merged block fits 1 MiB; without merging this would need a new segment.
  const Model::Allocation c = MustMalloc(model, 1 * kMiB);
  EXPECT_EQ(c.address, a.address);
  EXPECT_EQ(model.stats().reserved_bytes, 2 * kMiB);
  EXPECT_EQ(model.stats().num_segments, 1);
}

TEST(CachingAllocatorModel, FreeMergesWithBothNeighbours) {
  Model model;
  const Model::Allocation a = MustMalloc(model, 512 * kKiB);
  const Model::Allocation b = MustMalloc(model, 512 * kKiB);
  const Model::Allocation c = MustMalloc(model, 512 * kKiB);
  MustMalloc(model, 512 * kKiB);
  model.Free(a.block_id);
  model.Free(c.block_id);
  const std::vector<std::pair<int64_t, bool>> holes = {
      {512 * kKiB, false}, {512 * kKiB, true}, {512 * kKiB, false}, {512 * kKiB, true}};
  EXPECT_EQ(BlockLayout(model, 0), holes);
  model.Free(b.block_id);  // joins a before and c after
  const std::vector<std::pair<int64_t, bool>> merged = {{1536 * kKiB, false}, {512 * kKiB, true}};
  EXPECT_EQ(BlockLayout(model, 0), merged);
  ExpectConsistent(model);
}

TEST(CachingAllocatorModel, BestFitPicksSmallestFittingBlock) {
  Model model;
  // Segment s: a 768K | 64K | c 256K | 64K | free 896K (at s + 1152K).
  const Model::Allocation a = MustMalloc(model, 768 * kKiB);
  MustMalloc(model, 64 * kKiB);
  const Model::Allocation c = MustMalloc(model, 256 * kKiB);
  MustMalloc(model, 64 * kKiB);
  const int64_t s = a.address;
  model.Free(a.block_id);
  model.Free(c.block_id);
  // Free: 768K at s, 256K at s + 832K, 896K at s + 1152K.
  EXPECT_EQ(MustMalloc(model, 200 * kKiB).address, s + 832 * kKiB);   // 256K block
  EXPECT_EQ(MustMalloc(model, 700 * kKiB).address, s);                // 768K block
  EXPECT_EQ(MustMalloc(model, 800 * kKiB).address, s + 1152 * kKiB);  // 896K block
  EXPECT_EQ(model.stats().reserved_bytes, 2 * kMiB);
}

TEST(CachingAllocatorModel, BestFitBreaksTiesByLowestAddress) {
  Model model;
  // Segment s: a 256K | 64K | b 256K (at s + 320K) | 64K | free 1408K.
  const Model::Allocation a = MustMalloc(model, 256 * kKiB);
  MustMalloc(model, 64 * kKiB);
  const Model::Allocation b = MustMalloc(model, 256 * kKiB);
  MustMalloc(model, 64 * kKiB);
  model.Free(b.block_id);
  model.Free(a.block_id);
  EXPECT_EQ(MustMalloc(model, 256 * kKiB).address, a.address);
  EXPECT_EQ(MustMalloc(model, 256 * kKiB).address, a.address + 320 * kKiB);
}

TEST(CachingAllocatorModel, PoolsDoNotShareBlocks) {
  Model model;
  const Model::Allocation large = MustMalloc(model, 2 * kMiB);  // 18 MiB stays free
  const Model::Allocation small = MustMalloc(model, 512);       // still a new segment
  EXPECT_EQ(small.address, large.address + 20 * kMiB);
  EXPECT_EQ(model.stats().reserved_bytes, 22 * kMiB);
  EXPECT_EQ(model.stats().num_segments, 2);
  EXPECT_EQ(model.Segments()[1].pool, PoolKind::kSmall);
}

TEST(CachingAllocatorModel, OverCapacityReleasesCachedSegmentsAndRetries) {
  RecordingObserver observer;
  Model model(CachingAllocatorConfig(40 * kMiB), &observer);
  const Model::Allocation a = MustMalloc(model, 12 * kMiB);
  const Model::Allocation b = MustMalloc(model, 12 * kMiB);
  model.Free(a.block_id);  // a's segment is cached and entirely free
  // A 20 MiB segment: 24 + 20 > 40, so a's 12 MiB goes back, and 12 + 20 <= 40 fits.
  const std::optional<Model::Allocation> c = model.Malloc(20 * kMiB);
  ASSERT_TRUE(c.has_value());
  const int64_t s = a.address;
  EXPECT_EQ(b.address, s + 12 * kMiB);
  EXPECT_EQ(c->address, s + 24 * kMiB);  // addresses are never reused
  EXPECT_EQ(model.stats().reserved_bytes, 32 * kMiB);
  EXPECT_EQ(model.stats().allocated_bytes, 32 * kMiB);
  EXPECT_EQ(model.stats().num_alloc_retries, 1);
  EXPECT_EQ(model.stats().num_ooms, 0);
  EXPECT_EQ(model.stats().num_segments, 2);
  const std::vector<SegmentEvent> expected = {{true, s, 12 * kMiB, PoolKind::kLarge},
                                              {true, s + 12 * kMiB, 12 * kMiB, PoolKind::kLarge},
                                              {false, s, 12 * kMiB, PoolKind::kLarge},
                                              {true, s + 24 * kMiB, 20 * kMiB, PoolKind::kLarge}};
  EXPECT_EQ(observer.events, expected);
}

TEST(CachingAllocatorModel, OomKeepsAllocationsButCachedSegmentsStayReleased) {
  RecordingObserver observer;
  Model model(CachingAllocatorConfig(40 * kMiB), &observer);
  const Model::Allocation p = MustMalloc(model, 512);  // small segment at s
  model.Free(p.block_id);
  const Model::Allocation q = MustMalloc(model, 2 * kMiB);  // 20 MiB segment, 18 MiB free
  const int64_t s = p.address;
  // A 22 MiB segment: 22 + 22 > 40; releasing the free small segment gives 20 + 22 > 40.
  // q's segment is partly free, so it stays.
  EXPECT_FALSE(model.Malloc(22 * kMiB).has_value());
  EXPECT_EQ(model.stats().num_ooms, 1);
  EXPECT_EQ(model.stats().num_alloc_retries, 1);
  EXPECT_EQ(model.stats().reserved_bytes, 20 * kMiB);
  EXPECT_EQ(model.stats().allocated_bytes, 2 * kMiB);
  EXPECT_EQ(model.stats().num_segments, 1);
  const std::vector<SegmentEvent> expected = {{true, s, 2 * kMiB, PoolKind::kSmall},
                                              {true, s + 2 * kMiB, 20 * kMiB, PoolKind::kLarge},
                                              {false, s, 2 * kMiB, PoolKind::kSmall}};
  EXPECT_EQ(observer.events, expected);
  // The cache still serves what fits.
  EXPECT_EQ(MustMalloc(model, 18 * kMiB).address, q.address + 2 * kMiB);
  ExpectConsistent(model);
}

TEST(CachingAllocatorModel, RequestBeyondCapacityIsOom) {
  Model model(CachingAllocatorConfig(40 * kMiB));
  EXPECT_FALSE(model.Malloc(41 * kMiB).has_value());  // would need a 42 MiB segment
  EXPECT_EQ(model.stats().num_ooms, 1);
  EXPECT_EQ(model.stats().reserved_bytes, 0);
  EXPECT_EQ(model.stats().num_segments, 0);
  const Model::Allocation a = MustMalloc(model, 40 * kMiB);  // exactly the capacity
  EXPECT_EQ(a.block_bytes, 40 * kMiB);
  EXPECT_EQ(model.stats().reserved_bytes, 40 * kMiB);
  EXPECT_EQ(model.stats().num_ooms, 1);
}

TEST(CachingAllocatorModel, EmptyCacheReleasesOnlyEntirelyFreeSegments) {
  RecordingObserver observer;
  Model model({}, &observer);
  const Model::Allocation a = MustMalloc(model, 512 * kKiB);  // 2 MiB small at s
  MustMalloc(model, 2 * kMiB);  // 20 MiB large at s + 2 MiB, 18 MiB of it free
  // Too big for those 18 MiB: its own segment at s + 22 MiB.
  const Model::Allocation c = MustMalloc(model, 20 * kMiB);
  const int64_t s = a.address;
  EXPECT_NE(s, 0);
  EXPECT_EQ(s % (2 * kMiB), 0);
  model.Free(a.block_id);
  model.Free(c.block_id);
  observer.events.clear();
  model.EmptyCache();
  // Large pool first, as PyTorch's release_cached_blocks.
  const std::vector<SegmentEvent> expected = {{false, s + 22 * kMiB, 20 * kMiB, PoolKind::kLarge},
                                              {false, s, 2 * kMiB, PoolKind::kSmall}};
  EXPECT_EQ(observer.events, expected);
  EXPECT_EQ(model.stats().reserved_bytes, 20 * kMiB);
  EXPECT_EQ(model.stats().num_segments, 1);
  EXPECT_EQ(model.Segments().at(0).address, s + 2 * kMiB);

  // A new segment gets a fresh address, not a released one.
  EXPECT_EQ(MustMalloc(model, 512).address, s + 42 * kMiB);
  EXPECT_EQ(observer.events.back(),
            (SegmentEvent{true, s + 42 * kMiB, 2 * kMiB, PoolKind::kSmall}));
}

TEST(CachingAllocatorModel, PeakStats) {
  Model model;
  const Model::Allocation a = MustMalloc(model, 12 * kMiB);
  // 12 MiB - 1 B -> 12 MiB - 512 B in a 12 MiB segment; 512 B left: not split.
  const Model::Allocation b = MustMalloc(model, 12 * kMiB - 1);
  model.Free(a.block_id);
  model.Free(b.block_id);
  model.EmptyCache();
  EXPECT_EQ(model.stats().allocated_bytes, 0);
  EXPECT_EQ(model.stats().reserved_bytes, 0);
  EXPECT_EQ(model.stats().peak_allocated_bytes, 24 * kMiB);
  EXPECT_EQ(model.stats().peak_reserved_bytes, 24 * kMiB);
  EXPECT_EQ(model.stats().peak_requested_bytes, 24 * kMiB - 1);

  MustMalloc(model, 100);
  EXPECT_EQ(model.stats().peak_allocated_bytes, 24 * kMiB);
  model.ResetPeakStats();
  EXPECT_EQ(model.stats().peak_allocated_bytes, 512);
  EXPECT_EQ(model.stats().peak_reserved_bytes, 2 * kMiB);
  EXPECT_EQ(model.stats().peak_requested_bytes, 100);
}

TEST(CachingAllocatorModel, RejectsInvalidArguments) {
  EXPECT_THROW(Model(CachingAllocatorConfig(-1)), std::invalid_argument);
  CachingAllocatorConfig small_split;
  small_split.max_split_size_bytes = Model::kLargeBuffer - kMiB;  // PyTorch's minimum is 20 MiB
  EXPECT_THROW(Model{small_split}, std::invalid_argument);
  CachingAllocatorConfig both = Expandable();
  both.max_split_size_bytes = Model::kLargeBuffer;
  EXPECT_THROW(Model{both}, std::invalid_argument);
  CachingAllocatorConfig small_rounding;
  small_rounding.max_non_split_rounding_bytes = Model::kLargeBuffer - kMiB;
  EXPECT_THROW(Model{small_rounding}, std::invalid_argument);
  CachingAllocatorConfig odd_divisions;
  odd_divisions.roundup_power2_divisions[3] = 3;
  EXPECT_THROW(Model{odd_divisions}, std::invalid_argument);
  for (const double threshold : {-0.1, 1.0}) {
    CachingAllocatorConfig gc;
    gc.garbage_collection_threshold = threshold;
    EXPECT_THROW(Model{gc}, std::invalid_argument);
  }
  Model model;
  EXPECT_THROW(model.Malloc(0), std::invalid_argument);
  EXPECT_THROW(model.Malloc(-1), std::invalid_argument);
  EXPECT_THROW(model.Malloc(Model::kMaxRequestBytes + 1), std::invalid_argument);
  EXPECT_THROW(model.Free(0), std::invalid_argument);
  const Model::Allocation a = MustMalloc(model, 512);
  EXPECT_THROW(model.Free(-1), std::invalid_argument);
  model.Free(a.block_id);
  EXPECT_THROW(model.Free(a.block_id), std::invalid_argument);  // double free
  EXPECT_EQ(model.stats().allocated_bytes, 0);
}

// Note [Expandable segments], worked by hand from PyTorch's CUDACachingAllocator.cpp.
TEST(CachingAllocatorModel, ExpandableSegmentsMapPagesAndSplitEveryBlock) {
  RecordingObserver observer;
  Model model(Expandable(), &observer);
  // 11.5 MiB: a cudaMalloc'ed segment would be 12 MiB and unsplit (0.5 MiB <= 1 MiB), so
  // 12 MiB allocated; here one 20 MiB page is mapped and the block splits to 11.5 MiB.
  const Model::Allocation a = MustMalloc(model, 11 * kMiB + 512 * kKiB);
  EXPECT_EQ(a.block_bytes, 11 * kMiB + 512 * kKiB);
  EXPECT_EQ(model.stats().reserved_bytes, 20 * kMiB);
  const int64_t base = a.address;
  // 10 MiB does not fit the 8.5 MiB left: the next page is mapped behind it and they merge.
  const Model::Allocation b = MustMalloc(model, 10 * kMiB);
  EXPECT_EQ(b.address, base + 11 * kMiB + 512 * kKiB);
  EXPECT_EQ(model.stats().reserved_bytes, 40 * kMiB);
  EXPECT_EQ(model.stats().allocated_bytes, 21 * kMiB + 512 * kKiB);
  // The small pool has its own range, mapped in 2 MiB pages.
  const Model::Allocation c = MustMalloc(model, 1000);
  EXPECT_EQ(c.block_bytes, 1024);
  EXPECT_EQ(model.stats().reserved_bytes, 42 * kMiB);
  EXPECT_EQ(
      BlockLayout(model, 0),
      (std::vector<std::pair<int64_t, bool>>{
          {11 * kMiB + 512 * kKiB, true}, {10 * kMiB, true}, {18 * kMiB + 512 * kKiB, false}}));
  ASSERT_EQ(model.Segments().size(), 2u);
  EXPECT_TRUE(model.Segments()[0].expandable);
  EXPECT_EQ(model.stats().num_segments, 0);  // PyTorch counts no segment for a mapping
  ExpectConsistent(model);
  // No free block holds a whole page: nothing to unmap.
  model.Free(a.block_id);
  model.EmptyCache();
  EXPECT_EQ(model.stats().reserved_bytes, 42 * kMiB);
  model.Free(b.block_id);
  model.EmptyCache();  // both large pages are free: the large range goes
  EXPECT_EQ(model.stats().reserved_bytes, 2 * kMiB);
  model.Free(c.block_id);
  model.EmptyCache();
  EXPECT_EQ(model.stats().reserved_bytes, 0);
  EXPECT_TRUE(model.Segments().empty());
  const int64_t small_base = c.address;
  EXPECT_EQ(observer.events,
            (std::vector<SegmentEvent>{{true, base, 20 * kMiB, PoolKind::kLarge, true},
                                       {true, base + 20 * kMiB, 20 * kMiB, PoolKind::kLarge, true},
                                       {true, small_base, 2 * kMiB, PoolKind::kSmall, true},
                                       {false, base, 40 * kMiB, PoolKind::kLarge, true},
                                       {false, small_base, 2 * kMiB, PoolKind::kSmall, true}}));
}

TEST(CachingAllocatorModel, ExpandableBestFitPassesOverABlockThatCouldGrow) {
  Model model(Expandable());
  const Model::Allocation a = MustMalloc(model, 9 * kMiB);  // page [0, 20)
  MustMalloc(model, 3 * kMiB);                              // [9, 12); [12, 20) free
  model.Free(a.block_id);
  // Free: [0, 9) before an allocated block and [12, 20) before unmapped space. Best fit
  // by size is the 8 MiB one, but it could grow into the unmapped space, so PyTorch
  // takes the 9 MiB one.
  EXPECT_EQ(MustMalloc(model, 7 * kMiB).address, a.address);
  EXPECT_EQ(model.stats().reserved_bytes, 20 * kMiB);
}

TEST(CachingAllocatorModel, ExpandableUnmapsWholeFreePagesAndRefillsTheLowestHole) {
  RecordingObserver observer;
  Model model(Expandable(), &observer);
  const Model::Allocation a = MustMalloc(model, 50 * kMiB);  // pages [0, 60)
  MustMalloc(model, 5 * kMiB);                               // [50, 55)
  model.Free(a.block_id);
  model.EmptyCache();  // [0, 50) is free: its whole pages [0, 40) are unmapped
  EXPECT_EQ(model.stats().reserved_bytes, 20 * kMiB);
  EXPECT_EQ(BlockLayout(model, 0), (std::vector<std::pair<int64_t, bool>>{
                                       {10 * kMiB, false}, {5 * kMiB, true}, {5 * kMiB, false}}));
  EXPECT_EQ(model.Segments()[0].address, a.address + 40 * kMiB);
  // 30 MiB maps the hole at the lowest address, not the end, and merges with [40, 50).
  EXPECT_EQ(MustMalloc(model, 30 * kMiB).address, a.address);
  EXPECT_EQ(model.stats().reserved_bytes, 60 * kMiB);
  EXPECT_EQ(observer.events.back(),
            (SegmentEvent{true, a.address, 40 * kMiB, PoolKind::kLarge, true}));
  ExpectConsistent(model);
}

TEST(CachingAllocatorModel, ExpandableUnderAFractionChecksTheCudaMallocSegmentSize) {
  for (const bool fraction : {true, false}) {
    Model model(Expandable(60 * kMiB, fraction));
    MustMalloc(model, 25 * kMiB);  // maps [0, 40)
    MustMalloc(model, 12 * kMiB);  // [25, 37); 3 MiB left before the unmapped space
    // 22 MiB needs one more page: reserved 60 MiB, the capacity. Under a fraction PyTorch
    // checks reserved + 22 MiB (what a cudaMalloc would take) and refuses; the device
    // itself has room for the page.
    EXPECT_EQ(model.Malloc(22 * kMiB).has_value(), !fraction);
    EXPECT_EQ(model.stats().num_ooms, fraction ? 1 : 0);
    EXPECT_EQ(model.stats().reserved_bytes, fraction ? 40 * kMiB : 60 * kMiB);
  }
  // Under a fraction of 55 MiB a 12 MiB request passes the check (40 + 12 MiB) and maps a
  // whole page, beyond the limit; the device's driver would refuse that page.
  for (const bool fraction : {true, false}) {
    Model model(Expandable(55 * kMiB, fraction));
    MustMalloc(model, 25 * kMiB);
    MustMalloc(model, 15 * kMiB);  // fills [0, 40)
    EXPECT_EQ(model.Malloc(12 * kMiB).has_value(), fraction);
    EXPECT_EQ(model.stats().reserved_bytes, fraction ? 60 * kMiB : 40 * kMiB);
  }
}

// Note [Garbage collection threshold], worked by hand: capacity 100 MiB, threshold 0.6.
TEST(CachingAllocatorModel, GarbageCollectionFreesSegmentsAtLeastAsOldAsTheAverage) {
  const auto run = [](int64_t capacity_bytes, double threshold, bool fraction = true) {
    CachingAllocatorConfig config(capacity_bytes);
    config.capacity_is_fraction = fraction;
    config.garbage_collection_threshold = threshold;
    Model model(config);
    const Model::Allocation a = MustMalloc(model, 30 * kMiB);  // large-pool search 1
    const Model::Allocation b = MustMalloc(model, 24 * kMiB);  // search 2
    model.Free(a.block_id);                                    // a freed at search 2
    const Model::Allocation c = MustMalloc(model, 32 * kMiB);  // 3: 54 MiB <= 60, no collection
    model.Free(b.block_id);                                    // freed at search 3
    model.Free(c.block_id);
    EXPECT_EQ(model.stats().reserved_bytes, 86 * kMiB);
    MustMalloc(model, 36 * kMiB);  // search 4
    return model.stats();
  };
  // Search 4 finds no fit for 36 MiB and 86 MiB exceeds 60 MiB by 26 MiB. Ages: b 1, a 2,
  // c 1, average 4/3: only a (30 MiB) goes, which is enough; 56 + 36 MiB fits.
  const AllocatorStats collected = run(100 * kMiB, 0.6);
  EXPECT_EQ(collected.reserved_bytes, 92 * kMiB);
  EXPECT_EQ(collected.num_alloc_retries, 0);
  // Without collection 86 + 36 MiB exceeds the capacity: every cached segment is
  // released and the allocation retried.
  const AllocatorStats plain = run(100 * kMiB, 0);
  EXPECT_EQ(plain.reserved_bytes, 36 * kMiB);
  EXPECT_EQ(plain.num_alloc_retries, 1);
  // Without a memory fraction nothing is collected.
  EXPECT_EQ(run(0, 0.6).reserved_bytes, 122 * kMiB);
  EXPECT_EQ(run(100 * kMiB, 0.6, false).reserved_bytes, 36 * kMiB);
}

// Log-uniform sizes from 1 B to 32 MiB cover both pools and all segment rules.
int64_t RandomRequestBytes(std::mt19937_64& rng) {
  return std::max<int64_t>(1, int64_t{1} << (rng() % 26)) + static_cast<int64_t>(rng() % 4096);
}

void FreeOneAtRandom(Model& model, std::mt19937_64& rng, std::vector<Model::Allocation>* live) {
  const size_t index = rng() % live->size();
  model.Free((*live)[index].block_id);
  (*live)[index] = live->back();
  live->pop_back();
}

// Expandable segments under random mallocs, frees and cache releases: the invariants of
// ExpectConsistent hold for every run of mapped pages, on the device's capacity and under a
// memory fraction, and everything unmaps at the end.
TEST(CachingAllocatorModel, ExpandableRandomTraceStaysConsistent) {
  for (const auto& [capacity_bytes, fraction] :
       {std::pair<int64_t, bool>{0, false}, {200 * kMiB, false}, {200 * kMiB, true}}) {
    Model model(Expandable(capacity_bytes, fraction));
    std::mt19937_64 rng(7);
    std::vector<Model::Allocation> live;
    for (int step = 0; step < 3000; ++step) {
      const uint64_t dice = rng() % 20;
      if (dice == 0) {
        model.EmptyCache();
      } else if (!live.empty() && dice < 10) {
        FreeOneAtRandom(model, rng, &live);
      } else if (const std::optional<Model::Allocation> a = model.Malloc(RandomRequestBytes(rng))) {
        live.push_back(*a);
      }
      EXPECT_EQ(model.stats().reserved_bytes % Model::kSmallBuffer, 0);
      if (capacity_bytes > 0 && !fraction) {
        EXPECT_LE(model.stats().reserved_bytes, capacity_bytes);
      }
      if (step % 50 == 0) ExpectConsistent(model);
    }
    ExpectConsistent(model);
    if (capacity_bytes > 0) {
      EXPECT_GT(model.stats().num_ooms, 0);
    }
    for (const Model::Allocation& allocation : live) model.Free(allocation.block_id);
    model.EmptyCache();
    EXPECT_EQ(model.stats().reserved_bytes, 0);
    EXPECT_TRUE(model.Segments().empty());
  }
}

// A random trace, checked step by step against a brute-force best fit over Segments().
TEST(CachingAllocatorModel, RandomTraceMatchesBruteForceBestFit) {
  for (const int64_t capacity_bytes : {int64_t{0}, 200 * kMiB}) {
    Model model{CachingAllocatorConfig(capacity_bytes)};
    std::mt19937_64 rng(42);
    std::vector<Model::Allocation> live;
    int64_t ooms = 0;
    for (int step = 0; step < 3000; ++step) {
      if (!live.empty() && rng() % 2 == 0) {
        FreeOneAtRandom(model, rng, &live);
      } else {
        const int64_t bytes = RandomRequestBytes(rng);
        const int64_t rounded = Model::RoundSize(bytes);
        std::optional<int64_t> expected_address;
        int64_t best_size = 0;
        for (const AllocatorSegmentView& segment : model.Segments()) {
          if (segment.pool != Model::PoolFor(rounded)) continue;
          for (const AllocatorBlockView& block : segment.blocks) {
            if (block.allocated || block.size_bytes < rounded) continue;
            if (!expected_address || block.size_bytes < best_size) {
              expected_address = block.address;
              best_size = block.size_bytes;
            }
          }
        }
        const int64_t reserved_before = model.stats().reserved_bytes;
        const std::optional<Model::Allocation> allocation = model.Malloc(bytes);
        if (!allocation) {
          ++ooms;
          EXPECT_FALSE(expected_address.has_value());
        } else {
          live.push_back(*allocation);
          EXPECT_GE(allocation->block_bytes, rounded);
          if (expected_address) {
            EXPECT_EQ(allocation->address, *expected_address) << "step " << step;
            EXPECT_EQ(model.stats().reserved_bytes, reserved_before);
          }
        }
      }
      if (capacity_bytes > 0) {
        EXPECT_LE(model.stats().reserved_bytes, capacity_bytes);
      }
      if (step % 100 == 0) ExpectConsistent(model);
    }
    ExpectConsistent(model);
    EXPECT_EQ(model.stats().num_ooms, ooms);
    if (capacity_bytes > 0) {
      EXPECT_GT(ooms, 0) << "the capacity run should hit OOMs";
      EXPECT_GT(model.stats().num_alloc_retries, ooms) << "and retries that succeed";
    }
    for (const Model::Allocation& allocation : live) model.Free(allocation.block_id);
    model.EmptyCache();
    EXPECT_EQ(model.stats().reserved_bytes, 0);
    EXPECT_EQ(model.stats().allocated_bytes, 0);
    EXPECT_TRUE(model.Segments().empty());
  }
}

}  // namespace
}  // namespace memsim
