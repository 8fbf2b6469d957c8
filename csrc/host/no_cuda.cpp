// The CUDA entry points of a build without nvcc, in one place: each says CUDA is missing.
// CMakeLists.txt compiles this file only when the CUDA backend is off; csrc/cuda/ has the real ones.
#include <memory>

#include "gpipe_fast/copy.hpp"
#include "gpipe_fast/device.hpp"
#include "gpipe_fast/error.hpp"
#include "gpipe_fast/memory.hpp"
#include "gpipe_fast/task_clock.hpp"

#ifdef GPIPE_FAST_WITH_CUDA
#error "no_cuda.cpp stands in for csrc/cuda/ and must not be compiled in a CUDA build"
#endif

namespace gpipe_fast {
namespace {
[[noreturn]] void no_cuda() {
  throw CudaError("gpipe_fast was built without CUDA (nvcc was not found at build time)");
}
}  // namespace

bool cuda_compiled() { return false; }

// device.hpp, copy.hpp, task_clock.hpp
std::shared_ptr<StreamSync> make_cuda_sync() { no_cuda(); }
std::shared_ptr<CopyOps> make_cuda_copy_ops() { no_cuda(); }
std::shared_ptr<TaskClock> make_cuda_clock() { no_cuda(); }

// memory.hpp
CudaMemoryResource::CudaMemoryResource(bool stream_ordered) : stream_ordered_(stream_ordered) {
  no_cuda();
}
void* CudaMemoryResource::do_allocate(std::size_t, const Stream&) { no_cuda(); }
void CudaMemoryResource::do_deallocate(void*, std::size_t, const Stream&) { no_cuda(); }

std::shared_ptr<PoolRegistry> torch_allocator_pools() { return nullptr; }
std::shared_ptr<RecomputePool> torch_allocator_pool() { return nullptr; }
int select_torch_allocator_pool(int) { no_cuda(); }

}  // namespace gpipe_fast
