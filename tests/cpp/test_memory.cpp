// Memory resources and the recompute pool's policy, on the simulated and host resources.
#include <cstdint>
#include <cstring>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

#include "check.hpp"
#include "gpipe_fast/device.hpp"
#include "gpipe_fast/error.hpp"
#include "gpipe_fast/memory.hpp"

using gpipe_fast::HostMemoryResource;
using gpipe_fast::InvalidArgument;
using gpipe_fast::kAllocationAlignment;
using gpipe_fast::OutOfMemory;
using gpipe_fast::PoolStats;
using gpipe_fast::RecomputePool;
using gpipe_fast::SimulatedMemoryResource;
using gpipe_fast::Stream;

namespace {

constexpr std::size_t KiB = 1024;
constexpr std::size_t MiB = 1024 * KiB;

const Stream kStreamA{0, 0xA};
const Stream kStreamB{0, 0xB};

std::uintptr_t address(void* ptr) { return reinterpret_cast<std::uintptr_t>(ptr); }

std::shared_ptr<SimulatedMemoryResource> simulated(std::size_t capacity) {
  return std::make_shared<SimulatedMemoryResource>(capacity);
}

// The requests of one micro-batch's recompute: a few activations of different sizes.
const std::vector<std::size_t> kMicrobatch{100 * KiB, 300 * KiB, 3000, 200 * KiB};

std::size_t sum(const std::vector<std::size_t>& sizes) {
  std::size_t total = 0;
  for (std::size_t size : sizes) total += size;
  return total;
}

// Allocates every request of a micro-batch on `stream`, then frees them all (its backward).
std::vector<void*> run_microbatch(RecomputePool& pool, const Stream& stream) {
  std::vector<void*> blocks;
  for (std::size_t size : kMicrobatch) blocks.push_back(pool.allocate(size, stream));
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    pool.deallocate(blocks[i], kMicrobatch[i], stream);
  }
  return blocks;
}

}  // namespace

// ---- SimulatedMemoryResource ---------------------------------------------------------------

TEST(simulated_blocks_are_aligned_distinct_and_counted) {
  SimulatedMemoryResource resource(1 * MiB);
  const std::vector<std::size_t> sizes{1, 255, 256, 257, 1000};
  std::vector<void*> blocks;
  for (std::size_t size : sizes) blocks.push_back(resource.allocate(size, Stream{}));
  std::size_t expected = 0;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    CHECK(blocks[i] != nullptr);
    CHECK_EQ(address(blocks[i]) % kAllocationAlignment, std::size_t{0});
    CHECK(address(blocks[i]) >= SimulatedMemoryResource::kDefaultBase);
    expected += (sizes[i] + 255) / 256 * 256;
    if (i > 0) CHECK(address(blocks[i]) >= address(blocks[i - 1]) + sizes[i - 1]);
  }
  CHECK_EQ(resource.allocated_bytes(), expected);
  CHECK_EQ(resource.live_blocks(), sizes.size());
  for (std::size_t i = 0; i < sizes.size(); ++i) resource.deallocate(blocks[i], sizes[i], Stream{});
  CHECK_EQ(resource.allocated_bytes(), std::size_t{0});
  CHECK_EQ(resource.live_blocks(), std::size_t{0});
}

TEST(simulated_capacity_throws_out_of_memory_and_recovers) {
  SimulatedMemoryResource resource(4 * KiB);
  void* all = resource.allocate(4 * KiB, Stream{});
  CHECK_THROWS(resource.allocate(1, Stream{}), OutOfMemory);
  CHECK_THROWS(resource.allocate(1, Stream{}), std::bad_alloc);  // what Python sees as MemoryError
  resource.deallocate(all, 4 * KiB, Stream{});
  CHECK_THROWS(resource.allocate(4 * KiB + 1, Stream{}), OutOfMemory);
  CHECK(resource.allocate(4 * KiB, Stream{}) == all);
}

TEST(simulated_merges_freed_neighbours) {
  SimulatedMemoryResource resource(4 * KiB);
  std::vector<void*> quarters;
  for (int i = 0; i < 4; ++i) quarters.push_back(resource.allocate(1 * KiB, Stream{}));
  resource.deallocate(quarters[1], 1 * KiB, Stream{});
  CHECK_THROWS(resource.allocate(2 * KiB, Stream{}), OutOfMemory);  // 1 KiB holes only
  resource.deallocate(quarters[2], 1 * KiB, Stream{});
  CHECK(resource.allocate(2 * KiB, Stream{}) == quarters[1]);
}

