// Epilogue role of FC2 in the grouped GEMM's tokens-on-M layout (mma/tokens_on_m_mainloop.cuh):
// each routed row's expert output to its bf16 slot row (the deterministic combine reduces them
// later) or, weighted, into the fp32 output accumulator, as the swapAB epilogue
// (epilogue/fc2_combine.cuh) does from the other fragment layout. A thread holds rows r and r + 8
// of the tile and two adjacent channels per column group: one 4-byte store per group.
#pragma once

#include <cute/tensor.hpp>

#include <cuda_bf16.h>

#include "kernels/epilogue/gemm_op.hpp"
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

template <class Config, class Params, class Accumulators>
__device__ __forceinline__ void fc2_tokens_on_m_epilogue(const Params& p, const GroupedTile& tile,
                                                         const Accumulators& low, const Accumulators& high,
                                                         int base_row, int base_col, const Fc2RowSlots& slots) {
  constexpr int kHalfChannels = Config::kBlockM / 2;
  constexpr int kColGroups = kHalfChannels / 8;
  auto store_half = [&](const Accumulators& acc, int half, int v1) {
    const int slot = slots.slot[v1];
    const int first = tile.channel_block * Config::kBlockM + half * kHalfChannels + base_col;
#pragma unroll
    for (int v2 = 0; v2 < kColGroups; ++v2) {
      const int channel = first + 8 * v2;  // even, and out_channels a multiple of 64: both in or out
      if (channel >= p.out_channels) continue;
      const float at0 = acc(cute::make_coord(0, v1, v2), 0, 0), at1 = acc(cute::make_coord(1, v1, v2), 0, 0);
      if constexpr (Config::kGemmOp == GemmOp::fc2_atomic_combine) {
        const float weight = p.routed_weights[slot];
        float* y_row = p.y_accumulator + static_cast<size_t>(slot / p.top_k) * p.out_channels;
        atomicAdd(y_row + channel, weight * at0);
        atomicAdd(y_row + channel + 1, weight * at1);
      } else {
        __nv_bfloat16* slot_row = static_cast<__nv_bfloat16*>(p.out) + static_cast<size_t>(slot) * p.out_channels;
        *reinterpret_cast<__nv_bfloat162*>(slot_row + channel) = __floats2bfloat162_rn(at0, at1);
      }
    }
  };
#pragma unroll
  for (int v1 = 0; v1 < 2; ++v1) {
    if (base_row + 8 * v1 >= tile.valid_rows) continue;
    store_half(low, 0, v1);
    store_half(high, 1, v1);
  }
}

}  // namespace megamoe::kernels::gemm_detail
