// megamoe-combine-probe: what the deterministic combine costs alone, on the same rows: the question
// is how close the single kernel's combine share (one CTA a SM, its rows staged in the idle stage
// ring) comes to the combine kernel, and what the share's thread count gives.
//   combine_kernel   the five kernels' combine: 256-thread blocks, a vector (8 channels) a
//                    thread, its rows in registers
//   share, 256       combine_share (16-byte cp.async of each vector's rows into the staging,
//                    several vectors a thread deep) on the 256 math threads of a 384-thread block,
//                    one block a SM
//   share, 384       the same on every thread of the block (what the single kernel runs where that
//                    spreads the work and the staging holds top_k rows for each:
//                    combine_share_threads)
// The staging is what the single kernel's stage ring gives at the 128-token tile. Cases: top-8 at
// the large-batch points of the three named workloads (2048 tokens of hidden 2048, 8192 of 2048,
// 8192 of 7168); one slot in 16 routes nowhere and one token in 97 uses no slot. Two states before
// each timed call: L2 scrubbed, and the slot rows rewritten by a device copy (the last L2's worth
// of them dirty there, as FC2 leaves them). Every output is poisoned before the call and compared
// bit for bit with the combine kernel's. Prints µs (median over the calls) and the GB/s of slot
// rows read and output written.
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "buffer_reader.cuh"
#include "device_timing.hpp"
#include "probe_main.hpp"
#include "kernels/combine/combine_share.cuh"
#include "kernels/combine/combine_slots.cuh"
#include "kernels/cuda_check.hpp"
#include "kernels/layout/gemm_smem.hpp"

namespace megamoe::bench {
namespace {

using namespace megamoe::kernels;

constexpr int kBlockThreads = 384;  // the forward block: a producer warpgroup, two math warpgroups
constexpr int kMathThreads = 256;
constexpr int kTokenTile = layout::kGemmTokensOnMTile;
// The single kernel's stage ring at the 128-token tile (fp8_block): its weight and token stages.
constexpr int kStagingBytes = layout::gemm_stages(kTokenTile, true, layout::kSm90SmemPerBlockOptin) *
                              (layout::kGemmChannelTile + kTokenTile) * layout::kGemmKBytes;
constexpr Replays kReplays{3, 15};

struct Case {
  const char* name;
  int tokens;
  int top_k;
  int hidden;
};

enum class Mechanism { combine_kernel, share_math_threads, share_all_threads };
constexpr const char* kMechanismNames[] = {"combine_kernel", "share, 256", "share, 384"};

// The single kernel's combine share, every FC2 tile already stored, by the last kThreads threads.
// The count is a template argument: as a kernel argument ptxas 13.0 compiled the share's cp.async
// into the form the GPU refuses (docs/decisions.md#cpasync-with-an-l2-policy).
template <int kThreads>
__global__ void __launch_bounds__(kBlockThreads, 1) share_kernel(CombineParams p, const uint32_t* stored) {
  extern __shared__ __align__(1024) char smem[];
  const int thread = static_cast<int>(threadIdx.x) - (kBlockThreads - kThreads);
  if (thread < 0) return;
  combine_share<true>(p, stored, 1u, thread, kThreads, Timeline{}, CombineStaging{smem, kStagingBytes}, [] {});
}

// Slot rows of uniform values in [-1, 1), from a hash of their index.
__global__ void fill_rows_kernel(__nv_bfloat16* rows, size_t count, uint32_t seed) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 0x9E3779B1u ^ static_cast<uint32_t>(i >> 32) ^ seed;
    h ^= h >> 15, h *= 0x85EBCA77u, h ^= h >> 13, h *= 0xC2B2AE3Du, h ^= h >> 16;
    rows[i] = __float2bfloat16(static_cast<float>(h >> 8) * (2.0f / 16777216.0f) - 1.0f);
  }
}

struct Probe {
  cudaStream_t stream;
  int sms;
  BufferReader& scrub;

