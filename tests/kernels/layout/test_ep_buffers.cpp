#include "kernels/layout/ep_buffers.hpp"

#include <gtest/gtest.h>

#include "common/layout_checks.hpp"
#include "common/test_random.hpp"
#include "ref/ep_dispatch.hpp"

#include <utility>
#include <vector>

namespace megamoe::layout {
namespace {

TEST(EpBufferLayout, WorstCaseCountsEveryRowARankCanReceive) {
  // 2 ranks, 128 experts each, k=8: a token can send all 8 rows to one rank.
  EXPECT_EQ(EpBufferLayout::worst_case_recv_rows(2, 128, 8, 4096), 2u * 4096 * 8);
  // 64 ranks with 4 experts each: at most 4 rows of a token land on one rank.
  EXPECT_EQ(EpBufferLayout::worst_case_recv_rows(64, 4, 8, 128), 64u * 128 * 4);
}

TEST(EpBufferLayout, RegionsAreAlignedDisjointAndSized) {
  const EpBufferLayout l = EpBufferLayout::make(2, 256, 8, 7168, 4096);
  EXPECT_EQ(l.experts_per_rank, 128);
  const size_t rows = l.max_recv_rows;
  const std::vector<std::pair<size_t, size_t>> regions = {
      {l.send_tokens, 4096ull * 7168 * 2},
      {l.recv_counts, 4 * 2 * 128},
      {l.recv_sources, 16 * rows},
      {l.recv_tokens, rows * 7168 * 2},
      {l.combine_rows, 4096ull * 8 * 7168 * 2},
      {l.arrivals, 4 * 128},
      {l.signals, 8 * EpBufferLayout::kSignalSlots}};
  test::expect_aligned_disjoint(regions, l.total_bytes, kRegionAlignment);
}

// The dispatch kernels' per-slot rule and canonical placement, run on the CPU in slot order,
// against the CPU model of dispatch: the counts, the invalid ids and each slot's position in its
// owner's buffer. (The kernels rank slots tile by tile; the GPU test checks that they land in the
// same places.)
TEST(EpDispatchIndexing, SlotRuleAndSegmentBasesReproducePlanDispatch) {
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

    // Count phase on every source rank: counts[owner][src * epr + local].
    std::vector<std::vector<int32_t>> slot_rank(world), counts(world, std::vector<int32_t>(world * epr, 0));
    long invalid = 0;
    for (int src = 0; src < world; ++src) {
      for (size_t s = 0; s < ids[src].size(); ++s) {
        bool bad = false;
        const int e = ep_slot_expert(ids[src].data(), k, E, static_cast<long>(s), &bad);
        invalid += bad;
        slot_rank[src].push_back(e < 0 ? -1 : counts[e / epr][src * epr + e % epr]++);
      }
    }
    EXPECT_EQ(invalid, plan.invalid_ids);
    // Publish phase: every used slot lands at its canonical position.
    for (int owner = 0; owner < world; ++owner) {
      std::vector<int32_t> expert_prefix(epr, 0);
      long total = 0;
      for (int l = 0; l < epr; ++l) {
        expert_prefix[l] = static_cast<int32_t>(total);
        for (int src = 0; src < world; ++src) total += counts[owner][src * epr + l];
      }
      std::vector<ref::DispatchSource> received(total, {-1, -1, -1});
      for (int src = 0; src < world; ++src) {
        for (size_t s = 0; s < ids[src].size(); ++s) {
          const int e = ids[src][s];
          if (slot_rank[src][s] < 0 || e / epr != owner) continue;
          const long position =
              ep_segment_base(counts[owner].data(), expert_prefix.data(), epr, src, e % epr) + slot_rank[src][s];
          received[position] = {src, static_cast<int32_t>(s / k), static_cast<int32_t>(s % k)};
        }
      }
      std::vector<ref::DispatchSource> expected;
      for (int l = 0; l < epr; ++l) expected.insert(expected.end(), plan.received[owner][l].begin(), plan.received[owner][l].end());
      ASSERT_EQ(received, expected) << "world " << world << " owner " << owner;
    }
  }
}

}  // namespace
}  // namespace megamoe::layout
