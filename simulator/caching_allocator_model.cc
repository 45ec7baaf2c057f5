#include "simulator/caching_allocator_model.h"

#include <algorithm>
#include <iterator>
#include <limits>
#include <stdexcept>
#include <string>

#include "simulator/check.h"

namespace memsim {
namespace {

// By default fake device addresses start here (nonzero, 2 MiB aligned, in the range CUDA
// uses) and only grow, so an address names one segment or block for the whole run (Note
// [Segment addresses]).
constexpr int64_t kFirstSegmentAddress = int64_t{0x7f} << 40;

int64_t RoundUp(int64_t bytes, int64_t multiple) {
  return (bytes + multiple - 1) / multiple * multiple;
}

}  // namespace

CachingAllocatorModel::CachingAllocatorModel(CachingAllocatorConfig config,
                                             AllocatorObserver* observer)
    : config_(config), observer_(observer), next_address_(kFirstSegmentAddress) {
  if (config_.capacity_bytes < 0) {
    throw std::invalid_argument("CachingAllocatorModel: negative capacity_bytes");
  }
  if (config_.max_split_size_bytes != 0 && config_.max_split_size_bytes < kLargeBuffer) {
    throw std::invalid_argument("CachingAllocatorModel: max_split_size must be at least 20 MiB");
  }
  if (config_.max_non_split_rounding_bytes != 0 &&
      config_.max_non_split_rounding_bytes < kLargeBuffer) {
    throw std::invalid_argument(
        "CachingAllocatorModel: max_non_split_rounding must be at least 20 MiB");
  }
  for (const int64_t divisions : config_.roundup_power2_divisions) {
    if (divisions < 0 || divisions > kMaxDivisions || (divisions & (divisions - 1)) != 0) {
      throw std::invalid_argument(
          "CachingAllocatorModel: roundup_power2_divisions must be 0 or powers of two up to 2^30");
    }
  }
  if (config_.expandable_segments && config_.max_split_size_bytes != 0) {
    throw std::invalid_argument(
        "CachingAllocatorModel: expandable segments with max_split_size are not modelled");
  }
  if (!(config_.garbage_collection_threshold >= 0 && config_.garbage_collection_threshold < 1)) {
    throw std::invalid_argument(
        "CachingAllocatorModel: garbage_collection_threshold must be in [0, 1)");
  }
}

int64_t CachingAllocatorModel::RoundSize(int64_t bytes, int64_t divisions) {
  if (bytes < kMinBlockSize) return kMinBlockSize;
  if (divisions <= 1 || bytes <= kMinBlockSize * divisions) return RoundUp(bytes, kMinBlockSize);
  const int64_t power_of_two = int64_t{1} << (63 - __builtin_clzll(static_cast<uint64_t>(bytes)));
  if (power_of_two == bytes) return bytes;
  // bytes > 512 B x divisions, so the step, a power of two, is at least 512 B (PyTorch's
  // zero-step case cannot arise).
  return RoundUp(bytes, power_of_two / divisions);
}

int64_t CachingAllocatorModel::DivisionsFor(const CachingAllocatorConfig& config, int64_t bytes) {
  // Intervals start at 1 MiB (2^20): PyTorch's AllocatorConfig::roundup_power2_divisions.
  const int log2 = 63 - __builtin_clzll(static_cast<uint64_t>(bytes));
  const size_t last = config.roundup_power2_divisions.size() - 1;
  const size_t index = std::min<size_t>(static_cast<size_t>(std::max(0, log2 - 20)), last);
  return config.roundup_power2_divisions[index];
}

PoolKind CachingAllocatorModel::PoolFor(int64_t rounded_bytes) {
  return rounded_bytes <= kSmallSize ? PoolKind::kSmall : PoolKind::kLarge;
}

int64_t CachingAllocatorModel::SegmentSizeFor(int64_t rounded_bytes) {
  if (rounded_bytes <= kSmallSize) return kSmallBuffer;
  if (rounded_bytes < kMinLargeAlloc) return kLargeBuffer;
  return RoundUp(rounded_bytes, kRoundLarge);
}

int64_t CachingAllocatorModel::PageSizeFor(PoolKind pool) {
  return pool == PoolKind::kSmall ? kSmallBuffer : kLargeBuffer;
}

std::optional<CachingAllocatorModel::Allocation> CachingAllocatorModel::Malloc(
    int64_t requested_bytes) {
  if (requested_bytes <= 0 || requested_bytes > kMaxRequestBytes) {
    throw std::invalid_argument("CachingAllocatorModel::Malloc: bad size " +
                                std::to_string(requested_bytes));
  }
  const int64_t rounded_bytes = RoundSize(requested_bytes, DivisionsFor(config_, requested_bytes));
  const PoolKind pool = PoolFor(rounded_bytes);
  int64_t id = FindFreeBlock(pool, rounded_bytes);
  if (id != kNoBlock) return TakeBlock(id, rounded_bytes, requested_bytes);
  if (CollectsGarbage()) CollectGarbage();
  id = GrowPool(pool, rounded_bytes);
  if (id == kNoBlock && ReleaseOversizeSegments(pool, rounded_bytes)) {
    id = GrowPool(pool, rounded_bytes);
  }
  if (id == kNoBlock) {
    // What PyTorch does when cudaMalloc fails: free all cached segments, retry once.
    ReleaseCachedSegments();
    ++stats_.num_alloc_retries;
    id = GrowPool(pool, rounded_bytes);
    if (id == kNoBlock) {
      ++stats_.num_ooms;
      return std::nullopt;
    }
  }
  return TakeBlock(id, rounded_bytes, requested_bytes);
}

int64_t CachingAllocatorModel::FindFreeBlock(PoolKind pool, int64_t rounded_bytes) {
  if (CollectsGarbage()) ++free_block_searches_[PoolIndex(pool)];
  std::set<FreeKey>& free_blocks = FreeBlocks(pool);
  // Address and id 0 sort first, so this finds the smallest fit, then the lowest address.
  auto best = free_blocks.lower_bound(FreeKey{rounded_bytes, 0, 0});
  if (best == free_blocks.end()) return kNoBlock;
  if (config_.expandable_segments) {
    // Note [Expandable segments]: a block that could grow into unmapped space is passed
    // over while the next larger block would grow less.
    for (auto next = std::next(best);
         next != free_blocks.end() &&
         ExpandableSize(std::get<2>(*next)) < ExpandableSize(std::get<2>(*best));
         ++next) {
      best = next;
    }
  }
  // Note [Oversize blocks]: PyTorch looks at the best fit only.
  const bool usable = Oversize(rounded_bytes)
                          ? std::get<0>(*best) < rounded_bytes + MaxNonSplitRounding()
                          : !Oversize(std::get<0>(*best));
  if (!usable) return kNoBlock;
  const int64_t id = std::get<2>(*best);
  MEMSIM_DCHECK(!blocks_[id].allocated && blocks_[id].size_bytes >= rounded_bytes);
  free_blocks.erase(best);
  return id;
}

int64_t CachingAllocatorModel::ExpandableSize(int64_t id) const {
  const Block& block = blocks_[id];
  const bool grows = block.next != kNoBlock && !blocks_[block.next].mapped;
  return block.size_bytes + (grows ? blocks_[block.next].size_bytes : 0);
}

int64_t CachingAllocatorModel::GrowPool(PoolKind pool, int64_t rounded_bytes) {
  const int64_t segment_bytes = SegmentSizeFor(rounded_bytes);
  // Without expandable segments this is also the driver's answer: the segment is the growth.
  const bool checked_before = config_.capacity_is_fraction || !config_.expandable_segments;
  if (checked_before && ExceedsCapacity(segment_bytes)) return kNoBlock;
  if (config_.expandable_segments) return MapExpandable(pool, rounded_bytes);
  return CreateSegment(pool, segment_bytes);
}

void CachingAllocatorModel::Free(int64_t block_id) {
  if (block_id < 0 || block_id >= static_cast<int64_t>(blocks_.size()) ||
      !blocks_[block_id].allocated) {
    throw std::invalid_argument("CachingAllocatorModel::Free: block " + std::to_string(block_id) +
                                " is not allocated");
  }
  Block& block = blocks_[block_id];
  stats_.allocated_bytes -= block.size_bytes;
  stats_.requested_bytes -= block.requested_bytes;
  --stats_.num_active_blocks;
  block.allocated = false;
  block.requested_bytes = 0;

  JoinFreeNeighbours(block_id);
  MEMSIM_DCHECK(stats_.allocated_bytes >= 0 && stats_.requested_bytes >= 0 &&
                stats_.num_active_blocks >= 0);
}

int64_t CachingAllocatorModel::JoinFreeNeighbours(int64_t id) {
  const int64_t prev = blocks_[id].prev;
  const int64_t next = blocks_[id].next;
  // Mapped and unmapped neighbours stay apart (Note [Expandable segments]).
  const auto joins = [&](int64_t other) {
    return other != kNoBlock && !blocks_[other].allocated &&
           blocks_[other].mapped == blocks_[id].mapped;
  };
  if (joins(prev)) {
    EraseUnallocated(prev);
    Merge(prev, id);
    id = prev;
  }
  if (joins(next)) {
    EraseUnallocated(next);
    Merge(id, next);
  }
  InsertUnallocated(id);
  return id;
}

void CachingAllocatorModel::EmptyCache() { ReleaseCachedSegments(); }

void CachingAllocatorModel::ResetPeakStats() {
  stats_.peak_allocated_bytes = stats_.allocated_bytes;
  stats_.peak_reserved_bytes = stats_.reserved_bytes;
  stats_.peak_requested_bytes = stats_.requested_bytes;
}

std::vector<AllocatorSegmentView> CachingAllocatorModel::Segments() const {
  std::vector<AllocatorSegmentView> segments;
  segments.reserve(segments_.size());
  for (const auto& [address, head] : segments_) {
    // An expandable segment shows as one segment per run of mapped blocks.
    AllocatorSegmentView* segment = nullptr;
    for (int64_t id = head; id != kNoBlock; id = blocks_[id].next) {
      const Block& block = blocks_[id];
      if (!block.mapped) {
        segment = nullptr;
        continue;
      }
      if (segment == nullptr) {
        segment = &segments.emplace_back();
        segment->address = block.address;
        segment->size_bytes = 0;
        segment->pool = block.pool;
        segment->expandable = block.expandable;
      }
      segment->size_bytes += block.size_bytes;
      segment->blocks.push_back(
          {block.address, block.size_bytes, block.requested_bytes, block.allocated});
    }
  }
  return segments;
}

std::set<CachingAllocatorModel::FreeKey>& CachingAllocatorModel::FreeBlocks(PoolKind pool) {
  return pool == PoolKind::kSmall ? small_free_ : large_free_;
}

int64_t CachingAllocatorModel::NewBlock(const Block& block) {
  if (free_slots_.empty()) {
    blocks_.push_back(block);
    return static_cast<int64_t>(blocks_.size()) - 1;
  }
  const int64_t id = free_slots_.back();
  free_slots_.pop_back();
  blocks_[id] = block;
  return id;
}

void CachingAllocatorModel::InsertFree(int64_t id) {
  Block& block = blocks_[id];
  MEMSIM_DCHECK(!block.allocated && block.mapped);
  block.searches_when_freed = free_block_searches_[PoolIndex(block.pool)];
  FreeBlocks(block.pool).insert({block.size_bytes, block.address, id});
}

void CachingAllocatorModel::EraseFree(int64_t id) {
  const Block& block = blocks_[id];
  FreeBlocks(block.pool).erase({block.size_bytes, block.address, id});
}

void CachingAllocatorModel::InsertUnallocated(int64_t id) {
  if (blocks_[id].mapped) {
    InsertFree(id);
  } else {
    unmapped_[PoolIndex(blocks_[id].pool)].insert({blocks_[id].address, id});
  }
}

void CachingAllocatorModel::EraseUnallocated(int64_t id) {
  if (blocks_[id].mapped) {
    EraseFree(id);
  } else {
    unmapped_[PoolIndex(blocks_[id].pool)].erase({blocks_[id].address, id});
  }
}

int64_t CachingAllocatorModel::SplitAfter(int64_t id, int64_t front_bytes) {
  MEMSIM_DCHECK(!blocks_[id].allocated && front_bytes > 0 && front_bytes < blocks_[id].size_bytes);
  Block rest = blocks_[id];
  rest.address += front_bytes;
  rest.size_bytes -= front_bytes;
  rest.prev = id;
  const int64_t rest_id = NewBlock(rest);  // may reallocate blocks_: no references held
  if (rest.next != kNoBlock) blocks_[rest.next].prev = rest_id;
  blocks_[id].next = rest_id;
  blocks_[id].size_bytes = front_bytes;
  return rest_id;
}

void CachingAllocatorModel::Recycle(int64_t id) {
  blocks_[id] = Block();
  free_slots_.push_back(id);
}

int64_t CachingAllocatorModel::CreateSegment(PoolKind pool, int64_t size_bytes) {
  Block block;
  if (config_.segment_address) {
    block.address = config_.segment_address(size_bytes);
    // The segment must fit in the address space and overlap no live one: blocks are
    // found, split and merged by address.
    const auto next = segments_.lower_bound(block.address);
    const bool overlaps_next = next != segments_.end() && next->first < block.address + size_bytes;
    bool overlaps_prev = false;
    if (next != segments_.begin()) {
      int64_t last = std::prev(next)->second;  // walk to the previous segment's last block
      while (blocks_[last].next != kNoBlock) last = blocks_[last].next;
      overlaps_prev = blocks_[last].address + blocks_[last].size_bytes > block.address;
    }
    if (block.address <= 0 || block.address > std::numeric_limits<int64_t>::max() - size_bytes ||
        overlaps_next || overlaps_prev) {
      throw std::invalid_argument("CachingAllocatorModel: segment_address gave " +
                                  std::to_string(block.address) +
                                  ", outside the address space or overlapping a live segment");
    }
  } else {
    // Reserved bytes never exceed the address range handed out, so this guards them too.
    if (next_address_ > std::numeric_limits<int64_t>::max() - size_bytes) {
      throw std::overflow_error("CachingAllocatorModel: fake address space exhausted");
    }
    block.address = next_address_;
    next_address_ += size_bytes;  // segment sizes are multiples of 2 MiB: stays aligned
  }
  block.size_bytes = size_bytes;
  block.pool = pool;
  const int64_t id = NewBlock(block);
  segments_.emplace(block.address, id);
  stats_.reserved_bytes += size_bytes;
  ++stats_.num_segments;
  stats_.peak_reserved_bytes = std::max(stats_.peak_reserved_bytes, stats_.reserved_bytes);
  if (observer_ != nullptr) observer_->OnSegmentAlloc(block.address, size_bytes, pool);
  return id;
}

void CachingAllocatorModel::ReleaseSegment(int64_t id) {
  const Block block = blocks_[id];
  MEMSIM_DCHECK(!block.allocated && block.prev == kNoBlock && block.next == kNoBlock);
  segments_.erase(block.address);
  stats_.reserved_bytes -= block.size_bytes;
  --stats_.num_segments;
  Recycle(id);
  if (observer_ != nullptr) observer_->OnSegmentFree(block.address, block.size_bytes, block.pool);
}

void CachingAllocatorModel::ReleaseCachedSegments() {
  // Large pool first, each in free-set order, as PyTorch's release_cached_blocks does;
  // expandable blocks are unmapped after the pass, which they would disturb.
  for (const PoolKind pool : {PoolKind::kLarge, PoolKind::kSmall}) {
    std::set<FreeKey>& free_blocks = FreeBlocks(pool);
    std::vector<int64_t> to_unmap;
    for (auto it = free_blocks.begin(); it != free_blocks.end();) {
      const int64_t id = std::get<2>(*it);
      if (blocks_[id].expandable) {
        to_unmap.push_back(id);
        ++it;
      } else if (blocks_[id].prev == kNoBlock && blocks_[id].next == kNoBlock) {
        it = free_blocks.erase(it);
        ReleaseSegment(id);
      } else {
        ++it;
      }
    }
    for (const int64_t id : to_unmap) UnmapFreePages(id);
  }
}

void CachingAllocatorModel::CollectGarbage() {
  // PyTorch: static_cast<size_t>(threshold * allowed_memory_maximum).
  const auto threshold_bytes = static_cast<int64_t>(config_.garbage_collection_threshold *
                                                    static_cast<double>(config_.capacity_bytes));
  if (stats_.reserved_bytes <= threshold_bytes) return;
  const int64_t target_bytes = stats_.reserved_bytes - threshold_bytes;
  const int64_t searches = free_block_searches_[PoolIndex(PoolKind::kLarge)];
  const auto age = [&](int64_t id) { return searches - blocks_[id].searches_when_freed; };
  const auto whole = [&](int64_t id) {
    return blocks_[id].prev == kNoBlock && blocks_[id].next == kNoBlock;
  };
  int64_t total_age = 0;
  int64_t candidates = 0;
  for (const FreeKey& key : large_free_) {
    if (whole(std::get<2>(key))) {
      total_age += age(std::get<2>(key));
      ++candidates;
    }
  }
  int64_t reclaimed_bytes = 0;
  bool freed = true;
  while (reclaimed_bytes < target_bytes && freed && candidates > 0) {
    // Every whole block at least as old as the average, in free-set order, even beyond the
    // target: PyTorch does not want the collection to run again soon.
    const double average_age = static_cast<double>(total_age) / static_cast<double>(candidates);
    freed = false;
    for (auto it = large_free_.begin(); it != large_free_.end();) {
      const int64_t id = std::get<2>(*it);
      if (!whole(id) || static_cast<double>(age(id)) < average_age) {
        ++it;
        continue;
      }
      freed = true;
      reclaimed_bytes += blocks_[id].size_bytes;
      total_age -= age(id);
      --candidates;
      it = large_free_.erase(it);
      ReleaseSegment(id);
    }
  }
}

int64_t CachingAllocatorModel::MapExpandable(PoolKind pool, int64_t rounded_bytes) {
  int64_t id = FindExpandableSpace(pool, rounded_bytes);
  if (!blocks_[id].mapped) {
    id = MapPages(id, std::min(blocks_[id].size_bytes, rounded_bytes));
  }
  // A free block followed by unmapped space: map what is missing after it.
  while (id != kNoBlock && blocks_[id].size_bytes < rounded_bytes) {
    const int64_t next = blocks_[id].next;
    MEMSIM_DCHECK(next != kNoBlock && !blocks_[next].mapped);
    id = MapPages(next, std::min(rounded_bytes - blocks_[id].size_bytes, blocks_[next].size_bytes));
  }
  if (id != kNoBlock) EraseFree(id);
  return id;
}

int64_t CachingAllocatorModel::FindExpandableSpace(PoolKind pool, int64_t rounded_bytes) {
  const auto available = [&](int64_t id) { return id != kNoBlock && !blocks_[id].allocated; };
  for (const auto& [address, unmapped] : unmapped_[PoolIndex(pool)]) {
    int64_t first = unmapped;
    if (available(blocks_[first].prev)) first = blocks_[first].prev;
    int64_t bytes = 0;
    for (int64_t id = first; bytes < rounded_bytes && available(id); id = blocks_[id].next) {
      bytes += blocks_[id].size_bytes;
    }
    if (bytes >= rounded_bytes) return first;
  }
  // A new address range, aligned to both page sizes.
  const int64_t base = RoundUp(next_address_, kLargeBuffer);
  if (base > std::numeric_limits<int64_t>::max() - kExpandableRangeBytes) {
    throw std::overflow_error("CachingAllocatorModel: fake address space exhausted");
  }
  next_address_ = base + kExpandableRangeBytes;
  Block range;
  range.address = base;
  range.size_bytes = kExpandableRangeBytes;
  range.pool = pool;
  range.expandable = true;
  range.mapped = false;
  const int64_t id = NewBlock(range);
  segments_.emplace(base, id);
  unmapped_[PoolIndex(pool)].insert({base, id});
  return id;
}

int64_t CachingAllocatorModel::MapPages(int64_t id, int64_t bytes) {
  MEMSIM_DCHECK(!blocks_[id].mapped && bytes > 0 && bytes <= blocks_[id].size_bytes);
  const PoolKind pool = blocks_[id].pool;
  const int64_t mapped_bytes = std::min(RoundUp(bytes, PageSizeFor(pool)), blocks_[id].size_bytes);
  if (!config_.capacity_is_fraction && ExceedsCapacity(mapped_bytes)) {
    return kNoBlock;  // the driver has no memory for the pages
  }
  EraseUnallocated(id);
  if (mapped_bytes < blocks_[id].size_bytes) InsertUnallocated(SplitAfter(id, mapped_bytes));
  const int64_t mapped_address = blocks_[id].address;
  blocks_[id].mapped = true;
  id = JoinFreeNeighbours(id);
  stats_.reserved_bytes += mapped_bytes;
  stats_.peak_reserved_bytes = std::max(stats_.peak_reserved_bytes, stats_.reserved_bytes);
  if (observer_ != nullptr) observer_->OnSegmentMap(mapped_address, mapped_bytes, pool);
  return id;
}

void CachingAllocatorModel::UnmapFreePages(int64_t id) {
  const Block block = blocks_[id];
  const int64_t page = PageSizeFor(block.pool);
  // Range bases are page-aligned, so whole pages are aligned addresses.
  const int64_t begin = RoundUp(block.address, page);
  const int64_t end = (block.address + block.size_bytes) / page * page;
  if (begin >= end) return;
  EraseFree(id);
  if (begin > block.address) {  // the free head of a partly used first page stays mapped
    const int64_t pages = SplitAfter(id, begin - block.address);
    InsertFree(id);
    id = pages;
  }
  if (end < block.address + block.size_bytes) {  // and the tail of a partly used last page
    InsertFree(SplitAfter(id, end - begin));
  }
  blocks_[id].mapped = false;
  id = JoinFreeNeighbours(id);
  stats_.reserved_bytes -= end - begin;
  if (observer_ != nullptr) observer_->OnSegmentUnmap(begin, end - begin, block.pool);
  if (blocks_[id].prev == kNoBlock && blocks_[id].next == kNoBlock) {
    // Nothing of the range is mapped: PyTorch frees its addresses.
    EraseUnallocated(id);
    segments_.erase(blocks_[id].address);
    Recycle(id);
  }
}

bool CachingAllocatorModel::ReleaseOversizeSegments(PoolKind pool, int64_t rounded_bytes) {
  // The small pool holds no oversize blocks.
  if (config_.max_split_size_bytes == 0 || pool == PoolKind::kSmall) return false;
  // Oversize blocks are never split, so each free one is a whole segment of the large pool.
  std::set<FreeKey>& free_blocks = large_free_;
  const int64_t wanted_bytes = std::max(rounded_bytes, config_.max_split_size_bytes);
  const auto fit = free_blocks.lower_bound(FreeKey{wanted_bytes, 0, 0});
  if (fit != free_blocks.end()) {
    const int64_t id = std::get<2>(*fit);
    free_blocks.erase(fit);
    ReleaseSegment(id);
    return true;
  }
  // No single one is large enough: free from the largest down while they are oversize.
  int64_t released_bytes = 0;
  while (released_bytes < wanted_bytes && !free_blocks.empty()) {
    const auto largest = std::prev(free_blocks.end());
    if (!Oversize(std::get<0>(*largest))) break;
    const int64_t id = std::get<2>(*largest);
    released_bytes += std::get<0>(*largest);
    free_blocks.erase(largest);
    ReleaseSegment(id);
  }
  return released_bytes >= wanted_bytes;
}

CachingAllocatorModel::Allocation CachingAllocatorModel::TakeBlock(int64_t id,
                                                                   int64_t rounded_bytes,
                                                                   int64_t requested_bytes) {
  const int64_t remaining_bytes = blocks_[id].size_bytes - rounded_bytes;
  // PyTorch's should_split: a large-pool remainder must itself be large, so small requests
  // never fragment large segments into unusable slivers; oversize requests are never split
  // (Note [Oversize blocks]).
  // With expandable segments every block splits (Note [Expandable segments]).
  const bool split = blocks_[id].pool == PoolKind::kSmall || config_.expandable_segments
                         ? remaining_bytes >= kMinBlockSize
                         : !Oversize(rounded_bytes) && remaining_bytes > kSmallSize;
  if (split) InsertFree(SplitAfter(id, rounded_bytes));
  Block& block = blocks_[id];
  block.allocated = true;
  block.requested_bytes = requested_bytes;
  stats_.allocated_bytes += block.size_bytes;
  stats_.requested_bytes += requested_bytes;
  ++stats_.num_active_blocks;
  stats_.peak_allocated_bytes = std::max(stats_.peak_allocated_bytes, stats_.allocated_bytes);
  stats_.peak_requested_bytes = std::max(stats_.peak_requested_bytes, stats_.requested_bytes);
  // Every allocated byte lies in a reserved segment.
  MEMSIM_DCHECK(stats_.allocated_bytes <= stats_.reserved_bytes);
  return {id, block.address, block.size_bytes};
}

void CachingAllocatorModel::Merge(int64_t front, int64_t back) {
  Block& front_block = blocks_[front];
  const Block& back_block = blocks_[back];
  // Neighbours of one segment, both free and both mapped or both not, and adjacent.
  MEMSIM_DCHECK(front_block.next == back && back_block.prev == front);
  MEMSIM_DCHECK(!front_block.allocated && !back_block.allocated);
  MEMSIM_DCHECK(front_block.mapped == back_block.mapped);
  MEMSIM_DCHECK(front_block.address + front_block.size_bytes == back_block.address);
  front_block.size_bytes += back_block.size_bytes;
  front_block.next = back_block.next;
  if (back_block.next != kNoBlock) blocks_[back_block.next].prev = front;
  Recycle(back);
}

}  // namespace memsim
