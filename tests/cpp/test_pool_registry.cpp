// Per-cell recompute pools: separate accounting, frees routed to the owner, retirement.
#include <memory>
#include <vector>

#include "check.hpp"
#include "gpipe_fast/device.hpp"
#include "gpipe_fast/error.hpp"
#include "gpipe_fast/memory.hpp"
#include "gpipe_fast/pool_registry.hpp"

using gpipe_fast::InvalidArgument;
using gpipe_fast::PoolRegistry;
using gpipe_fast::SimulatedMemoryResource;
using gpipe_fast::Stream;

namespace {

constexpr std::size_t KiB = 1024;
constexpr std::size_t kArena = 256 * KiB;
const Stream kCell0{0, 0x10};
const Stream kCell1{0, 0x11};

struct Fixture {
  std::shared_ptr<SimulatedMemoryResource> upstream =
      std::make_shared<SimulatedMemoryResource>(64 * kArena);
  PoolRegistry registry{upstream, kArena};
};

}  // namespace

TEST(each_pool_accounts_for_its_own_blocks) {
  Fixture f;
  const int a = f.registry.create();
  const int b = f.registry.create();
  CHECK_EQ(a, 0);
  CHECK_EQ(b, 1);
  CHECK_EQ(f.registry.pools(), 2);
  void* x = f.registry.allocate(a, 10 * KiB, kCell0);
  void* y = f.registry.allocate(b, 30 * KiB, kCell1);
  CHECK_EQ(f.registry.pool(a)->stats().current_bytes, 10 * KiB);
  CHECK_EQ(f.registry.pool(b)->stats().current_bytes, 30 * KiB);
  f.registry.deallocate(y, 30 * KiB, kCell1);  // routed to b, whichever thread frees it
  CHECK_EQ(f.registry.pool(b)->stats().current_bytes, std::size_t{0});
  CHECK_EQ(f.registry.pool(b)->stats().peak_bytes, 30 * KiB);
  CHECK_EQ(f.registry.pool(a)->stats().current_bytes, 10 * KiB);
  f.registry.deallocate(x, 10 * KiB, kCell0);
  CHECK_EQ(f.registry.pool(a)->stats().current_bytes, std::size_t{0});
}

TEST(a_pool_reuses_its_blocks_between_microbatches) {
  Fixture f;
  const int id = f.registry.create();
  for (int microbatch = 0; microbatch < 4; ++microbatch) {
    std::vector<void*> blocks;
    for (std::size_t size : {40 * KiB, 8 * KiB, 40 * KiB}) {
      blocks.push_back(f.registry.allocate(id, size, kCell0));
    }
    f.registry.deallocate(blocks[0], 40 * KiB, kCell0);
    f.registry.deallocate(blocks[1], 8 * KiB, kCell0);
    f.registry.deallocate(blocks[2], 40 * KiB, kCell0);
  }
  const auto stats = f.registry.pool(id)->stats();
  CHECK_EQ(stats.allocations, 12);
  CHECK_EQ(stats.reuses, 9);  // only the first micro-batch reached upstream
  CHECK_EQ(stats.arenas, 1);
}

TEST(unknown_ids_and_blocks_are_rejected) {
  Fixture f;
  const int id = f.registry.create();
  CHECK_THROWS(f.registry.pool(id + 1), InvalidArgument);
  CHECK_THROWS(f.registry.allocate(-1, 64, kCell0), InvalidArgument);
  int on_stack = 0;
  CHECK_THROWS(f.registry.deallocate(&on_stack, 64, kCell0), InvalidArgument);
  f.registry.deallocate(nullptr, 0, kCell0);  // a null block is a no-op, as for resources
  CHECK_EQ(f.registry.allocate(id, 0, kCell0), static_cast<void*>(nullptr));
  CHECK_THROWS(f.registry.retire(7), InvalidArgument);
}

TEST(a_retired_pool_gives_its_arenas_back_as_its_blocks_are_freed) {
  Fixture f;
  const int kept = f.registry.create();
  const int retired = f.registry.create();
  void* other = f.registry.allocate(kept, 10 * KiB, kCell0);
  void* first = f.registry.allocate(retired, 10 * KiB, kCell1);
  void* big = f.registry.allocate(retired, 2 * kArena, kCell1);  // an arena of its own
  const std::size_t before = f.upstream->allocated_bytes();
  f.registry.deallocate(big, 2 * kArena, kCell1);
  CHECK_EQ(f.registry.retire(retired), 2 * kArena);  // the free arena goes back at once
  CHECK_EQ(f.upstream->allocated_bytes(), before - 2 * kArena);
  f.registry.deallocate(first, 10 * KiB, kCell1);  // the last block: its arena follows
  CHECK_EQ(f.registry.pool(retired)->stats().reserved_bytes, std::size_t{0});
  CHECK_EQ(f.upstream->allocated_bytes(), kArena);  // only the kept pool's arena is left
  f.registry.deallocate(other, 10 * KiB, kCell0);
  CHECK_EQ(f.registry.pool(kept)->stats().arenas, 1);  // a live pool keeps its arena
}
