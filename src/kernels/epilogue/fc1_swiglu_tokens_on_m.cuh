// Epilogue role of FC1 in the grouped GEMM's tokens-on-M layout (mma/tokens_on_m_mainloop.cuh):
// SwiGLU in registers, then bf16 or per-token-per-128 E4M3 requantization of the FC2 input, as the
// swapAB epilogue (epilogue/fc1_swiglu.cuh) computes it, from the other fragment layout.
//
// A thread holds rows r and r + 8 of the tile and, in each n128 half, columns 8 v2 + c and
// 8 v2 + c + 1 (c = 2 (lane % 4)). The gate/up interleave by 8 (layout/weight_layout.hpp) makes
// column groups 2j and 2j + 1 the gate and up rows of the same 8 channels, so both halves of every
// SwiGLU pair are in the thread, and the tile's 256 packed columns are the 128 output channels of
// one requantization block: a row's amax is the thread's 32 values and two shuffles within its quad
// of lanes (the lanes holding that row), with no shared memory. Rows are stored 16 (bf16) or 8
// (E4M3) bytes per lane after a quad transpose (epilogue/quad_transpose.cuh).
#pragma once

#include <cute/tensor.hpp>

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/epilogue/quad_transpose.cuh"
#include "kernels/layout/weight_layout.hpp"
#include "kernels/quant/fp8_block_scale.cuh"
#include "kernels/scheduler/grouped_tile_scheduler.cuh"

namespace megamoe::kernels::gemm_detail {

template <class Config, class Params, class Accumulators>
__device__ __forceinline__ void fc1_swiglu_tokens_on_m_epilogue(const Params& p, const GroupedTile& tile,
                                                                const Accumulators& low, const Accumulators& high,
                                                                int base_row, int base_col) {
  constexpr int kHalfChannels = Config::kBlockM / 2;
  constexpr int kPairs = kHalfChannels / 16;  // SwiGLU column-group pairs per half: 8 output channels each
  static_assert(kPairs % 4 == 0, "output groups go through the quad transpose four at a time");
  float h[2][kPairs][2][2];                   // [half][pair][v1][v0]
  auto swiglu = [&](const Accumulators& acc, int half) {
#pragma unroll
    for (int j = 0; j < kPairs; ++j)
#pragma unroll
      for (int v1 = 0; v1 < 2; ++v1)
#pragma unroll
        for (int v0 = 0; v0 < 2; ++v0) {
          const float gate = acc(cute::make_coord(v0, v1, 2 * j), 0, 0);
          const float up = acc(cute::make_coord(v0, v1, 2 * j + 1), 0, 0);
          // The swapAB epilogue's formula (see there), so both layouts give the same bits.
          h[half][j][v1][v0] = gate * __fdividef(1.0f, 1.0f + __expf(-gate)) * up;
        }
  };
  swiglu(low, 0);
  swiglu(high, 1);
  // The first output channel of pair j of a half (its gate group's first row, unpacked).
  auto group_channel = [&](int half, int j) {
    return layout::original_w13_row(tile.channel_block * Config::kBlockM + half * kHalfChannels + 16 * j,
                                    p.out_channels);
  };
  const int quad_lane = base_col / 2;

  // Per row, four output groups at a time: each lane's two values of each group, transposed across
  // the quad, so that lane q stores the 8 channels of group 4a + q with one store (16 bytes of
  // bf16, 8 of E4M3). The rows of a quad are the same, so validity is the quad's; invalid rows take
  // part in the shuffles and skip the stores.
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
        for (int a = 0; a < kPairs / 4; ++a) {
          uint32_t parts[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const __nv_bfloat162 pair = __floats2bfloat162_rn(h[half][4 * a + i][v1][0], h[half][4 * a + i][v1][1]);
            parts[i] = reinterpret_cast<const uint32_t&>(pair);
          }
          quad_transpose(parts);
          // out_channels is a multiple of 64: a group of 8 is in or out whole.
          const int channel = group_channel(half, 4 * a + quad_lane);
          if (valid && channel < p.out_channels) {
            *reinterpret_cast<uint4*>(out + channel) = make_uint4(parts[0], parts[1], parts[2], parts[3]);
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
      const BlockScale s = block_scale(a, p.ue8m0);
      if (valid && quad_lane == 0) p.out_scales[static_cast<size_t>(tile.channel_block) * p.pool_rows + pool_row] = s.scale;
      uint8_t* out = static_cast<uint8_t*>(p.out) + pool_row * p.out_channels;
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int g = 0; g < kPairs / 4; ++g) {
          uint32_t parts[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            parts[i] = static_cast<uint32_t>(encode_e4m3(h[half][4 * g + i][v1][0] * s.factor)) |
                       static_cast<uint32_t>(encode_e4m3(h[half][4 * g + i][v1][1] * s.factor)) << 8;
          }
          quad_transpose(parts);
          if (valid) {
            *reinterpret_cast<uint2*>(out + group_channel(half, 4 * g + quad_lane)) =
                make_uint2(parts[0] | parts[1] << 16, parts[2] | parts[3] << 16);
          }
        }
    }
  }
}

}  // namespace megamoe::kernels::gemm_detail
