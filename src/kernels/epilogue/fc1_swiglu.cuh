// Epilogue role of the FC1 grouped GEMM: SwiGLU in registers, then bf16, per-token-per-128 E4M3
// (fp8_block) or per-tensor E4M3 (fp8_tensor) requantization of the FC2 input.
#pragma once

#include <cute/tensor.hpp>

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/epilogue/gemm_op.hpp"
#include "kernels/layout/gemm_smem.hpp"
#include "kernels/layout/weight_layout.hpp"
#include "kernels/ptx/sync.cuh"
#include "kernels/quant/fp8_block_scale.cuh"
#include "kernels/quant/tensor_amax.cuh"
#include "kernels/scheduler/grouped_tile_scheduler.cuh"

namespace megamoe::kernels::gemm_detail {

// FC1 epilogue: SwiGLU on the gate/up rows r and r+8 that the interleave-by-8 packing put in the
// same thread, then bf16, or E4M3 with one scale per token per 128 channels (the CTA's 256 packed
// rows are exactly 128 channels; the amax is reduced over the math warpgroups through shared
// memory), or E4M3 with FC2's one input scale (fp8_tensor: *p.out_factor is its reciprocal), or,
// with dynamic fp8_tensor scales, bf16 and the amax the encoding pass takes FC2's input scale from.
template <class Config, class Params, class Accumulators>
__device__ __forceinline__ void fc1_swiglu_epilogue(const Params& p, const GroupedTile& tile, Accumulators& acc,
                                                    const int (&base_row)[Config::kMBlocks], int base_col,
                                                    typename Config::SharedStorage& smem, int consumer_thread) {
  constexpr int kColGroups = Config::kBlockN / 8;
  constexpr int kMBlocks = Config::kMBlocks;
  float h[kMBlocks][2][kColGroups];  // [m][v0][v2]
#pragma unroll
  for (int m = 0; m < kMBlocks; ++m)
#pragma unroll
    for (int v2 = 0; v2 < kColGroups; ++v2)
#pragma unroll
      for (int v0 = 0; v0 < 2; ++v0) {
        const float gate = acc(cute::make_coord(v0, 0, v2), m, 0);
        const float up = acc(cute::make_coord(v0, 1, v2), m, 0);
        // Hardware exp2 and approximate reciprocal (one MUFU op each) instead of expf and an IEEE
        // reciprocal, whose refinement and slow path cost more than the rest of SwiGLU; fp32
        // rounding of h is below what the bf16 or E4M3 output keeps. exp(-gate) = inf gives a
        // reciprocal of 0: silu -> -0.
        h[m][v0][v2] = gate * __fdividef(1.0f, 1.0f + __expf(-gate)) * up;
      }

  int channel[kMBlocks];  // the output channel of this thread's gate rows in each m64 block
#pragma unroll
  for (int m = 0; m < kMBlocks; ++m) {
    const int packed_row = tile.channel_block * Config::kBlockM + base_row[m];
    channel[m] = layout::original_w13_row(packed_row, p.out_channels);  // a gate row: the channel itself
  }
  auto column = [&](int v0, int v2) { return base_col + 8 * v2 + v0; };

  // bf16 stores (bf16, and fp8_tensor with dynamic scales, whose encoding pass reads them); returns
  // the largest finite magnitude stored, as bf16 bits (quant/tensor_amax.cuh).
  auto store_bf16 = [&] {
    __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out);
    uint32_t magnitude = 0;
#pragma unroll
    for (int m = 0; m < kMBlocks; ++m) {
      if (channel[m] >= p.out_channels) continue;
#pragma unroll
      for (int v2 = 0; v2 < kColGroups; ++v2)
#pragma unroll
        for (int v0 = 0; v0 < 2; ++v0) {
          const int col = column(v0, v2);
          if (col < tile.valid_rows) {
            const __nv_bfloat16 value = __float2bfloat16_rn(h[m][v0][v2]);
            out[static_cast<size_t>(tile.pool_row + col) * p.out_channels + channel[m]] = value;
            magnitude = max(magnitude, finite_bf16_magnitude(__bfloat16_as_ushort(value)));
          }
        }
    }
    return magnitude;
  };

