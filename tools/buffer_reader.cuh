// A large buffer read once per call: the HBM read-bandwidth measurement of the bench tools, and
// the L2 scrub before each timed replay (reading twice the L2 evicts what a previous replay left).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "device_timing.hpp"
#include "kernels/cuda_check.hpp"

namespace megamoe::bench {

// Reads a large buffer once per launch; the XOR keeps the loads alive.
inline __global__ void hbm_read_kernel(const uint4* data, size_t count, uint32_t* sink) {
  uint32_t acc = 0;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const uint4 v = data[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9E3779B9u) sink[0] = acc;  // practically never true; the compiler cannot know
}

// One pass of hbm_read_kernel over a buffer of its own.
class BufferReader {
 public:
  BufferReader(cudaStream_t stream, size_t bytes, int num_sms)
      : stream_(stream), num_sms_(num_sms), buffer_(bytes), sink_(sizeof(uint32_t)) {
    MEGAMOE_CUDA_CHECK(cudaMemsetAsync(buffer_.as<void>(), 0x5A, buffer_.bytes(), stream));
  }
  void operator()() {
    hbm_read_kernel<<<num_sms_ * 8, 512, 0, stream_>>>(buffer_.as<uint4>(), buffer_.bytes() / sizeof(uint4),
                                                       sink_.as<uint32_t>());
    MEGAMOE_CHECK_LAUNCH("hbm_read_kernel");
  }
  size_t bytes() const { return buffer_.bytes(); }

 private:
  cudaStream_t stream_;
  int num_sms_;
  DeviceBuffer buffer_, sink_;
};

}  // namespace megamoe::bench
