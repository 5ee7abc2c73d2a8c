// Work on another stream that holds SMs: one block per SM (its shared memory leaves room for no
// other block) spinning until released, for tests that run the layer beside other kernels, as a
// serving engine runs communication kernels beside compute. The hog ends by itself after its
// timeout, so a test that never releases it cannot hang the GPU.
#pragma once

#include <cuda_runtime_api.h>

namespace megamoe::test {

class SmHog {
 public:
  // Starts `blocks` spinning blocks on `stream` and returns once all of them are resident (or
  // throws after a few seconds). Each gives up after `timeout_s`.
  SmHog(int blocks, cudaStream_t stream, double timeout_s);
  ~SmHog();
  SmHog(const SmHog&) = delete;
  SmHog& operator=(const SmHog&) = delete;

  // Whether every block is still spinning (none released or timed out).
  bool holding() const;
  // Lets the blocks go and waits for them to end.
  void release();

 private:
  cudaStream_t stream_;
  int blocks_;
  volatile int* flags_ = nullptr;  // host-mapped: [0] release, [1] blocks started, [2] blocks timed out
  int* device_flags_ = nullptr;
  bool released_ = false;
};

}  // namespace megamoe::test
