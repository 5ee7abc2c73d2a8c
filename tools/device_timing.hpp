// Device buffers and event timing shared by the GPU paths of the bench tools (CUDA builds only).
#pragma once

#include <cuda_runtime_api.h>

#include <utility>
#include <vector>

#include "bench_stats.hpp"
#include "kernels/cuda_check.hpp"

namespace megamoe::bench {

// Owns one device allocation.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) { MEGAMOE_CUDA_CHECK(cudaMalloc(&ptr_, bytes)); }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <class T>
  T* as() const { return static_cast<T*>(ptr_); }
  size_t bytes() const { return bytes_; }
  template <class T>
  void upload(const std::vector<T>& host) {
    MEGAMOE_CUDA_CHECK(cudaMemcpy(ptr_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_;
};

struct Replays {
  int warmup;
  int timed;
};

// A graph of what `record` enqueues on `stream`.
template <class Record>
cudaGraph_t capture_graph(cudaStream_t stream, Record&& record) {
  cudaGraph_t graph;
  MEGAMOE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  record();
  MEGAMOE_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  return graph;
}

// Median time of `launch` over `replays.timed` calls after `replays.warmup` untimed ones, each
// timed call between its own pair of events; `before_each` runs outside the events.
template <class Launch, class Before>
double median_ms(cudaStream_t stream, Replays replays, Launch&& launch, Before&& before_each) {
  for (int i = 0; i < replays.warmup; ++i) launch();
  std::vector<cudaEvent_t> events(2 * replays.timed);
  for (cudaEvent_t& e : events) MEGAMOE_CUDA_CHECK(cudaEventCreate(&e));
  for (int i = 0; i < replays.timed; ++i) {
    before_each();
    MEGAMOE_CUDA_CHECK(cudaEventRecord(events[2 * i], stream));
    launch();
    MEGAMOE_CUDA_CHECK(cudaEventRecord(events[2 * i + 1], stream));
  }
  MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<float> ms(replays.timed);
  for (int i = 0; i < replays.timed; ++i) {
    MEGAMOE_CUDA_CHECK(cudaEventElapsedTime(&ms[i], events[2 * i], events[2 * i + 1]));
  }
  for (cudaEvent_t& e : events) cudaEventDestroy(e);
  return median(ms);
}

template <class Launch>
double median_ms(cudaStream_t stream, Replays replays, Launch&& launch) {
  return median_ms(stream, replays, std::forward<Launch>(launch), [] {});
}

}  // namespace megamoe::bench
