// CachingAllocatorModel: a model of PyTorch's CUDA caching allocator
// (c10/cuda/CUDACachingAllocator.cpp) on one device and one stream.
//
// It turns a sequence of tensor mallocs and frees into the segments and blocks the real
// allocator would hold, so reserved memory, fragmentation and OOMs can be predicted
// without a GPU. Requests are rounded to 512 B and served best-fit from a small pool
// (<= 1 MiB) or a large pool; a miss "cudaMallocs" a new segment, and frees only return
// blocks to the cache, merging them with free neighbours. PYTORCH_CUDA_ALLOC_CONF's
// max_split_size_mb, max_non_split_rounding_mb, roundup_power2_divisions,
// expandable_segments and garbage_collection_threshold are modelled (the Notes below); not
// modelled: streams and events, CUDA graphs.
//
// Note [Oversize blocks]
// With max_split_size_mb, blocks of at least that size are "oversize" (PyTorch 2.x
// get_free_block, should_split, release_available_cached_blocks): a request below
// max_split_size never takes one, a request at or above it takes one only if it wastes
// less than kLargeBuffer (max_non_split_rounding_mb's default), and they are never split. When a
// new segment would exceed the device, PyTorch first frees the smallest free oversize segment that
// is at least as large as the request (or as max_split_size), else free oversize segments from the
// largest down until as many bytes are freed, and tries again; only then does it release the whole
// cache and retry (the retry the stats count). Checked against PyTorch 2.11 with
// max_split_size_mb:128 on the replays of Note [Segment addresses].
//
// Note [Segment addresses]
// PyTorch serves a request from the smallest free block that fits and, among blocks of
// that size, the one at the lowest address; so where cudaMalloc puts each segment decides
// which block is reused, and with it later splits, merges and segments. Checked on a GPU
// (simulator/testdata/allocator: seven sequences, five of them memsim's own model runs,
// replayed through PyTorch 2.11's allocator on an H200, unlimited and on a capped device):
// given the addresses the driver returned there (CachingAllocatorConfig::segment_address),
// this model reproduces every change of reserved memory at the same event, the peaks, the
// retries, the out-of-memory event and the final segments in all 21 replays (7 unlimited,
// 14 capped; each run's segment addresses recorded). The driver's own placement is not
// modelled: it put most large
// segments below the previous one and runs of 2 MiB ones upward, with exceptions. By
// default each segment goes above the last; the peak reserved is then exact in 14 of 21
// replays and within +0.08% on the model runs (+3.6% on a random sequence). Placing each
// below the last was exact in 19 of 21, but it moved 73 validation metrics (through which
// blocks stay unsplit), 41 for the worse, so it is not the default.
//
// Note [Rounding to power-of-two divisions]
// roundup_power2_divisions:D splits each interval between powers of two into D equal
// steps and rounds a request up to the next step (PyTorch's round_size): with D = 4, 1200
// KiB becomes 1280 KiB. D is chosen by the request's interval, 1 MiB and below sharing the
// first and 32 GiB and above the last; a power of two, or a request no larger than 512 B x D,
// is left at PyTorch's 512-byte rounding. Checked against PyTorch 2.11 with the replays of
// Note [Segment addresses] under "4" and "[256:1,512:2,1024:4,>:8]" (whose '>' sets the
// intervals above 1024 MiB's, not 1024 MiB's own: its 1572 MiB logits rounded to 1792).
//
// Note [Expandable segments]
// With expandable_segments:True (PyTorch 2.x, Note [Expandable Segments] in
// CUDACachingAllocator.cpp) each pool reserves one range of virtual addresses and maps
// physical pages onto it as needed: 2 MiB pages for the small pool, 20 MiB for the large.
// A request no free block fits maps pages at the lowest address where the free and
// unmapped space in a row is large enough (a free block followed by unmapped space
// counts), merging with free neighbours; every block then splits down to its rounded size
// (remainder >= 512 B), so allocated memory is the rounded requests'. The best fit skips a
// free block followed by unmapped space while the next larger free block would grow less
// (PyTorch compares size plus the unmapped space after it). Releasing the cache unmaps
// the whole pages inside free blocks; a range left with nothing mapped is released. Reserved
// memory is the mapped pages; the snapshot shows each run of mapped pages as a segment
// (PyTorch's snapshot()), and segment_map/segment_unmap trace actions. Under a memory
// fraction PyTorch checks reserved memory plus the segment a cudaMalloc would have taken
// (SegmentSizeFor) against it before mapping, so it may refuse a request whose pages would
// fit, or map a page beyond it; on the whole device the driver refuses pages that do not fit.
// PyTorch reserves 1.125x the device's memory per range and opens a second one only when
// that is used up; the model reserves kExpandableRangeBytes, so it never does.
// Checked against PyTorch 2.11 on an H200 with the replays of Note [Segment addresses].
//
// Note [Garbage collection threshold]
// garbage_collection_threshold:T acts only under a memory fraction
// (set_per_process_memory_fraction; CachingAllocatorConfig::capacity_is_fraction): when no free
// block fits a request and reserved memory exceeds T x capacity, PyTorch frees whole free segments
// of the large pool whose age is at least the average, recomputing the average until it has freed
// the excess or nothing more qualifies, before it maps a new segment. A block's age counts the
// large pool's best-fit searches since it was last returned to the free set. Megatron-LM never sets
// a fraction, so there it has no effect. Checked against PyTorch 2.11 with
// garbage_collection_threshold:0.6 on the capped replays.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <tuple>
#include <vector>

