// RecomputePool: size-classed blocks carved from upstream arenas, reused between micro-batches.
#include <algorithm>
#include <limits>
#include <string>

#include "gpipe_fast/error.hpp"
#include "gpipe_fast/memory.hpp"

namespace gpipe_fast {

// Size classes: four per doubling (1, 1.25, 1.5, 1.75 x a power of two), each a multiple of
// kAllocationAlignment. A block is reused only for a request of its own class (a free list
// per class), not best-fit across classes, because:
// - re-materialisation asks for the same sizes every micro-batch (the micro-batches of a step
//   are equal but for one row), so same-class reuse already hits after the first one;
// - handing a large free block to a small request would make the next large request of that
//   micro-batch carve a new block, growing the pool where exact classes stay flat;
// - a lookup is a map find and a vector pop, and the pool's growth is easy to predict (and
//   to test exactly).
// Rounding wastes less than a quarter of a block; the classes keep requests that differ by a
// few bytes on the same list.
std::size_t RecomputePool::size_class(std::size_t bytes) {
  if (bytes > std::numeric_limits<std::size_t>::max() / 4) {
    throw OutOfMemory("RecomputePool: a request of " + std::to_string(bytes) +
                      " bytes cannot be satisfied");
  }
  if (bytes <= kAllocationAlignment) return kAllocationAlignment;
  std::size_t power = 1;  // the largest power of two <= bytes
  while (power <= bytes / 2) power *= 2;
  const std::size_t step = std::max(power / 4, kAllocationAlignment);
  return (bytes + step - 1) / step * step;
}

RecomputePool::RecomputePool(std::shared_ptr<MemoryResource> upstream, std::size_t arena_bytes)
    : upstream_(std::move(upstream)), arena_bytes_(arena_bytes) {
  GF_EXPECTS(upstream_ != nullptr, "RecomputePool: upstream must not be null");
  GF_EXPECTS(arena_bytes > 0 && arena_bytes % kAllocationAlignment == 0,
             "RecomputePool: arena_bytes must be a positive multiple of " +
                 std::to_string(kAllocationAlignment) + ", got " + std::to_string(arena_bytes));
}

RecomputePool::~RecomputePool() {
  for (auto& [id, arena] : arenas_) {
    try {
      upstream_->deallocate(arena.base, arena.size, Stream{arena.owner.first, 0});
    } catch (...) {
      // A destructor cannot report; the upstream (e.g. a CUDA context being torn down at
      // process exit) has failed to take the arena back, which leaks nothing we can reuse.
    }
  }
}

void* RecomputePool::pop(FreeLists& lists, std::size_t size) {
  const auto list = lists.find(size);
  if (list == lists.end() || list->second.empty()) return nullptr;
  void* ptr = list->second.back();  // last freed first: most likely still in cache
  list->second.pop_back();
  return ptr;
}

// Cuts a block of `size` from the first arena of the stream's device that this stream may use
// and that has room at its end, or from a new arena. Caller holds mutex_.
void* RecomputePool::carve(std::size_t size, const StreamKey& key, const Stream& stream) {
  auto usable = arenas_.end();
  for (auto it = arenas_.begin(); it != arenas_.end(); ++it) {
    const Arena& arena = it->second;
    if (arena.owner.first == key.first && (arena.shared || arena.owner == key) &&
        arena.size - arena.carved >= size) {
      usable = it;
      break;
    }
  }
  if (usable == arenas_.end()) {
    const std::size_t arena_size = std::max(size, arena_bytes_);
    void* base = nullptr;
    try {
      base = upstream_->allocate(arena_size, stream);
    } catch (const OutOfMemory& error) {
      throw OutOfMemory(std::string(error.what()) + " (RecomputePool: a new arena of " +
                        std::to_string(arena_size) + " bytes; the pool holds " +
                        std::to_string(stats_.reserved_bytes) + " bytes in " +
                        std::to_string(stats_.arenas) +
                        " arenas; trim() after a synchronisation returns unused ones)");
    }
    Arena arena;
    arena.base = static_cast<char*>(base);
    arena.size = arena_size;
    arena.owner = key;
    usable = arenas_.emplace(next_arena_++, arena).first;
    stats_.reserved_bytes += arena_size;
    stats_.arenas += 1;
  }
  Arena& arena = usable->second;
  void* ptr = arena.base + arena.carved;
  arena.carved += size;
  arena.blocks += 1;
  Block block;
  block.size = size;
  block.arena = usable->first;
  blocks_.emplace(ptr, block);
  return ptr;
}

void* RecomputePool::do_allocate(std::size_t bytes, const Stream& stream) {
  const std::size_t size = size_class(bytes);
  const StreamKey key{stream.device, stream.handle};
  std::lock_guard<std::mutex> lock(mutex_);
  void* ptr = nullptr;
  const auto pending = pending_.find(key);
  if (pending != pending_.end()) ptr = pop(pending->second, size);
  if (ptr == nullptr) {
    const auto released = released_.find(stream.device);
    if (released != released_.end()) {
      ptr = pop(released->second, size);
      if (ptr != nullptr) arenas_.at(blocks_.at(ptr).arena).released_blocks -= 1;
    }
  }
  if (ptr != nullptr) {
    stats_.reuses += 1;
  } else {
    ptr = carve(size, key, stream);
  }
  Block& block = blocks_.at(ptr);
  block.state = BlockState::InUse;
  block.requested = bytes;
  stats_.allocations += 1;
  stats_.current_bytes += bytes;
  stats_.peak_bytes = std::max(stats_.peak_bytes, stats_.current_bytes);
  return ptr;
}

void RecomputePool::do_deallocate(void* ptr, std::size_t bytes, const Stream& stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto found = blocks_.find(ptr);
  GF_EXPECTS(found != blocks_.end() && found->second.state == BlockState::InUse,
             found == blocks_.end() ? "RecomputePool: deallocate of a block it did not hand out"
                                    : "RecomputePool: deallocate of a free block (double free)");
  Block& block = found->second;
  GF_EXPECTS(bytes == block.requested,
             "RecomputePool: deallocate with " + std::to_string(bytes) +
                 " bytes of a block allocated with " + std::to_string(block.requested));
  const int device = arenas_.at(block.arena).owner.first;
  GF_EXPECTS(stream.device == device,
             "RecomputePool: a block of device " + std::to_string(device) +
                 " deallocated on a stream of device " + std::to_string(stream.device));
  block.state = BlockState::Pending;
  stats_.current_bytes -= block.requested;
  block.requested = 0;
  pending_[StreamKey{stream.device, stream.handle}][block.size].push_back(ptr);
}

void RecomputePool::release_stream(const Stream& stream) {
  const StreamKey key{stream.device, stream.handle};
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& [id, arena] : arenas_) {
    if (arena.owner == key) arena.shared = true;
  }
  const auto pending = pending_.find(key);
  if (pending == pending_.end()) return;
  FreeLists& released = released_[stream.device];
  for (auto& [size, list] : pending->second) {
    for (void* ptr : list) {
      Block& block = blocks_.at(ptr);
      block.state = BlockState::Released;
      arenas_.at(block.arena).released_blocks += 1;
      released[size].push_back(ptr);
    }
  }
  pending_.erase(pending);
}

std::size_t RecomputePool::trim() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::size_t returned = 0;
  for (auto it = arenas_.begin(); it != arenas_.end();) {
    Arena& arena = it->second;
    if (!arena.shared || arena.released_blocks != arena.blocks) {
      ++it;
      continue;
    }
    // Upstream first: if it fails, the arena and its blocks stay as they were.
    upstream_->deallocate(arena.base, arena.size, Stream{arena.owner.first, 0});
    // Every block of this arena sits on its device's released lists: forget them there.
    const std::uint64_t id = it->first;
    if (arena.blocks > 0) {
      for (auto& [size, list] : released_[arena.owner.first]) {
        std::vector<void*> kept;
        for (void* ptr : list) {
          if (blocks_.at(ptr).arena == id) {
            blocks_.erase(ptr);
          } else {
            kept.push_back(ptr);
          }
        }
        list.swap(kept);
      }
    }
    returned += arena.size;
    stats_.reserved_bytes -= arena.size;
    stats_.arenas -= 1;
    it = arenas_.erase(it);
  }
  return returned;
}

PoolStats RecomputePool::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

void RecomputePool::reset_peak() {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.peak_bytes = stats_.current_bytes;
}

}  // namespace gpipe_fast
