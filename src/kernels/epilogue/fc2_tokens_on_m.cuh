// Epilogue role of FC2 in the grouped GEMM's tokens-on-M layout (mma/tokens_on_m_mainloop.cuh):
// each routed row's expert output to its bf16 slot row (the deterministic combine reduces them
// later) or, weighted, into the fp32 output accumulator, as the swapAB epilogue
// (epilogue/fc2_combine.cuh) does from the other fragment layout. A thread holds rows r and r + 8
// of the tile and, in each n128 half it holds (both, or one on a short tile: the mainloop says
// which), two adjacent channels per 8-channel group; after a quad transpose it stores one whole
// group per row: 16 bytes.
#pragma once

#include <cute/tensor.hpp>

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/epilogue/gemm_op.hpp"
#include "kernels/epilogue/quad_transpose.cuh"
#include "kernels/scheduler/grouped_tile_scheduler.cuh"

namespace megamoe::kernels::gemm_detail {

// The slots (token * k + j) of this thread's two rows, loaded when the tile starts so that the
// global round trip overlaps the mainloop; 0 for padding rows (whose pool_slot is unset).
struct Fc2RowSlots {
  int slot[2];

  template <class Params>
  __device__ __forceinline__ void load(const Params& p, const GroupedTile& tile, int base_row) {
#pragma unroll
    for (int v1 = 0; v1 < 2; ++v1) {
      const int row = base_row + 8 * v1;
      slot[v1] = row < tile.valid_rows ? p.pool_slot[tile.pool_row + row] : 0;
    }
  }
};

// kHeld halves of the tile's channels, the i-th in accumulator i (`first`, then `second`), which
// is channel half first_half + i of the tile.
template <class Config, int kHeld, class Params, class Accumulators>
__device__ __forceinline__ void fc2_tokens_on_m_epilogue(const Params& p, const GroupedTile& tile,
                                                         const Accumulators& first, const Accumulators& second,
                                                         int first_half, int base_row, int base_col,
                                                         const Fc2RowSlots& slots) {
  static_assert(kHeld == 1 || kHeld == 2, "one or both n128 halves");
  constexpr int kHalfChannels = Config::kBlockM / 2;
  constexpr int kColGroups = kHalfChannels / 8;
  const int quad_lane = base_col / 2;
  auto store_half = [&](const Accumulators& acc, int half) {
    const int half_channel = tile.channel_block * Config::kBlockM + half * kHalfChannels;
#pragma unroll
    for (int v1 = 0; v1 < 2; ++v1) {
      const bool valid = base_row + 8 * v1 < tile.valid_rows;  // the same for the whole quad
      const int slot = slots.slot[v1];
      if constexpr (Config::kGemmOp == GemmOp::fc2_atomic_combine) {
        if (!valid) continue;
        const float weight = p.routed_weights[slot];
        float* y_row = p.y_accumulator + static_cast<size_t>(slot / p.top_k) * p.out_channels;
#pragma unroll
        for (int v2 = 0; v2 < kColGroups; ++v2) {
          const int channel = half_channel + 8 * v2 + base_col;  // even, out_channels a multiple of 64
          if (channel >= p.out_channels) continue;
          atomicAdd(y_row + channel, weight * acc(cute::make_coord(0, v1, v2), 0, 0));
          atomicAdd(y_row + channel + 1, weight * acc(cute::make_coord(1, v1, v2), 0, 0));
        }
      } else {
        __nv_bfloat16* slot_row = p.slot_row(slot);
#pragma unroll
        for (int g = 0; g < kColGroups; g += 4) {
          uint32_t x[4];
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            x[j] = bf16x2_bits(acc(cute::make_coord(0, v1, g + j), 0, 0), acc(cute::make_coord(1, v1, g + j), 0, 0));
          }
          transpose_quad(x, quad_lane);
          // out_channels is a multiple of 64: a group of 8 channels is all in or all out.
          const int channel = half_channel + 8 * (g + quad_lane);
          if (valid && channel < p.out_channels) {
            *reinterpret_cast<uint4*>(slot_row + channel) = make_uint4(x[0], x[1], x[2], x[3]);
          }
        }
      }
    }
  };
  store_half(first, first_half);
  if constexpr (kHeld == 2) store_half(second, first_half + 1);
}

}  // namespace megamoe::kernels::gemm_detail
