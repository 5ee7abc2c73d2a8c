// How the grouped GEMMs number their work, shared by the device scheduler
// (grouped_tile_scheduler.cuh) and the CPU tests: each expert's pool segment, and the tile a
// linear index names.
//
// Work is (expert, channel block, token tile). Tiles are numbered expert by expert; inside an
// expert the channel block is the slow index and the token tile the fast one, so CTAs running at
// the same time read the same weight tile and all but the first find it in L2. CTA pairs
// (weight multicast) number an expert's short last tiles after its full ones (TileOrder), so that
// the pairs' tiles 2u and 2u + 1 are alike.
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
  int alone_in_pair;    // CTA pairs: set by the weight producer where the pair's other tile is past
                        // the last one (an odd tile count), so this tile's stages go back to its
                        // own CTA only (docs/decisions.md#weight-multicast-pairs); 0 from number_tile
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

// Whether a tile holding `valid_rows` routed rows is one subtile high: an expert's short last
// tile, where a token tile travels in more than one subtile.
MEGAMOE_HOST_DEVICE constexpr bool one_subtile_high(int valid_rows, int token_tile_rows) {
  const int subtile_rows = layout::gemm_token_subtile(token_tile_rows);
  return subtile_rows < token_tile_rows && valid_rows <= subtile_rows;
}

// Token subtiles a tile loads and multiplies: one for an expert's short last tile, else all.
MEGAMOE_HOST_DEVICE constexpr int tile_subtiles(const GroupedTile& tile, int token_tile_rows) {
  return one_subtile_high(tile.valid_rows, token_tile_rows)
             ? 1
             : token_tile_rows / layout::gemm_token_subtile(token_tile_rows);
}

// An expert's token tiles of full height (all but a short last one of one subtile), from its
// routed rows.
MEGAMOE_HOST_DEVICE constexpr int expert_full_tiles(int routed_rows, int token_tile_rows) {
  const int tiles = expert_segment(routed_rows, token_tile_rows).token_tiles;
  const bool short_last = tiles > 0 && one_subtile_high(routed_rows - (tiles - 1) * token_tile_rows, token_tile_rows);
  return short_last ? tiles - 1 : tiles;
}

// The order of an expert's tiles in the numbering. block_major: channel block slow, token tile
// fast. short_tiles_last, for CTA pairs: each channel block's full tiles in the same order, then
// the expert's short last tiles (half a full tile's rows and MACs), one per channel block. A
// pair moves at its slower tile's pace, and in block-major order global parity pairs a short
// tile with a full one wherever an expert's tile count is odd or its last tile short
// (docs/decisions.md#weight-multicast-pairs).
enum class TileOrder { block_major, short_tiles_last };

// Whether a CTA pair's two tiles (2u and 2u + 1 of the short_tiles_last numbering below) multiply
// the same weight block, which the pair then loads once for both by multicast; else each CTA loads
// its own (docs/decisions.md#weight-multicast-pairs). From either CTA's own tile (`cta_rank` 0
// holds 2u, 1 holds 2u + 1) and its expert's full tiles: a channel block's full tiles are
// consecutive, token tile fastest, so the other tile shares the block unless this one is the
// block's last (CTA 0) or first (CTA 1) full tile; a short tile has no neighbour of its block.
MEGAMOE_HOST_DEVICE constexpr bool pair_shares_weights(const GroupedTile& tile, int cta_rank, int full_tiles) {
  if (tile.token_tile >= full_tiles) return false;  // the short last tile
  return cta_rank == 0 ? tile.token_tile + 1 < full_tiles : tile.token_tile > 0;
}

// The expert of every token tile, in token_tile_prefix's numbering (token tiles of the experts
// before each expert): the routing scan writes it, one expert's run per thread, so that finding a
// tile's expert is one load instead of a binary search over the prefix (a chain of ~log2(E)
// dependent loads, microseconds when the tables are not yet in L1). There are at most as many
// token tiles as routed rows, since each tile holds at least one.
MEGAMOE_HOST_DEVICE inline void mark_expert_token_tiles(int expert, int first_token_tile, int token_tiles,
                                                        int32_t* token_tile_expert) {
  for (int t = 0; t < token_tiles; ++t) token_tile_expert[first_token_tile + t] = expert;
}

// The tile with linear index `linear` (0 <= linear < token_tile_prefix[E] * channel_blocks), from
// the experts' token tiles, the exclusive prefix sums of their segments (token tiles and rows) and
// their routed rows. Tiles are numbered expert by expert, in either order, so linear /
// channel_blocks is the token tile whose expert owns the tile: expert e's tiles are
// [prefix[e] * channel_blocks, prefix[e + 1] * channel_blocks).
template <TileOrder kOrder = TileOrder::block_major>
MEGAMOE_HOST_DEVICE MEGAMOE_FORCEINLINE GroupedTile number_tile(int linear, const int32_t* token_tile_expert,
                                                   const int32_t* token_tile_prefix, const int32_t* expert_offsets,
                                                   const int32_t* expert_rows, int channel_blocks, int token_tile_rows) {
  const int expert = token_tile_expert[linear / channel_blocks];
  const int first = token_tile_prefix[expert] * channel_blocks;
  const int tiles_of_expert = token_tile_prefix[expert + 1] - token_tile_prefix[expert];
  const int local = linear - first;
  GroupedTile t;
  t.expert = expert;
  if constexpr (kOrder == TileOrder::block_major) {
    t.channel_block = local / tiles_of_expert;
    t.token_tile = local % tiles_of_expert;
  } else {
    const int full_tiles = expert_full_tiles(expert_rows[expert], token_tile_rows);
    const bool full = local < full_tiles * channel_blocks;  // then full_tiles > 0
    t.channel_block = full ? local / full_tiles : local - full_tiles * channel_blocks;
    t.token_tile = full ? local % full_tiles : tiles_of_expert - 1;
  }
  t.pool_row = expert_offsets[expert] + t.token_tile * token_tile_rows;
  const int remaining = expert_rows[expert] - t.token_tile * token_tile_rows;
  t.valid_rows = remaining < token_tile_rows ? remaining : token_tile_rows;
  t.expert_token_tiles = tiles_of_expert;
  t.alone_in_pair = 0;
  return t;
}

}  // namespace megamoe::kernels
