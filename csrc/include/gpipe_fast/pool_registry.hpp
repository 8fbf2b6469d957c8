// Recompute pools by id over one upstream: one per CUDA cell, each block freed to its owner.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

#include "gpipe_fast/device.hpp"
#include "gpipe_fast/memory.hpp"

namespace gpipe_fast {

// The torch allocator entry points serve every pipe's cells in the process. Each cell gets
// a RecomputePool of its own (so memory_stats() can say what each cell's re-materialisation
// holds); the registry remembers which pool handed out each block, because torch may free a
// block from any thread, long after the recompute that allocated it.
class PoolRegistry {
 public:
  PoolRegistry(std::shared_ptr<MemoryResource> upstream,
               std::size_t arena_bytes = RecomputePool::kDefaultArenaBytes);

  // A new pool and its id (ids count up from 0 and are never reused).
  int create();
  // The pool with that id; InvalidArgument when there is none.
  std::shared_ptr<RecomputePool> pool(int id) const;
  int pools() const;

  void* allocate(int id, std::size_t bytes, const Stream& stream);
  // Frees to the pool that allocated `ptr`; InvalidArgument for a block it never handed out.
  // A retired pool returns arenas that became free at once.
  void deallocate(void* ptr, std::size_t bytes, const Stream& stream);

  // The pool's owner is gone: every stream it saw is released and its free arenas go back
  // upstream now, the rest as their last blocks are freed. Only after the device work that
  // used its blocks has finished (e.g. after a synchronisation when a pipe closes).
  // Returns the bytes given back now.
  std::size_t retire(int id);

 private:
  std::size_t release_and_trim(int id);  // caller holds mutex_

  const std::shared_ptr<MemoryResource> upstream_;
  const std::size_t arena_bytes_;
  mutable std::mutex mutex_;
  std::vector<std::shared_ptr<RecomputePool>> pools_;
  std::vector<std::set<std::pair<int, std::uintptr_t>>> streams_;  // per pool: streams seen
  std::vector<bool> retired_;
  std::unordered_map<void*, int> owner_;  // block -> the pool that handed it out
};

}  // namespace gpipe_fast
