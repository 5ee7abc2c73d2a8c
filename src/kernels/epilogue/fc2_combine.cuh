// Epilogue role of the FC2 grouped GEMM: each routed row's expert output to its slot row (the
// deterministic combine reduces them later) or, weighted, into the fp32 output accumulator.
#pragma once

#include <cute/tensor.hpp>

#include <cuda_bf16.h>

#include "kernels/epilogue/gemm_op.hpp"
#include "kernels/scheduler/grouped_tile_scheduler.cuh"

namespace megamoe::kernels::gemm_detail {

// The slots (token * k + j) of an FC2 tile's pool rows, loaded when the tile starts, so that the
// global round trip overlaps the mainloop instead of delaying the epilogue, during which no stage
// is released and the weight stream stalls. Each lane keeps two of them across the mainloop, the
// columns 2 lane and 2 lane + 1 (8 (lane / 4) + base_col + v0, base_col = 2 (lane % 4)), and the
// epilogue takes each column's from its lane by a shuffle: 16 registers held through the
// mainloop were what made the single kernel's 64-token tiles spill
// (docs/design.md#single-kernel-token-tiles).
template <class Config>
struct Fc2TileSlots {
  static constexpr int kColGroups = Config::kBlockN / 8;
  int slot[2];  // of columns 8 (lane / 4) + base_col + v0; 0 for padding columns

  template <class Params>
  __device__ __forceinline__ void load(const Params& p, const GroupedTile& tile, int base_col, int lane) {
#pragma unroll
    for (int v0 = 0; v0 < 2; ++v0) {
      const int col = 8 * (lane / 4) + base_col + v0;
      slot[v0] = lane / 4 < kColGroups && col < tile.valid_rows ? p.pool_slot[tile.pool_row + col] : 0;
    }
  }
  // Column 8 v2 + base_col + v0's slot, by every lane of the warp at once.
  __device__ __forceinline__ int at(int v2, int v0, int lane) const {
    return __shfl_sync(0xffffffffu, slot[v0], 4 * v2 + lane % 4);
  }
};

// FC2 epilogue: each routed row's expert output goes to its bf16 slot row (deterministic combine)
// or is weighted and added into the fp32 output accumulator (fast combine).
template <class Config, class Params, class Accumulators>
__device__ __forceinline__ void fc2_epilogue(const Params& p, const GroupedTile& tile, Accumulators& acc,
                                             const int (&base_row)[Config::kMBlocks], int base_col, int lane,
                                             const Fc2TileSlots<Config>& slots) {
  constexpr int kColGroups = Config::kBlockN / 8;
  // Per m64 block, once per tile: slot store: this lane holds rows r and r + 8, its neighbour
  // (lane ^ 4) rows r + 1 and r + 9 (or r - 1 and r + 7); one exchange gives each a pair of
  // adjacent channels, so one warp store writes whole 32-byte sectors of four slot rows.
  constexpr int kMBlocks = Config::kMBlocks;
  int row[kMBlocks], pair_channel[kMBlocks];
  bool odd[kMBlocks], stored[kMBlocks];
#pragma unroll
  for (int m = 0; m < kMBlocks; ++m) {
    row[m] = tile.channel_block * Config::kBlockM + base_row[m];
    odd[m] = row[m] & 1;
    pair_channel[m] = odd[m] ? row[m] + 7 : row[m];
    stored[m] = pair_channel[m] < p.out_channels;
  }
#pragma unroll
  for (int v2 = 0; v2 < kColGroups; ++v2)
#pragma unroll
    for (int v0 = 0; v0 < 2; ++v0) {
      const int col = base_col + 8 * v2 + v0;
      const bool valid = col < tile.valid_rows;  // the same in lanes whose lane / 4 differ
      const int slot = slots.at(v2, v0, lane);
      if constexpr (Config::kGemmOp == GemmOp::fc2_atomic_combine) {
        if (!valid) continue;
        const float weight = p.routed_weights[slot];
        float* y_row = p.y_accumulator + static_cast<size_t>(slot / p.top_k) * p.out_channels;
#pragma unroll
        for (int m = 0; m < kMBlocks; ++m)
#pragma unroll
          for (int v1 = 0; v1 < 2; ++v1) {
            const int channel = row[m] + 8 * v1;
            if (channel < p.out_channels) atomicAdd(y_row + channel, weight * acc(cute::make_coord(v0, v1, v2), m, 0));
          }
      } else {
        __nv_bfloat16* slot_row = p.slot_row(slot);
#pragma unroll
        for (int m = 0; m < kMBlocks; ++m) {
          const float at_r = acc(cute::make_coord(v0, 0, v2), m, 0), at_r8 = acc(cute::make_coord(v0, 1, v2), m, 0);
          const float received = __shfl_xor_sync(0xffffffffu, odd[m] ? at_r : at_r8, 4);
          const __nv_bfloat162 pair =
              odd[m] ? __floats2bfloat162_rn(received, at_r8) : __floats2bfloat162_rn(at_r, received);
          if (valid && stored[m]) *reinterpret_cast<__nv_bfloat162*>(slot_row + pair_channel[m]) = pair;
        }
      }
    }
}

}  // namespace megamoe::kernels::gemm_detail
