#include "quant/fp8_codec.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "common/test_random.hpp"

namespace megamoe::quant {
namespace {

TEST(E4M3, HandCheckedCodes) {
  struct Case {
    uint8_t code;
    float value;
  };
  // Values worked out by hand from the E4M3 definition: bias 7, 3 mantissa bits, no infinities.
  const Case cases[] = {
      {0x00, 0.0f},         {0x01, 0.001953125f},  // smallest subnormal 2^-9
      {0x07, 0.013671875f},                         // largest subnormal 7 * 2^-9
      {0x08, 0.015625f},                            // smallest normal 2^-6
      {0x38, 1.0f},         {0x39, 1.125f},  {0x3F, 1.875f}, {0x40, 2.0f},
      {0x7E, 448.0f},                               // largest finite
      {0x80, -0.0f},        {0xB8, -1.0f},   {0xFE, -448.0f}, {0x4C, 6.0f}, {0x26, 0.21875f},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(e4m3_decode(c.code), c.value) << "code " << int(c.code);
    EXPECT_EQ(std::signbit(e4m3_decode(c.code)), std::signbit(c.value)) << "code " << int(c.code);
    EXPECT_EQ(e4m3_encode(c.value), c.code) << "value " << c.value;
  }
  EXPECT_TRUE(std::isnan(e4m3_decode(0x7F)));
  EXPECT_TRUE(std::isnan(e4m3_decode(0xFF)));
}

TEST(E4M3, AllCodesRoundTripAndAreOrdered) {
  float previous = -1.0f;
  for (int code = 0; code < 256; ++code) {
    const float value = e4m3_decode(static_cast<uint8_t>(code));
    if ((code & 0x7F) == 0x7F) continue;
    EXPECT_EQ(e4m3_encode(value), code) << "code " << code << " value " << value;
    if (code < 0x7F) {  // positive codes decode in increasing order
      EXPECT_GT(value, previous) << "code " << code;
      previous = value;
    }
    EXPECT_EQ(e4m3_decode(static_cast<uint8_t>(code ^ 0x80)), -value) << "code " << code;
  }
}

TEST(E4M3, RoundsHalfToEvenBetweenNeighbours) {
  for (int code = 0; code < 0x7E; ++code) {
    const float lo = e4m3_decode(static_cast<uint8_t>(code));
    const float hi = e4m3_decode(static_cast<uint8_t>(code + 1));
    const float mid = lo + (hi - lo) / 2;  // exact: neighbours differ by a power of two
    const uint8_t even = (code % 2 == 0) ? code : code + 1;
    EXPECT_EQ(e4m3_encode(mid), even) << "midpoint of codes " << code << " and " << code + 1;
    EXPECT_EQ(e4m3_encode(-mid), even | 0x80) << "negative midpoint of codes " << code << " and " << code + 1;
    EXPECT_EQ(e4m3_encode(std::nextafter(mid, 0.0f)), code);
    EXPECT_EQ(e4m3_encode(std::nextafter(mid, 1000.0f)), code + 1);
  }
}

TEST(E4M3, SaturatesAndHandlesSpecials) {
  EXPECT_EQ(e4m3_encode(448.0f), 0x7E);
  EXPECT_EQ(e4m3_encode(460.0f), 0x7E);
  EXPECT_EQ(e4m3_encode(1e30f), 0x7E);
  EXPECT_EQ(e4m3_encode(INFINITY), 0x7E);
  EXPECT_EQ(e4m3_encode(-INFINITY), 0xFE);
  EXPECT_EQ(e4m3_encode(NAN), kE4M3NaN);
  EXPECT_EQ(e4m3_encode(-NAN), kE4M3NaN);
  EXPECT_EQ(e4m3_encode(1e-30f), 0x00);
  EXPECT_EQ(e4m3_encode(-1e-30f), 0x80);
  EXPECT_EQ(e4m3_encode(0.0009765625f), 0x00);  // 2^-10: tie between 0 and 2^-9 goes to even 0
  EXPECT_EQ(e4m3_encode(0.0029296875f), 0x02);  // 1.5 * 2^-9: tie between codes 1 and 2 goes to 2
}

TEST(E4M3, RandomValuesRoundToNearestCode) {
  test::SeededRng rng;
  for (int i = 0; i < 200000; ++i) {
    const float value = std::ldexp(rng.uniform(-1.0f, 1.0f), rng.integer(-12, 10));
    const float decoded = e4m3_decode(e4m3_encode(value));
    // No finite code is strictly closer (brute force over all codes).
    const float error = std::fabs(decoded - value);
    for (int code = 0; code < 256; ++code) {
      if ((code & 0x7F) == 0x7F) continue;
      ASSERT_LE(error, std::fabs(e4m3_decode(static_cast<uint8_t>(code)) - value)) << "value " << value;
    }
  }
}

TEST(UE8M0, HandCheckedScales) {
  EXPECT_EQ(ue8m0_encode_ceil(1.0f), 127);
  EXPECT_EQ(ue8m0_encode_ceil(1.5f), 128);
  EXPECT_EQ(ue8m0_encode_ceil(2.0f), 128);
  EXPECT_EQ(ue8m0_encode_ceil(0.25f), 125);
  EXPECT_EQ(ue8m0_encode_ceil(0.3f), 126);
  EXPECT_EQ(ue8m0_decode(127), 1.0f);
  EXPECT_EQ(ue8m0_decode(130), 8.0f);
  EXPECT_EQ(ue8m0_decode(120), 0.0078125f);
}

TEST(UE8M0, ScaleIsSmallestPowerOfTwoCoveringTheRatio) {
  test::SeededRng rng;
  for (int i = 0; i < 100000; ++i) {
    const float ratio = std::ldexp(rng.uniform(0.5f, 1.0f), rng.integer(-60, 60));
    const float scale = ue8m0_decode(ue8m0_encode_ceil(ratio));
    ASSERT_GE(scale, ratio);
    ASSERT_LT(scale / 2, ratio);
  }
}

TEST(BlockScale, Fp32AndUe8m0Rules) {
  const BlockScale fp32 = block_scale(3.5f, ScaleFormat::fp32);
  EXPECT_EQ(fp32.scale, 3.5f / 448.0f);
  EXPECT_EQ(fp32.factor, 448.0f / 3.5f);
  const BlockScale pow2 = block_scale(3.5f, ScaleFormat::ue8m0);
  EXPECT_EQ(pow2.scale, 0.0078125f);  // 3.5 / 448 = 0.0078125 exactly: already a power of two
  EXPECT_EQ(pow2.factor, 128.0f);
  const BlockScale pow2_up = block_scale(3.6f, ScaleFormat::ue8m0);
  EXPECT_EQ(pow2_up.scale, 0.015625f);
  const BlockScale zeros = block_scale(0.0f, ScaleFormat::fp32);
  EXPECT_EQ(zeros.scale, kMinBlockAmax / 448.0f);
}

}  // namespace
}  // namespace megamoe::quant
