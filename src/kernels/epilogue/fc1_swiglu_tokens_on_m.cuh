// Epilogue role of FC1 in the grouped GEMM's tokens-on-M layout (mma/tokens_on_m_mainloop.cuh):
// SwiGLU in registers, then bf16 or per-token-per-128 E4M3 requantization of the FC2 input, as the
// swapAB epilogue (epilogue/fc1_swiglu.cuh) computes it, from the other fragment layout.
//
// A thread holds rows r and r + 8 of the tile and, in each n128 half, columns 8 v2 + c and
// 8 v2 + c + 1 (c = 2 (lane % 4)). The gate/up interleave by 8 (layout/weight_layout.hpp) makes
// column groups 2j and 2j + 1 the gate and up rows of the same 8 channels, so both halves of every
// SwiGLU pair are in the thread, and the tile's 256 packed columns are the 128 output channels of
// one requantization block: a row's amax is the thread's 32 values and two shuffles within its quad
// of lanes (the lanes holding that row), with no shared memory. Stores are 4 (bf16) or 2 (E4M3)
// bytes per lane (wider ones: docs/decisions.md#tokens-on-m-tile).
#pragma once

#include <cute/tensor.hpp>

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/layout/weight_layout.hpp"
#include "kernels/quant/fp8_block_scale.cuh"
#include "kernels/scheduler/grouped_tile_scheduler.cuh"

namespace megamoe::kernels::gemm_detail {

template <class Config, class Params, class Accumulators>
__device__ __forceinline__ void fc1_swiglu_tokens_on_m_epilogue(const Params& p, const GroupedTile& tile,
                                                                const Accumulators& low, const Accumulators& high,
                                                                int base_row, int base_col) {
  constexpr int kHalfChannels = Config::kBlockM / 2;
  constexpr int kPairs = kHalfChannels / 16;  // SwiGLU column-group pairs per half
  float h[2][kPairs][2][2];                   // [half][pair][v1][v0]
  int channel[2][kPairs];                     // the output channel of v0 = 0
  auto swiglu = [&](const Accumulators& acc, int half) {
#pragma unroll
    for (int j = 0; j < kPairs; ++j) {
      const int packed = tile.channel_block * Config::kBlockM + half * kHalfChannels + 16 * j + base_col;
      channel[half][j] = layout::original_w13_row(packed, p.out_channels);  // a gate row: the channel itself
#pragma unroll
      for (int v1 = 0; v1 < 2; ++v1)
#pragma unroll
        for (int v0 = 0; v0 < 2; ++v0) {
          const float gate = acc(cute::make_coord(v0, v1, 2 * j), 0, 0);
          const float up = acc(cute::make_coord(v0, v1, 2 * j + 1), 0, 0);
          // The swapAB epilogue's formula (see there), so both layouts give the same bits.
          h[half][j][v1][v0] = gate * __fdividef(1.0f, 1.0f + __expf(-gate)) * up;
        }
    }
  };
  swiglu(low, 0);
  swiglu(high, 1);

#pragma unroll
  for (int v1 = 0; v1 < 2; ++v1) {
    const int row = base_row + 8 * v1;
    const bool valid = row < tile.valid_rows;
    const size_t pool_row = static_cast<size_t>(tile.pool_row + row);
    if constexpr (!Config::kFp8) {
      __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out) + pool_row * p.out_channels;
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int j = 0; j < kPairs; ++j) {
          // channel is even and out_channels a multiple of 64: both columns are in or out.
          if (valid && channel[half][j] < p.out_channels) {
            *reinterpret_cast<__nv_bfloat162*>(out + channel[half][j]) =
                __floats2bfloat162_rn(h[half][j][v1][0], h[half][j][v1][1]);
          }
        }
    } else {
      // fp8: out_channels is a multiple of 128, so every channel of the block is a real one.
      float a = 0.0f;
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int j = 0; j < kPairs; ++j) a = fmaxf(a, fmaxf(fabsf(h[half][j][v1][0]), fabsf(h[half][j][v1][1])));
      a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 1));
      a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 2));
      if (!valid) continue;
      const BlockScale s = block_scale(a, p.ue8m0);
      if (base_col == 0) p.out_scales[static_cast<size_t>(tile.channel_block) * p.pool_rows + pool_row] = s.scale;
      uint8_t* out = static_cast<uint8_t*>(p.out) + pool_row * p.out_channels;
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int j = 0; j < kPairs; ++j) {
          *reinterpret_cast<uint16_t*>(out + channel[half][j]) =
              static_cast<uint16_t>(encode_e4m3(h[half][j][v1][0] * s.factor)) |
              static_cast<uint16_t>(encode_e4m3(h[half][j][v1][1] * s.factor)) << 8;
        }
    }
  }
}

}  // namespace megamoe::kernels::gemm_detail
