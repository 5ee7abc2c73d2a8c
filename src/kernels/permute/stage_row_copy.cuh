// Token role of FC1 when the gather quantizes each token once (GatherParams::rows_by_token): one
// producer warp copies each tile's rows, K block by K block, from x's quantized copy ([T, H], row =
// token) and (fp8_block) its scales into the stage's token block with cp.async, in the layout a TMA
// load of the pool would leave there (K-major, 128-byte swizzle), so the math warps cannot tell the
// two apart.
// The pool of k copies of every row is then never written: the gather writes T rows instead of
// T * k, and FC1 reads rows from a copy k times smaller, which L2 keeps.
//
// Eight lanes copy one row's 128 bytes of a K block (one line, coalesced), four rows per
// instruction. Each lane's copies land on the stage's full barrier through its own arrival
// (cp.async.mbarrier.arrive.noinc), so the barrier expects kArrivals of them.
#pragma once

#include <cstdint>

#include "kernels/pipeline/pipeline_state.cuh"
#include "kernels/ptx/cp_async.cuh"
#include "kernels/ptx/mbarrier.cuh"
#include "kernels/scheduler/grouped_tile_scheduler.cuh"

namespace megamoe::kernels {

// What the row copy reads: x quantized per token (the gather's rows_by_token mode, or the caller's
// quantized x: MoeInputs::x_scales).
struct QuantizedTokenRows {
  const uint8_t* rows;       // e4m3 [T, hidden]
  const float* scales;       // fp8_block: [hidden / 128, scale_stride], token t's scale of K block kb at
                             // kb * stride + t
  int scale_stride;
  const int32_t* pool_slot;  // [pool rows]: slot = token * top_k + j
  int top_k;
  int hidden;
};

template <class Config>
struct StageRowCopy {
  static_assert(Config::kFp8 && Config::kBlockK == 128, "a row's K block is one 128-byte line of e4m3");
  static constexpr int kRows = Config::kBlockN;
  static constexpr int kChunks = 8;                  // 16-byte chunks of a row's K block
  static constexpr int kRowsPerCopy = 32 / kChunks;  // rows one warp instruction copies
  static constexpr int kArrivals = 32;               // one per lane and stage
  static_assert(Config::kTokenSubtile % kRowsPerCopy == 0, "a tile's rows are whole copy instructions");
  static_assert(Config::kSubtiles == 1 || Config::kScaleSubtileStride == Config::kTokenSubtile,
                "a stage's token scales are one row after another");

  // Byte offset of chunk `chunk` of `row` in `stage`'s token block: rows of 128 bytes in atoms of 8
  // rows, each row's chunks permuted by the row's place in its atom (Swizzle<3,4,3>); checked
  // against the CuTe layout the math warps read through.
  __host__ __device__ static constexpr int swizzled_offset(int row, int chunk, int stage) {
    return (stage * kRows + row) * Config::kBlockK + ((chunk ^ (row % 8)) * 16);
  }
  static constexpr bool matches_layout(int row, int chunk, int stage) {
    return swizzled_offset(row, chunk, stage) == typename Config::SmemLayoutB{}(row, 16 * chunk, stage);
  }
  static_assert(matches_layout(0, 0, 0) && matches_layout(5, 3, 1) && matches_layout(kRows - 1, 7, Config::kStages - 1) &&
                    matches_layout(9, 6, 2),
                "the token block's swizzle is the SW128 K-major atom of Config::SmemLayoutB");

  // The whole warp, after FC1's dependency wait. `b` is the stages' token blocks, `token_scales`
  // their scales (stage stride Config::kScaleStageStride, a tile's rows contiguous); `take_tile`
  // (called by lane 0) gives the next tile, expert -1 when none is left.
  template <class TakeTile>
  __device__ __forceinline__ static void run(const QuantizedTokenRows& src, uint8_t* b, float* token_scales,
                                             uint64_t* full, uint64_t* empty, int k_blocks, TakeTile take_tile) {
    const int lane = threadIdx.x % 32;
    const int chunk = lane % kChunks;
    const int row_in_copy = lane / kChunks;
    constexpr int kHalves = (kRows + 31) / 32;
    pipeline::PipelineState<Config::kStages> state;
    for (;;) {
      const GroupedTile tile = broadcast_from_lane0(lane == 0 ? take_tile() : GroupedTile{});
      if (tile.expert < 0) return;
      // The rows the math warps multiply (a short last tile: one subtile); past the routed ones,
      // zeros.
      const int rows = Config::tile_subtiles(tile) * Config::kTokenSubtile;
      // Lane r holds the token of rows r and r + 32, -1 for padding. The gather wrote the table
      // before this grid's dependency wait; read past L1 all the same.
      int token[kHalves];
#pragma unroll
      for (int h = 0; h < kHalves; ++h) {
        const int row = lane + 32 * h;
        token[h] = row < tile.valid_rows ? __ldcg(src.pool_slot + tile.pool_row + row) / src.top_k : -1;
      }
      for (int kb = 0; kb < k_blocks; ++kb, state.advance()) {
        ptx::wait_parity(&empty[state.stage], state.phase ^ 1);
        const uint8_t* block_start = src.rows + static_cast<size_t>(kb) * Config::kBlockK + chunk * 16;
#pragma unroll
        for (int i = 0; i < kRows / kRowsPerCopy; ++i) {
          const int row = i * kRowsPerCopy + row_in_copy;
          if (i * kRowsPerCopy >= rows) break;  // the same in every lane
          const int t = __shfl_sync(0xffffffffu, token[i * kRowsPerCopy / 32], row % 32);
          ptx::cp_async_16_or_zero(b + swizzled_offset(row, chunk, state.stage),
                                   block_start + static_cast<size_t>(t < 0 ? 0 : t) * src.hidden, t >= 0);
        }
        if constexpr (Config::kBlockScales) {
          float* scales = token_scales + state.stage * Config::kScaleStageStride;
          const float* block_scales = src.scales + static_cast<size_t>(kb) * src.scale_stride;
#pragma unroll
          for (int h = 0; h < kHalves; ++h) {
            const int row = lane + 32 * h;
            if (row < rows) {
              ptx::cp_async_4_or_zero(scales + row, block_scales + (token[h] < 0 ? 0 : token[h]), token[h] >= 0);
            }
          }
        }
        ptx::cp_async_mbarrier_arrive_noinc(&full[state.stage]);
      }
    }
  }
};

}  // namespace megamoe::kernels
