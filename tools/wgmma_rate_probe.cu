// megamoe-wgmma-probe: how fast the grouped GEMM's fp8 mainloop runs on one SM with data that is
// already in L2, by tile shape, and what each part of it costs. It answers whether the math warps'
// ~1000 cycles per K block at large batches (~540 of tensor work: docs/decisions.md#swapab-tile)
// come from the tensor cores, the promotion, or the stage traffic through shared
// memory (wgmma reads both operands from shared memory while the stage copies write it).
//
// Each CTA (one per SM) runs the mainloop's skeleton: a producer thread fills a ring of stages,
// two math warpgroups take each stage (full barrier), issue one wgmma batch per m64 block and
// K block (swapAB: channels on M, tokens on N), wait for it, hand the stage back (empty barrier)
// and, where the case promotes, add the batch into the accumulators with a scale (64 FFMA per
// thread at 256 x 64). Cases, per tile shape:
//   tensor   no copies (the producer arrives without bytes), no promotion: the wgmma batches alone
//   promote  no copies, promotion: the math warps' whole chain
//   copy     bulk copies of each stage's bytes from an L2-resident buffer, no promotion
//   stream   bulk copies of each stage's bytes from an L2-resident buffer, and promotion: the
//            mainloop as the GEMM runs it, minus TMA's swizzle, the scales and the epilogue
//   shared   as stream, in clusters of two CTAs that share the weight block: each copies half of
//            it to both (multicast), so L2 sends it once for two token blocks; a stage is free
//            again once both CTAs' math warps have handed it back
//   coupled  as shared, but each CTA copies the whole weight block itself: what the pairing of
//            the two CTAs' stages costs without the multicast
//   stream-hbm / shared-hbm  as stream / shared (256 x 64 only), the weight blocks read from a
//            buffer far larger than L2 instead, four CTAs on each block at a time (as an expert's
//            four 64-token tiles at 8192 tokens): one from HBM and three from L2 if L2 keeps it.
//            Nsight Compute's dram__bytes_read.sum of the two tells whether multicast loads find
//            each other's lines in L2 (FC1 in pairs read twice the HBM bytes:
//            docs/decisions.md#cta-pairs-sharing-weight-blocks)
// Prints the time per K block and the rate, beside the tile's tensor work at the fp8 peak (4096
// MACs per cycle per SM, dense), per case. 256 x 128 (what the GEMM cannot hold twice in
// registers) runs the cases without promotion only.
#include <cute/tensor.hpp>

#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/float8.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>

#include "device_timing.hpp"
#include "probe_main.hpp"
#include "kernels/cuda_check.hpp"
#include "kernels/pipeline/pipeline_state.cuh"
#include "kernels/ptx/cluster.cuh"
#include "kernels/ptx/cp_async.cuh"
#include "kernels/ptx/mbarrier.cuh"

