// Host memory resource: aligned new/delete.
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

}  // namespace gpipe_fast