#include "simulator/check.h"

namespace memsim {

struct CachingAllocatorConfig {
  CachingAllocatorConfig() = default;
  explicit CachingAllocatorConfig(int64_t capacity) : capacity_bytes(capacity) {}

  // Device memory the allocator may reserve, like a GPU's total memory; 0: unlimited.
  int64_t capacity_bytes = 0;
  // True: the capacity is a torch.cuda.set_per_process_memory_fraction limit, which PyTorch
  // checks before it asks the driver, against reserved memory plus the segment a cudaMalloc
  // would take (SegmentSizeFor), and under which garbage_collection_threshold acts. False:
  // it is the device's memory, so the driver refuses what does not fit. The two differ
  // only with expandable segments, which map pages rather than that segment.
  bool capacity_is_fraction = false;
  // PYTORCH_CUDA_ALLOC_CONF's max_split_size_mb in bytes (Note [Oversize blocks]); 0: none,
  // PyTorch's default. REQUIRES: 0 or at least kLargeBuffer (PyTorch 2.9 on accept 20 MiB).
  int64_t max_split_size_bytes = 0;
  // PYTORCH_CUDA_ALLOC_CONF's max_non_split_rounding_mb in bytes (Note [Oversize blocks]); 0:
  // PyTorch's default, kLargeBuffer. REQUIRES: 0 or at least kLargeBuffer.
  int64_t max_non_split_rounding_bytes = 0;
  // PYTORCH_CUDA_ALLOC_CONF's roundup_power2_divisions (Note [Rounding to power-of-two
  // divisions]): per size interval [2^(20+i), 2^(21+i)) bytes (the first and last open-
  // ended), 0 or 1: no rounding, else a power of two. REQUIRES: each is 0 or a power of two
  // up to CachingAllocatorModel::kMaxDivisions (2^30).
  std::array<int64_t, 16> roundup_power2_divisions{};
  // PYTORCH_CUDA_ALLOC_CONF's expandable_segments (Note [Expandable segments]).
  // REQUIRES: not with max_split_size_bytes (PyTorch asserts when it would release an
  // oversize expandable block).
  bool expandable_segments = false;
  // PYTORCH_CUDA_ALLOC_CONF's garbage_collection_threshold (Note [Garbage collection
  // threshold]); 0: off. Acts only under a fraction (capacity_is_fraction).
  // REQUIRES: 0 <= value < 1.
  double garbage_collection_threshold = 0;
  // Where each new segment goes (Note [Segment addresses]), called with its size; not
  // called with expandable segments, whose ranges the model places itself.
  // REQUIRES: a positive address at which the segment overlaps no live one and ends
  // within int64_t (else Malloc throws std::invalid_argument). Empty: above every earlier
  // segment.
  // Tests replaying a real allocator's run pass the addresses cudaMalloc returned there.
  std::function<int64_t(int64_t size_bytes)> segment_address;
};

enum class PoolKind { kSmall, kLarge };

struct AllocatorBlockView {
  int64_t address;
  int64_t size_bytes;
  int64_t requested_bytes;  // 0 for a free block
  bool allocated;
};

struct AllocatorSegmentView {
  int64_t address;
  int64_t size_bytes;
  PoolKind pool;
  bool expandable;                         // a run of mapped pages of an expandable segment
  std::vector<AllocatorBlockView> blocks;  // in address order, covering the segment
};

// The counters torch.cuda.memory_stats() reports, for the "all" pools aggregate.
struct AllocatorStats {
  int64_t allocated_bytes = 0;  // sizes of allocated blocks, after rounding and splitting
  int64_t reserved_bytes = 0;   // sizes of segments and of mapped pages
  int64_t requested_bytes = 0;  // sizes callers asked for, of allocated blocks
  int64_t peak_allocated_bytes = 0;
  int64_t peak_reserved_bytes = 0;
  int64_t peak_requested_bytes = 0;
  int64_t num_segments = 0;  // cudaMalloc'ed segments (expandable ranges not counted)
  int64_t num_active_blocks = 0;
  int64_t num_alloc_retries = 0;  // segment allocations retried after releasing the cache
  int64_t num_ooms = 0;
};

// Receives segment-level events, e.g. for a memory snapshot's segment_alloc/segment_free.
class AllocatorObserver {
 public:
  virtual ~AllocatorObserver() = default;
  virtual void OnSegmentAlloc(int64_t address, int64_t size_bytes, PoolKind pool) = 0;
  virtual void OnSegmentFree(int64_t address, int64_t size_bytes, PoolKind pool) = 0;
  // Pages mapped onto or unmapped from an expandable segment (Note [Expandable segments]).
  virtual void OnSegmentMap(int64_t address, int64_t size_bytes, PoolKind pool) = 0;
  virtual void OnSegmentUnmap(int64_t address, int64_t size_bytes, PoolKind pool) = 0;
};

class CachingAllocatorModel {
 public:
  // Values from c10/cuda/CUDACachingAllocator.cpp.
  static constexpr int64_t kMinBlockSize = 512;     // all block sizes are multiples of this
  static constexpr int64_t kSmallSize = 1 << 20;    // largest rounded size of the small pool
  static constexpr int64_t kSmallBuffer = 2 << 20;  // segment size of the small pool
  // Segment size for large-pool requests below kMinLargeAlloc; larger requests get a
  // segment of their own, rounded up to a multiple of kRoundLarge.
  static constexpr int64_t kLargeBuffer = 20 << 20;
  static constexpr int64_t kMinLargeAlloc = 10 << 20;
  static constexpr int64_t kRoundLarge = 2 << 20;
  // Keeps rounding free of overflow; far beyond any device.
  static constexpr int64_t kMaxRequestBytes = int64_t{1} << 62;
  // The most roundup_power2_divisions per interval the model takes (more would not split
  // any interval further, and 512 B times it must stay within int64_t).
  static constexpr int64_t kMaxDivisions = int64_t{1} << 30;
  // Virtual addresses an expandable segment reserves (Note [Expandable segments]): 16 TiB,
  // more than 1.125x any GPU's memory.
  static constexpr int64_t kExpandableRangeBytes = int64_t{1} << 44;

