// CudaMemoryResource: device memory on the stream's device, stream-ordered or synchronous.
#include <cuda_runtime.h>

#include <string>

#include "cuda_check.hpp"
#include "device_guard.hpp"
#include "gpipe_fast/memory.hpp"

namespace gpipe_fast {
namespace {

cudaStream_t as_cuda(const Stream& stream) {
  return reinterpret_cast<cudaStream_t>(stream.handle);
}

void expect_device_stream(const Stream& stream) {
  GF_EXPECTS(stream.device >= 0, "CudaMemoryResource: needs a CUDA stream (device >= 0), got "
                                 "device " + std::to_string(stream.device));
}

}  // namespace

// Makes no CUDA call: building one (e.g. the torch allocator's process-wide pool) must not
// create a CUDA context before the first allocation.
CudaMemoryResource::CudaMemoryResource(bool stream_ordered) : stream_ordered_(stream_ordered) {}

void* CudaMemoryResource::do_allocate(std::size_t bytes, const Stream& stream) {
  expect_device_stream(stream);
  detail::DeviceGuard guard(stream.device);
  void* ptr = nullptr;
  if (stream_ordered_) {
    GF_CUDA_CHECK(cudaMallocAsync(&ptr, bytes, as_cuda(stream)));
  } else {
    GF_CUDA_CHECK(cudaMalloc(&ptr, bytes));
  }
  return ptr;
}

void CudaMemoryResource::do_deallocate(void* ptr, std::size_t, const Stream& stream) {
  expect_device_stream(stream);
  detail::DeviceGuard guard(stream.device);
  if (stream_ordered_) {
    GF_CUDA_CHECK(cudaFreeAsync(ptr, as_cuda(stream)));
  } else {
    GF_CUDA_CHECK(cudaFree(ptr));
  }
}

}  // namespace gpipe_fast
