// The one scheduler of the grouped GEMMs: every role of a CTA walks the same tile sequence, in
// the numbering of tile_numbering.hpp.
//
// CTA b takes tile b first (where b < first_wave); after that each CTA claims the next unclaimed
// tile when it starts one (a global counter), so a CTA that started late (an SM still busy with the
// previous kernel) or streams slowly takes fewer tiles, instead of a fixed round robin in which the
// CTA with one tile more, or the slowest, sets the end of the whole grid. The single-kernel forward
// claims every tile (first_wave 0): there a tile that other tiles wait for must belong to a CTA
// that is running, never to one that has not started (docs/design.md#single-kernel-forward).
// CTA pairs (weight multicast) claim units of two tiles instead: pair c takes tiles 2c and 2c + 1
// first, then its first CTA claims unit u for both, which hold tiles 2u and 2u + 1 of the order
// that numbers an expert's short tiles last (pipeline/pair_claims.cuh,
// docs/decisions.md#weight-multicast-pairs).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/ptx/grid_dependency.cuh"
#include "kernels/ptx/memory.cuh"
#include "kernels/scheduler/tile_numbering.hpp"

namespace megamoe::kernels {

// Lane `source`'s tile in every lane (called by the whole warp): the tile tags and queue entries
// are read by one lane, whose own arrival then orders the read before any rewrite.
__device__ __forceinline__ GroupedTile broadcast_from_lane(const GroupedTile& tile, int source) {
  static_assert(sizeof(GroupedTile) % sizeof(int) == 0 && std::is_trivially_copyable_v<GroupedTile>,
                "a tile travels as ints");
  constexpr int kWords = sizeof(GroupedTile) / sizeof(int);
  int words[kWords];
  memcpy(words, &tile, sizeof tile);
#pragma unroll
  for (int i = 0; i < kWords; ++i) words[i] = __shfl_sync(0xffffffffu, words[i], source);
  GroupedTile out;
  memcpy(&out, words, sizeof out);
  return out;
}

__device__ __forceinline__ GroupedTile broadcast_from_lane0(const GroupedTile& tile) { return broadcast_from_lane(tile, 0); }

struct GroupedTileScheduler {
  const int32_t* token_tile_expert;  // [token tiles]: the expert of each (mark_expert_token_tiles)
  const int32_t* token_tile_prefix;  // [E+1]
  const int32_t* expert_offsets;     // [E+1]
  const int32_t* expert_rows;        // [E]
  int num_experts;
  int channel_blocks;
  int token_tile_rows;
  uint32_t* tiles_claimed;           // [1] tiles claimed past the first wave; zeroed by the routing scan
  int first_wave;                    // tiles taken by CTA index, without a claim (the grid, or 0)

  // One warp starts every line of the per-expert arrays into this SM's L1 at once, so that tile()
  // reads its expert's entries from L1 (the only tile of a tiny batch waits for them before its
  // first TMA load). Lane l touches element 32 l of each array: one element per 128-byte line, and
  // lane 0 also the last one.
  __device__ __forceinline__ void prefetch_to_l1(int lane) const {
    auto touch = [lane](const int32_t* array, int count) {
      constexpr int kIntsPerLine = 32;
      for (int i = lane * kIntsPerLine; i < count; i += 32 * kIntsPerLine) ptx::prefetch_l1(array + i);
      if (lane == 0) ptx::prefetch_l1(array + count - 1);
    };
    touch(token_tile_prefix, num_experts + 1);
    touch(expert_offsets, num_experts + 1);
    touch(expert_rows, num_experts);
  }

  __device__ __forceinline__ int token_tiles() const { return token_tile_prefix[num_experts]; }
  __device__ __forceinline__ int num_tiles() const { return token_tiles() * channel_blocks; }

  // The tile this CTA takes first, and after its current one (may be >= num_tiles(): none left).
  __device__ __forceinline__ int first_tile() const {
    return static_cast<int>(blockIdx.x) < first_wave ? static_cast<int>(blockIdx.x) : claim_next_tile();
  }
  __device__ __forceinline__ int claim_next_tile() const {
    return first_wave + static_cast<int>(atomicAdd(tiles_claimed, 1u));
  }
  // The first tile (2u) of the next unclaimed unit of a CTA pair's two tiles, past the first wave's
  // units (the pairs' first tiles, by CTA index).
  __device__ __forceinline__ int claim_next_unit() const {
    return first_wave + 2 * static_cast<int>(atomicAdd(tiles_claimed, 1u));
  }