  struct Allocation {
    int64_t block_id;  // handle for Free(); may be reused once freed
    int64_t address;
    int64_t block_bytes;  // what allocated_bytes grew by: the rounded size or a whole block
  };

  // REQUIRES: config.capacity_bytes >= 0 and the config's own REQUIRES (else throws
  // std::invalid_argument); `observer`, if given, outlives the model.
  explicit CachingAllocatorModel(CachingAllocatorConfig config = {},
                                 AllocatorObserver* observer = nullptr);

  // Returns std::nullopt on OOM: a new segment would exceed capacity even after releasing
  // every entirely free cached segment (which stay released).
  // REQUIRES: 0 < requested_bytes <= kMaxRequestBytes (else throws std::invalid_argument).
  std::optional<Allocation> Malloc(int64_t requested_bytes);

  // REQUIRES: block_id came from Malloc and was not freed since (else throws
  // std::invalid_argument, when detectable).
  void Free(int64_t block_id);
  // What Malloc returned for the block, which an allocated block keeps until it is freed.
  // REQUIRES: block_id came from Malloc and was not freed since.
  Allocation AllocatedBlock(int64_t block_id) const {
    const Block& block = blocks_[static_cast<size_t>(block_id)];
    MEMSIM_DCHECK(block.allocated);
    return {block_id, block.address, block.size_bytes};
  }

