// CUDA backend of the stream/event interface: pooled timing-free events, device-side waits.
#include "cuda_check.hpp"
#include "device_guard.hpp"
#include "event_pool.hpp"
#include "gpipe_fast/device.hpp"

namespace gpipe_fast {
namespace {

using detail::DeviceGuard;
using detail::EventPool;

cudaStream_t as_cuda(const Stream& stream) {
  return reinterpret_cast<cudaStream_t>(stream.handle);
}

class CudaSync final : public StreamSync {
 public:
  std::string name() const override { return "cuda"; }

  // A stream with device < 0 is the host's (a CPU cell in a mixed pipeline): its work is
  // done when the task returns, so its "event" is a plain marker that nobody must wait for.
  EventId record(const Stream& stream) override {
    if (stream.device < 0) return events_.acquire(-1);
    DeviceGuard guard(stream.device);
    const EventId id = events_.acquire(stream.device);
    try {
      GF_CUDA_CHECK(cudaEventRecord(events_.event(id), as_cuda(stream)));
    } catch (...) {
      events_.release(id);
      throw;
    }
    return id;
  }

  void wait(const Stream& stream, EventId event) override {
    const int device = events_.device(event);
    if (device < 0) return;  // host work is already finished
    cudaEvent_t cuda_event = events_.event(event);
    if (stream.device < 0) {
      // The host is about to read what a device produced: it must really wait.
      GF_CUDA_CHECK(cudaEventSynchronize(cuda_event));
      return;
    }
    DeviceGuard guard(stream.device);
    GF_CUDA_CHECK(cudaStreamWaitEvent(as_cuda(stream), cuda_event, 0));
  }

  void synchronize(EventId event) override {
    if (events_.device(event) >= 0) GF_CUDA_CHECK(cudaEventSynchronize(events_.event(event)));
  }

  void release(EventId event) override { events_.release(event); }

  std::int64_t live_events() const override { return events_.live(); }
  std::int64_t pooled_events() const override { return events_.pooled(); }

 private:
  EventPool events_{cudaEventDisableTiming};
};

}  // namespace

std::shared_ptr<StreamSync> make_cuda_sync() { return std::make_shared<CudaSync>(); }

bool cuda_compiled() { return true; }

}  // namespace gpipe_fast
