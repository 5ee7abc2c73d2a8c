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

TEST(PlanDispatch, EachTokenArrivesOnceAtEveryRankOwningOneOfItsExpertsInCanonicalOrder) {
  test::SeededRng rng;
  for (int world : {1, 2, 4, 8}) {
    const EpTopology topology{world, 32};
    const int k = 4, epr = topology.experts_per_rank();
    std::vector<std::vector<int32_t>> ids(world);
    std::vector<RankRouting> routing(world);
    for (int r = 0; r < world; ++r) {
      const int tokens = r == 1 ? 0 : rng.integer(1, 50);  // rank 1 may have no tokens at all
      ids[r] = random_ids(rng, tokens, k, topology.num_experts, /*holes=*/true);
      routing[r] = RankRouting{tokens, ids[r].data()};
    }
    const DispatchPlan plan = plan_dispatch(topology, k, routing);

    // Brute force from the raw ids: per (owner, source rank, token), the slots' local experts.
    std::map<std::tuple<int, int, int>, std::vector<int32_t>> expected;
    long invalid = 0, routed = 0;
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
          auto [it, fresh] = expected.try_emplace({id / epr, r, t}, std::vector<int32_t>(k, -1));
          it->second[j] = id % epr;
          ++routed;
        }
      }
    }
    EXPECT_EQ(plan.invalid_ids, invalid);
    long slots_received = 0;
    for (int dst = 0; dst < world; ++dst) {
      std::vector<ReceivedRow> want;
      for (const auto& [key, local_ids] : expected) {
        if (std::get<0>(key) == dst) want.push_back({std::get<1>(key), std::get<2>(key), local_ids});
      }
      // std::map orders by (owner, rank, token): the canonical order within each owner.
      ASSERT_EQ(plan.received[dst], want) << "world " << world << " rank " << dst;
      for (const ReceivedRow& row : plan.received[dst]) {
        slots_received += std::count_if(row.local_ids.begin(), row.local_ids.end(), [](int32_t l) { return l >= 0; });
      }
      // The count exchange carries exactly what arrives.
      long sent = 0;
      for (int src = 0; src < world; ++src) sent += plan.sent[src][dst];
      EXPECT_EQ(sent, static_cast<long>(plan.received[dst].size()));
    }
    EXPECT_EQ(slots_received, routed);
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