  template <TileOrder kOrder = TileOrder::block_major>
  __device__ __forceinline__ GroupedTile tile(int linear) const {
    return number_tile<kOrder>(linear, token_tile_expert, token_tile_prefix, expert_offsets, expert_rows,
                               channel_blocks, token_tile_rows);
  }
  // The full-height token tiles of `expert` (its row count is in L1 after tile()).
  __device__ __forceinline__ int full_tiles(int expert) const {
    return expert_full_tiles(expert_rows[expert], token_tile_rows);
  }
};

// Per-forward counters of the two grouped GEMMs, which the routing scan zeroes: the GEMMs launch
// only after the routing is complete, and the previous forward's GEMMs are complete by then.
struct GemmTileCounters {
  uint32_t* tiles_claimed;   // [2]: FC1's, then FC2's GroupedTileScheduler::tiles_claimed
  uint32_t* fc1_tiles_done;  // [E+1]: FC1 tiles stored per expert, then in all (pipeline/fc1_handoff.cuh)
  uint32_t* fc1_blocks_issued;  // [1]: FC1's weight blocks issued, where counted (producer/weight_producer.cuh)
};

// Padded segment offsets, token-tile prefix and token tiles' experts from the routing counters, by
// one whole block (every thread must call it) once every counter is final (segments as
// expert_segment() pads them). It moves the counters to
// expert_rows and leaves them zero, so each forward (and each graph replay, whole or cut short)
// starts from zero without a memset, and zeroes the GEMMs' counters. Global counters are read from
// L2 (other blocks' atomics wrote them); kSharedCounts: the counters are this block's shared
// memory. `sums` is kThreads / 32 entries of the block's shared memory (each warp's tiles and
// padded rows).
template <int kThreads, bool kSharedCounts = false>
__device__ __forceinline__ void scan_expert_segments(int32_t* expert_counts, int num_experts, int token_tile_rows,
                                                     int32_t* expert_rows, int32_t* expert_offsets,
                                                     int32_t* token_tile_prefix, int32_t* token_tile_expert,
                                                     const GemmTileCounters& gemm, int2* sums) {
  constexpr int kWarps = kThreads / 32;
  static_assert(kThreads % 32 == 0 && kWarps <= 32, "whole warps, one warp's worth of warp sums");
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int2 carry = make_int2(0, 0);
  for (int base = 0; base < num_experts; base += kThreads) {
    const int e = base + threadIdx.x;
    int rows = 0;
    if (e < num_experts) {
      rows = kSharedCounts ? expert_counts[e] : __ldcg(expert_counts + e);
      expert_counts[e] = 0;
      expert_rows[e] = rows;
      gemm.fc1_tiles_done[e] = 0;
    }
    const ExpertSegment segment = expert_segment(rows, token_tile_rows);
    const int2 mine = make_int2(segment.token_tiles, segment.rows);
    // Inclusive scan within the warp by shuffles, then each thread adds the warps before its own:
    // one block barrier per round instead of one per doubling step.
    int2 inclusive = mine;
#pragma unroll
    for (int offset = 1; offset < 32; offset *= 2) {
      const int tiles = __shfl_up_sync(0xffffffffu, inclusive.x, offset);
      const int padded = __shfl_up_sync(0xffffffffu, inclusive.y, offset);
      if (lane >= offset) inclusive = make_int2(inclusive.x + tiles, inclusive.y + padded);
    }
    if (lane == 31) sums[warp] = inclusive;
    __syncthreads();
    int2 before = carry, total = carry;
#pragma unroll 1
    for (int w = 0; w < kWarps; ++w) {
      const int2 warp_sum = sums[w];
      if (w < warp) before = make_int2(before.x + warp_sum.x, before.y + warp_sum.y);
      total = make_int2(total.x + warp_sum.x, total.y + warp_sum.y);
    }
    if (e < num_experts) {
      const int first_token_tile = before.x + inclusive.x - mine.x;
      token_tile_prefix[e] = first_token_tile;
      expert_offsets[e] = before.y + inclusive.y - mine.y;
      mark_expert_token_tiles(e, first_token_tile, segment.token_tiles, token_tile_expert);
    }
    carry = total;
    __syncthreads();  // the warp sums are rewritten next round
  }
  if (threadIdx.x == 0) {
    token_tile_prefix[num_experts] = carry.x;
    expert_offsets[num_experts] = carry.y;
    gemm.tiles_claimed[0] = 0;
    gemm.tiles_claimed[1] = 0;
    gemm.fc1_tiles_done[num_experts] = 0;
    gemm.fc1_blocks_issued[0] = 0;
  }
}

}  // namespace megamoe::kernels
