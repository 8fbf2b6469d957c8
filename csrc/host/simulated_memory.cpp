// Simulated memory resource: fake aligned addresses from a fixed range, for policy tests.
#include <iterator>
#include <limits>
#include <string>

#include "gpipe_fast/error.hpp"
#include "gpipe_fast/memory.hpp"

namespace gpipe_fast {
namespace {

std::size_t aligned_size(std::size_t bytes) {
  if (bytes > std::numeric_limits<std::size_t>::max() - kAllocationAlignment) return 0;
  return (bytes + kAllocationAlignment - 1) / kAllocationAlignment * kAllocationAlignment;
}

std::string hex(std::uintptr_t address) {
  static const char digits[] = "0123456789abcdef";
  std::string out;
  do {
    out.insert(out.begin(), digits[address % 16]);
    address /= 16;
  } while (address != 0);
  return "0x" + out;
}

}  // namespace

SimulatedMemoryResource::SimulatedMemoryResource(std::size_t capacity, std::uintptr_t base)
    : capacity_(capacity), base_(base) {
  GF_EXPECTS(base % kAllocationAlignment == 0 && base != 0,
             "SimulatedMemoryResource: base must be a non-zero multiple of " +
                 std::to_string(kAllocationAlignment));
  GF_EXPECTS(capacity <= std::numeric_limits<std::uintptr_t>::max() - base,
             "SimulatedMemoryResource: base + capacity overflows the address space");
  if (capacity >= kAllocationAlignment) {
    free_.emplace(base, capacity / kAllocationAlignment * kAllocationAlignment);
  }
}

std::size_t SimulatedMemoryResource::allocated_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return allocated_;
}

std::size_t SimulatedMemoryResource::live_blocks() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return live_.size();
}

void* SimulatedMemoryResource::do_allocate(std::size_t bytes, const Stream&) {
  const std::size_t size = aligned_size(bytes);
  std::lock_guard<std::mutex> lock(mutex_);
  if (size != 0) {
    for (auto range = free_.begin(); range != free_.end(); ++range) {
      if (range->second < size) continue;
      const std::uintptr_t address = range->first;
      const std::size_t rest = range->second - size;
      free_.erase(range);
      if (rest > 0) free_.emplace(address + size, rest);
      live_.emplace(address, bytes);
      allocated_ += size;
      return reinterpret_cast<void*>(address);
    }
  }
  throw OutOfMemory("SimulatedMemoryResource: out of memory allocating " + std::to_string(bytes) +
                    " bytes (" + std::to_string(allocated_) + " of " + std::to_string(capacity_) +
                    " bytes in use)");
}

void SimulatedMemoryResource::do_deallocate(void* ptr, std::size_t bytes, const Stream&) {
  const auto address = reinterpret_cast<std::uintptr_t>(ptr);
  std::lock_guard<std::mutex> lock(mutex_);
  const auto live = live_.find(address);
  GF_EXPECTS(live != live_.end(), "SimulatedMemoryResource: deallocate of " + hex(address) +
                                      ", which is not a live block (double free?)");
  GF_EXPECTS(live->second == bytes, "SimulatedMemoryResource: deallocate of " + hex(address) +
                                        " with " + std::to_string(bytes) +
                                        " bytes, but it was allocated with " +
                                        std::to_string(live->second));
  std::size_t size = aligned_size(bytes);
  live_.erase(live);
  allocated_ -= size;
  // Merge with the free neighbours so that freed space serves larger requests again.
  std::uintptr_t start = address;
  auto next = free_.lower_bound(address);
  if (next != free_.begin()) {
    const auto previous = std::prev(next);
    if (previous->first + previous->second == address) {
      start = previous->first;
      size += previous->second;
      free_.erase(previous);
    }
  }
  if (next != free_.end() && next->first == address + aligned_size(bytes)) {
    size += next->second;
    free_.erase(next);
  }
  free_.emplace(start, size);
}

}  // namespace gpipe_fast
