#include "ref/ep_dispatch.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <tuple>

#include "common/test_random.hpp"
#include "megamoe/error.hpp"

namespace megamoe::ref {
namespace {

// Random distinct ids per token, optionally with -1 holes and invalid ids.
std::vector<int32_t> random_ids(test::SeededRng& rng, int tokens, int k, int E, bool holes) {
  std::vector<int32_t> ids;
  for (int t = 0; t < tokens; ++t) {
    std::vector<int32_t> experts(E);
    for (int e = 0; e < E; ++e) experts[e] = e;
    for (int j = 0; j < k; ++j) {
      std::swap(experts[j], experts[rng.integer(j, E - 1)]);
      int32_t id = experts[j];
      if (holes && rng.integer(0, 9) == 0) id = -1;
      if (holes && rng.integer(0, 19) == 0) id = E + rng.integer(0, 5);
      ids.push_back(id);
    }
  }
  return ids;
}

TEST(PlanDispatch, EveryRoutedSlotArrivesOnceAtItsOwnerInCanonicalOrder) {
  test::SeededRng rng;
  for (int world : {1, 2, 4, 8}) {
    const EpTopology topology{world, 32};
    const int k = 4;
    std::vector<std::vector<int32_t>> ids(world);
    std::vector<RankRouting> routing(world);
    for (int r = 0; r < world; ++r) {
      const int tokens = r == 1 ? 0 : rng.integer(1, 50);  // rank 1 may have no tokens at all
      ids[r] = random_ids(rng, tokens, k, topology.num_experts, /*holes=*/true);
      routing[r] = RankRouting{tokens, ids[r].data()};
    }
    const DispatchPlan plan = plan_dispatch(topology, k, routing);

    // Brute force: the multiset of (owner, local expert) -> sources from the raw ids.
    std::map<std::tuple<int, int>, std::vector<DispatchSource>> expected;
    long invalid = 0;
    for (int r = 0; r < world; ++r) {
      for (int t = 0; t < routing[r].num_tokens; ++t) {
        for (int j = 0; j < k; ++j) {
          const int id = ids[r][t * k + j];
          if (id == -1) continue;
          bool duplicate = false;
          for (int i = 0; i < j; ++i) duplicate |= ids[r][t * k + i] == id;
          if (id < 0 || id >= topology.num_experts || duplicate) {
            ++invalid;
            continue;
          }
          expected[{id / (topology.num_experts / world), id % (topology.num_experts / world)}].push_back({r, t, j});
        }
      }
    }
    EXPECT_EQ(plan.invalid_ids, invalid);
    long received = 0;
    for (int dst = 0; dst < world; ++dst) {
      for (int local = 0; local < topology.experts_per_rank(); ++local) {
        const auto& got = plan.received[dst][local];
        const auto it = expected.find({dst, local});
        const std::vector<DispatchSource> want = it == expected.end() ? std::vector<DispatchSource>{} : it->second;
        ASSERT_EQ(got, want) << "world " << world << " rank " << dst << " expert " << local;
        EXPECT_TRUE(std::is_sorted(got.begin(), got.end(), [](const DispatchSource& a, const DispatchSource& b) {
          return std::tie(a.rank, a.token, a.slot) < std::tie(b.rank, b.token, b.slot);
        }));
        received += static_cast<long>(got.size());
        // The count exchange carries exactly what arrives.
        long sent = 0;
        for (int src = 0; src < world; ++src) sent += plan.sent[src][dst * topology.experts_per_rank() + local];
        EXPECT_EQ(sent, static_cast<long>(got.size()));
      }
    }
    long routed = 0;
    for (const auto& [key, sources] : expected) routed += static_cast<long>(sources.size());
    EXPECT_EQ(received, routed);
  }
}

TEST(PlanDispatch, RejectsBadTopologies) {
  std::vector<RankRouting> two(2);
  EXPECT_THROW(plan_dispatch(EpTopology{3, 32}, 4, std::vector<RankRouting>(3)), Error);
  EXPECT_THROW(plan_dispatch(EpTopology{2, 32}, 4, std::vector<RankRouting>(3)), Error);
  EXPECT_NO_THROW(plan_dispatch(EpTopology{2, 32}, 4, two));
}

}  // namespace
}  // namespace megamoe::ref