  // Releases every entirely free segment and unmaps the free pages of expandable ones, like
  // torch.cuda.empty_cache().
  void EmptyCache();

  // Sets the peaks to the current values, like torch.cuda.reset_peak_memory_stats().
  void ResetPeakStats();

  const AllocatorStats& stats() const { return stats_; }

  // In address order. O(number of blocks): meant for snapshots and tests.
  std::vector<AllocatorSegmentView> Segments() const;

  // The block size a request is rounded to, by 512 B or to `divisions` steps per power of
  // two (Note [Rounding to power-of-two divisions]).
  // REQUIRES: 0 < bytes <= kMaxRequestBytes; divisions 0 or a power of two up to
  // kMaxDivisions.
  static int64_t RoundSize(int64_t bytes, int64_t divisions = 0);
  // The divisions `config` rounds a request of `bytes` to.
  static int64_t DivisionsFor(const CachingAllocatorConfig& config, int64_t bytes);
  static PoolKind PoolFor(int64_t rounded_bytes);
  // The size of the segment allocated when no cached block fits.
  static int64_t SegmentSizeFor(int64_t rounded_bytes);
  // The page size of an expandable segment of `pool`.
  static int64_t PageSizeFor(PoolKind pool);

 private:
  static constexpr int64_t kNoBlock = -1;

  struct Block {
    int64_t address = 0;
    int64_t size_bytes = 0;
    int64_t requested_bytes = 0;  // 0 while free
    int64_t prev = kNoBlock;      // neighbours in the same segment, by address
    int64_t next = kNoBlock;
    // The large or small pool's best-fit count when the block entered the free set (Note
    // [Garbage collection threshold]).
    int64_t searches_when_freed = 0;
    PoolKind pool = PoolKind::kSmall;
    bool allocated = false;
    bool expandable = false;  // part of an expandable segment's address range
    bool mapped = true;       // false: unmapped address space of an expandable segment
  };
  // Orders like PyTorch's BlockComparatorSize: by size, then address.
  using FreeKey = std::tuple<int64_t, int64_t, int64_t>;  // (size, address, block id)
  using UnmappedKey = std::pair<int64_t, int64_t>;        // (address, block id)

