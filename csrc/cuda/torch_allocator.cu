// extern "C" allocate/free for torch.cuda.memory.CUDAPluggableAllocator over per-cell pools.
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
#include "gpipe_fast/pool_registry.hpp"

namespace gpipe_fast {
namespace {

// The pool this thread's allocations go to: a cell's worker selects its cell's pool around
// a recompute; every other thread uses the default pool 0.
thread_local int selected_pool = 0;

}  // namespace

std::shared_ptr<PoolRegistry> torch_allocator_pools() {
  // Created on first use and never destroyed: torch may free blocks while the process exits,
  // after static destructors (and the CUDA runtime's teardown) have run.
  static auto* const pools = [] {
    auto registry = std::make_shared<PoolRegistry>(std::make_shared<CudaMemoryResource>());
    registry->create();  // pool 0: the default
    return new std::shared_ptr<PoolRegistry>(std::move(registry));
  }();
  return *pools;
}

std::shared_ptr<RecomputePool> torch_allocator_pool() { return torch_allocator_pools()->pool(0); }

int select_torch_allocator_pool(int id) {
  torch_allocator_pools()->pool(id);  // checks the id
  const int previous = selected_pool;
  selected_pool = id;
  return previous;
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
    return gpipe_fast::torch_allocator_pools()->allocate(
        gpipe_fast::selected_pool, static_cast<std::size_t>(size), as_stream(device, stream));
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
    gpipe_fast::torch_allocator_pools()->deallocate(ptr, static_cast<std::size_t>(size),
                                                    as_stream(device, stream));
  } catch (const std::exception& error) {
    report("gpipe_fast_free", error.what());
  } catch (...) {
    report("gpipe_fast_free", "unknown error");
  }
}

}  // extern "C"
