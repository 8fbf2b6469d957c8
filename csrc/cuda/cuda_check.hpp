// GF_CUDA_CHECK: every CUDA runtime call checked, failures thrown with call, file:line, name.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "gpipe_fast/error.hpp"

namespace gpipe_fast::detail {

[[noreturn]] inline void throw_cuda_error(cudaError_t status, const char* call, const char* file,
                                          int line) {
  cudaGetLastError();  // clear the sticky-free error so the next call starts clean
  const std::string message = std::string(call) + " failed: " + cudaGetErrorName(status) + " (" +
                              cudaGetErrorString(status) + ") at " + file + ":" +
                              std::to_string(line);
  if (status == cudaErrorMemoryAllocation) throw OutOfMemory(message);
  throw CudaError(message);
}

}  // namespace gpipe_fast::detail

#define GF_CUDA_CHECK(call)                                                         \
  do {                                                                              \
    const cudaError_t gf_status_ = (call);                                          \
    if (gf_status_ != cudaSuccess)                                                  \
      ::gpipe_fast::detail::throw_cuda_error(gf_status_, #call, __FILE__, __LINE__); \
  } while (0)
