// Epilogue role of FC1 in the grouped GEMM's tokens-on-M layout (mma/tokens_on_m_mainloop.cuh):
// SwiGLU in registers, then bf16, per-token-per-128 E4M3 (fp8_block) or per-tensor E4M3
// (fp8_tensor; bf16 and an amax with dynamic scales) requantization of the FC2 input, as the
// swapAB epilogue (epilogue/fc1_swiglu.cuh) computes it, from the other fragment layout.
//
// A thread holds rows r and r + 8 of the tile and, in each n128 half it holds, columns 8 v2 + c and
// 8 v2 + c + 1 (c = 2 (lane % 4)). The gate/up interleave by 8 (layout/weight_layout.hpp) makes
// column groups 2j and 2j + 1 the gate and up rows of the same 8 channels, so both halves of every
// SwiGLU pair are in the thread, and the tile's 256 packed columns are the 128 output channels of
// one requantization block. Where a warpgroup holds both halves of its rows, a row's amax is the
// thread's 32 values and two shuffles within its quad of lanes (the lanes holding that row); on a
// short tile the two warpgroups hold one half each of the same rows and trade their halves' amaxes
// through shared memory. A quad transpose (epilogue/quad_transpose.cuh) then gives each lane 8
// whole channels of a row to store: 16 bytes of bf16, 8 of E4M3.
#pragma once

#include <cute/tensor.hpp>

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/epilogue/gemm_op.hpp"
#include "kernels/epilogue/quad_transpose.cuh"
#include "kernels/layout/weight_layout.hpp"
#include "kernels/ptx/sync.cuh"
#include "kernels/quant/fp8_block_scale.cuh"
#include "kernels/quant/tensor_amax.cuh"
#include "kernels/scheduler/grouped_tile_scheduler.cuh"

namespace megamoe::kernels::gemm_detail {

// kHeld halves of the tile's packed columns, the i-th in accumulator i (`first`, then `second`),
// which is half first_half + i. With one held half (warpgroup w holds half w), `row_amax` is the
// [2][64] shared exchange of the two warpgroups (w writes row r of its half at [w][r]); every math
// thread calls.
template <class Config, int kHeld, class Params, class Accumulators>
__device__ __forceinline__ void fc1_swiglu_tokens_on_m_epilogue(const Params& p, const GroupedTile& tile,
                                                                const Accumulators& first, const Accumulators& second,
                                                                int first_half, int base_row, int base_col,
                                                                float* row_amax) {
  static_assert(kHeld == 1 || kHeld == 2, "one or both n128 halves");
  constexpr int kHalfChannels = Config::kBlockM / 2;
  constexpr int kPairs = kHalfChannels / 16;  // SwiGLU column-group pairs (8 output channels each) per half
  static_assert(kPairs % 4 == 0, "whole quad transposes");
  constexpr int kExchangeRows = Config::kTokenSubtile;  // a short tile's rows: SharedStorage::amax_exchange's rows
  const int quad_lane = base_col / 2;
  float h[kHeld][kPairs][2][2];  // [held half][pair][v1][v0]
  auto swiglu = [&](const Accumulators& acc, int held) {
#pragma unroll
    for (int j = 0; j < kPairs; ++j)
#pragma unroll
      for (int v1 = 0; v1 < 2; ++v1)
#pragma unroll
        for (int v0 = 0; v0 < 2; ++v0) {
          const float gate = acc(cute::make_coord(v0, v1, 2 * j), 0, 0);
          const float up = acc(cute::make_coord(v0, v1, 2 * j + 1), 0, 0);
          // The swapAB epilogue's formula (see there), so both layouts give the same bits.
          h[held][j][v1][v0] = gate * __fdividef(1.0f, 1.0f + __expf(-gate)) * up;
        }
  };
  swiglu(first, 0);
  if constexpr (kHeld == 2) swiglu(second, 1);
  // The first of the 8 output channels of pair j of half `half` (a gate row: the channel itself).
  auto pair_channel = [&](int half, int j) {
    return layout::original_w13_row(tile.channel_block * Config::kBlockM + half * kHalfChannels + 16 * j,
                                    p.out_channels);
  };
  // Pairs g..g+3 of held half `held` in row v1, one 32-bit word each by `pack`, transposed so that
  // this lane holds pair g + quad_lane whole; `store` gets its first channel and the four words.
  auto transpose_and_store = [&](int held, int v1, auto pack, auto store) {
#pragma unroll
    for (int g = 0; g < kPairs; g += 4) {
      uint32_t x[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) x[j] = pack(h[held][g + j][v1][0], h[held][g + j][v1][1]);
      transpose_quad(x, quad_lane);
      store(pair_channel(first_half + held, g + quad_lane), x);
    }
  };

  // bf16 stores (bf16, and fp8_tensor with dynamic scales, whose encoding pass reads them); returns
  // the largest finite magnitude stored, as bf16 bits (quant/tensor_amax.cuh).
  auto store_bf16 = [&] {
    uint32_t magnitude = 0;
#pragma unroll
    for (int v1 = 0; v1 < 2; ++v1) {
      const bool valid = base_row + 8 * v1 < tile.valid_rows;  // the same for the whole quad
      const size_t pool_row = static_cast<size_t>(tile.pool_row + base_row + 8 * v1);
      __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out) + pool_row * p.out_channels;
#pragma unroll
      for (int held = 0; held < kHeld; ++held) {
        transpose_and_store(held, v1, bf16x2_bits, [&](int channel, const uint32_t (&x)[4]) {
          // out_channels is a multiple of 64: a group of 8 channels is all in or all out.
          if (valid && channel < p.out_channels) {
            *reinterpret_cast<uint4*>(out + channel) = make_uint4(x[0], x[1], x[2], x[3]);
#pragma unroll
            for (int i = 0; i < 4; ++i) magnitude = max(magnitude, finite_bf16x2_magnitude(x[i]));
          }
        });
      }
    }
    return magnitude;
  };

