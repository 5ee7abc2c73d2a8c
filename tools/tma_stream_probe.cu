// megamoe-tma-probe: how fast TMA streams the grouped GEMM's weight tiles when nothing else runs.
//
// Each CTA walks weight tiles the way sm90_grouped_gemm_swapab_kernel does (a tile is 256
// channels of one expert; for each, every 128-byte K block in turn) through a ring of stages,
// and one consumer lane only waits for each stage and hands it back, after an optional spin that
// stands in for the math. The question it answers: is a CTA's stream bound by the stages it keeps
// in flight (latency), by HBM, or by how the weights sit in memory? Two layouts:
//   rows   weights [E][rows][K] (what the layer uses): a stage is 256 rows of 128 bytes at a
//          stride of K bytes
//   tiles  each stage's 256 x 128 bytes stored contiguously (32 KiB)
// L2 is scrubbed before each timed call. A last case streams weights that fit in L2, every tile
// read by many CTAs: what the L2 delivers to the SMs through TMA. A decode case streams the 32
// tiles of one token's eight experts once, each tile's K blocks split over 1, 2 or 4 CTAs (split-K
// over more of the SMs, without the math or the reduction): the question is whether a tile's
// stream is paced per CTA, so that more CTAs per tile finish sooner; a second streams the bytes of
// one token's FC1 and FC2 weights together, beside the same launch with no tile. Prints one line
// per case: µs, GB/s of the whole grid and per CTA.
#include <cute/tensor.hpp>

#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/float8.h>

#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "buffer_reader.cuh"
#include "device_timing.hpp"
#include "probe_main.hpp"
#include "kernels/cuda_check.hpp"
#include "kernels/ptx/mbarrier.cuh"
#include "kernels/pipeline/pipeline_state.cuh"

namespace megamoe::bench {
namespace {

using namespace cute;
using Element = cutlass::float_e4m3_t;

constexpr int kTileRows = 256;
constexpr int kBlockBytes = 128;
constexpr int kStageBytes = kTileRows * kBlockBytes;
constexpr int kMaxStages = 6;
constexpr int kTilesPerCta = 8;  // for grids too small to cover every tile
constexpr Replays kCalls{3, 20};

using SmemLayout = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                          Shape<Int<kTileRows>, Int<kBlockBytes>, Int<kMaxStages>>{}));
using BoxShape = Shape<Int<kTileRows>, Int<kBlockBytes>>;

enum class WeightOrder { rows, tiles };

struct Shape3 {
  const char* name;
  int rows;     // channels per expert
  int k_bytes;  // K, one byte per fp8 element
  int experts;
};

struct SmemStorage {
  alignas(1024) ArrayEngine<Element, cosize_v<SmemLayout>> stages;
  uint64_t full[kMaxStages];
  uint64_t empty[kMaxStages];
};

template <class Tma>
__global__ void __launch_bounds__(64, 1)
    tma_stream_kernel(CUTE_GRID_CONSTANT const Tma tma, WeightOrder order, Shape3 shape, int tiles, int stages,
                      int consumer_spin_cycles, int k_slices) {
  // Work beyond the weights' own tiles wraps around to the first (the L2-resident case).
  extern __shared__ char smem_raw[];
  SmemStorage& smem = *reinterpret_cast<SmemStorage*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      ptx::mbarrier_init(&smem.full[s], 1);
      ptx::mbarrier_init(&smem.empty[s], 1);
    }
    ptx::fence_barrier_init();
  }
  __syncthreads();
  const int channel_blocks = shape.rows / kTileRows;
  // A work item is one K slice of a tile: `slice_blocks` K blocks from `first_block`.
  const int k_blocks = shape.k_bytes / kBlockBytes, slice_blocks = k_blocks / k_slices;
  uint32_t stage = 0, phase = 0;
  auto advance = [&] {
    if (++stage == static_cast<uint32_t>(stages)) {
      stage = 0;
      phase ^= 1;
    }
  };

  if (threadIdx.x == 0) {
    Tensor s = make_tensor(make_smem_ptr(smem.stages.begin()), SmemLayout{});
    const int tile_rows = kTileRows, block_bytes = kBlockBytes;  // by value: make_shape takes references
    Tensor m = order == WeightOrder::rows
                   ? tma.get_tma_tensor(make_shape(shape.rows, shape.k_bytes, shape.experts))
                   : tma.get_tma_tensor(make_shape(tile_rows, block_bytes, shape.experts * channel_blocks * k_blocks));
    Tensor g = local_tile(m, BoxShape{}, make_coord(_, _, _));  // (256, 128, m, k, z)
    auto [tg, ts] = tma_partition(tma, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(s), group_modes<0, 2>(g));
    const int weight_tiles = shape.experts * channel_blocks;
    for (int work = blockIdx.x; work < tiles; work += gridDim.x) {
      const int tile = (work / k_slices) % weight_tiles;
      const int expert = tile / channel_blocks, channel_block = tile % channel_blocks;
      const int first_block = (work % k_slices) * slice_blocks;
      for (int kb = first_block; kb < first_block + slice_blocks; ++kb) {
        ptx::wait_parity(&smem.empty[stage], phase ^ 1);
        ptx::mbarrier_arrive_expect_tx(&smem.full[stage], kStageBytes);
        if (order == WeightOrder::rows) {
          copy(tma.with(smem.full[stage]), tg(_, channel_block, kb, expert), ts(_, stage));
        } else {
          copy(tma.with(smem.full[stage]), tg(_, 0, 0, tile * k_blocks + kb), ts(_, stage));
        }
        advance();
      }
    }
  } else if (threadIdx.x == 32) {
    for (int work = blockIdx.x; work < tiles; work += gridDim.x) {
      for (int kb = 0; kb < slice_blocks; ++kb) {
        ptx::wait_parity(&smem.full[stage], phase);
        const long long start = clock64();
        while (clock64() - start < consumer_spin_cycles) {
        }
        ptx::mbarrier_arrive(&smem.empty[stage]);
        advance();
      }
    }
  }
}

