// Helpers for GPU suites: device-memory buffers with checked calls, and the rule that a GPU suite
// skips on a machine without a Hopper GPU unless MEGAMOE_REQUIRE_GPU=1 (set by scripts/gpu/gpu_check.sh
// on the GPU machine, where a skip would hide a failure).
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernels/cuda_check.hpp"

namespace megamoe::test {

inline bool hopper_available(std::string* why) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    *why = "no CUDA device";
    return false;
  }
  cudaDeviceProp prop{};
  MEGAMOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  if (prop.major != 9) {
    *why = std::string("device 0 is ") + prop.name + ", not Hopper (sm_90)";
    return false;
  }
  return true;
}

#define MEGAMOE_REQUIRE_HOPPER()                                                        \
  do {                                                                                  \
    std::string why;                                                                    \
    if (!::megamoe::test::hopper_available(&why)) {                                     \
      const char* require = std::getenv("MEGAMOE_REQUIRE_GPU");                         \
      if (require && std::strcmp(require, "1") == 0) FAIL() << "GPU required: " << why; \
      GTEST_SKIP() << why;                                                              \
    }                                                                                   \
  } while (0)

template <class T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t count) : count_(count) { MEGAMOE_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&ptr_), bytes())); }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* get() const { return ptr_; }
  size_t bytes() const { return count_ * sizeof(T); }
  void upload(const std::vector<T>& host) { MEGAMOE_CUDA_CHECK(cudaMemcpy(ptr_, host.data(), bytes(), cudaMemcpyHostToDevice)); }
  std::vector<T> download() const {
    std::vector<T> host(count_);
    MEGAMOE_CUDA_CHECK(cudaMemcpy(host.data(), ptr_, bytes(), cudaMemcpyDeviceToHost));
    return host;
  }
  // Fills every byte with 0xFF: NaN for float and bf16, so an unwritten element cannot pass.
  void poison() { MEGAMOE_CUDA_CHECK(cudaMemset(ptr_, 0xFF, bytes())); }

 private:
  T* ptr_ = nullptr;
  size_t count_;
};

}  // namespace megamoe::test