  static int PoolIndex(PoolKind pool) { return pool == PoolKind::kSmall ? 0 : 1; }
  std::set<FreeKey>& FreeBlocks(PoolKind pool);
  int64_t NewBlock(const Block& block);
  // Moves a free mapped block into (out of) its pool's free set.
  void InsertFree(int64_t id);
  void EraseFree(int64_t id);
  // Moves an unallocated block into (out of) its set: the free set if mapped, else the
  // pool's unmapped set.
  void InsertUnallocated(int64_t id);
  void EraseUnallocated(int64_t id);
  // Splits unallocated block `id` after its first `front_bytes`: the rest becomes a new
  // block of the same kind right after it, in no set, whose id is returned.
  int64_t SplitAfter(int64_t id, int64_t front_bytes);
  // Whether reserving `more_bytes` more would exceed the capacity.
  bool ExceedsCapacity(int64_t more_bytes) const {
    return config_.capacity_bytes > 0 &&
           stats_.reserved_bytes > config_.capacity_bytes - more_bytes;
  }
  // PyTorch's get_free_block: the free block a request of `rounded_bytes` takes, out of
  // the free set, or kNoBlock.
  int64_t FindFreeBlock(PoolKind pool, int64_t rounded_bytes);
  // A free block of at least `rounded_bytes` from new device memory, out of the free set,
  // or kNoBlock when it would exceed capacity.
  int64_t GrowPool(PoolKind pool, int64_t rounded_bytes);
  // Returns the segment's single free block (not yet in a free set).
  int64_t CreateSegment(PoolKind pool, int64_t size_bytes);
  // REQUIRES: `id` is a segment's only block, free and out of the free sets.
  void ReleaseSegment(int64_t id);
  void ReleaseCachedSegments();
  // Note [Garbage collection threshold].
  void CollectGarbage();
  bool CollectsGarbage() const {
    return config_.garbage_collection_threshold > 0 && config_.capacity_is_fraction &&
           config_.capacity_bytes > 0;
  }
  // Note [Expandable segments]. MapExpandable returns a free mapped block of at least
  // `rounded_bytes`, out of the free set, or kNoBlock when the device is full (pages it
  // mapped before stay mapped, as in PyTorch).
  int64_t MapExpandable(PoolKind pool, int64_t rounded_bytes);
  // The first block of the lowest run of free and unmapped blocks ending in unmapped space
  // that holds `rounded_bytes`, opening a new address range when none does.
  int64_t FindExpandableSpace(PoolKind pool, int64_t rounded_bytes);
  // Maps whole pages covering the first `bytes` of unmapped block `id` and merges them
  // with free neighbours; returns the resulting free block (in the free set), or kNoBlock
  // when the pages exceed the device's capacity.
  int64_t MapPages(int64_t id, int64_t bytes);
  // Unmaps the whole pages inside free block `id`; releases the address range when
  // nothing of it stays mapped.
  void UnmapFreePages(int64_t id);
  // PyTorch's best fit compares an expandable block's size plus the unmapped space after it.
  int64_t ExpandableSize(int64_t id) const;
  // PyTorch's release_available_cached_blocks for a request of `rounded_bytes` from `pool`;
  // true if it freed enough to try again.
  bool ReleaseOversizeSegments(PoolKind pool, int64_t rounded_bytes);
  int64_t MaxNonSplitRounding() const {
    return config_.max_non_split_rounding_bytes > 0 ? config_.max_non_split_rounding_bytes
                                                    : kLargeBuffer;
  }
  bool Oversize(int64_t size_bytes) const {
    return config_.max_split_size_bytes > 0 && size_bytes >= config_.max_split_size_bytes;
  }
  // Allocates the front of free block `id` (out of the free sets), splitting off the rest
  // when PyTorch would.
  Allocation TakeBlock(int64_t id, int64_t rounded_bytes, int64_t requested_bytes);
  // Merges unallocated block `id` with its unallocated neighbours that are mapped as it is
  // and puts the result in its set (PyTorch's free_block, map_block and unmap_block);
  // returns the result's id.
  int64_t JoinFreeNeighbours(int64_t id);
  // Appends block `back` to its free predecessor `front` and recycles `back`'s slot.
  void Merge(int64_t front, int64_t back);
  // Makes slot `id` available to NewBlock.
  void Recycle(int64_t id);

  CachingAllocatorConfig config_;
  AllocatorObserver* observer_;
  AllocatorStats stats_;
  int64_t next_address_;
  std::vector<Block> blocks_;        // indexed by block id
  std::vector<int64_t> free_slots_;  // ids of unused entries of blocks_
  std::set<FreeKey> small_free_;
  std::set<FreeKey> large_free_;
  std::set<UnmappedKey> unmapped_[2];        // by PoolIndex
  int64_t free_block_searches_[2] = {0, 0};  // by PoolIndex; counted while CollectsGarbage()
  std::map<int64_t, int64_t> segments_;      // address -> id of the segment's first block
};

}  // namespace memsim