namespace megamoe::bench {
namespace {

using namespace cute;
using Element = cutlass::float_e4m3_t;

constexpr int kBlockK = 128;             // one 128-byte swizzle row of fp8 per stage, as the GEMM
constexpr int kMathWarpgroups = 2;
constexpr int kThreads = 128 * (1 + kMathWarpgroups);
constexpr int kSmemBudget = 200 * 1024;  // stages, as the GEMM leaves them beside its epilogue
constexpr int kMacsPerCyclePerSm = 4096; // fp8 dense wgmma peak of one SM
constexpr int kKBlocks = 4096;           // per CTA and call
constexpr int kSourceBytes = 8 << 20;    // the copies' source: stays in L2
constexpr Replays kCalls{2, 10};

enum class Case { tensor, promote, copy, stream, shared, coupled, stream_hbm, shared_hbm };
const char* case_name(Case c) {
  const char* names[] = {"tensor", "promote", "copy", "stream", "shared", "coupled", "stream-hbm", "shared-hbm"};
  return names[static_cast<int>(c)];
}
constexpr bool multicasts(Case c) { return c == Case::shared || c == Case::shared_hbm; }
constexpr bool clustered(Case c) { return multicasts(c) || c == Case::coupled; }
constexpr bool from_hbm(Case c) { return c == Case::stream_hbm || c == Case::shared_hbm; }
constexpr bool copies(Case c) { return c == Case::copy || c == Case::stream || clustered(c) || from_hbm(c); }
constexpr bool promotes(Case c) { return c == Case::promote || c == Case::stream || clustered(c) || from_hbm(c); }
// The HBM cases' weights: each group of kCtasPerWeightBlock CTAs walks its own kKBlocks blocks
// (33 groups x 128 MB on an H200), so no two groups read the same bytes.
constexpr size_t kHbmBytes = size_t{8} << 30;
constexpr int kCtasPerWeightBlock = 4;
constexpr int kClusterCtas = 2;  // the shared case

template <int kChannels, int kTokens>
struct ProbeTile {
  static constexpr int kMBlocks = kChannels / (64 * kMathWarpgroups);  // m64 blocks per math warpgroup
  static constexpr int kStageBytes = (kChannels + kTokens) * kBlockK;
  static constexpr int kStages = std::min(8, kSmemBudget / kStageBytes);
  using SmemLayoutA = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                             Shape<Int<kChannels>, Int<kBlockK>, Int<kStages>>{}));
  using SmemLayoutB = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                             Shape<Int<kTokens>, Int<kBlockK>, Int<kStages>>{}));
  using MmaAtom = decltype(GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kTokens>, Int<kBlockK>>,
                                                GMMA::Major::K, GMMA::Major::K>());
  // Warpgroup w owns rows [64 kMBlocks w, 64 kMBlocks (w + 1)), as in the GEMM.
  using PermutationM = Layout<Shape<_64, Int<kMathWarpgroups>, Int<kMBlocks>>, Stride<_1, Int<64 * kMBlocks>, _64>>;
  using TiledMma = decltype(make_tiled_mma(MmaAtom{}, Layout<Shape<Int<kMathWarpgroups>, _1, _1>>{},
                                           Tile<PermutationM, Underscore, Underscore>{}));
  struct SharedStorage {
    alignas(1024) ArrayEngine<Element, cosize_v<SmemLayoutA>> a;
    alignas(1024) ArrayEngine<Element, cosize_v<SmemLayoutB>> b;
    uint64_t full[kStages];
    uint64_t empty[kStages];
  };
  static_assert(kMBlocks >= 1 && kStages >= 3, "a tile the GEMM could run");
};

