// Our E4M3 codec against NVIDIA's host implementation in cuda_fp8.h, which documents the same
// semantics as the device conversion (cvt.rn.satfinite.e4m3x2.f32).
#include <cuda_fp8.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "common/test_random.hpp"
#include "quant/fp8_codec.hpp"

namespace megamoe::quant {
namespace {

uint8_t nvidia_encode(float value) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(value, __NV_SATFINITE, __NV_E4M3));
}

float nvidia_decode(uint8_t code) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), __NV_E4M3);
  return __half2float(__half(h));
}

TEST(E4M3VsCuda, DecodesAll256CodesIdentically) {
  for (int code = 0; code < 256; ++code) {
    const float ours = e4m3_decode(static_cast<uint8_t>(code));
    const float theirs = nvidia_decode(static_cast<uint8_t>(code));
    if (std::isnan(theirs)) {
      EXPECT_TRUE(std::isnan(ours)) << "code " << code;
    } else {
      EXPECT_EQ(ours, theirs) << "code " << code;
      EXPECT_EQ(std::signbit(ours), std::signbit(theirs)) << "code " << code;
    }
  }
}

TEST(E4M3VsCuda, EncodesMidpointsAndRandomFloatsIdentically) {
  for (int code = 0; code < 0x7E; ++code) {
    const float lo = e4m3_decode(static_cast<uint8_t>(code)), hi = e4m3_decode(static_cast<uint8_t>(code + 1));
    for (float v : {lo, (lo + hi) / 2, std::nextafter((lo + hi) / 2, 0.0f), std::nextafter((lo + hi) / 2, 1e9f)}) {
      EXPECT_EQ(e4m3_encode(v), nvidia_encode(v)) << "value " << v;
      EXPECT_EQ(e4m3_encode(-v), nvidia_encode(-v)) << "value " << -v;
    }
  }
  for (float v : {448.0f, 463.99f, 464.0f, 464.01f, 480.0f, 1e30f, INFINITY, -INFINITY}) {
    EXPECT_EQ(e4m3_encode(v), nvidia_encode(v)) << "value " << v;
  }
  test::SeededRng rng;
  for (int i = 0; i < 1000000; ++i) {
    // Alternate raw bit patterns (every exponent) with values in the range E4M3 represents.
    float v;
    if (i % 2 == 0) {
      const uint32_t bits = static_cast<uint32_t>(rng.engine()());
      std::memcpy(&v, &bits, sizeof v);
    } else {
      v = std::ldexp(rng.uniform(-1.0f, 1.0f), rng.integer(-12, 10));
    }
    if (std::isnan(v)) continue;  // NaN payloads differ by convention; both give a NaN code
    ASSERT_EQ(e4m3_encode(v), nvidia_encode(v)) << "value " << v;
  }
}

}  // namespace
}  // namespace megamoe::quant
