#include "common/sm_hog.hpp"

#include <chrono>
#include <thread>

#include "kernels/cuda_check.hpp"
#include "kernels/ptx/timer.cuh"

namespace megamoe::test {
namespace {

// Leaves too little shared memory beside a block for a second one, or for a GEMM CTA.
constexpr int kHogSmemBytes = 160 * 1024;

__global__ void hog_kernel(volatile int* flags, unsigned long long timeout_ns) {
  extern __shared__ int smem[];
  if (threadIdx.x != 0) return;
  smem[0] = 0;
  atomicAdd(const_cast<int*>(flags + 1), 1);
  __threadfence_system();
  const unsigned long long start = ptx::global_timer_ns();
  while (flags[0] == 0) {
    if (ptx::global_timer_ns() - start > timeout_ns) {
      atomicAdd(const_cast<int*>(flags + 2), 1);
      return;
    }
    __nanosleep(1000);
  }
}

}  // namespace

SmHog::SmHog(int blocks, cudaStream_t stream, double timeout_s) : stream_(stream), blocks_(blocks) {
  MEGAMOE_CUDA_CHECK(cudaHostAlloc(const_cast<int**>(&flags_), 3 * sizeof(int), cudaHostAllocMapped));
  flags_[0] = flags_[1] = flags_[2] = 0;
  MEGAMOE_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_flags_), const_cast<int*>(flags_), 0));
  MEGAMOE_CUDA_CHECK(cudaFuncSetAttribute(hog_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kHogSmemBytes));
  hog_kernel<<<blocks, 32, kHogSmemBytes, stream>>>(device_flags_, static_cast<unsigned long long>(timeout_s * 1e9));
  MEGAMOE_CHECK_LAUNCH("hog_kernel");
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (flags_[1] < blocks) {
    if (std::chrono::steady_clock::now() > deadline) {
      release();
      throw Error(ErrorCode::timeout, "the SM hog's blocks did not all become resident within 10 s");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

bool SmHog::holding() const { return !released_ && flags_[2] == 0 && cudaStreamQuery(stream_) == cudaErrorNotReady; }

void SmHog::release() {
  if (released_) return;
  released_ = true;
  flags_[0] = 1;
  MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

SmHog::~SmHog() {
  if (!released_) {
    flags_[0] = 1;
    cudaStreamSynchronize(stream_);
  }
  cudaFreeHost(const_cast<int*>(flags_));
}

}  // namespace megamoe::test
