// megamoe-code-probe: what code that runs once costs when its instructions are not cached.
//
// A one-token forward runs most of its instructions once (the front role, the epilogues, the
// combine), and with the L2 scrubbed, the benchmark method, those instructions come from HBM as
// they run: a router with fewer dependent instructions but twice the SASS routed slower scrubbed
// and faster warm (docs/decisions.md#h200-facts). This probe measures that cost alone. One warp per
// SM runs N straight-line instructions (four independent chains of integer multiply-adds, so
// that issue, not latency, paces them when the code is cached) and times them with the global
// timer from the first to the last. Three states of the code, each the median of the SMs' times,
// then of the rounds:
//   warm         the same launch just ran (the code in every cache)
//   l2           the code in L2 only (a launch of other code of 256 KB in between evicts it from
//                the SMs' instruction caches)
//   cold         the code in no cache (that other code, then the L2 scrub of the bench tools)
// Prints, per N: the code's KB, the three times, and what each cold KB costs over warm. The
// comparison with the forward: the single kernel's one-shot files hold ~77 KB of SASS
// (scripts/sass_by_source.py).
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <vector>

#include "bench_stats.hpp"
#include "buffer_reader.cuh"
#include "device_timing.hpp"
#include "probe_main.hpp"
#include "kernels/cuda_check.hpp"
#include "kernels/ptx/timer.cuh"

namespace megamoe::bench {
namespace {

constexpr int kChains = 4;
constexpr int kInstructionBytes = 16;  // one sm_90 instruction
constexpr int kFlushInstructions = 16384;  // 256 KB: more than an SM's instruction caches hold
constexpr int kRounds = 15;

// a * m + k, opaque to ptxas (which would otherwise fold a chain of constant steps into one).
__device__ __forceinline__ uint32_t opaque_mad(uint32_t a, uint32_t m, uint32_t k) {
  asm volatile("mad.lo.u32 %0, %0, %1, %2;" : "+r"(a) : "r"(m), "r"(k));
  return a;
}

// kInstructions multiply-adds in kChains independent chains, all unrolled: kInstructions * 16
// bytes of straight code. kCopy only makes another copy of the same code at another address.
template <int kInstructions, int kCopy>
__global__ void __launch_bounds__(32) straight_code_kernel(uint32_t m, uint32_t k, unsigned long long* elapsed_ns,
                                                           uint32_t* sink) {
  uint32_t chain[kChains];
#pragma unroll
  for (int c = 0; c < kChains; ++c) chain[c] = threadIdx.x + c + kCopy;
  const unsigned long long start = ptx::global_timer_ns();
#pragma unroll
  for (int i = 0; i < kInstructions / kChains; ++i) {
#pragma unroll
    for (int c = 0; c < kChains; ++c) chain[c] = opaque_mad(chain[c], m, k);
  }
  const unsigned long long end = ptx::global_timer_ns();
  if (threadIdx.x == 0 && elapsed_ns != nullptr) elapsed_ns[blockIdx.x] = end - start;
  uint32_t folded = 0;
#pragma unroll
  for (int c = 0; c < kChains; ++c) folded ^= chain[c];
  if (folded == 0x9E3779B9u) sink[0] = folded;  // practically never; the compiler cannot know
}

struct Probe {
  cudaStream_t stream;
  int sms;
  BufferReader& scrub;
  DeviceBuffer elapsed, sink;

  template <int kInstructions, int kCopy>
  void launch(bool timed) {
    straight_code_kernel<kInstructions, kCopy><<<sms, 32, 0, stream>>>(
        3u, 7u, timed ? elapsed.as<unsigned long long>() : nullptr, sink.as<uint32_t>());
    MEGAMOE_CHECK_LAUNCH("straight_code_kernel");
  }

  // The median over SMs of the last timed launch, in µs.
  double median_us() {
    std::vector<unsigned long long> ns(sms);
    MEGAMOE_CUDA_CHECK(cudaMemcpyAsync(ns.data(), elapsed.as<void>(), sms * sizeof(unsigned long long),
                                       cudaMemcpyDeviceToHost, stream));
    MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    std::vector<float> us(ns.begin(), ns.end());
    for (float& v : us) v /= 1000.0f;
    return median(us);
  }

  template <int kInstructions>
  void run_case() {
    std::vector<float> warm, l2, cold;
    for (int round = 0; round < kRounds; ++round) {
      launch<kInstructions, 0>(false);
      launch<kInstructions, 0>(true);
      warm.push_back(static_cast<float>(median_us()));
      launch<kFlushInstructions, 1>(false);
      launch<kInstructions, 0>(true);
      l2.push_back(static_cast<float>(median_us()));
      launch<kFlushInstructions, 1>(false);
      scrub();
      launch<kInstructions, 0>(true);
      cold.push_back(static_cast<float>(median_us()));
    }
    const double kb = kInstructions * kInstructionBytes / 1024.0;
    const double w = median(warm), c = median(cold);
    std::printf("  %6d | %7.0f | %8.2f | %8.2f | %8.2f | %13.1f\n", kInstructions, kb, w, median(l2), c,
                1000.0 * (c - w) / kb);
  }
};

}  // namespace
}  // namespace megamoe::bench

int main(int argc, char**) {
  using namespace megamoe::bench;
  return run_probe("megamoe-code-probe", argc, [](const cudaDeviceProp& prop, cudaStream_t stream) {
    BufferReader scrub(stream, 2 * static_cast<size_t>(prop.l2CacheSize), prop.multiProcessorCount);
    Probe probe{stream, prop.multiProcessorCount, scrub,
                DeviceBuffer(sizeof(unsigned long long) * prop.multiProcessorCount), DeviceBuffer(sizeof(uint32_t))};
    std::printf("megamoe-code-probe on %s (%d SMs): one warp per SM runs N straight instructions once;\n"
                "median µs over SMs, then over %d rounds\n", prop.name, prop.multiProcessorCount, kRounds);
    std::printf("  %6s | %7s | %8s | %8s | %8s | %13s\n", "N", "code KB", "warm us", "l2 us", "cold us",
                "cold ns/KB");
    probe.run_case<1024>();
    probe.run_case<4096>();
    probe.run_case<16384>();
  });
}