template <int kChannels, int kTokens, Case kCase>
__global__ void __launch_bounds__(kThreads, 1) wgmma_rate_kernel(const uint8_t* source, const uint8_t* weights,
                                                                 float* sink) {
  using T = ProbeTile<kChannels, kTokens>;
  constexpr int kStages = T::kStages;
  extern __shared__ __align__(1024) char smem_raw[];
  auto& smem = *reinterpret_cast<typename T::SharedStorage*>(smem_raw);
  constexpr int kConsumerWarps = 4 * kMathWarpgroups;
  constexpr bool kShared = clustered(kCase);
  constexpr uint32_t kCtas = kShared ? kClusterCtas : 1;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      ptx::mbarrier_init(&smem.full[s], 1);
      ptx::mbarrier_init(&smem.empty[s], kConsumerWarps * kCtas);
    }
    ptx::fence_barrier_init();
  }
  // The peer's barriers must be initialized before this CTA's multicasts and arrivals reach them.
  if constexpr (kShared) {
    ptx::cluster_sync();
  } else {
    __syncthreads();
  }
  pipeline::PipelineState<kStages> state;

  if (threadIdx.x == 0) {
    // Each CTA copies from its own window of the source, which all CTAs' windows keep in L2 (the
    // HBM cases take the weight block from their group's part of `weights` instead).
    constexpr uint32_t kA = kChannels * kBlockK, kB = kTokens * kBlockK;
    const uint32_t rank = kShared ? ptx::cluster_cta_rank() : 0;
    const uint8_t* window = source + (blockIdx.x * 64 * 1024) % (kSourceBytes - 128 * 1024);
    for (int kb = 0; kb < kKBlocks; ++kb, state.advance()) {
      ptx::wait_parity(&smem.empty[state.stage], state.phase ^ 1);
      if constexpr (copies(kCase)) {
        ptx::mbarrier_arrive_expect_tx(&smem.full[state.stage], kA + kB);
        const uint8_t* from = window + (kb % 8) * 4096;
        const uint8_t* a_from = from;
        if constexpr (from_hbm(kCase)) {
          const size_t block = static_cast<size_t>(blockIdx.x / kCtasPerWeightBlock) * kKBlocks + kb;
          a_from = weights + block * kA % kHbmBytes;
        }
        Element* a = smem.a.begin() + state.stage * kA;
        if constexpr (multicasts(kCase)) {
          const uint32_t half = kA / kCtas;
          ptx::bulk_copy_multicast(a + rank * half, a_from + rank * half, half, &smem.full[state.stage], (1u << kCtas) - 1);
        } else {
          ptx::bulk_copy_to_shared(a, a_from, kA, &smem.full[state.stage]);
        }
        ptx::bulk_copy_to_shared(smem.b.begin() + state.stage * kB, from + kA, kB, &smem.full[state.stage]);
      } else {
        ptx::mbarrier_arrive(&smem.full[state.stage]);
      }
    }
  }
  if (threadIdx.x < 128) {
    // No CTA leaves while its peer may still multicast into it or arrive on its barriers.
    if constexpr (kShared) ptx::cluster_sync();
    return;
  }

  const int consumer_thread = threadIdx.x - 128;
  const int lane = consumer_thread % 32;
  Tensor sA = make_tensor(make_smem_ptr(smem.a.begin()), typename T::SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(smem.b.begin()), typename T::SmemLayoutB{});
  typename T::TiledMma mma;
  ThrMMA thr_mma = mma.get_thread_slice(consumer_thread);
  Tensor tCrA = thr_mma.make_fragment_A(thr_mma.partition_A(sA));
  Tensor tCrB = thr_mma.make_fragment_B(thr_mma.partition_B(sB));
  using TileMN = Shape<Int<kChannels>, Int<kTokens>>;
  Tensor acc = partition_fragment_C(mma, TileMN{});
  Tensor partial = partition_fragment_C(mma, TileMN{});
  clear(acc);
  const float scale = 1.0f + consumer_thread * 1e-7f;
  for (int kb = 0; kb < kKBlocks; ++kb, state.advance()) {
    ptx::wait_parity(&smem.full[state.stage], state.phase);
    auto& out = promotes(kCase) ? partial : acc;
    warpgroup_fence_operand(out);
    warpgroup_arrive();
    mma.accumulate_ = promotes(kCase) ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
    CUTE_UNROLL
    for (int k = 0; k < size<2>(tCrA); ++k) {
      gemm(mma, tCrA(_, _, k, state.stage), tCrB(_, _, k, state.stage), out);
      mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
    warpgroup_wait<0>();
    warpgroup_fence_operand(out);
    __syncwarp();
    if constexpr (kShared) {
      // Lane c hands the stage back to CTA c, side by side.
      if (lane < kCtas) ptx::mbarrier_arrive_cluster(&smem.empty[state.stage], lane);
    } else if (lane == 0) {
      ptx::mbarrier_arrive(&smem.empty[state.stage]);
    }
    if constexpr (promotes(kCase)) {
      CUTE_UNROLL
      for (int i = 0; i < size(acc); ++i) acc(i) += partial(i) * scale;
    }
  }
  // Keeps the accumulators (and so the work) alive; the values mean nothing.
  float sum = 0.0f;
  CUTE_UNROLL
  for (int i = 0; i < size(acc); ++i) sum += acc(i);
  if (sum == 12345.0f) sink[threadIdx.x] = sum;
  if constexpr (kShared) ptx::cluster_sync();
}

