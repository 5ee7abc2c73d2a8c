// Host-side CUDA error checks: every runtime call and every launch goes through these.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "megamoe/error.hpp"

namespace megamoe {

// A failed call also leaves its error as the runtime's last error, where the caller's next check
// (PyTorch's after its next kernel, say) would find it and fail for megamoe's reason: it is read
// back here, so that the exception is the only report. Sticky errors (a kernel fault) stay.
inline void cuda_check(cudaError_t status, const char* what, const char* file, int line) {
  if (status != cudaSuccess) {
    (void)cudaGetLastError();
    throw Error(ErrorCode::cuda_error, std::string(what) + " failed at " + file + ":" + std::to_string(line) + ": " +
                                           cudaGetErrorName(status) + " (" + cudaGetErrorString(status) + ")");
  }
}

// Device memory for `count` elements of T (at least one, so empty requests still get a valid
// pointer); throws megamoe::Error on failure.
template <class T>
T* cuda_alloc(size_t count) {
  void* p = nullptr;
  const size_t bytes = (count > 0 ? count : 1) * sizeof(T);
  const cudaError_t status = cudaMalloc(&p, bytes);
  if (status == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    throw Error(ErrorCode::out_of_memory, "cudaMalloc of " + std::to_string(bytes) + " bytes failed: the device is out of memory");
  }
  cuda_check(status, "cudaMalloc", __FILE__, __LINE__);
  return static_cast<T*>(p);
}

}  // namespace megamoe

#define MEGAMOE_CUDA_CHECK(expr) ::megamoe::cuda_check((expr), #expr, __FILE__, __LINE__)
// After a launch: catches configuration errors now and, in debug runs, faults of earlier work.
#define MEGAMOE_CHECK_LAUNCH(name) ::megamoe::cuda_check(cudaGetLastError(), name, __FILE__, __LINE__)