  if constexpr (!Config::kFp8) {
    store_bf16();
  } else if (Config::kTensorScales && p.out_amax != nullptr) {
    publish_amax(p.out_amax, store_bf16());
  } else {
    // Row v1's encoding factor: fp8_block's from the row's amax over the tile's 128 channels (whose
    // scale is stored), fp8_tensor's the reciprocal of FC2's input scale.
    float factor[2];
    if constexpr (Config::kTensorScales) factor[0] = factor[1] = *p.out_factor;
    if constexpr (Config::kBlockScales) {
      float amax[2];
#pragma unroll
      for (int v1 = 0; v1 < 2; ++v1) {
        float a = 0.0f;
#pragma unroll
        for (int held = 0; held < kHeld; ++held)
#pragma unroll
          for (int j = 0; j < kPairs; ++j) a = fmaxf(a, fmaxf(fabsf(h[held][j][v1][0]), fabsf(h[held][j][v1][1])));
        a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 1));
        amax[v1] = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 2));
      }
      if constexpr (kHeld == 1) {
        // The other warpgroup holds the other 64 channels of the same rows. The exchange is
        // rewritten only after the tile's publication barrier, which every math thread reaches
        // after its reads.
        const int warpgroup = first_half;
        if (quad_lane == 0) {
          row_amax[warpgroup * kExchangeRows + base_row] = amax[0];
          row_amax[warpgroup * kExchangeRows + base_row + 8] = amax[1];
        }
        ptx::named_barrier_sync(static_cast<uint32_t>(NamedBarrier::kRowAmaxExchanged), Config::kConsumerThreads);
        const float* other = row_amax + (1 - warpgroup) * kExchangeRows;
        amax[0] = fmaxf(amax[0], other[base_row]);
        amax[1] = fmaxf(amax[1], other[base_row + 8]);
      }
#pragma unroll
      for (int v1 = 0; v1 < 2; ++v1) {
        const int row = base_row + 8 * v1;
        const BlockScale s = block_scale(amax[v1], p.ue8m0);
        factor[v1] = s.factor;
        if (row < tile.valid_rows && base_col == 0 && first_half == 0) {  // one writer per row: the holder of half 0
          p.out_scales[static_cast<size_t>(tile.channel_block) * p.pool_rows + tile.pool_row + row] = s.scale;
        }
      }
    }
    // fp8: out_channels is a multiple of 128, so every channel of the block is a real one.
#pragma unroll
    for (int v1 = 0; v1 < 2; ++v1) {
      const int row = base_row + 8 * v1;
      const bool valid = row < tile.valid_rows;
      const size_t pool_row = static_cast<size_t>(tile.pool_row + row);
      uint8_t* out = static_cast<uint8_t*>(p.out) + pool_row * p.out_channels;
      const float f = factor[v1];
      auto encode = [&](float a, float b) -> uint32_t { return encode_e4m3x2(a * f, b * f); };
#pragma unroll
      for (int held = 0; held < kHeld; ++held) {
        transpose_and_store(held, v1, encode, [&](int channel, const uint32_t (&x)[4]) {
          if (valid) *reinterpret_cast<uint2*>(out + channel) = make_uint2(x[0] | x[1] << 16, x[2] | x[3] << 16);
        });
      }
    }
  }
}

}  // namespace megamoe::kernels::gemm_detail