template <class Tma>
double time_case(const Tma& tma, WeightOrder order, const Shape3& shape, int grid, int stages, int spin, bool wrap,
                 BufferReader& scrub, cudaStream_t stream, long long* bytes, int k_slices = 1, int decode_tiles = -1) {
  const int total_tiles = shape.experts * (shape.rows / kTileRows);
  int tiles = wrap ? grid * kTilesPerCta : std::min(total_tiles, grid * kTilesPerCta);
  if (decode_tiles >= 0) tiles = decode_tiles * k_slices;  // work items: each tile's slices, once (none: empty)
  *bytes = static_cast<long long>(tiles / k_slices) * shape.k_bytes * kTileRows;
  const int smem_bytes = static_cast<int>(sizeof(SmemStorage)) + 1024;
  auto* kernel = &tma_stream_kernel<Tma>;
  MEGAMOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  return median_ms(
      stream, kCalls,
      [&] {
        kernel<<<grid, 64, smem_bytes, stream>>>(tma, order, shape, tiles, stages, spin, k_slices);
        MEGAMOE_CHECK_LAUNCH("tma_stream_kernel");
      },
      scrub);
}

// `wrap`: every CTA streams kTilesPerCta tiles even when the weights hold fewer (they are then
// read again, from L2 when they fit there).
void run_shape(const Shape3& shape, const std::vector<int>& grids, const std::vector<int>& stage_counts,
               const std::vector<int>& spins, bool wrap, BufferReader& scrub, cudaStream_t stream) {
  const size_t elements = static_cast<size_t>(shape.experts) * shape.rows * shape.k_bytes;
  DeviceBuffer weights(elements);
  MEGAMOE_CUDA_CHECK(cudaMemsetAsync(weights.as<void>(), 0x3C, elements, stream));
  const Element* base = weights.as<const Element>();
  Tensor as_rows = make_tensor(make_gmem_ptr(base), make_shape(shape.rows, shape.k_bytes, shape.experts),
                               make_stride(static_cast<int64_t>(shape.k_bytes), _1{},
                                           static_cast<int64_t>(shape.rows) * shape.k_bytes));
  const int num_boxes = static_cast<int>(elements / kStageBytes);
  Tensor as_tiles = make_tensor(make_gmem_ptr(base), make_shape(kTileRows, kBlockBytes, num_boxes),
                                make_stride(Int<kBlockBytes>{}, _1{}, static_cast<int64_t>(kStageBytes)));
  auto tma_rows = make_tma_atom(SM90_TMA_LOAD{}, as_rows, SmemLayout{}(_, _, 0), BoxShape{});
  auto tma_tiles = make_tma_atom(SM90_TMA_LOAD{}, as_tiles, SmemLayout{}(_, _, 0), BoxShape{});
  std::printf("%s: %d experts x %d channels x K %d (fp8, %.0f MB)\n", shape.name, shape.experts, shape.rows,
              shape.k_bytes, elements / 1e6);
  std::printf("  %-6s %5s %6s %6s %10s %10s %12s\n", "order", "grid", "stages", "spin", "us", "GB/s", "GB/s per CTA");
  for (const WeightOrder order : {WeightOrder::rows, WeightOrder::tiles}) {
    for (const int grid : grids) {
      for (const int stages : stage_counts) {
        for (const int spin : spins) {
          long long bytes = 0;
          const double ms = order == WeightOrder::rows
                                ? time_case(tma_rows, order, shape, grid, stages, spin, wrap, scrub, stream, &bytes)
                                : time_case(tma_tiles, order, shape, grid, stages, spin, wrap, scrub, stream, &bytes);
          const double gbps = bytes / (ms * 1e-3) / 1e9;
          std::printf("  %-6s %5d %6d %6d %10.1f %10.0f %12.1f\n", order == WeightOrder::rows ? "rows" : "tiles", grid,
                      stages, spin, ms * 1e3, gbps, gbps / grid);
          std::fflush(stdout);
        }
      }
    }
  }
}

