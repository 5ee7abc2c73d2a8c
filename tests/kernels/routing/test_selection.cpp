// order_key must order every pair of non-NaN floats exactly as the reference's `>` and `==` do,
// or the router picks a different expert than src/ref/routing.cpp on some input; sanitize_logit
// must leave no NaN or infinity.
#include "kernels/routing/selection.hpp"

#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

namespace megamoe::kernels {
namespace {

float from_bits(uint32_t bits) {
  float v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

uint32_t bits_of(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return bits;
}

std::vector<float> special_values() {
  const float inf = std::numeric_limits<float>::infinity();
  return {-inf, -FLT_MAX, -1.5f, -1.0f, -FLT_MIN, -from_bits(1), -0.0f, 0.0f, from_bits(1), FLT_MIN, 1.0f,
          1.5f, FLT_MAX, inf};
}

TEST(SanitizeLogit, MapsNanAndInfinitiesToFiniteExtremesAndKeepsNumbers) {
  EXPECT_EQ(sanitize_logit(std::nanf("")), -FLT_MAX);
  EXPECT_EQ(sanitize_logit(from_bits(0xFFC00000u)), -FLT_MAX);
  EXPECT_EQ(sanitize_logit(std::numeric_limits<float>::infinity()), FLT_MAX);
  EXPECT_EQ(sanitize_logit(-std::numeric_limits<float>::infinity()), -FLT_MAX);
  for (float v : special_values()) {
    if (std::isfinite(v)) {
      EXPECT_EQ(bits_of(sanitize_logit(v)), bits_of(v)) << v;
    }
  }
}

TEST(OrderKey, OrdersSpecialValuesLikeFloatComparison) {
  const std::vector<float> values = special_values();
  for (float a : values)
    for (float b : values) {
      SCOPED_TRACE(testing::Message() << a << " vs " << b);
      EXPECT_EQ(a > b, order_key(a) > order_key(b));
      EXPECT_EQ(a == b, order_key(a) == order_key(b));
    }
}

TEST(OrderKey, OrdersRandomBitPatternsLikeFloatComparison) {
  std::mt19937 engine(12345);
  int compared = 0;
  for (int i = 0; i < 1000000; ++i) {
    const float a = from_bits(engine()), b = from_bits(i % 4 == 0 ? bits_of(a) ^ (engine() & 0xFFu) : engine());
    if (std::isnan(a) || std::isnan(b)) continue;
    ++compared;
    ASSERT_EQ(a > b, order_key(a) > order_key(b)) << a << " vs " << b;
    ASSERT_EQ(a == b, order_key(a) == order_key(b)) << a << " vs " << b;
  }
  EXPECT_GT(compared, 990000);
}

TEST(OrderKey, NanIsBelowEveryNumber) {
  for (uint32_t nan_bits : {0x7FC00000u, 0x7F800001u, 0xFFFFFFFFu, 0xFFC00000u}) {
    EXPECT_EQ(order_key(from_bits(nan_bits)), 0u);
  }
  for (float v : special_values()) EXPECT_GT(order_key(v), 0u) << v;
}

TEST(OrderKey, DecodesBackToTheValue) {
  std::mt19937 engine(777);
  for (int i = 0; i < 100000; ++i) {
    const float v = from_bits(engine());
    if (std::isnan(v) || v == 0.0f) continue;
    ASSERT_EQ(bits_of(from_order_key(order_key(v))), bits_of(v)) << v;
  }
  EXPECT_EQ(bits_of(from_order_key(order_key(-0.0f))), bits_of(0.0f));
}

}  // namespace
}  // namespace megamoe::kernels