  if constexpr (!Config::kFp8) {
    store_bf16();
  } else {
    // E4M3 codes of this thread's values, each token column's with factor_of(column).
    auto store_codes = [&](auto factor_of) {
      uint8_t* out = static_cast<uint8_t*>(p.out);
#pragma unroll
      for (int v2 = 0; v2 < kColGroups; ++v2)
#pragma unroll
        for (int v0 = 0; v0 < 2; ++v0) {
          const int col = column(v0, v2);
          const float factor = factor_of(col);
          if (col >= tile.valid_rows) continue;
          const size_t row = static_cast<size_t>(tile.pool_row + col);
          uint8_t* token_out = out + row * p.out_channels;  // one address per token, a store per m64 block
#pragma unroll
          for (int m = 0; m < kMBlocks; ++m) token_out[channel[m]] = encode_e4m3(h[m][v0][v2] * factor);
        }
    };
    if constexpr (Config::kTensorScales) {
      if (p.out_amax != nullptr) {
        publish_amax(p.out_amax, store_bf16());
      } else {
        const float factor = *p.out_factor;
        store_codes([&](int) { return factor; });
      }
      return;
    }
    // Each token's amax over the tile's 128 channels, in three steps: within a warp (lanes with
    // equal lane % 4 hold the same columns, 8 rows each), then one thread per column over the
    // warps' partials, which also turns the amax into the token's scale (stored once, coalesced)
    // and encoding factor, then every thread reads the factors of its own columns. (Each thread
    // computing the scales of its 2 x N/8 columns itself was two IEEE divisions per column in
    // every thread holding it.)
    const int warp = consumer_thread / 32, lane = consumer_thread % 32;
    constexpr int kTokenFactorRow = layout::kGemmConsumerWarps;
#pragma unroll
    for (int v2 = 0; v2 < kColGroups; ++v2)
#pragma unroll
      for (int v0 = 0; v0 < 2; ++v0) {
        float a = fabsf(h[0][v0][v2]);
#pragma unroll
        for (int m = 1; m < kMBlocks; ++m) a = fmaxf(a, fabsf(h[m][v0][v2]));
#pragma unroll
        for (int offset = 4; offset < 32; offset *= 2) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, offset));
        if (lane < 4) smem.amax_exchange[warp][column(v0, v2)] = a;
      }
    ptx::named_barrier_sync(static_cast<uint32_t>(NamedBarrier::kEpilogueExchange), Config::kConsumerThreads);
    if (consumer_thread < Config::kBlockN) {
      float a = smem.amax_exchange[0][consumer_thread];
#pragma unroll
      for (int w = 1; w < layout::kGemmConsumerWarps; ++w) a = fmaxf(a, smem.amax_exchange[w][consumer_thread]);
      const BlockScale s = block_scale(a, p.ue8m0);
      smem.amax_exchange[kTokenFactorRow][consumer_thread] = s.factor;
      if (consumer_thread < tile.valid_rows)
        p.out_scales[static_cast<size_t>(tile.channel_block) * p.pool_rows + tile.pool_row + consumer_thread] = s.scale;
    }
    ptx::named_barrier_sync(static_cast<uint32_t>(NamedBarrier::kEpilogueExchange), Config::kConsumerThreads);
    store_codes([&](int col) { return smem.amax_exchange[kTokenFactorRow][col]; });
    // The exchange buffer is rewritten by the next tile's epilogue.
    ptx::named_barrier_sync(static_cast<uint32_t>(NamedBarrier::kEpilogueExchange), Config::kConsumerThreads);
  }
}

}  // namespace megamoe::kernels::gemm_detail
