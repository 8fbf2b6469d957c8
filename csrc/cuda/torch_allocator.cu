// extern "C" allocate/free for torch.cuda.memory.CUDAPluggableAllocator over a RecomputePool.
//
// Load them from the gpipe_fast._C module (no libtorch link):
//   allocator = torch.cuda.memory.CUDAPluggableAllocator(
//       gpipe_fast._C.__file__, "gpipe_fast_malloc", "gpipe_fast_free")
//   pool = torch.cuda.MemPool(allocator.allocator())
//   with torch.cuda.use_mem_pool(pool): ...   # this thread's allocations go to the pool
// The signatures are those torch calls (torch/csrc/cuda/CUDAPluggableAllocator.h: alloc
// (size_t, int, cudaStream_t), free (void*, size_t, int, cudaStream_t); the docstring of
// CUDAPluggableAllocator omits free's device argument). torch frees a block with the device
// and stream it was allocated on, which is the pool's "freed on its stream" case.
#include <cuda_runtime.h>
#include <sys/types.h>

#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>

#include "gpipe_fast/error.hpp"
#include "gpipe_fast/memory.hpp"

namespace gpipe_fast {

std::shared_ptr<RecomputePool> torch_allocator_pool() {
  // Created on first use and never destroyed: torch may free blocks while the process exits,
  // after static destructors (and the CUDA runtime's teardown) have run.
  static auto* const pool = new std::shared_ptr<RecomputePool>(
      std::make_shared<RecomputePool>(std::make_shared<CudaMemoryResource>()));
  return *pool;
}

}  // namespace gpipe_fast

namespace {

gpipe_fast::Stream as_stream(int device, cudaStream_t stream) {
  return gpipe_fast::Stream{device, reinterpret_cast<std::uintptr_t>(stream)};
}

// Errors other than out-of-memory go to stderr: the entry points below cannot throw.
void report(const char* where, const char* what) {
  std::fprintf(stderr, "gpipe_fast: %s: %s\n", where, what);
}

}  // namespace

// No exception may cross into torch: its deleters are noexcept, and a null pointer is how an
// allocator says "out of memory" to torch.cuda.MemPool (torch then frees its cached blocks,
// retries, and raises torch.cuda.OutOfMemoryError). Through change_current_allocator torch
// does not check for null: use the MemPool route.
extern "C" {

__attribute__((visibility("default"))) void* gpipe_fast_malloc(ssize_t size, int device,
                                                               cudaStream_t stream) noexcept {
  if (size <= 0) return nullptr;
  try {
    return gpipe_fast::torch_allocator_pool()->allocate(static_cast<std::size_t>(size),
                                                        as_stream(device, stream));
  } catch (const gpipe_fast::OutOfMemory&) {
    return nullptr;  // expected under memory pressure: torch reports it, not us
  } catch (const std::exception& error) {
    report("gpipe_fast_malloc", error.what());
  } catch (...) {
    report("gpipe_fast_malloc", "unknown error");
  }
  return nullptr;
}

__attribute__((visibility("default"))) void gpipe_fast_free(void* ptr, ssize_t size, int device,
                                                            cudaStream_t stream) noexcept {
  if (ptr == nullptr || size <= 0) return;
  try {
    gpipe_fast::torch_allocator_pool()->deallocate(ptr, static_cast<std::size_t>(size),
                                                   as_stream(device, stream));
  } catch (const std::exception& error) {
    report("gpipe_fast_free", error.what());
  } catch (...) {
    report("gpipe_fast_free", "unknown error");
  }
}

}  // extern "C"
