#include "kernels/layout/ep_buffers.hpp"

#include <gtest/gtest.h>

#include "common/layout_checks.hpp"
#include "common/test_random.hpp"
#include "ref/ep_dispatch.hpp"

#include <utility>
#include <vector>

namespace megamoe::layout {
namespace {

TEST(EpBufferLayout, WorstCaseIsOneRowPerSourceToken) {
  EXPECT_EQ(EpBufferLayout::worst_case_recv_rows(2, 4096), 2u * 4096);
  EXPECT_EQ(EpBufferLayout::worst_case_recv_rows(64, 128), 64u * 128);
}

// bf16 token rows, or FP8 ones (one byte per channel) with their scales [H / 128][rows]; bf16
// partial sums, or also FP8 ones with their scales [rows][H / 128].
TEST(EpBufferLayout, RegionsAreAlignedDisjointAndSized) {
  for (auto [fp8_rows, fp8_partials] : {std::pair{false, false}, {true, false}, {false, true}, {true, true}}) {
    const EpBufferLayout l = EpBufferLayout::make(2, 256, 8, 7168, 4096, fp8_rows, fp8_partials);
    EXPECT_EQ(l.experts_per_rank, 128);
    EXPECT_EQ(l.fp8_rows, fp8_rows);
    EXPECT_EQ(l.fp8_partials, fp8_partials);
    const size_t rows = l.max_recv_rows;
    std::vector<std::pair<size_t, size_t>> regions = {
        {l.counts, 4 * 2 * 2},
        {l.recv_origin, 8 * rows},
        {l.recv_ids, 4 * 8 * rows},
        {l.recv_weights, 4 * 8 * rows},
        {l.recv_tokens, rows * 7168 * (fp8_rows ? 1 : 2)},
        {l.partial_sums, rows * 7168 * 2},
        {l.signals, 8 * EpBufferLayout::kSignalSlots}};
    // In offset order.
    if (fp8_partials) {
      regions.insert(regions.begin() + 6, {{l.partial_codes, rows * 7168}, {l.partial_scales, 4 * (7168 / 128) * rows}});
    }
    if (fp8_rows) regions.insert(regions.begin() + 5, {l.recv_scales, 4 * (7168 / 128) * rows});
    test::expect_aligned_disjoint(regions, l.total_bytes, kRegionAlignment);
  }
}

// The dispatch kernels' per-token rules (destinations, local slot ids) and canonical placement
// (tokens ranked in source order per destination, after the rows of earlier sources), run on the
// CPU, against the CPU model of dispatch. (The kernels rank tokens tile by tile; the GPU test checks
// that rows land in the same places.)
TEST(EpDispatchIndexing, TokenRulesAndPlacementReproducePlanDispatch) {
  test::SeededRng rng;
  for (int world : {1, 2, 4}) {
    const int E = 16, k = 4, epr = E / world;
    std::vector<std::vector<int32_t>> ids(world);
    std::vector<ref::RankRouting> routing(world);
    for (int r = 0; r < world; ++r) {
      const int tokens = rng.integer(0, 40);
      for (int i = 0; i < tokens * k; ++i) {
        const int pick = rng.integer(0, 24);
        ids[r].push_back(pick < E ? pick : (pick < 22 ? -1 : E + pick));  // some -1 and out-of-range ids
      }
      routing[r] = {tokens, ids[r].data()};
    }
    const ref::DispatchPlan plan = ref::plan_dispatch(ref::EpTopology{world, E}, k, routing);

    // Count phase: counts[owner][src], each token's rank among its source's rows to that owner.
    std::vector<std::vector<int32_t>> counts(world, std::vector<int32_t>(world, 0));
    std::vector<std::vector<uint64_t>> destinations(world);
    long invalid = 0;
    for (int src = 0; src < world; ++src) {
      for (int t = 0; t < routing[src].num_tokens; ++t) {
        int bad = 0;
        const uint64_t ranks = ep_token_destinations(ids[src].data(), k, E, epr, t, &bad);
        invalid += bad;
        destinations[src].push_back(ranks);
        for (int owner = 0; owner < world; ++owner) counts[owner][src] += (ranks >> owner) & 1;
      }
    }
    EXPECT_EQ(invalid, plan.invalid_ids);
    // Push phase: a token's row lands after the rows of earlier sources and earlier tokens.
    for (int owner = 0; owner < world; ++owner) {
      long total = 0;
      for (int src = 0; src < world; ++src) total += counts[owner][src];
      std::vector<ref::ReceivedRow> received(total, {-1, -1, {}});
      long base = 0;
      for (int src = 0; src < world; ++src) {
        long rank_in_source = 0;
        for (int t = 0; t < routing[src].num_tokens; ++t) {
          if (!((destinations[src][t] >> owner) & 1)) continue;
          ref::ReceivedRow& row = received[base + rank_in_source++];
          row = {src, t, {}};
          for (int j = 0; j < k; ++j) row.local_ids.push_back(ep_local_slot_expert(ids[src].data(), k, E, epr, t, j, owner));
        }
        base += counts[owner][src];
      }
      ASSERT_EQ(received, plan.received[owner]) << "world " << world << " owner " << owner;
    }
  }
}

}  // namespace
}  // namespace megamoe::layout
