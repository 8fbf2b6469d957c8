// CUDA copy operations for boundary copies: peer access and peer/device copies.
#include "cuda_check.hpp"
#include "device_guard.hpp"
#include "gpipe_fast/copy.hpp"

namespace gpipe_fast {
namespace {

class CudaCopyOps final : public CopyOps {
 public:
  bool can_access_peer(int device, int peer) override {
    int can = 0;
    GF_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, device, peer));
    return can != 0;
  }

  void enable_peer_access(int device, int peer) override {
    detail::DeviceGuard guard(device);  // access is granted to the current device
    const cudaError_t status = cudaDeviceEnablePeerAccess(peer, 0);
    if (status == cudaErrorPeerAccessAlreadyEnabled) {
      cudaGetLastError();  // someone (PyTorch, another pipe) enabled it first: success
      return;
    }
    GF_CUDA_CHECK(status);
  }

  void copy_async(const DeviceBuffer& destination, const DeviceBuffer& source, std::size_t bytes,
                  const Stream& stream) override {
    detail::DeviceGuard guard(stream.device);
    auto* const to = reinterpret_cast<void*>(destination.address);
    const auto* const from = reinterpret_cast<const void*>(source.address);
    const auto cuda_stream = reinterpret_cast<cudaStream_t>(stream.handle);
    if (destination.device == source.device) {
      GF_CUDA_CHECK(cudaMemcpyAsync(to, from, bytes, cudaMemcpyDeviceToDevice, cuda_stream));
    } else {
      GF_CUDA_CHECK(cudaMemcpyPeerAsync(to, destination.device, from, source.device, bytes,
                                        cuda_stream));
    }
  }
};

}  // namespace

std::shared_ptr<CopyOps> make_cuda_copy_ops() { return std::make_shared<CudaCopyOps>(); }

}  // namespace gpipe_fast