  void run_case(const Case& c) {
    const size_t slots = static_cast<size_t>(c.tokens) * c.top_k;
    const size_t row_elements = slots * c.hidden, out_elements = static_cast<size_t>(c.tokens) * c.hidden;
    DeviceBuffer rows(row_elements * sizeof(__nv_bfloat16)), pristine(rows.bytes());
    DeviceBuffer out(out_elements * sizeof(__nv_bfloat16)), ids(slots * sizeof(int32_t)), weights(slots * sizeof(float));
    DeviceBuffer stored(sizeof(uint32_t));
    fill_rows_kernel<<<sms * 8, 256, 0, stream>>>(pristine.as<__nv_bfloat16>(), row_elements, 12345u);
    MEGAMOE_CHECK_LAUNCH("fill_rows_kernel");
    MEGAMOE_CUDA_CHECK(cudaMemcpyAsync(rows.as<void>(), pristine.as<void>(), rows.bytes(), cudaMemcpyDeviceToDevice, stream));
    const uint32_t one = 1;
    MEGAMOE_CUDA_CHECK(cudaMemcpyAsync(stored.as<void>(), &one, sizeof(one), cudaMemcpyHostToDevice, stream));
    std::mt19937 rng(7);
    std::vector<int32_t> host_ids(slots);
    std::vector<float> host_weights(slots);
    for (size_t s = 0; s < slots; ++s) {
      const bool unused = rng() % 16 == 0 || (s / c.top_k) % 97 == 0;
      host_ids[s] = unused ? -1 : static_cast<int32_t>(rng() % 256);
      host_weights[s] = std::uniform_real_distribution<float>(0.0f, 0.5f)(rng);
    }
    ids.upload(host_ids);
    weights.upload(host_weights);
    CombineParams p{};
    p.num_tokens = c.tokens;
    p.top_k = c.top_k;
    p.hidden = c.hidden;
    p.routed_ids = ids.as<int32_t>();
    p.routed_weights = weights.as<float>();
    p.slot_outputs = rows.as<__nv_bfloat16>();
    p.y = out.as<__nv_bfloat16>();

    const auto launch = [&](Mechanism m) {
      switch (m) {
        case Mechanism::combine_kernel: {
          const long vectors = static_cast<long>(out_elements / Bf16x8Sum::kChannels);
          combine_kernel<true><<<static_cast<unsigned>((vectors + 255) / 256), 256, 0, stream>>>(p);
          MEGAMOE_CHECK_LAUNCH("combine_kernel");
          break;
        }
        case Mechanism::share_math_threads:
          share_kernel<kMathThreads><<<sms, kBlockThreads, kStagingBytes, stream>>>(p, stored.as<uint32_t>());
          MEGAMOE_CHECK_LAUNCH("share_kernel<256>");
          break;
        case Mechanism::share_all_threads:
          share_kernel<kBlockThreads><<<sms, kBlockThreads, kStagingBytes, stream>>>(p, stored.as<uint32_t>());
          MEGAMOE_CHECK_LAUNCH("share_kernel<384>");
          break;
      }
    };
    const double gigabytes = static_cast<double>(rows.bytes() + out.bytes()) / 1e9;
    std::vector<uint16_t> reference(out_elements), result(out_elements);
    for (const bool dirty : {false, true}) {
      for (const Mechanism m :
           {Mechanism::combine_kernel, Mechanism::share_math_threads, Mechanism::share_all_threads}) {
        const auto prepare = [&] {
          MEGAMOE_CUDA_CHECK(cudaMemsetAsync(out.as<void>(), 0xFF, out.bytes(), stream));  // NaN poison
          if (dirty) {
            MEGAMOE_CUDA_CHECK(
                cudaMemcpyAsync(rows.as<void>(), pristine.as<void>(), rows.bytes(), cudaMemcpyDeviceToDevice, stream));
          } else {
            scrub();
          }
        };
        const double ms = median_ms(stream, kReplays, [&] { launch(m); }, prepare);
        MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
        std::vector<uint16_t>& host = m == Mechanism::combine_kernel ? reference : result;
        MEGAMOE_CUDA_CHECK(cudaMemcpy(host.data(), out.as<void>(), out.bytes(), cudaMemcpyDeviceToHost));
        size_t differ = 0;
        if (m != Mechanism::combine_kernel) {
          for (size_t i = 0; i < out_elements; ++i) differ += reference[i] != result[i];
        }
        std::printf("  %-14s %6d %2d %5d | %-11s | %-14s | %8.1f | %7.0f | %s\n", c.name, c.tokens, c.top_k, c.hidden,
                    dirty ? "rows dirty" : "scrubbed", kMechanismNames[static_cast<int>(m)], ms * 1e3,
                    gigabytes / (ms * 1e-3), differ == 0 ? "same bits" : "DIFFER");
        if (differ != 0) throw std::runtime_error(std::to_string(differ) + " output elements differ from combine_kernel's");
      }
    }
  }
};

}  // namespace
}  // namespace megamoe::bench

int main(int argc, char** argv) {
  using namespace megamoe::bench;
  return run_probe("megamoe-combine-probe", argc, argv, [](const cudaDeviceProp& prop, cudaStream_t stream) {
    for (const auto kernel : {share_kernel<kMathThreads>, share_kernel<kBlockThreads>}) {
      MEGAMOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kStagingBytes));
    }
    BufferReader scrub(stream, 2 * static_cast<size_t>(prop.l2CacheSize), prop.multiProcessorCount);
    Probe probe{stream, prop.multiProcessorCount, scrub};
    std::printf("megamoe-combine-probe on %s (%d SMs): staging %d KB a block; median of %d calls\n", prop.name,
                prop.multiProcessorCount, kStagingBytes / 1024, kReplays.timed);
    std::printf("  %-14s %6s %2s %5s | %-11s | %-14s | %8s | %7s | %s\n", "case", "tokens", "k", "H", "L2 before",
                "mechanism", "us", "GB/s", "vs combine_kernel");
    for (const Case& c : {Case{"qwen35-a3b", 2048, 8, 2048}, Case{"qwen3-30b-a3b", 8192, 8, 2048},
                          Case{"dsv3", 8192, 8, 7168}}) {
      probe.run_case(c);
    }
  });
}
