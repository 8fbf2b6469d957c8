// CUDA task clock: pooled timing events on the cells' streams, read against device anchors.
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cuda_check.hpp"
#include "device_guard.hpp"
#include "event_pool.hpp"
#include "gpipe_fast/clock_anchor.hpp"
#include "gpipe_fast/error.hpp"
#include "gpipe_fast/task_clock.hpp"

namespace gpipe_fast {
namespace {

using detail::DeviceGuard;
using detail::EventPool;

// Calibration samples per anchor: the tightest host bracket wins, so one sample delayed by
// a preempted thread or a first-use stall does not set the anchor.
constexpr int kCalibrationSamples = 3;

cudaStream_t as_cuda(const Stream& stream) {
  return reinterpret_cast<cudaStream_t>(stream.handle);
}

class CudaClock final : public TaskClock {
 public:
  ~CudaClock() override {
    for (auto& entry : anchors_) {
      DeviceAnchor& anchor = entry.second;
      if (anchor.event != nullptr) cudaEventDestroy(anchor.event);
      if (anchor.probe != nullptr) cudaEventDestroy(anchor.probe);
      if (anchor.stream != nullptr) cudaStreamDestroy(anchor.stream);
    }
  }

  std::string name(const Stream& stream) const override {
    return stream.device < 0 ? "host" : "cuda";
  }

  void calibrate(const std::vector<Stream>& streams) override {
    std::lock_guard<std::mutex> lock(mutex_);
    const std::int64_t now = steady_now_ns();
    for (const Stream& stream : streams) {
      if (stream.device < 0) continue;
      DeviceAnchor& anchor = anchors_[stream.device];
      // Unread stamps were timed against the current anchor; renewing it now would put
      // them before the new one.
      const bool renew = anchor.tied && events_.live() == 0 && anchor_is_stale(anchor.tie, now);
      if (!anchor.tied || renew) tie_to_host(stream.device, anchor);
    }
  }

  Stamp stamp(const Stream& stream) override {
    if (stream.device < 0) return Stamp{steady_now_ns(), -1};
    DeviceGuard guard(stream.device);
    const Stamp stamp{0, acquire(stream.device)};
    try {
      GF_CUDA_CHECK(cudaEventRecord(events_.event(stamp.event), as_cuda(stream)));
    } catch (...) {
      discard(stamp);
      throw;
    }
    return stamp;
  }

  std::int64_t resolve(const Stamp& stamp) override {
    if (stamp.event < 0) return stamp.ns;
    cudaEvent_t event = events_.event(stamp.event);
    const int device = events_.device(stamp.event);
    cudaEvent_t anchor_event = nullptr;
    ClockAnchor when{};
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const DeviceAnchor& anchor = anchors_.at(device);
      anchor_event = anchor.event;
      when = anchor.tie;
    }
    float elapsed_ms = 0.0f;
    try {
      DeviceGuard guard(device);
      GF_CUDA_CHECK(cudaEventSynchronize(event));
      GF_CUDA_CHECK(cudaEventElapsedTime(&elapsed_ms, anchor_event, event));
    } catch (...) {
      discard(stamp);
      throw;
    }
    discard(stamp);
    return host_ns_after(when, elapsed_ms);
  }

  void discard(const Stamp& stamp) noexcept override {
    if (stamp.event >= 0) events_.release_if_live(stamp.event);  // not ours, or already back
  }

  std::int64_t live_events() const override { return events_.live(); }
  std::int64_t pooled_events() const override { return events_.pooled(); }

 private:
  // A device's anchor: `event` ran at host time `tie`. `probe` and `stream` (created with
  // cudaStreamNonBlocking, used by nothing else, hence idle) serve calibration.
  struct DeviceAnchor {
    cudaStream_t stream = nullptr;
    cudaEvent_t event = nullptr;
    cudaEvent_t probe = nullptr;
    ClockAnchor tie{};
    bool tied = false;
  };

  // Records a probe on the idle stream between two host clock reads, a few times, and keeps
  // the sample with the tightest bracket (caller holds mutex_; no run is in flight).
  void tie_to_host(int device, DeviceAnchor& anchor) {
    DeviceGuard guard(device);
    anchor.tied = false;  // until a sample lands: `event` may be swapped below
    if (anchor.stream == nullptr) {
      GF_CUDA_CHECK(cudaStreamCreateWithFlags(&anchor.stream, cudaStreamNonBlocking));
    }
    if (anchor.event == nullptr) GF_CUDA_CHECK(cudaEventCreate(&anchor.event));
    if (anchor.probe == nullptr) GF_CUDA_CHECK(cudaEventCreate(&anchor.probe));
    for (int sample = 0; sample < kCalibrationSamples; ++sample) {
      const std::int64_t before = steady_now_ns();
      GF_CUDA_CHECK(cudaEventRecord(anchor.probe, anchor.stream));
      GF_CUDA_CHECK(cudaEventSynchronize(anchor.probe));
      const ClockAnchor sample_tie = anchor_from_bracket(before, steady_now_ns());
      if (!anchor.tied || sample_tie.uncertainty_ns < anchor.tie.uncertainty_ns) {
        std::swap(anchor.event, anchor.probe);
        anchor.tie = sample_tie;
        anchor.tied = true;
      }
    }
  }

  // A timing event of that device from the pool (current device set by the caller), once
  // the device has an anchor to read it against.
  EventId acquire(int device) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const auto anchor = anchors_.find(device);
      GF_EXPECTS(anchor != anchors_.end() && anchor->second.tied,
                 "no clock anchor for cuda:" + std::to_string(device) +
                     ": TaskClock::calibrate must run before stamps on it");
    }
    return events_.acquire(device);
  }

  EventPool events_{cudaEventDefault};  // timing enabled
  mutable std::mutex mutex_;            // guards anchors_
  std::unordered_map<int, DeviceAnchor> anchors_;
};

}  // namespace

std::shared_ptr<TaskClock> make_cuda_clock() { return std::make_shared<CudaClock>(); }

}  // namespace gpipe_fast
