// PoolRegistry: per-cell recompute pools and the block -> pool map that routes every free.
#include "gpipe_fast/pool_registry.hpp"

#include <string>

#include "gpipe_fast/error.hpp"

namespace gpipe_fast {

PoolRegistry::PoolRegistry(std::shared_ptr<MemoryResource> upstream, std::size_t arena_bytes)
    : upstream_(std::move(upstream)), arena_bytes_(arena_bytes) {
  GF_EXPECTS(upstream_ != nullptr, "PoolRegistry needs an upstream resource");
}

int PoolRegistry::create() {
  auto pool = std::make_shared<RecomputePool>(upstream_, arena_bytes_);  // checks arena_bytes
  std::lock_guard<std::mutex> lock(mutex_);
  pools_.push_back(std::move(pool));
  streams_.emplace_back();
  retired_.push_back(false);
  return static_cast<int>(pools_.size() - 1);
}

std::shared_ptr<RecomputePool> PoolRegistry::pool(int id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  GF_EXPECTS(id >= 0 && id < static_cast<int>(pools_.size()),
             "no recompute pool with id " + std::to_string(id));
  return pools_[static_cast<std::size_t>(id)];
}

int PoolRegistry::pools() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int>(pools_.size());
}

void* PoolRegistry::allocate(int id, std::size_t bytes, const Stream& stream) {
  std::shared_ptr<RecomputePool> chosen = pool(id);
  void* ptr = chosen->allocate(bytes, stream);  // outside the lock: it may reach upstream
  if (ptr == nullptr) return nullptr;
  std::lock_guard<std::mutex> lock(mutex_);
  owner_[ptr] = id;
  streams_[static_cast<std::size_t>(id)].emplace(stream.device, stream.handle);
  return ptr;
}

void PoolRegistry::deallocate(void* ptr, std::size_t bytes, const Stream& stream) {
  if (ptr == nullptr) return;
  std::lock_guard<std::mutex> lock(mutex_);
  const auto owner = owner_.find(ptr);
  GF_EXPECTS(owner != owner_.end(), "free of a block no recompute pool handed out");
  const int id = owner->second;
  pools_[static_cast<std::size_t>(id)]->deallocate(ptr, bytes, stream);  // may throw: keep it
  owner_.erase(owner);
  if (retired_[static_cast<std::size_t>(id)]) release_and_trim(id);
}

std::size_t PoolRegistry::retire(int id) {
  pool(id);  // checks the id
  std::lock_guard<std::mutex> lock(mutex_);
  retired_[static_cast<std::size_t>(id)] = true;
  return release_and_trim(id);
}

std::size_t PoolRegistry::release_and_trim(int id) {
  RecomputePool& chosen = *pools_[static_cast<std::size_t>(id)];
  for (const auto& [device, handle] : streams_[static_cast<std::size_t>(id)]) {
    chosen.release_stream(Stream{device, handle});
  }
  return chosen.trim();
}

}  // namespace gpipe_fast
