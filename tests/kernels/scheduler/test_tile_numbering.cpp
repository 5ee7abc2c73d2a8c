#include "kernels/scheduler/tile_numbering.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/layout/moe_workspace.hpp"

namespace megamoe::kernels {
namespace {

// What the routing scan writes (scan_expert_segments), built from the same expert_segment() and
// mark_expert_token_tiles().
struct Segments {
  std::vector<int32_t> rows;               // routed rows per expert
  std::vector<int32_t> token_tile_prefix;  // [E+1]
  std::vector<int32_t> offsets;            // [E+1]
  std::vector<int32_t> token_tile_expert;  // [token tiles]
};

Segments segments_for(const std::vector<int32_t>& rows, int token_tile_rows) {
  Segments s;
  s.rows = rows;
  s.token_tile_prefix.assign(rows.size() + 1, 0);
  s.offsets.assign(rows.size() + 1, 0);
  for (size_t e = 0; e < rows.size(); ++e) {
    const ExpertSegment segment = expert_segment(rows[e], token_tile_rows);
    s.token_tile_prefix[e + 1] = s.token_tile_prefix[e] + segment.token_tiles;
    s.offsets[e + 1] = s.offsets[e] + segment.rows;
  }
  // Filled from a poisoned start: every entry the numbering reads must have been written.
  s.token_tile_expert.assign(s.token_tile_prefix.back(), -1);
  for (size_t e = 0; e < rows.size(); ++e) {
    mark_expert_token_tiles(static_cast<int>(e), s.token_tile_prefix[e], s.token_tile_prefix[e + 1] - s.token_tile_prefix[e],
                            s.token_tile_expert.data());
  }
  return s;
}

template <TileOrder kOrder>
GroupedTile tile_of(const Segments& s, int linear, int channel_blocks, int token_tile_rows) {
  return number_tile<kOrder>(linear, s.token_tile_expert.data(), s.token_tile_prefix.data(), s.offsets.data(),
                             s.rows.data(), channel_blocks, token_tile_rows);
}

// Whether a tile is an expert's short last one (one subtile high).
bool is_short(const GroupedTile& t, int token_tile_rows) {
  return tile_subtiles(t, token_tile_rows) * layout::gemm_token_subtile(token_tile_rows) < token_tile_rows;
}

// Every linear index names a tile of a routed expert inside that expert's segment; together the
// tiles of each (expert, channel block) cover the expert's rows once each, in token-tile order,
// and the numbering runs expert by expert: with the channel block as the slow index
// (block_major), or so for each block's full tiles and then the expert's short tiles by channel
// block (short_tiles_last).
template <TileOrder kOrder>
void expect_numbering_covers_every_row(const std::vector<int32_t>& rows, int token_tile_rows, int channel_blocks) {
  SCOPED_TRACE("token tile " + std::to_string(token_tile_rows) + ", channel blocks " + std::to_string(channel_blocks) +
               (kOrder == TileOrder::block_major ? ", block major" : ", short tiles last"));
  const int E = static_cast<int>(rows.size());
  const Segments s = segments_for(rows, token_tile_rows);
  const int num_tiles = s.token_tile_prefix[E] * channel_blocks;
  std::map<std::pair<int, int>, std::vector<int>> covered;  // (expert, channel block) -> rows seen
  auto order_key = [&](const GroupedTile& t) {
    const int kind = kOrder == TileOrder::short_tiles_last && is_short(t, token_tile_rows) ? 1 : 0;
    return std::make_tuple(t.expert, kind, t.channel_block, t.token_tile);
  };
  GroupedTile previous{-1, 0, 0, 0, 0, 0, 0};
  for (int linear = 0; linear < num_tiles; ++linear) {
    const GroupedTile t = tile_of<kOrder>(s, linear, channel_blocks, token_tile_rows);
    ASSERT_GE(t.expert, 0);
    ASSERT_LT(t.expert, E);
    ASSERT_GT(rows[t.expert], 0) << "a tile of an expert with no rows";
    ASSERT_GE(t.channel_block, 0);
    ASSERT_LT(t.channel_block, channel_blocks);
    ASSERT_EQ(t.expert_token_tiles, expert_segment(rows[t.expert], token_tile_rows).token_tiles);
    ASSERT_GT(t.valid_rows, 0);
    ASSERT_LE(t.valid_rows, token_tile_rows);
    // The rows the tile loads, padding included, lie in the expert's segment; only an expert's
    // last tile may be short.
    const int loaded_rows = tile_subtiles(t, token_tile_rows) * layout::gemm_token_subtile(token_tile_rows);
    ASSERT_GE(t.pool_row, s.offsets[t.expert]);
    ASSERT_LE(t.pool_row + loaded_rows, s.offsets[t.expert + 1]);
    ASSERT_GE(loaded_rows, t.valid_rows);
    if (loaded_rows < token_tile_rows) {
      ASSERT_EQ(t.token_tile, t.expert_token_tiles - 1);
    }
    ASSERT_EQ(t.token_tile < expert_full_tiles(rows[t.expert], token_tile_rows), !is_short(t, token_tile_rows));
    // Order: experts ascending; inside one, (the short tiles last,) channel block slow, token tile fast.
    if (previous.expert >= 0) {
      ASSERT_LT(order_key(previous), order_key(t));
    }
    previous = t;
    auto& seen = covered[{t.expert, t.channel_block}];
    for (int r = 0; r < t.valid_rows; ++r) seen.push_back(t.pool_row - s.offsets[t.expert] + r);
  }
  for (int e = 0; e < E; ++e) {
    for (int c = 0; c < channel_blocks; ++c) {
      const auto it = covered.find({e, c});
      if (rows[e] == 0) {
        EXPECT_EQ(it, covered.end()) << "expert " << e;
        continue;
      }
      ASSERT_NE(it, covered.end()) << "expert " << e << " channel block " << c;
      std::vector<int> expected(rows[e]);
      std::iota(expected.begin(), expected.end(), 0);
      EXPECT_EQ(it->second, expected) << "expert " << e << " channel block " << c;
    }
  }
}

TEST(TileNumbering, CoversEveryRoutedRowOnceInSchedulerOrder) {
  std::mt19937 rng(20261130);
  for (int token_tile_rows : {16, 32, 64, 128}) {
    for (int channel_blocks : {1, 4, 28}) {
      // Random counts, with empty experts and exact multiples of the tile among them.
      std::vector<int32_t> rows(37);
      for (auto& r : rows) {
        const int kind = static_cast<int>(rng() % 4);
        r = kind == 0 ? 0 : kind == 1 ? token_tile_rows * static_cast<int>(1 + rng() % 3) : static_cast<int>(rng() % 300);
      }
      // Each remainder around the subtile and tile sizes; every row on one expert; one row on each.
      const std::vector<int32_t> remainders{1, 15, 16, 17, 31, 32, 33, 47, 48, 63, 64, 65, 95, 96, 97, 128, 0, 129};
      std::vector<int32_t> one_expert(16, 0);
      one_expert[11] = 1000;
      for (const auto& counts : {rows, remainders, one_expert, std::vector<int32_t>(256, 1)}) {
        expect_numbering_covers_every_row<TileOrder::block_major>(counts, token_tile_rows, channel_blocks);
        expect_numbering_covers_every_row<TileOrder::short_tiles_last>(counts, token_tile_rows, channel_blocks);
      }
    }
  }
}

// CTA pairs (weight multicast) take the tiles 2u and 2u + 1 of the short_tiles_last numbering. Both
// CTAs, each from its own tile, decide alike whether the pair shares a weight block, and they
// decide it exactly where the two tiles are full tiles of the same (expert, channel block): then the
// second tile holds the next token rows. The two tiles are alike (both full or both short) but
// where a pair straddles two experts or an expert's last full tile and its first short one; an
// odd tile count leaves the last tile alone,
// sharing nothing. Block-major order, which single CTAs take, mixes them far more often. The
// tiles' experts fit the workspace's T x k entries (each token tile holds a routed row).
TEST(TileNumbering, PairsShareWeightsAndJoinLikeTiles) {
  std::mt19937 rng(20261203);
  const int token_tile_rows = 128;
  for (int channel_blocks : {1, 4, 7, 28}) {
    SCOPED_TRACE("channel blocks " + std::to_string(channel_blocks));
    std::vector<int32_t> rows(41);
    for (auto& r : rows) r = rng() % 3 == 0 ? 0 : static_cast<int>(rng() % 700);
    rows[3] = 128;  // exactly one tile
    rows[4] = 256;  // exactly two
    rows[5] = 257;  // two and a short one
    rows[6] = 40;   // a short one alone
    rows[7] = 300;  // two and a short one
    rows[8] = 200;  // a full one and a full-height last one
    const int E = static_cast<int>(rows.size());
    const Segments s = segments_for(rows, token_tile_rows);
    const int num_tiles = s.token_tile_prefix[E] * channel_blocks;
    auto full_tiles = [&](const GroupedTile& t) { return expert_full_tiles(rows[t.expert], token_tile_rows); };
    int shared = 0, routed = 0, mixed = 0, mixed_block_major = 0;
    for (int e = 0; e < E; ++e) routed += rows[e];
    for (int linear = 0; linear + 1 < num_tiles; linear += 2) {
      const GroupedTile first = tile_of<TileOrder::short_tiles_last>(s, linear, channel_blocks, token_tile_rows);
      const GroupedTile second = tile_of<TileOrder::short_tiles_last>(s, linear + 1, channel_blocks, token_tile_rows);
      ASSERT_GT(first.valid_rows, 0) << linear;
      ASSERT_GT(second.valid_rows, 0) << linear;
      const bool shares = pair_shares_weights(first, 0, full_tiles(first));
      ASSERT_EQ(shares, pair_shares_weights(second, 1, full_tiles(second))) << linear << ": the pair's CTAs disagree";
      const bool first_short = is_short(first, token_tile_rows), second_short = is_short(second, token_tile_rows);
      const bool same_block = first.expert == second.expert && first.channel_block == second.channel_block;
      ASSERT_EQ(shares, same_block && !first_short && !second_short) << linear;
      if (shares) {
        ASSERT_EQ(first.token_tile + 1, second.token_tile) << linear;
        ++shared;
      }
      if (first_short != second_short) {
        ++mixed;
        const bool across_experts = first.expert != second.expert;
        const bool last_full_then_short = !first_short && second_short && first.channel_block == channel_blocks - 1 &&
                                          first.token_tile == full_tiles(first) - 1 && second.channel_block == 0;
        ASSERT_TRUE(across_experts || last_full_then_short) << linear << ": a short tile paired with a full one";
      }
      const GroupedTile first_bm = tile_of<TileOrder::block_major>(s, linear, channel_blocks, token_tile_rows);
      const GroupedTile second_bm = tile_of<TileOrder::block_major>(s, linear + 1, channel_blocks, token_tile_rows);
      mixed_block_major += is_short(first_bm, token_tile_rows) != is_short(second_bm, token_tile_rows);
    }
    if (num_tiles % 2 == 1) {
      const GroupedTile last = tile_of<TileOrder::short_tiles_last>(s, num_tiles - 1, channel_blocks, token_tile_rows);
      EXPECT_FALSE(pair_shares_weights(last, 0, full_tiles(last))) << "the lone last tile";
    }
    EXPECT_GT(shared, 0);
    EXPECT_LE(mixed, 2 * E) << "at most one expert boundary and one switch to short tiles per expert";
    if (channel_blocks > 1) {
      EXPECT_LT(mixed, mixed_block_major);
    }
    EXPECT_LE(s.token_tile_prefix[E], routed);
  }
}

TEST(TileNumbering, SegmentsFitTheWorkspacePool) {
  // The pool the workspace sizes for max_tokens tokens holds every expert's segment for any
  // routing of those tokens' k rows.
  std::mt19937 rng(7);
  const int E = 64, k = 4, max_tokens = 300;
  for (int token_tile_rows : {16, 32, 64, 128}) {
    const size_t pool = layout::MoeWorkspaceLayout::worst_case_pool_rows(E, k, max_tokens, token_tile_rows);
    for (int trial = 0; trial < 200; ++trial) {
      // k distinct experts per token, over a random subset of the experts.
      const int used = 1 + static_cast<int>(rng() % E);
      std::vector<int32_t> rows(E, 0);
      const int tokens = 1 + static_cast<int>(rng() % max_tokens);
      for (int t = 0; t < tokens; ++t) {
        std::vector<int> picked;
        while (static_cast<int>(picked.size()) < std::min(k, used)) {
          const int e = static_cast<int>(rng() % used);
          if (std::find(picked.begin(), picked.end(), e) == picked.end()) picked.push_back(e);
        }
        for (int e : picked) ++rows[e];
      }
      const Segments s = segments_for(rows, token_tile_rows);
      EXPECT_LE(static_cast<size_t>(s.offsets[E]), pool) << "token tile " << token_tile_rows << ", trial " << trial;
      // The token tiles' experts fit the workspace's T x k entries: a tile holds a routed row.
      EXPECT_LE(s.token_tile_prefix[E], tokens * k) << "token tile " << token_tile_rows << ", trial " << trial;
    }
  }
}

}  // namespace
}  // namespace megamoe::kernels