TEST(simulated_detects_double_free_unknown_address_and_wrong_size) {
  SimulatedMemoryResource resource(1 * MiB);
  void* block = resource.allocate(1000, Stream{});
  CHECK_THROWS(resource.deallocate(block, 999, Stream{}), InvalidArgument);
  CHECK_THROWS(resource.deallocate(static_cast<char*>(block) + 256, 1000, Stream{}),
               InvalidArgument);
  resource.deallocate(block, 1000, Stream{});
  CHECK_THROWS(resource.deallocate(block, 1000, Stream{}), InvalidArgument);
}

TEST(zero_bytes_is_a_null_block_that_frees_as_a_no_op) {
  SimulatedMemoryResource resource(1 * KiB);
  CHECK(resource.allocate(0, Stream{}) == nullptr);
  resource.deallocate(nullptr, 0, Stream{});
  CHECK_EQ(resource.live_blocks(), std::size_t{0});
}

TEST(host_resource_gives_aligned_writable_memory) {
  HostMemoryResource resource;
  void* block = resource.allocate(1000, Stream{});
  CHECK(block != nullptr);
  CHECK_EQ(address(block) % kAllocationAlignment, std::size_t{0});
  std::memset(block, 0x5a, 1000);
  CHECK_EQ(static_cast<unsigned char*>(block)[999], static_cast<unsigned char>(0x5a));
  resource.deallocate(block, 1000, Stream{});
}

// ---- RecomputePool ---------------------------------------------------------------------------

TEST(pool_size_classes) {
  CHECK_EQ(RecomputePool::size_class(1), std::size_t{256});
  CHECK_EQ(RecomputePool::size_class(256), std::size_t{256});
  CHECK_EQ(RecomputePool::size_class(257), std::size_t{512});
  CHECK_EQ(RecomputePool::size_class(1000), std::size_t{1024});
  CHECK_EQ(RecomputePool::size_class(1025), std::size_t{1280});
  CHECK_EQ(RecomputePool::size_class(3000), std::size_t{3072});
  CHECK_EQ(RecomputePool::size_class(1 * MiB), 1 * MiB);
  CHECK_EQ(RecomputePool::size_class(1 * MiB + 1), 1 * MiB + 256 * KiB);
  CHECK_EQ(RecomputePool::size_class(7 * MiB), 7 * MiB);
  for (std::size_t bytes = 1; bytes < 70000; bytes += 37) {
    const std::size_t size = RecomputePool::size_class(bytes);
    CHECK(size >= bytes && size % kAllocationAlignment == 0);
    CHECK(size < bytes + bytes / 4 + kAllocationAlignment);  // under a quarter wasted
  }
  CHECK_THROWS(RecomputePool::size_class(~std::size_t{0}), OutOfMemory);
}

TEST(pool_rejects_bad_arguments) {
  CHECK_THROWS(RecomputePool(nullptr), InvalidArgument);
  CHECK_THROWS(RecomputePool(simulated(MiB), 0), InvalidArgument);
  CHECK_THROWS(RecomputePool(simulated(MiB), 1000), InvalidArgument);
}

TEST(pool_reuses_blocks_between_microbatches) {
  auto upstream = simulated(64 * MiB);
  RecomputePool pool(upstream, 1 * MiB);
  const std::vector<void*> first = run_microbatch(pool, kStreamA);
  const PoolStats after_first = pool.stats();
  CHECK_EQ(after_first.reserved_bytes, 1 * MiB);  // one micro-batch's worth: one arena
  CHECK_EQ(after_first.arenas, std::int64_t{1});
  const int microbatches = 8;
  for (int m = 1; m < microbatches; ++m) {
    const std::vector<void*> blocks = run_microbatch(pool, kStreamA);
    // Freed last-in first-out per class, every block comes back (one block per class here).
    CHECK(blocks == first);
  }
  const PoolStats stats = pool.stats();
  const auto requests = static_cast<std::int64_t>(kMicrobatch.size());
  CHECK_EQ(stats.reserved_bytes, 1 * MiB);
  CHECK_EQ(stats.arenas, std::int64_t{1});
  CHECK_EQ(stats.allocations, microbatches * requests);
  CHECK_EQ(stats.reuses, (microbatches - 1) * requests);
  CHECK_EQ(stats.current_bytes, std::size_t{0});
  CHECK_EQ(stats.peak_bytes, sum(kMicrobatch));
  CHECK_EQ(upstream->allocated_bytes(), 1 * MiB);
  CHECK_EQ(upstream->live_blocks(), std::size_t{1});
}

