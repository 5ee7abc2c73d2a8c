#include "ref/ep_dispatch.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <tuple>

#include "common/test_random.hpp"
#include "megamoe/error.hpp"
#include "ref/moe_reference.hpp"
#include "ref/random_problem.hpp"

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

// The owners' passes of `world` ranks for precision `precision` (fp8_tensor: `scales`), and the
// single-GPU reference of each rank's tokens with all experts: their relative L2 distance, worst
// over the ranks.
double owner_passes_against_one_gpu(Precision precision, InputScales scales, int world, test::SeededRng& rng) {
  MoeSpec spec;
  spec.num_experts = 8;
  spec.top_k = 2;
  spec.hidden = 128;
  spec.intermediate = 128;
  spec.precision = precision;
  spec.routing = Precomputed{};
  const RandomWeights weights = make_random_weights(spec, rng.integer(0, 1 << 30), scales);
  const PackedWeights all = prepare_weights(spec, weights.view());
  MoeSpec local = spec;
  local.num_experts = spec.num_experts / world;
  const std::vector<PackedWeights> shares = weights.pack_rank_shares(spec, world);
  std::vector<std::vector<bf16_t>> x(world);
  std::vector<std::vector<int32_t>> ids(world);
  std::vector<std::vector<float>> routing_weights(world);
  std::vector<RankRouting> routing;
  std::vector<SourceCall> sources;
  for (int r = 0; r < world; ++r) {
    const int tokens = rng.integer(1, 24);
    // Rank r's x at 2^r times the scale of rank 0's: owners' amaxes differ from each source's.
    for (int i = 0; i < tokens * spec.hidden; ++i) x[r].push_back(bf16_t::from_float(rng.normal(static_cast<float>(1 << r))));
    ids[r] = random_ids(rng, tokens, spec.top_k, spec.num_experts, /*holes=*/false);
    for (int i = 0; i < tokens * spec.top_k; ++i) routing_weights[r].push_back(rng.uniform(0.1f, 1.0f));
    routing.push_back({tokens, ids[r].data()});
    sources.push_back({tokens, x[r].data(), routing_weights[r].data()});
  }
  const DispatchPlan plan = plan_dispatch(EpTopology{world, spec.num_experts}, spec.top_k, routing);
  std::vector<const PackedWeights*> owners;
  for (const PackedWeights& share : shares) owners.push_back(&share);
  double worst = 0.0;
  for (int r = 0; r < world; ++r) {
    std::vector<bf16_t> rounded(x[r].size());
    const ReferenceReport one_gpu = reference_forward(
        spec, all, MoeInputs{sources[r].num_tokens, x[r].data(), nullptr, ids[r].data(), routing_weights[r].data()},
        MoeOutputs{rounded.data()});
    worst = std::max(worst, relative_l2(owner_passes_forward(local, owners, plan, sources, r), one_gpu.y));
  }
  return worst;
}

TEST(OwnerPassesForward, IsTheSingleGpuReferenceWhereEveryOwnerComputesAlike) {
  test::SeededRng rng;
  for (int world : {1, 2, 4}) {
    EXPECT_LT(owner_passes_against_one_gpu(Precision::fp8_block, InputScales::from_checkpoint, world, rng), 1e-12)
        << "fp8_block, world " << world;
    EXPECT_LT(owner_passes_against_one_gpu(Precision::fp8_tensor, InputScales::from_checkpoint, world, rng), 1e-12)
        << "fp8_tensor with static scales, world " << world;
  }
  // One owner receives every row: its amax is the single GPU's.
  EXPECT_LT(owner_passes_against_one_gpu(Precision::fp8_tensor, InputScales::dynamic, 1, rng), 1e-12);
}

TEST(OwnerPassesForward, DynamicScalesAreEachOwnersOwn) {
  test::SeededRng rng;
  // Each owner's amax over the rows it received, not the source's over its tokens: close, not equal.
  const double distance = owner_passes_against_one_gpu(Precision::fp8_tensor, InputScales::dynamic, 2, rng);
  EXPECT_GT(distance, 1e-6);
  EXPECT_LT(distance, 0.1);
}

}  // namespace
}  // namespace megamoe::ref
