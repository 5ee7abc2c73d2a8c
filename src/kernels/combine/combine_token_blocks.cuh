// Combine role of the single-kernel forward (docs/design.md#single-kernel-forward): the FC2 tile
// that stores the last of a token's slot rows for a channel block combines that block of the
// token's output itself, so the combine runs beside FC2's other tiles instead of after the last
// of them. The routing sets each (token, channel block) counter to the token's used slots
// (route_token); every FC2 tile, once stored, counts its rows' counters down, and the row whose
// count reaches zero has every slot row of its block stored (or added, for the atomic combine).
// Its warp combines the block, one 8-channel vector per lane, in slot order as combine_kernel
// does, so the output is the five kernels' bit for bit. The counters end at zero: no reset.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/combine/combine_slots.cuh"
#include "kernels/epilogue/gemm_op.hpp"
#include "kernels/layout/gemm_smem.hpp"
#include "kernels/ptx/sync.cuh"
#include "kernels/scheduler/tile_numbering.hpp"

namespace megamoe::kernels {

struct TileCombine {
  CombineParams combine;
  uint32_t* slots_left;  // [T, blocks]: layout::MoeWorkspaceLayout::combine_slots_left; null: no combine here
  int blocks;            // FC2 channel blocks per token
};

// FC2 tiles of at most this many rows carry the combine: the single-kernel forward's. Compiled
// into 64-row tiles, it made FC2's accumulators spill (those tiles run in the per-stage forward).
inline constexpr int kCombineMaxTileRows = 32;

// Tokens a warp combines at once (at most): each batch costs the memory round trips of one token.
inline constexpr int kMaxCombineBatch = 2;

// By every math thread once its part of an FC2 tile is stored. Row r of the tile is counted by
// lane r / warps of warp r mod warps, and that warp combines the blocks its rows complete.
template <bool kDeterministic, int kTileRows, int kMathThreads>
__device__ __forceinline__ void combine_completed_blocks(const TileCombine& c, const int32_t* pool_slot,
                                                         const GroupedTile& tile, int math_thread) {
  constexpr int kWarps = kMathThreads / 32;
  constexpr int kRowsPerWarp = (kTileRows + kWarps - 1) / kWarps;
  constexpr int kBatch = kRowsPerWarp < kMaxCombineBatch ? kRowsPerWarp : kMaxCombineBatch;
  constexpr int kVector = Bf16x8Sum::kChannels;
  static_assert(kRowsPerWarp <= 32 && kRowsPerWarp % kBatch == 0, "a warp's rows fit its lanes, in whole batches");
  static_assert(layout::kGemmChannelTile == 32 * kVector, "a warp's lanes cover one channel block");
  static_assert(kTileRows <= kCombineMaxTileRows, "see kCombineMaxTileRows");
  // Every math thread's stores of the tile come before any count.
  ptx::named_barrier_sync(static_cast<uint32_t>(NamedBarrier::kTileStored), kMathThreads);
  const int warp = math_thread / 32, lane = math_thread % 32;
  const int row = warp + kWarps * lane;
  int token = -1;
  bool last = false;
  if (lane < kRowsPerWarp && row < tile.valid_rows) {
    token = pool_slot[tile.pool_row + row] / c.combine.top_k;
    __threadfence();  // release: this CTA's stores of the tile, ordered before by the barrier
    last = atomicSub(c.slots_left + static_cast<size_t>(token) * c.blocks + tile.channel_block, 1u) == 1u;
    if (last) __threadfence();  // acquire: every other tile's rows of the block
  }
  const uint32_t completed = __ballot_sync(0xffffffffu, last);
  if (completed == 0u) return;
  __syncwarp();  // the counting lanes' acquire orders the whole warp's loads
  const int column = tile.channel_block * layout::kGemmChannelTile + lane * kVector;
#pragma unroll
  for (int first = 0; first < kRowsPerWarp; first += kBatch) {
    int tokens[kBatch], columns[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int t = __shfl_sync(0xffffffffu, token, first + b);
      tokens[b] = ((completed >> (first + b)) & 1u) && column < c.combine.hidden ? t : -1;
      columns[b] = column;
    }
    if (((completed >> first) & ((1u << kBatch) - 1u)) == 0u) continue;
    combine_vectors_at<kDeterministic, kBatch>(c.combine, tokens, columns);
  }
}

}  // namespace megamoe::kernels
