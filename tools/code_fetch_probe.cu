// megamoe-code-probe: what code that runs once costs when its instructions are not cached.
//
// A one-token forward runs most of its instructions once (the front role, the epilogues, the
// combine), and with the L2 scrubbed, the benchmark method, those instructions come from HBM as
// they run: a router with fewer dependent instructions but twice the SASS routed slower scrubbed
// and faster warm (docs/decisions.md#h200-facts). This probe measures that cost alone. One warp per
// SM runs N straight-line instructions (four independent chains of integer multiply-adds, so
// that issue, not latency, paces them when the code is cached) and counts the SM's cycles from
// the first to the last. Three states of the code, each the median over SMs (one block per SM
// counted), then over the rounds:
//   warm         the same launch just ran (the code in every cache the SM has; 256 KB is more
//                than its instruction caches hold, so there warm is about l2)
//   l2           the code in L2 only (a launch of other code of 256 KB in between evicts it from
//                the SMs' instruction caches)
//   cold         the code in no cache (that other code, then the L2 scrub of the bench tools)
// Every SM runs the same code at once, as a forward's CTAs do, so the first SM's miss fills L2
// for the others: cold is what a KB costs a forward, a lower bound for one SM alone. Prints, per N:
// the code's KB, the three times in µs (cycles at the clock the device reports), and the cycles a
// cold KB costs over warm. For comparison: the single kernel's one-shot files hold ~77 KB of SASS
// (scripts/sass_by_source.py).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "bench_stats.hpp"
#include "buffer_reader.cuh"
#include "device_timing.hpp"
#include "probe_main.hpp"
#include "kernels/cuda_check.hpp"

namespace megamoe::bench {
namespace {

constexpr int kChains = 4;
constexpr int kInstructionBytes = 16;  // one sm_90 instruction
constexpr int kFlushInstructions = 16384;  // 256 KB: more than an SM's instruction caches hold
constexpr int kRounds = 15;

// a * m + k as one instruction: the front end keeps every asm statement, and m and k are kernel
// arguments, so ptxas cannot fold a chain of them into fewer (the SASS holds N IMADs).
__device__ __forceinline__ uint32_t opaque_mad(uint32_t a, uint32_t m, uint32_t k) {
  asm volatile("mad.lo.u32 %0, %0, %1, %2;" : "+r"(a) : "r"(m), "r"(k));
  return a;
}

// The SM this block runs on, for counting one block per SM.
__device__ __forceinline__ uint32_t sm_id() {
  uint32_t id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}

struct BlockTime {
  long long cycles;  // the SM's clock from the first instruction of the chain to the last
  uint32_t sm;
};

// kInstructions multiply-adds in kChains independent chains, all unrolled: kInstructions * 16
// bytes of straight code. kCopy only makes another copy of the same code at another address.
template <int kInstructions, int kCopy>
__global__ void __launch_bounds__(32) straight_code_kernel(uint32_t m, uint32_t k, BlockTime* times, uint32_t* sink) {
  uint32_t chain[kChains];
#pragma unroll
  for (int c = 0; c < kChains; ++c) chain[c] = threadIdx.x + c + kCopy;
  const long long start = clock64();
#pragma unroll
  for (int i = 0; i < kInstructions / kChains; ++i) {
#pragma unroll
    for (int c = 0; c < kChains; ++c) chain[c] = opaque_mad(chain[c], m, k);
  }
  const long long end = clock64();
  if (threadIdx.x == 0 && times != nullptr) times[blockIdx.x] = BlockTime{end - start, sm_id()};
  uint32_t folded = 0;
#pragma unroll
  for (int c = 0; c < kChains; ++c) folded ^= chain[c];
  if (folded == 0x9E3779B9u) sink[0] = folded;  // practically never; the compiler cannot know
}

struct Probe {
  cudaStream_t stream;
  int sms;
  double cycles_per_us;
  BufferReader& scrub;
  DeviceBuffer times, sink;

  template <int kInstructions, int kCopy>
  void launch(bool timed) {
    straight_code_kernel<kInstructions, kCopy><<<sms, 32, 0, stream>>>(3u, 7u, timed ? times.as<BlockTime>() : nullptr,
                                                                       sink.as<uint32_t>());
    MEGAMOE_CHECK_LAUNCH("straight_code_kernel");
  }

  // The median cycles of the last timed launch over the SMs it ran on (the first block of each).
  float median_cycles() {
    std::vector<BlockTime> blocks(sms);
    MEGAMOE_CUDA_CHECK(cudaMemcpyAsync(blocks.data(), times.as<void>(), sms * sizeof(BlockTime),
                                       cudaMemcpyDeviceToHost, stream));
    MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    uint32_t last_sm = 0;
    for (const BlockTime& b : blocks) last_sm = std::max(last_sm, b.sm);
    std::vector<bool> seen(last_sm + 1, false);
    std::vector<float> cycles;
    for (const BlockTime& b : blocks) {
      if (seen[b.sm]) continue;
      seen[b.sm] = true;
      cycles.push_back(static_cast<float>(b.cycles));
    }
    return static_cast<float>(median(cycles));
  }

  template <int kInstructions>
  void run_case() {
    std::vector<float> warm, l2, cold;
    for (int round = 0; round < kRounds; ++round) {
      launch<kInstructions, 0>(false);
      launch<kInstructions, 0>(true);
      warm.push_back(median_cycles());
      launch<kFlushInstructions, 1>(false);
      launch<kInstructions, 0>(true);
      l2.push_back(median_cycles());
      launch<kFlushInstructions, 1>(false);
      scrub();
      launch<kInstructions, 0>(true);
      cold.push_back(median_cycles());
    }
    const double kb = kInstructions * kInstructionBytes / 1024.0;
    const double w = median(warm), l = median(l2), c = median(cold);
    std::printf("  %6d | %7.0f | %8.2f | %8.2f | %8.2f | %15.0f\n", kInstructions, kb, w / cycles_per_us,
                l / cycles_per_us, c / cycles_per_us, (c - w) / kb);
  }
};

}  // namespace
}  // namespace megamoe::bench

int main(int argc, char** argv) {
  using namespace megamoe::bench;
  return run_probe("megamoe-code-probe", argc, argv, [](const cudaDeviceProp& prop, cudaStream_t stream) {
    BufferReader scrub(stream, 2 * static_cast<size_t>(prop.l2CacheSize), prop.multiProcessorCount);
    int clock_khz = 0;
    MEGAMOE_CUDA_CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
    Probe probe{stream, prop.multiProcessorCount, clock_khz / 1000.0, scrub,
                DeviceBuffer(sizeof(BlockTime) * prop.multiProcessorCount), DeviceBuffer(sizeof(uint32_t))};
    std::printf("megamoe-code-probe on %s (%d SMs, %d MHz): one warp per SM runs N straight instructions once;\n"
                "median over SMs, then over %d rounds\n", prop.name, prop.multiProcessorCount, clock_khz / 1000,
                kRounds);
    std::printf("  %6s | %7s | %8s | %8s | %8s | %15s\n", "N", "code KB", "warm us", "l2 us", "cold us",
                "cold cycles/KB");
    probe.run_case<1024>();
    probe.run_case<4096>();
    probe.run_case<16384>();
  });
}
