#include "ref/random_problem.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <set>
#include <stdexcept>
#include <tuple>
#include <vector>

namespace megamoe::ref {
namespace {

std::vector<int> rows_per_expert(const RandomRouting& r, int experts) {
  std::vector<int> rows(experts, 0);
  for (int32_t id : r.ids) ++rows.at(id);
  return rows;
}

void expect_distinct_per_token(const RandomRouting& r, int tokens, int top_k) {
  ASSERT_EQ(r.ids.size(), static_cast<size_t>(tokens) * top_k);
  for (int t = 0; t < tokens; ++t) {
    const std::set<int32_t> ids(r.ids.begin() + t * top_k, r.ids.begin() + (t + 1) * top_k);
    EXPECT_EQ(ids.size(), static_cast<size_t>(top_k)) << "token " << t;
  }
}

TEST(BalancedRouting, EveryExpertGetsTheSameRows) {
  // The named workloads' shapes at a large batch, and counts that T k / E does not divide.
  for (auto [tokens, top_k, experts] : {std::tuple{8192, 8, 256}, std::tuple{8192, 8, 128}, std::tuple{1000, 6, 64},
                                        std::tuple{7, 8, 256}, std::tuple{3, 4, 4}}) {
    const RandomRouting r = make_balanced_routing(tokens, top_k, experts, 11);
    expect_distinct_per_token(r, tokens, top_k);
    const std::vector<int> rows = rows_per_expert(r, experts);
    const long total = static_cast<long>(tokens) * top_k;
    for (int e = 0; e < experts; ++e) {
      EXPECT_GE(rows[e], total / experts) << tokens << " tokens, expert " << e;
      EXPECT_LE(rows[e], (total + experts - 1) / experts) << tokens << " tokens, expert " << e;
    }
    ASSERT_EQ(r.weights.size(), r.ids.size());
    for (float w : r.weights) {
      EXPECT_GE(w, 0.05f);
      EXPECT_LT(w, 1.0f);
    }
  }
}

TEST(BalancedRouting, RefusesMoreChoicesThanExperts) {
  EXPECT_THROW(make_balanced_routing(4, 9, 8, 1), std::invalid_argument);
}

TEST(RandomRouting, ChoicesOfATokenAreDistinctAndUneven) {
  const RandomRouting r = make_random_routing(8192, 8, 256, 5);
  expect_distinct_per_token(r, 8192, 8);
  const std::vector<int> rows = rows_per_expert(r, 256);
  // Uniform draws spread the rows (standard deviation ~16 about 256): unlike the balanced routing,
  // some expert is far from the mean.
  int widest = 0;
  for (int n : rows) widest = std::max(widest, std::abs(n - 256));
  EXPECT_GT(widest, 16);
}

}  // namespace
}  // namespace megamoe::ref
