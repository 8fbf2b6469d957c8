// Streams and events behind one interface, with a host (CPU) and a CUDA backend.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

namespace gpipe_fast {

// A stream as a plain fact: the device index and the raw handle (cudaStream_t cast to an
// integer; 0 is the legacy default stream; ignored by the host backend).
struct Stream {
  int device = -1;
  std::uintptr_t handle = 0;
};

using EventId = std::int64_t;

// Orders work between streams without blocking the host. record() marks the point on a
// stream after everything enqueued so far; wait() makes another stream wait for that point
// on the device. Implementations are thread-safe: every cell's worker calls them.
class StreamSync {
 public:
  virtual ~StreamSync() = default;
  virtual std::string name() const = 0;
  virtual EventId record(const Stream& stream) = 0;
  virtual void wait(const Stream& stream, EventId event) = 0;
  // Blocks the calling host thread until the event's work has finished.
  virtual void synchronize(EventId event) = 0;
  // Returns the event to the pool; waits already enqueued on it stay valid.
  virtual void release(EventId event) = 0;
  // Events recorded and not yet released (leak checks).
  virtual std::int64_t live_events() const = 0;
  // Events ever created by the pool (steady after warm-up when events are reused).
  virtual std::int64_t pooled_events() const = 0;
};

// Host backend: work on a host "stream" is finished when the call that enqueued it returns,
// so record/wait/synchronize only keep the bookkeeping honest.
std::shared_ptr<StreamSync> make_host_sync();

// CUDA backend: a pool of cudaEventDisableTiming events per device, cudaEventRecord and
// cudaStreamWaitEvent. Throws CudaError when the extension was built without CUDA.
std::shared_ptr<StreamSync> make_cuda_sync();

// Whether this build compiled the CUDA backend (nvcc was found at build time).
bool cuda_compiled();

}  // namespace gpipe_fast
