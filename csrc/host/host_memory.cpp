// Host memory resource (aligned new/delete), and the CUDA memory stand-ins of a host-only build.
#include <new>
#include <string>

#include "gpipe_fast/error.hpp"
#include "gpipe_fast/memory.hpp"

namespace gpipe_fast {

void* HostMemoryResource::do_allocate(std::size_t bytes, const Stream&) {
  try {
    return ::operator new(bytes, std::align_val_t{kAllocationAlignment});
  } catch (const std::bad_alloc&) {
    throw OutOfMemory("HostMemoryResource: cannot allocate " + std::to_string(bytes) +
                      " bytes of host memory");
  }
}

void HostMemoryResource::do_deallocate(void* ptr, std::size_t, const Stream&) {
  ::operator delete(ptr, std::align_val_t{kAllocationAlignment});
}

#ifndef GPIPE_FAST_WITH_CUDA
namespace {
[[noreturn]] void no_cuda() {
  throw CudaError("gpipe_fast was built without CUDA (nvcc was not found at build time)");
}
}  // namespace

CudaMemoryResource::CudaMemoryResource(bool stream_ordered) : stream_ordered_(stream_ordered) {
  no_cuda();
}
void* CudaMemoryResource::do_allocate(std::size_t, const Stream&) { no_cuda(); }
void CudaMemoryResource::do_deallocate(void*, std::size_t, const Stream&) { no_cuda(); }

std::shared_ptr<PoolRegistry> torch_allocator_pools() { return nullptr; }
std::shared_ptr<RecomputePool> torch_allocator_pool() { return nullptr; }
int select_torch_allocator_pool(int) { no_cuda(); }
#endif

}  // namespace gpipe_fast
