// Times tasks on their cells' streams: host clock on host streams, device events on GPUs.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gpipe_fast/device.hpp"

namespace gpipe_fast {

// Nanoseconds of std::chrono::steady_clock: CLOCK_MONOTONIC on Linux, the clock of Python's
// time.monotonic_ns, so spans line up with times taken in Python.
inline std::int64_t steady_now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// A point on a stream's timeline. A host stamp knows its time at once (`ns`); a device
// stamp is a timing event (`event` >= 0) enqueued on the stream, whose time is only known
// once the device has reached it, so it is read later by TaskClock::resolve.
struct Stamp {
  std::int64_t ns = 0;
  std::int64_t event = -1;
};

// Stamps never block the host, so a run in flight is never synchronised; resolving does,
// and is meant for after the run. Thread-safe: every cell's worker stamps.
class TaskClock {
 public:
  virtual ~TaskClock() = default;
  // What times tasks on `stream`: "host" (steady clock on the worker) or "cuda" (events).
  virtual std::string name(const Stream& stream) const = 0;
  // Ties each device clock among `streams` to the host clock where it has no anchor yet, or
  // a stale one and no stamp is unread (renewing it would misplace them). Blocks briefly on
  // a private idle stream, never on the cells' work; call between runs.
  virtual void calibrate(const std::vector<Stream>& streams) = 0;
  // Marks now on `stream` without blocking: reads the host clock, or enqueues an event.
  virtual Stamp stamp(const Stream& stream) = 0;
  // Steady-clock ns of a stamp; waits for a device stamp's event, then releases it.
  virtual std::int64_t resolve(const Stamp& stamp) = 0;
  // Releases a stamp's event unread (a failed task, an abandoned or unread run).
  virtual void discard(const Stamp& stamp) noexcept = 0;
  // Timing events stamped and not yet resolved or discarded (leak checks).
  virtual std::int64_t live_events() const = 0;
  // Timing events ever created (steady after warm-up: they are reused).
  virtual std::int64_t pooled_events() const = 0;
};

// Host clock: every stamp is the steady clock read on the worker thread.
std::shared_ptr<TaskClock> make_host_clock();

// CUDA clock: a pool of timing events per device for stamps on device streams, read against
// a per-device anchor; host streams (CPU cells) get host stamps. Throws CudaError when the
// extension was built without CUDA.
std::shared_ptr<TaskClock> make_cuda_clock();

}  // namespace gpipe_fast
