// Boundary copies between cells: peer access and stream-ordered device-to-device copies.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <utility>

#include "gpipe_fast/device.hpp"

namespace gpipe_fast {

// A device buffer as a plain fact: its address and the device it lives on.
struct DeviceBuffer {
  std::uintptr_t address = 0;
  int device = -1;
};

// The device calls a copier makes, behind an interface so that its policy (which pairs get
// peer access, when, how copies are ordered) is testable without a GPU.
class CopyOps {
 public:
  virtual ~CopyOps() = default;
  virtual bool can_access_peer(int device, int peer) = 0;
  virtual void enable_peer_access(int device, int peer) = 0;  // already enabled is success
  // Enqueues the copy on `stream` (a peer copy when the devices differ).
  virtual void copy_async(const DeviceBuffer& destination, const DeviceBuffer& source,
                          std::size_t bytes, const Stream& stream) = 0;
};

// cudaDeviceCanAccessPeer / cudaDeviceEnablePeerAccess / cudaMemcpyPeerAsync (cudaMemcpyAsync
// on one device), every call checked. Throws CudaError in a build without CUDA.
std::shared_ptr<CopyOps> make_cuda_copy_ops();

// Copies a boundary tensor (an activation in forward, its gradient in backward) into the
// receiving cell's memory on a dedicated copy stream, so that copies overlap the cells'
// compute. Ordering is by events from the StreamSync's pool, never by host synchronisation:
// the copy stream waits for the consumer stream (which the executor has already ordered
// after the producer, and on which the destination was allocated), copies, and the consumer
// stream waits for the copy. The caller keeps the source block alive until the copy stream
// has read it (PyTorch: record_stream on the copy stream). Thread-safe.
class BoundaryCopier {
 public:
  BoundaryCopier(std::shared_ptr<StreamSync> sync, std::shared_ptr<CopyOps> ops);

  // Lets `device` access `peer`'s memory directly; true when it can, false when the pair has
  // no peer path (copies between them still work, staged by the driver). Asks the device
  // once per ordered pair and remembers the answer; a device with itself is always true.
  bool enable_peer_access(int device, int peer);

  // Copies `bytes` from `source` to `destination` on `copy_stream`, between the two waits
  // described above. Both buffers must be on devices (>= 0); copy_stream on one of them.
  void copy(const DeviceBuffer& destination, const DeviceBuffer& source, std::size_t bytes,
            const Stream& consumer, const Stream& copy_stream);

  const StreamSync& sync() const { return *sync_; }

 private:
  std::shared_ptr<StreamSync> sync_;
  std::shared_ptr<CopyOps> ops_;
  std::mutex mutex_;
  std::map<std::pair<int, int>, bool> peer_access_;  // (device, peer) -> enabled
};

}  // namespace gpipe_fast