// One token's tiles (the experts of `shape`, 4 tiles each: eight experts are one qwen35 token's FC1)
// streamed once, each tile's K split over `k_slices` CTAs, a CTA per slice. The first row is the
// same launch with no tile (barrier setup, launch and drain, timed alike), and each row says how
// much longer it took than that: the stream's own time.
void run_decode(const Shape3& shape, const std::vector<int>& slice_counts, const std::vector<int>& spins,
                BufferReader& scrub, cudaStream_t stream) {
  const size_t elements = static_cast<size_t>(shape.experts) * shape.rows * shape.k_bytes;
  DeviceBuffer weights(elements);
  MEGAMOE_CUDA_CHECK(cudaMemsetAsync(weights.as<void>(), 0x3C, elements, stream));
  Tensor as_rows = make_tensor(make_gmem_ptr(weights.as<const Element>()), make_shape(shape.rows, shape.k_bytes, shape.experts),
                               make_stride(static_cast<int64_t>(shape.k_bytes), _1{},
                                           static_cast<int64_t>(shape.rows) * shape.k_bytes));
  auto tma = make_tma_atom(SM90_TMA_LOAD{}, as_rows, SmemLayout{}(_, _, 0), BoxShape{});
  const int tiles = shape.experts * (shape.rows / kTileRows);
  std::printf("%s decode: %d tiles of 256 x %d bytes once (%.1f MB), K split over CTAs; 6 stages\n", shape.name, tiles,
              shape.k_bytes, static_cast<double>(elements) / 1e6);
  std::printf("  %7s %5s %6s %10s %14s %10s %12s\n", "slices", "grid", "spin", "us", "us past empty", "GB/s",
              "GB/s per CTA");
  long long no_bytes = 0;
  const double empty_ms = time_case(tma, WeightOrder::rows, shape, tiles * slice_counts.back(), 6, 0, false, scrub,
                                    stream, &no_bytes, 1, 0);
  std::printf("  %7s %5d %6d %10.1f %14s %10s %12s\n", "empty", tiles * slice_counts.back(), 0, empty_ms * 1e3, "-",
              "-", "-");
  for (const int slices : slice_counts) {
    for (const int spin : spins) {
      long long bytes = 0;
      const int grid = tiles * slices;
      const double ms = time_case(tma, WeightOrder::rows, shape, grid, 6, spin, false, scrub, stream, &bytes, slices, tiles);
      const double gbps = bytes / (ms * 1e-3) / 1e9;
      std::printf("  %7d %5d %6d %10.1f %14.1f %10.0f %12.1f\n", slices, grid, spin, ms * 1e3, (ms - empty_ms) * 1e3,
                  gbps, gbps / grid);
      std::fflush(stdout);
    }
  }
}

}  // namespace
}  // namespace megamoe::bench

int main(int argc, char** argv) {
  using namespace megamoe::bench;
  return run_probe("megamoe-tma-probe", argc, argv, [](const cudaDeviceProp& prop, cudaStream_t stream) {
    BufferReader scrub(stream, 2 * static_cast<size_t>(prop.l2CacheSize), prop.multiProcessorCount);
    const int sms = prop.multiProcessorCount;
    std::printf("%s, %d SMs; L2 scrubbed before each call; median of %d calls\n", prop.name, sms, kCalls.timed);
    // qwen35-a3b's FC1 (2I x H) and FC2 (H x I) weights.
    run_shape({"fc1-like", 1024, 2048, 256}, {1, 8, 32, sms}, {2, 3, 4, 6}, {0, 600}, false, scrub, stream);
    run_shape({"fc2-like", 2048, 512, 256}, {32, sms}, {3, 6}, {0}, false, scrub, stream);
    // One qwen35 token's FC1: 8 experts x 1024 channels x K 2048 (16.8 MB), split-K 1 / 2 / 4.
    run_decode({"fc1-like", 1024, 2048, 8}, {1, 2, 4}, {0, 600}, scrub, stream);
    // The bytes of one qwen35 token's FC1 and FC2 weights together (25.2 MB, as twelve FC1-shaped
    // experts): what one launch would stream if FC2's weights went beside FC1's.
    run_decode({"fc1+fc2-bytes", 1024, 2048, 12}, {1, 2}, {0}, scrub, stream);
    // 16 MB of weights, each tile read by ~33 CTAs: all but the first read hit L2.
    run_shape({"l2-resident", 1024, 2048, 8}, {sms}, {4, 6}, {0}, true, scrub, stream);
  });
}
