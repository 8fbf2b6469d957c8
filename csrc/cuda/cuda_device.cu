// CUDA backend of the stream/event interface: pooled timing-free events, device-side waits.
#include <deque>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "cuda_check.hpp"
#include "device_guard.hpp"
#include "gpipe_fast/device.hpp"

namespace gpipe_fast {
namespace {

using detail::DeviceGuard;

cudaStream_t as_cuda(const Stream& stream) {
  return reinterpret_cast<cudaStream_t>(stream.handle);
}

class CudaSync final : public StreamSync {
 public:
  ~CudaSync() override {
    for (auto& slot : slots_) {
      if (slot.event != nullptr) cudaEventDestroy(slot.event);
    }
  }

  std::string name() const override { return "cuda"; }

  // A stream with device < 0 is the host's (a CPU cell in a mixed pipeline): its work is
  // done when the task returns, so its "event" is a plain marker that nobody must wait for.
  EventId record(const Stream& stream) override {
    if (stream.device < 0) return acquire_marker();
    DeviceGuard guard(stream.device);
    const EventId id = acquire(stream.device);
    GF_CUDA_CHECK(cudaEventRecord(slot(id).event, as_cuda(stream)));
    return id;
  }

  void wait(const Stream& stream, EventId event) override {
    const Slot& s = slot(event);
    if (s.device < 0) return;  // host work is already finished
    if (stream.device < 0) {
      // The host is about to read what a device produced: it must really wait.
      GF_CUDA_CHECK(cudaEventSynchronize(s.event));
      return;
    }
    DeviceGuard guard(stream.device);
    GF_CUDA_CHECK(cudaStreamWaitEvent(as_cuda(stream), s.event, 0));
  }

  void synchronize(EventId event) override {
    const Slot& s = slot(event);
    if (s.device >= 0) GF_CUDA_CHECK(cudaEventSynchronize(s.event));
  }

  void release(EventId event) override {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& s = slots_.at(static_cast<std::size_t>(event));
    GF_EXPECTS(s.live, "release of an event that is not live");
    s.live = false;
    free_[s.device].push_back(event);
    --live_;
  }

  std::int64_t live_events() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return live_;
  }
  std::int64_t pooled_events() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return static_cast<std::int64_t>(slots_.size());
  }

 private:
  struct Slot {
    cudaEvent_t event;
    int device;
    bool live;
  };

  EventId acquire_marker() {
    std::lock_guard<std::mutex> lock(mutex_);
    ++live_;
    auto& free = free_[-1];
    if (!free.empty()) {
      const EventId id = free.back();
      free.pop_back();
      slots_[static_cast<std::size_t>(id)].live = true;
      return id;
    }
    slots_.push_back(Slot{nullptr, -1, true});
    return static_cast<EventId>(slots_.size() - 1);
  }

  // Reuses a free event of that device, or creates one (current device set by the caller).
  EventId acquire(int device) {
    std::lock_guard<std::mutex> lock(mutex_);
    ++live_;
    auto& free = free_[device];
    if (!free.empty()) {
      const EventId id = free.back();
      free.pop_back();
      slots_[static_cast<std::size_t>(id)].live = true;
      return id;
    }
    cudaEvent_t event = nullptr;
    try {
      GF_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    } catch (...) {
      --live_;
      throw;
    }
    slots_.push_back(Slot{event, device, true});
    return static_cast<EventId>(slots_.size() - 1);
  }

  Slot& slot(EventId id) {
    std::lock_guard<std::mutex> lock(mutex_);
    GF_EXPECTS(id >= 0 && static_cast<std::size_t>(id) < slots_.size() &&
                   slots_[static_cast<std::size_t>(id)].live,
               "unknown or released event " + std::to_string(id));
    return slots_[static_cast<std::size_t>(id)];
  }

  mutable std::mutex mutex_;
  std::deque<Slot> slots_;  // a deque: references stay valid while other threads append
  std::unordered_map<int, std::vector<EventId>> free_;
  std::int64_t live_ = 0;
};

}  // namespace

std::shared_ptr<StreamSync> make_cuda_sync() { return std::make_shared<CudaSync>(); }

bool cuda_compiled() { return true; }

}  // namespace gpipe_fast
