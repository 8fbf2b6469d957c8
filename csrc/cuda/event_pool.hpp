// EventPool: CUDA events per device, handed out by id and reused once released.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "cuda_check.hpp"
#include "gpipe_fast/device.hpp"
#include "gpipe_fast/error.hpp"

namespace gpipe_fast::detail {

// Events are created only until the pool covers the most ever in use at once, then reused:
// a step in steady state creates none. Thread-safe. Device -1 stands for the host: its slots
// carry no CUDA event (a marker that the host's work is done when its task returns).
class EventPool {
 public:
  // `flags` for cudaEventCreateWithFlags: cudaEventDisableTiming for ordering events,
  // cudaEventDefault for timing ones.
  explicit EventPool(unsigned flags) : flags_(flags) {}
  ~EventPool() {
    // Destroying an event the device has not reached yet is allowed: CUDA frees it later.
    for (const Slot& slot : slots_) {
      if (slot.event != nullptr) cudaEventDestroy(slot.event);
    }
  }
  EventPool(const EventPool&) = delete;
  EventPool& operator=(const EventPool&) = delete;

  // A free event of `device`, created when there is none (the caller has made `device`
  // current).
  EventId acquire(int device) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& free = free_[device];
    if (!free.empty()) {
      const EventId id = free.back();
      free.pop_back();
      slots_[static_cast<std::size_t>(id)].live = true;
      ++live_;
      return id;
    }
    cudaEvent_t event = nullptr;
    if (device >= 0) GF_CUDA_CHECK(cudaEventCreateWithFlags(&event, flags_));
    slots_.push_back(Slot{event, device, true});
    ++live_;
    return static_cast<EventId>(slots_.size() - 1);
  }

  // Gives a live event back; InvalidArgument for an unknown or released one.
  void release(EventId id) {
    std::lock_guard<std::mutex> lock(mutex_);
    Slot& slot = live_slot(id);
    slot.live = false;
    free_[slot.device].push_back(id);
    --live_;
  }

  // release() for an id that may already be back (or never was the pool's): never throws.
  void release_if_live(EventId id) noexcept {
    std::lock_guard<std::mutex> lock(mutex_);
    if (id < 0 || static_cast<std::size_t>(id) >= slots_.size()) return;
    Slot& slot = slots_[static_cast<std::size_t>(id)];
    if (!slot.live) return;
    slot.live = false;
    free_[slot.device].push_back(id);
    --live_;
  }

  // The live event's CUDA handle (nullptr for a host marker) and device.
  cudaEvent_t event(EventId id) {
    std::lock_guard<std::mutex> lock(mutex_);
    return live_slot(id).event;
  }
  int device(EventId id) {
    std::lock_guard<std::mutex> lock(mutex_);
    return live_slot(id).device;
  }

  std::int64_t live() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return live_;
  }
  std::int64_t pooled() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return static_cast<std::int64_t>(slots_.size());
  }

 private:
  struct Slot {
    cudaEvent_t event;
    int device;
    bool live;
  };

  Slot& live_slot(EventId id) {  // caller holds mutex_
    GF_EXPECTS(id >= 0 && static_cast<std::size_t>(id) < slots_.size() &&
                   slots_[static_cast<std::size_t>(id)].live,
               "unknown or released event " + std::to_string(id));
    return slots_[static_cast<std::size_t>(id)];
  }

  const unsigned flags_;
  mutable std::mutex mutex_;
  std::deque<Slot> slots_;
  std::unordered_map<int, std::vector<EventId>> free_;
  std::int64_t live_ = 0;
};

}  // namespace gpipe_fast::detail
