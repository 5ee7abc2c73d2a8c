#include "ref/routing.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <numeric>
#include <set>

#include "common/test_random.hpp"

namespace megamoe::ref {
namespace {

// Brute force: sort every candidate by (value desc, index asc) and take the first n.
std::vector<int> sorted_top(const std::vector<double>& values, const std::vector<int>& candidates, int n) {
  std::vector<int> order = candidates;
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return values[a] > values[b]; });
  order.resize(n);
  return order;
}

std::vector<float> random_logits(test::SeededRng& rng, int T, int E, bool with_ties) {
  std::vector<float> logits(static_cast<size_t>(T) * E);
  // With ties: only 5 distinct values, so equal logits are everywhere.
  for (float& l : logits) l = with_ties ? static_cast<float>(rng.integer(-2, 2)) : rng.normal(2.0f);
  return logits;
}

MoeSpec spec_with(int E, int k, Routing routing) {
  MoeSpec spec;
  spec.num_experts = E;
  spec.top_k = k;
  spec.hidden = 128;
  spec.intermediate = 128;
  spec.routing = std::move(routing);
  return spec;
}

class SoftmaxRouting : public ::testing::TestWithParam<std::tuple<bool, bool>> {};

TEST_P(SoftmaxRouting, MatchesBruteForce) {
  const auto [renormalize, with_ties] = GetParam();
  test::SeededRng rng;
  const int T = 64, E = 32, k = 6;
  const MoeSpec spec = spec_with(E, k, SoftmaxTopK{.renormalize = renormalize});
  const std::vector<float> logits = random_logits(rng, T, E, with_ties);
  const RoutingResult r = route(spec, logits.data(), T);
  std::vector<int> all(E);
  std::iota(all.begin(), all.end(), 0);
  for (int t = 0; t < T; ++t) {
    std::vector<double> row(logits.begin() + t * E, logits.begin() + (t + 1) * E);
    const double max = *std::max_element(row.begin(), row.end());
    double denom = 0;
    for (double l : row) denom += std::exp(l - max);
    const std::vector<int> expected = sorted_top(row, all, k);
    double picked = 0;
    for (int e : expected) picked += std::exp(row[e] - max) / denom;
    for (int j = 0; j < k; ++j) {
      ASSERT_EQ(r.ids[t * k + j], expected[j]) << "token " << t << " slot " << j;
      const double p = std::exp(row[expected[j]] - max) / denom;
      EXPECT_NEAR(r.weights[t * k + j], renormalize ? p / picked : p, 1e-6);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, SoftmaxRouting, ::testing::Combine(::testing::Bool(), ::testing::Bool()));

TEST(SoftmaxRouting, NonFiniteLogitsGiveValidDistinctIds) {
  const int E = 8, k = 4;
  const MoeSpec spec = spec_with(E, k, SoftmaxTopK{.renormalize = true});
  const std::vector<float> logits = {NAN, INFINITY, -INFINITY, NAN, 0.5f, NAN, -1.0f, NAN,   // mixed
                                     NAN, NAN,      NAN,       NAN, NAN,  NAN, NAN,   NAN};  // all NaN
  const RoutingResult r = route(spec, logits.data(), 2);
  EXPECT_EQ(std::vector<int>(r.ids.begin(), r.ids.begin() + k), (std::vector<int>{1, 4, 6, 0}));
  EXPECT_EQ(std::vector<int>(r.ids.begin() + k, r.ids.end()), (std::vector<int>{0, 1, 2, 3}));
  for (float w : r.weights) EXPECT_TRUE(std::isfinite(w));
  EXPECT_NEAR(r.weights[4] + r.weights[5] + r.weights[6] + r.weights[7], 1.0, 1e-6);
}

struct GroupedCase {
  int E, k, n_group, topk_group;
  bool renormalize;
};

class GroupedRouting : public ::testing::TestWithParam<std::tuple<GroupedCase, bool>> {};

TEST_P(GroupedRouting, MatchesBruteForce) {
  const auto [c, with_ties] = GetParam();
  test::SeededRng rng;
  const int T = 48;
  DeepseekGrouped mode{.n_group = c.n_group, .topk_group = c.topk_group, .routed_scaling_factor = 2.5f,
                       .renormalize = c.renormalize};
  for (int e = 0; e < c.E; ++e) mode.e_score_correction_bias.push_back(with_ties ? 0.0f : rng.uniform(-0.1f, 0.1f));
  const MoeSpec spec = spec_with(c.E, c.k, mode);
  const std::vector<float> logits = random_logits(rng, T, c.E, with_ties);
  const RoutingResult r = route(spec, logits.data(), T);
  const int group_size = c.E / c.n_group;
  for (int t = 0; t < T; ++t) {
    std::vector<double> score(c.E), choice(c.E);
    for (int e = 0; e < c.E; ++e) {
      score[e] = static_cast<float>(1.0 / (1.0 + std::exp(-double(logits[t * c.E + e]))));
      choice[e] = static_cast<float>(score[e] + mode.e_score_correction_bias[e]);
    }
    std::vector<double> group_score(c.n_group);
    for (int g = 0; g < c.n_group; ++g) {
      std::vector<double> members(choice.begin() + g * group_size, choice.begin() + (g + 1) * group_size);
      std::sort(members.rbegin(), members.rend());
      group_score[g] = static_cast<float>(members[0] + (group_size > 1 ? members[1] : 0.0));
    }
    std::vector<int> groups(c.n_group);
    std::iota(groups.begin(), groups.end(), 0);
    std::vector<int> candidates;
    for (int g : sorted_top(group_score, groups, c.topk_group))
      for (int e = g * group_size; e < (g + 1) * group_size; ++e) candidates.push_back(e);
    std::sort(candidates.begin(), candidates.end());
    const std::vector<int> expected = sorted_top(choice, candidates, c.k);
    double sum = 0;
    for (int e : expected) sum += score[e];
    for (int j = 0; j < c.k; ++j) {
      ASSERT_EQ(r.ids[t * c.k + j], expected[j]) << "token " << t << " slot " << j;
      const double w = (c.renormalize ? score[expected[j]] / sum : score[expected[j]]) * 2.5;
      EXPECT_NEAR(r.weights[t * c.k + j], w, 1e-5);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GroupedRouting,
    ::testing::Combine(::testing::Values(GroupedCase{64, 8, 8, 4, true}, GroupedCase{32, 4, 4, 2, false},
                                         GroupedCase{16, 8, 8, 4, true}, GroupedCase{12, 3, 12, 3, true}),
                       ::testing::Bool()));

TEST(GroupedRouting, NonFiniteLogitsGiveValidDistinctIds) {
  const int E = 16, k = 4;
  const MoeSpec spec = spec_with(E, k, DeepseekGrouped{.n_group = 4, .topk_group = 2});
  std::vector<float> logits(E, NAN);
  logits[9] = INFINITY;
  const RoutingResult r = route(spec, logits.data(), 1);
  std::set<int> unique(r.ids.begin(), r.ids.end());
  EXPECT_EQ(unique.size(), static_cast<size_t>(k));
  for (int id : r.ids) EXPECT_TRUE(id >= 0 && id < E);
  EXPECT_EQ(r.ids[0], 9);
  for (float w : r.weights) EXPECT_TRUE(std::isfinite(w));
}

TEST(CheckRouting, ClassifiesUnusedAndInvalidIds) {
  const int32_t ids[] = {3, -1, 3, 9,    // duplicate 3 and out-of-range 9: two invalid
                         0, 1, 2, -7};   // -7 invalid
  const RoutingCheck check = check_routing(ids, 2, 4, 8);
  EXPECT_EQ(check.invalid_ids, 3);
  EXPECT_EQ(check.used, (std::vector<uint8_t>{1, 0, 0, 0, 1, 1, 1, 0}));
}

TEST(RoutedFloors, CountDistinctValidExperts) {
  MoeSpec spec;
  spec.num_experts = 256;
  spec.top_k = 8;
  spec.hidden = 2048;
  spec.intermediate = 512;
  std::vector<int32_t> ids = {0, 1, 2, 3, 4, 5, 6, 7,      // token 0
                              0, 1, 2, 3, -1, 300, 9, 9};  // token 1: -1 unused, 300 invalid, 9 twice
  const plan::Floors f = routed_floors(spec, ids.data(), 2, plan::DeviceFacts::h200_measured());
  EXPECT_EQ(f.touched_experts, 9);
  EXPECT_EQ(f.routed_rows, 8 + 5);
  EXPECT_NEAR(f.weight_bytes, 9 * 3.0 * 2048 * 512 * 2, 1e-3);
}

}  // namespace
}  // namespace megamoe::ref
