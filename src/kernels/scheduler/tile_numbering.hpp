// How the grouped GEMMs number their work, shared by the device scheduler
// (grouped_tile_scheduler.cuh) and the CPU tests: each expert's pool segment, and the tile a
// linear index names.
//
// Work is (expert, channel block, token tile). Tiles are numbered expert by expert; inside an
// expert the channel block is the slow index and the token tile the fast one, so CTAs running at
// the same time read the same weight tile and all but the first find it in L2.
#pragma once

#include <cstdint>

#include "kernels/layout/gemm_smem.hpp"
#include "kernels/layout/weight_layout.hpp"

namespace megamoe::kernels {

struct GroupedTile {
  int expert;
  int channel_block;
  int token_tile;       // within the expert
  int pool_row;         // first pool row of the tile
  int valid_rows;       // rows of the tile that hold routed tokens (the rest is padding); a last
                        // tile with at most one subtile of them is one subtile high
  int expert_token_tiles;  // token tiles of the expert
};

// An expert's share of the pool: its token tiles, and its rows padded to the token subtile
// (layout::gemm_token_subtile): whole tiles, then a last tile of one subtile when that holds
// what is left.
struct ExpertSegment {
  int token_tiles;
  int rows;
};

MEGAMOE_HOST_DEVICE constexpr ExpertSegment expert_segment(int routed_rows, int token_tile_rows) {
  const int subtile_rows = layout::gemm_token_subtile(token_tile_rows);
  return ExpertSegment{(routed_rows + token_tile_rows - 1) / token_tile_rows,
                       (routed_rows + subtile_rows - 1) / subtile_rows * subtile_rows};
}

// Token subtiles a tile loads and multiplies: one for an expert's short last tile, else all.
MEGAMOE_HOST_DEVICE constexpr int tile_subtiles(const GroupedTile& tile, int token_tile_rows) {
  const int subtile_rows = layout::gemm_token_subtile(token_tile_rows);
  return subtile_rows < token_tile_rows && tile.valid_rows <= subtile_rows ? 1 : token_tile_rows / subtile_rows;
}

// The tile with linear index `linear` (0 <= linear < token_tile_prefix[E] * channel_blocks), from
// the exclusive prefix sums of the experts' segments (token tiles and rows) and their routed rows.
MEGAMOE_HOST_DEVICE MEGAMOE_FORCEINLINE GroupedTile number_tile(int linear, const int32_t* token_tile_prefix,
                                                   const int32_t* expert_offsets, const int32_t* expert_rows,
                                                   int num_experts, int channel_blocks, int token_tile_rows) {
  // Last expert whose first tile is <= linear (binary search over the prefix of tiles).
  int lo = 0, hi = num_experts - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (token_tile_prefix[mid] * channel_blocks <= linear) lo = mid;
    else hi = mid - 1;
  }
  const int expert = lo;
  const int first = token_tile_prefix[expert] * channel_blocks;
  const int tiles_of_expert = token_tile_prefix[expert + 1] - token_tile_prefix[expert];
  const int local = linear - first;
  GroupedTile t;
  t.expert = expert;
  t.channel_block = local / tiles_of_expert;
  t.token_tile = local % tiles_of_expert;
  t.pool_row = expert_offsets[expert] + t.token_tile * token_tile_rows;
  const int remaining = expert_rows[expert] - t.token_tile * token_tile_rows;
  t.valid_rows = remaining < token_tile_rows ? remaining : token_tile_rows;
  t.expert_token_tiles = tiles_of_expert;
  return t;
}

}  // namespace megamoe::kernels
