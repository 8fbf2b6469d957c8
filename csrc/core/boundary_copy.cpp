// BoundaryCopier: peer-access bookkeeping and the event ordering around each copy.
#include <string>

#include "gpipe_fast/copy.hpp"
#include "gpipe_fast/error.hpp"

namespace gpipe_fast {
namespace {

// Orders `waiter` after the work enqueued on `signaller` so far, with a pooled event.
void order_after(StreamSync& sync, const Stream& waiter, const Stream& signaller) {
  const EventId event = sync.record(signaller);
  try {
    sync.wait(waiter, event);
  } catch (...) {
    sync.release(event);
    throw;
  }
  sync.release(event);  // the wait is enqueued: the pool may hand the event out again
}

}  // namespace

BoundaryCopier::BoundaryCopier(std::shared_ptr<StreamSync> sync, std::shared_ptr<CopyOps> ops)
    : sync_(std::move(sync)), ops_(std::move(ops)) {
  GF_EXPECTS(sync_ != nullptr, "BoundaryCopier needs a StreamSync");
  GF_EXPECTS(ops_ != nullptr, "BoundaryCopier needs CopyOps");
}

bool BoundaryCopier::enable_peer_access(int device, int peer) {
  GF_EXPECTS(device >= 0 && peer >= 0, "enable_peer_access needs two device indices, got " +
                                           std::to_string(device) + " and " +
                                           std::to_string(peer));
  if (device == peer) return true;
  // One lock around the query: peer access is process-wide state, enabled once per pair.
  std::lock_guard<std::mutex> lock(mutex_);
  const auto pair = std::make_pair(device, peer);
  const auto known = peer_access_.find(pair);
  if (known != peer_access_.end()) return known->second;
  const bool can = ops_->can_access_peer(device, peer);
  if (can) ops_->enable_peer_access(device, peer);
  peer_access_.emplace(pair, can);
  return can;
}

void BoundaryCopier::copy(const DeviceBuffer& destination, const DeviceBuffer& source,
                          std::size_t bytes, const Stream& consumer, const Stream& copy_stream) {
  GF_EXPECTS(destination.device >= 0 && source.device >= 0,
             "a boundary copy is between device buffers, got devices " +
                 std::to_string(source.device) + " -> " + std::to_string(destination.device));
  GF_EXPECTS(copy_stream.device == destination.device || copy_stream.device == source.device,
             "the copy stream must be on the source or destination device, got device " +
                 std::to_string(copy_stream.device));
  if (bytes == 0) return;
  // The destination was allocated on the consumer stream: the copy must not write it before
  // the consumer's earlier work (a previous user of that block) has finished.
  order_after(*sync_, copy_stream, consumer);
  ops_->copy_async(destination, source, bytes, copy_stream);
  order_after(*sync_, consumer, copy_stream);
}

}  // namespace gpipe_fast