TEST(pool_stats_track_current_and_peak_exactly) {
  RecomputePool pool(simulated(64 * MiB), 1 * MiB);
  void* a = pool.allocate(1000, kStreamA);
  void* b = pool.allocate(5000, kStreamA);
  CHECK_EQ(pool.stats().current_bytes, std::size_t{6000});
  pool.deallocate(a, 1000, kStreamA);
  CHECK_EQ(pool.stats().current_bytes, std::size_t{5000});
  CHECK_EQ(pool.stats().peak_bytes, std::size_t{6000});
  pool.reset_peak();
  CHECK_EQ(pool.stats().peak_bytes, std::size_t{5000});
  void* c = pool.allocate(800, kStreamA);  // class 1024: reuses a's block
  CHECK(c == a);
  CHECK_EQ(pool.stats().peak_bytes, std::size_t{5800});
  CHECK_EQ(pool.stats().reuses, std::int64_t{1});
  pool.deallocate(b, 5000, kStreamA);
  pool.deallocate(c, 800, kStreamA);
  CHECK_EQ(pool.stats().current_bytes, std::size_t{0});
  CHECK_EQ(pool.stats().allocations, std::int64_t{3});
}

TEST(pool_reuses_across_streams_only_after_release) {
  auto upstream = simulated(64 * MiB);
  RecomputePool pool(upstream, 1 * MiB);
  void* a = pool.allocate(4000, kStreamA);
  pool.deallocate(a, 4000, kStreamA);
  // Stream B may not take A's freed block, nor carve from the arena allocated on A.
  void* b = pool.allocate(4000, kStreamB);
  CHECK(b != a);
  CHECK_EQ(pool.stats().reuses, std::int64_t{0});
  CHECK_EQ(pool.stats().arenas, std::int64_t{2});
  pool.deallocate(b, 4000, kStreamB);
  // Stream A still reuses its own block at once.
  CHECK(pool.allocate(4000, kStreamA) == a);
  pool.deallocate(a, 4000, kStreamA);
  pool.release_stream(kStreamA);
  // After release, B's own pending block comes first, then A's released one.
  CHECK(pool.allocate(4000, kStreamB) == b);
  CHECK(pool.allocate(4000, kStreamB) == a);
  // And B may now carve from A's arena instead of allocating a third.
  void* carved = pool.allocate(8000, kStreamB);
  CHECK(address(carved) > address(a) && address(carved) < address(a) + 1 * MiB);
  CHECK_EQ(pool.stats().arenas, std::int64_t{2});
  // A stream of another device never sees device 0's blocks, released or not.
  pool.release_stream(kStreamB);
  void* other = pool.allocate(4000, Stream{1, 0xA});
  CHECK(other != a && other != b);
  CHECK_EQ(pool.stats().arenas, std::int64_t{3});
}

TEST(pool_detects_bad_frees) {
  RecomputePool pool(simulated(64 * MiB), 1 * MiB);
  void* block = pool.allocate(1000, kStreamA);
  CHECK_THROWS(pool.deallocate(block, 999, kStreamA), InvalidArgument);  // wrong size
  CHECK_THROWS(pool.deallocate(block, 1000, Stream{1, 0xA}), InvalidArgument);  // wrong device
  CHECK_THROWS(pool.deallocate(static_cast<char*>(block) + 256, 1000, kStreamA), InvalidArgument);
  pool.deallocate(block, 1000, kStreamA);
  CHECK_THROWS(pool.deallocate(block, 1000, kStreamA), InvalidArgument);  // double free
  CHECK_EQ(pool.stats().current_bytes, std::size_t{0});
}

TEST(pool_serves_large_requests_from_their_own_arena) {
  auto upstream = simulated(64 * MiB);
  RecomputePool pool(upstream, 1 * MiB);
  void* big = pool.allocate(3 * MiB, kStreamA);
  CHECK_EQ(pool.stats().reserved_bytes, 3 * MiB);
  void* small = pool.allocate(1000, kStreamA);  // the big arena is full: a regular one
  CHECK_EQ(pool.stats().reserved_bytes, 4 * MiB);
  pool.deallocate(big, 3 * MiB, kStreamA);
  pool.deallocate(small, 1000, kStreamA);
}

TEST(pool_trim_returns_only_free_released_arenas) {
  auto upstream = simulated(64 * MiB);
  RecomputePool pool(upstream, 1 * MiB);
  void* kept = pool.allocate(1000, kStreamA);
  void* big = pool.allocate(2 * MiB, kStreamA);  // an arena of its own
  pool.deallocate(big, 2 * MiB, kStreamA);
  CHECK_EQ(pool.trim(), std::size_t{0});  // freed but not released: A may still use it
  pool.release_stream(kStreamA);
  CHECK_EQ(pool.trim(), 2 * MiB);  // the arena holding `kept` stays
  CHECK_EQ(pool.stats().reserved_bytes, 1 * MiB);
  CHECK_EQ(upstream->allocated_bytes(), 1 * MiB);
  // The trimmed block is forgotten: a new 2 MiB request carves a new arena.
  void* again = pool.allocate(2 * MiB, kStreamA);
  CHECK_EQ(pool.stats().reuses, std::int64_t{0});
  CHECK_EQ(pool.stats().reserved_bytes, 3 * MiB);
  pool.deallocate(again, 2 * MiB, kStreamA);
  pool.deallocate(kept, 1000, kStreamA);
  pool.release_stream(kStreamA);
  CHECK_EQ(pool.trim(), 3 * MiB);
  CHECK_EQ(pool.stats().arenas, std::int64_t{0});
  CHECK_EQ(upstream->allocated_bytes(), std::size_t{0});
  CHECK_THROWS(pool.deallocate(kept, 1000, kStreamA), InvalidArgument);  // gone with its arena
}

