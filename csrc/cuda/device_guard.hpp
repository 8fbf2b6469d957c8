// DeviceGuard: makes a device current for a scope and restores the caller's device after.
#pragma once

#include <cuda_runtime.h>

#include "cuda_check.hpp"

namespace gpipe_fast::detail {

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    GF_CUDA_CHECK(cudaGetDevice(&previous_));
    if (device != previous_) GF_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }  // a destructor cannot throw; best effort
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace gpipe_fast::detail
