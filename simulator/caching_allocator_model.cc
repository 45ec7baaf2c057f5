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
}

int64_t CachingAllocatorModel::RoundSize(int64_t bytes) {
  return bytes < kMinBlockSize ? kMinBlockSize : RoundUp(bytes, kMinBlockSize);
}

PoolKind CachingAllocatorModel::PoolFor(int64_t rounded_bytes) {
  return rounded_bytes <= kSmallSize ? PoolKind::kSmall : PoolKind::kLarge;
}

int64_t CachingAllocatorModel::SegmentSizeFor(int64_t rounded_bytes) {
  if (rounded_bytes <= kSmallSize) return kSmallBuffer;
  if (rounded_bytes < kMinLargeAlloc) return kLargeBuffer;
  return RoundUp(rounded_bytes, kRoundLarge);
}

std::optional<CachingAllocatorModel::Allocation> CachingAllocatorModel::Malloc(
    int64_t requested_bytes) {
  if (requested_bytes <= 0 || requested_bytes > kMaxRequestBytes) {
    throw std::invalid_argument("CachingAllocatorModel::Malloc: bad size " +
                                std::to_string(requested_bytes));
  }
  const int64_t rounded_bytes = RoundSize(requested_bytes);
  const PoolKind pool = PoolFor(rounded_bytes);
  std::set<FreeKey>& free_blocks = FreeBlocks(pool);
  // Address and id 0 sort first, so this finds the smallest fit, then the lowest address.
  const auto best = free_blocks.lower_bound(FreeKey{rounded_bytes, 0, 0});
  // Note [Oversize blocks]: PyTorch looks at the best fit only.
  const bool usable = best != free_blocks.end() &&
                      (Oversize(rounded_bytes) ? std::get<0>(*best) < rounded_bytes + kLargeBuffer
                                               : !Oversize(std::get<0>(*best)));
  if (usable) {
    const int64_t id = std::get<2>(*best);
    MEMSIM_DCHECK(!blocks_[id].allocated && blocks_[id].size_bytes >= rounded_bytes);
    free_blocks.erase(best);
    return TakeBlock(id, rounded_bytes, requested_bytes);
  }
  const int64_t segment_bytes = SegmentSizeFor(rounded_bytes);
  int64_t id = CreateSegment(pool, segment_bytes);
  if (id == kNoBlock && ReleaseOversizeSegments(pool, rounded_bytes)) {
    id = CreateSegment(pool, segment_bytes);
  }
  if (id == kNoBlock) {
    // What PyTorch does when cudaMalloc fails: free all cached segments, retry once.
    ReleaseCachedSegments();
    ++stats_.num_alloc_retries;
    id = CreateSegment(pool, segment_bytes);
    if (id == kNoBlock) {
      ++stats_.num_ooms;
      return std::nullopt;
    }
  }
  return TakeBlock(id, rounded_bytes, requested_bytes);
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

  int64_t id = block_id;
  const int64_t prev = block.prev;
  const int64_t next = block.next;
  if (prev != kNoBlock && !blocks_[prev].allocated) {
    EraseFree(prev);
    Merge(prev, id);
    id = prev;
  }
  if (next != kNoBlock && !blocks_[next].allocated) {
    EraseFree(next);
    Merge(id, next);
  }
  InsertFree(id);
  MEMSIM_DCHECK(stats_.allocated_bytes >= 0 && stats_.requested_bytes >= 0 &&
                stats_.num_active_blocks >= 0);
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
    AllocatorSegmentView& segment = segments.emplace_back();
    segment.address = address;
    segment.size_bytes = 0;
    segment.pool = blocks_[head].pool;
    for (int64_t id = head; id != kNoBlock; id = blocks_[id].next) {
      const Block& block = blocks_[id];
      segment.size_bytes += block.size_bytes;
      segment.blocks.push_back(
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
  const Block& block = blocks_[id];
  FreeBlocks(block.pool).insert({block.size_bytes, block.address, id});
}

void CachingAllocatorModel::EraseFree(int64_t id) {
  const Block& block = blocks_[id];
  FreeBlocks(block.pool).erase({block.size_bytes, block.address, id});
}

int64_t CachingAllocatorModel::CreateSegment(PoolKind pool, int64_t size_bytes) {
  if (config_.capacity_bytes > 0 && stats_.reserved_bytes + size_bytes > config_.capacity_bytes) {
    return kNoBlock;
  }
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
  blocks_[id] = Block();
  free_slots_.push_back(id);
  if (observer_ != nullptr) observer_->OnSegmentFree(block.address, block.size_bytes, block.pool);
}

void CachingAllocatorModel::ReleaseCachedSegments() {
  // Large pool first, each in free-set order, as PyTorch's release_cached_blocks does.
  for (const PoolKind pool : {PoolKind::kLarge, PoolKind::kSmall}) {
    std::set<FreeKey>& free_blocks = FreeBlocks(pool);
    for (auto it = free_blocks.begin(); it != free_blocks.end();) {
      const int64_t id = std::get<2>(*it);
      if (blocks_[id].prev == kNoBlock && blocks_[id].next == kNoBlock) {
        it = free_blocks.erase(it);
        ReleaseSegment(id);
      } else {
        ++it;
      }
    }
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
  const bool split = blocks_[id].pool == PoolKind::kSmall
                         ? remaining_bytes >= kMinBlockSize
                         : !Oversize(rounded_bytes) && remaining_bytes > kSmallSize;
  if (split) {
    Block rest;
    rest.address = blocks_[id].address + rounded_bytes;
    rest.size_bytes = remaining_bytes;
    rest.prev = id;
    rest.next = blocks_[id].next;
    rest.pool = blocks_[id].pool;
    const int64_t rest_id = NewBlock(rest);  // may reallocate blocks_: no references held
    if (rest.next != kNoBlock) blocks_[rest.next].prev = rest_id;
    blocks_[id].next = rest_id;
    blocks_[id].size_bytes = rounded_bytes;
    InsertFree(rest_id);
  }
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
  // Neighbours of one segment, both free, and adjacent in address.
  MEMSIM_DCHECK(front_block.next == back && back_block.prev == front);
  MEMSIM_DCHECK(!front_block.allocated && !back_block.allocated);
  MEMSIM_DCHECK(front_block.address + front_block.size_bytes == back_block.address);
  front_block.size_bytes += back_block.size_bytes;
  front_block.next = back_block.next;
  if (back_block.next != kNoBlock) blocks_[back_block.next].prev = front;
  blocks_[back] = Block();
  free_slots_.push_back(back);
}

}  // namespace memsim