TEST(pool_out_of_memory_upstream_leaves_it_usable) {
  auto upstream = simulated(2 * MiB);
  RecomputePool pool(upstream, 1 * MiB);
  void* a = pool.allocate(1 * MiB, kStreamA);
  void* b = pool.allocate(1 * MiB, kStreamA);
  CHECK_THROWS(pool.allocate(1000, kStreamA), OutOfMemory);
  const PoolStats stats = pool.stats();
  CHECK_EQ(stats.allocations, std::int64_t{2});
  CHECK_EQ(stats.current_bytes, 2 * MiB);
  pool.deallocate(b, 1 * MiB, kStreamA);
  CHECK(pool.allocate(1 * MiB, kStreamA) == b);
  pool.deallocate(a, 1 * MiB, kStreamA);
  pool.deallocate(b, 1 * MiB, kStreamA);
}

TEST(pool_returns_every_arena_when_destroyed) {
  auto upstream = simulated(64 * MiB);
  {
    RecomputePool pool(upstream, 1 * MiB);
    pool.allocate(1000, kStreamA);  // still in use: its arena goes back all the same
    pool.allocate(5 * MiB, kStreamB);
    CHECK_EQ(upstream->live_blocks(), std::size_t{2});
  }
  CHECK_EQ(upstream->live_blocks(), std::size_t{0});
  CHECK_EQ(upstream->allocated_bytes(), std::size_t{0});
}

TEST(pool_is_thread_safe_with_four_streams) {
  auto upstream = simulated(256 * MiB);
  RecomputePool pool(upstream, 1 * MiB);
  constexpr int kThreads = 4;
  constexpr int kMicrobatches = 300;
  std::mutex mutex;
  std::map<std::uintptr_t, std::size_t> live;  // start -> bytes of every block in use
  int overlaps = 0;
  auto worker = [&](int cell) {
    const Stream stream{0, static_cast<std::uintptr_t>(0x100 + cell)};
    for (int m = 0; m < kMicrobatches; ++m) {
      std::vector<void*> blocks;
      for (std::size_t size : kMicrobatch) {
        void* ptr = pool.allocate(size + static_cast<std::size_t>(cell), stream);
        std::lock_guard<std::mutex> lock(mutex);
        const auto start = address(ptr);
        auto next = live.lower_bound(start);
        if (next != live.end() && next->first < start + size) ++overlaps;
        if (next != live.begin() && std::prev(next)->first + std::prev(next)->second > start) {
          ++overlaps;
        }
        live.emplace(start, size);
        blocks.push_back(ptr);
      }
      for (std::size_t i = 0; i < blocks.size(); ++i) {
        {
          std::lock_guard<std::mutex> lock(mutex);
          live.erase(address(blocks[i]));
        }
        pool.deallocate(blocks[i], kMicrobatch[i] + static_cast<std::size_t>(cell), stream);
      }
      if (m % 50 == 49) pool.release_stream(stream);  // the executor's events, in effect
    }
  };
  std::vector<std::thread> threads;
  for (int cell = 0; cell < kThreads; ++cell) threads.emplace_back(worker, cell);
  for (auto& thread : threads) thread.join();
  CHECK_EQ(overlaps, 0);
  const PoolStats stats = pool.stats();
  const auto requests = static_cast<std::int64_t>(kMicrobatch.size());
  CHECK_EQ(stats.allocations, kThreads * kMicrobatches * requests);
  CHECK_EQ(stats.current_bytes, std::size_t{0});
  // The first micro-batch carves; a stream that starts late may reuse what others released.
  // Later a stream carves only when another has taken its released blocks while it still
  // holds its own in use or pending: at most one micro-batch's worth per stream, twice.
  const std::int64_t carved = stats.allocations - stats.reuses;
  CHECK(carved >= requests);
  CHECK(carved <= 2 * kThreads * requests);
  CHECK(stats.arenas <= 2 * kThreads);
}
