#include "quant/quantize.hpp"

#include <gtest/gtest.h>

#include <cmath>

#include "common/test_random.hpp"
#include "quant/fp8_codec.hpp"

namespace megamoe::quant {
namespace {

// Largest error round-to-nearest E4M3 may make on |v| <= 448 after scaling: half a mantissa step
// (2^-4 relative) for normals, half the subnormal step (2^-10) below 2^-6.
double e4m3_error_bound(double scaled) { return std::max(std::fabs(scaled) * 0x1p-4, 0x1p-10); }

class QuantizeRows : public ::testing::TestWithParam<ScaleFormat> {};

TEST_P(QuantizeRows, ErrorWithinHalfStepAndAmaxFitsRange) {
  const ScaleFormat format = GetParam();
  test::SeededRng rng;
  const int rows = 7, cols = 512;
  std::vector<float> values(rows * cols);
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) values[r * cols + c] = rng.normal(std::ldexp(1.0f, rng.integer(-8, 8)));
  const QuantizedRows q = quantize_rows_per_128(values.data(), rows, cols, format);
  ASSERT_EQ(q.scales.size(), static_cast<size_t>(rows * cols / 128));
  const std::vector<double> decoded = dequantize_rows_per_128(q.codes.data(), q.scales.data(), rows, cols);
  for (int r = 0; r < rows; ++r) {
    for (int b = 0; b < cols / 128; ++b) {
      const float scale = q.scales[r * (cols / 128) + b];
      float amax = 0;
      for (int c = b * 128; c < (b + 1) * 128; ++c) amax = std::max(amax, std::fabs(values[r * cols + c]));
      if (format == ScaleFormat::ue8m0) {
        int exponent;
        EXPECT_EQ(std::frexp(scale, &exponent), 0.5f) << "ue8m0 scale must be a power of two";
        EXPECT_LE(amax / scale, 448.0f);
        EXPECT_GT(amax / scale, 224.0f);
      } else {
        EXPECT_EQ(scale, amax / 448.0f);
      }
      for (int c = b * 128; c < (b + 1) * 128; ++c) {
        const double v = values[r * cols + c];
        ASSERT_LE(std::fabs(decoded[r * cols + c] - v), e4m3_error_bound(v / scale) * scale * (1 + 1e-6))
            << "row " << r << " col " << c;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, QuantizeRows, ::testing::Values(ScaleFormat::fp32, ScaleFormat::ue8m0));

TEST(QuantizeBlock, AmaxElementMapsToTheLargestCode) {
  test::SeededRng rng;
  std::vector<float> values(128);
  for (float& v : values) v = rng.uniform(-2.0f, 2.0f);
  values[37] = -5.5f;
  std::vector<uint8_t> codes(128);
  const float scale = quantize_block(values.data(), 128, 1, ScaleFormat::fp32, codes.data());
  EXPECT_EQ(codes[37], 0xFE);  // -448
  EXPECT_EQ(scale, 5.5f / 448.0f);
}

TEST(QuantizeBlock, ZeroBlockGetsTheMinimumScale) {
  std::vector<float> values(128, 0.0f);
  std::vector<uint8_t> codes(128, 0xAA);
  const float scale = quantize_block(values.data(), 128, 1, ScaleFormat::fp32, codes.data());
  EXPECT_EQ(scale, kMinBlockAmax / 448.0f);
  for (uint8_t c : codes) EXPECT_EQ(c, 0x00);
}

TEST(QuantizeBlock, StridedAccessTouchesOnlyItsElements) {
  std::vector<float> values(256);
  for (int i = 0; i < 256; ++i) values[i] = (i % 2 == 0) ? 1.0f : 1000.0f;
  std::vector<uint8_t> codes(256, 0xAA);
  const float scale = quantize_block(values.data(), 128, 2, ScaleFormat::fp32, codes.data());
  EXPECT_EQ(scale, 1.0f / 448.0f);
  for (int i = 0; i < 256; ++i) EXPECT_EQ(codes[i], i % 2 == 0 ? 0x7E : 0xAA) << i;
}

TEST(QuantizeBlocks128x128, OneScalePerBlockRowMajor) {
  test::SeededRng rng;
  const int rows = 256, cols = 384;
  std::vector<float> values(rows * cols);
  for (float& v : values) v = rng.uniform(-1.0f, 1.0f);
  values[130 * cols + 300] = 9.0f;  // block (1, 2)
  std::vector<uint8_t> codes(values.size());
  std::vector<float> scales(6);
  quantize_blocks_128x128(values.data(), rows, cols, ScaleFormat::fp32, codes.data(), scales.data());
  ASSERT_EQ(scales.size(), 6u);
  EXPECT_EQ(scales[1 * 3 + 2], 9.0f / 448.0f);
  EXPECT_EQ(codes[130 * cols + 300], 0x7E);
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) {
      const double decoded = double(e4m3_decode(codes[r * cols + c])) * scales[(r / 128) * 3 + c / 128];
      const double v = values[r * cols + c];
      ASSERT_LE(std::fabs(decoded - v), e4m3_error_bound(v / scales[(r / 128) * 3 + c / 128]) * scales[(r / 128) * 3 + c / 128] * (1 + 1e-6));
    }
}

// fp8_tensor's activations: factor 1 / scale (one fp32 division), codes e4m3(v * factor); values
// beyond 448 scales saturate to +-448 codes, never to NaN.
TEST(QuantizePerTensor, EncodesWithTheReciprocalOfTheScaleAndSaturates) {
  test::SeededRng rng;
  const float scale = rng.uniform(1e-3f, 1e-1f);
  EXPECT_EQ(tensor_factor(scale), 1.0f / scale);
  // 2.2 standard deviations reach 448 scales: a few percent of the values saturate.
  const std::vector<float> values = rng.normals(4096, 200.0f * scale);
  std::vector<uint8_t> codes(values.size());
  quantize_per_tensor(values.data(), values.size(), scale, codes.data());
  const std::vector<double> decoded = dequantize_per_tensor(codes.data(), codes.size(), scale);
  int saturated = 0;
  for (size_t i = 0; i < values.size(); ++i) {
    const float scaled = values[i] * (1.0f / scale);
    ASSERT_EQ(codes[i], e4m3_encode(scaled)) << i;
    ASSERT_EQ(decoded[i], static_cast<double>(e4m3_decode(codes[i])) * scale) << i;
    if (std::fabs(scaled) >= 464.0f) {  // past the midpoint of 448 and the next step, 480
      ASSERT_EQ(codes[i], values[i] > 0 ? 0x7E : 0xFE) << i;
      ++saturated;
    } else {
      ASSERT_LE(std::fabs(decoded[i] - values[i]), e4m3_error_bound(scaled) * scale * (1 + 1e-6)) << i;
    }
  }
  EXPECT_GT(saturated, 0);
}

TEST(QuantizePerTensor, ScaleFromAmaxIsTheFp32BlockScale) {
  test::SeededRng rng;
  const float amax = rng.uniform(0.01f, 100.0f);
  EXPECT_EQ(tensor_scale(amax), amax / 448.0f);
  EXPECT_EQ(tensor_scale(amax), block_scale(amax, ScaleFormat::fp32).scale);
  EXPECT_EQ(tensor_scale(rng.uniform(0.0f, kMinBlockAmax)), kMinBlockAmax / 448.0f);
}

}  // namespace
}  // namespace megamoe::quant