template <int kChannels, int kTokens, Case kCase>
void run_case(const uint8_t* source, const uint8_t* weights, float* sink, int sms, cudaStream_t stream) {
  using T = ProbeTile<kChannels, kTokens>;
  const int smem_bytes = static_cast<int>(sizeof(typename T::SharedStorage));
  auto* kernel = &wgmma_rate_kernel<kChannels, kTokens, kCase>;
  MEGAMOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = clustered(kCase) ? kClusterCtas : 1;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = sms / kClusterCtas * kClusterCtas;
  config.blockDim = kThreads;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  config.attrs = &cluster;
  config.numAttrs = 1;
  const double ms = median_ms(stream, kCalls, [&] {
    MEGAMOE_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, source, weights, sink));
    MEGAMOE_CHECK_LAUNCH("wgmma_rate_kernel");
  });
  const int ctas = static_cast<int>(config.gridDim.x);
  const double macs = static_cast<double>(kChannels) * kTokens * kBlockK;  // per K block and CTA
  const double seconds_per_block = ms * 1e-3 / kKBlocks;
  const double tflops = 2.0 * macs * ctas / seconds_per_block / 1e12;
  const double cycles_at_peak = macs / kMacsPerCyclePerSm;
  std::printf("  %3d x %-3d %-8s %d stages %8.3f us per K block %7.1f TFLOP/s  tensor work %5.0f cycles per K block\n",
              kChannels, kTokens, case_name(kCase), T::kStages, seconds_per_block * 1e6, tflops, cycles_at_peak);
}

// A shape whose two fp32 fragments (accumulators and the batch to promote) exceed the math
// warpgroups' registers runs the tensor case only.
template <int kChannels, int kTokens>
void run_shape(const uint8_t* source, const uint8_t* weights, float* sink, int sms, cudaStream_t stream) {
  run_case<kChannels, kTokens, Case::tensor>(source, weights, sink, sms, stream);
  run_case<kChannels, kTokens, Case::copy>(source, weights, sink, sms, stream);
  constexpr int kFragmentRegisters = kChannels * kTokens / (128 * kMathWarpgroups);
  if constexpr (2 * kFragmentRegisters <= 128) {
    run_case<kChannels, kTokens, Case::promote>(source, weights, sink, sms, stream);
    run_case<kChannels, kTokens, Case::stream>(source, weights, sink, sms, stream);
    run_case<kChannels, kTokens, Case::shared>(source, weights, sink, sms, stream);
    run_case<kChannels, kTokens, Case::coupled>(source, weights, sink, sms, stream);
  }
  if constexpr (kChannels == 256 && kTokens == 64) {
    run_case<kChannels, kTokens, Case::stream_hbm>(source, weights, sink, sms, stream);
    run_case<kChannels, kTokens, Case::shared_hbm>(source, weights, sink, sms, stream);
  }
  std::fflush(stdout);
}

}  // namespace
}  // namespace megamoe::bench

int main(int argc, char** argv) {
  using namespace megamoe::bench;
  return run_probe("megamoe-wgmma-probe", argc, argv, [](const cudaDeviceProp& prop, cudaStream_t stream) {
    DeviceBuffer source(kSourceBytes);
    DeviceBuffer hbm_weights(kHbmBytes);
    MEGAMOE_CUDA_CHECK(cudaMemsetAsync(hbm_weights.as<void>(), 0x3C, kHbmBytes, stream));
    DeviceBuffer sink(sizeof(float) * kThreads);
    MEGAMOE_CUDA_CHECK(cudaMemsetAsync(source.as<void>(), 0x3C, kSourceBytes, stream));
    const int sms = prop.multiProcessorCount;
    std::printf("%s, %d SMs, one CTA each (an even count), %d K blocks per CTA and call, median of %d calls\n",
                prop.name, sms, kKBlocks, kCalls.timed);
    std::printf("  tile (channels x tokens), case, stages, time per K block, rate, the tile's tensor work at peak\n");
    const uint8_t* src = source.as<const uint8_t>();
    const uint8_t* weights = hbm_weights.as<const uint8_t>();
    float* out = sink.as<float>();
    run_shape<256, 16>(src, weights, out, sms, stream);
    run_shape<256, 32>(src, weights, out, sms, stream);
    run_shape<256, 64>(src, weights, out, sms, stream);
    run_shape<128, 128>(src, weights, out, sms, stream);
    run_shape<256, 128>(src, weights, out, sms, stream);
  });
}
