#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>

#include "common/test_random.hpp"
#include "kernels/layout/weight_layout.hpp"
#include "megamoe/error.hpp"
#include "megamoe/weights.hpp"
#include "quant/fp8_codec.hpp"
#include "quant/quantize.hpp"

namespace megamoe {
namespace {

MoeSpec small_spec(Precision precision, int E = 3, int H = 256, int I = 128) {
  MoeSpec spec;
  spec.num_experts = E;
  spec.top_k = 2;
  spec.hidden = H;
  spec.intermediate = I;
  spec.precision = precision;
  return spec;
}

TEST(WeightLayout, InterleaveByEightIsABijection) {
  for (int I : {8, 64, 512, 2048}) {
    std::vector<int> seen(2 * I, 0);
    for (int row = 0; row < 2 * I; ++row) {
      const int packed = layout::packed_w13_row(row, I);
      ASSERT_GE(packed, 0);
      ASSERT_LT(packed, 2 * I);
      ASSERT_EQ(layout::original_w13_row(packed, I), row);
      ++seen[packed];
    }
    for (int count : seen) ASSERT_EQ(count, 1);
  }
  // gate[0:8], up[0:8], gate[8:16], ...
  EXPECT_EQ(layout::original_w13_row(0, 64), 0);
  EXPECT_EQ(layout::original_w13_row(7, 64), 7);
  EXPECT_EQ(layout::original_w13_row(8, 64), 64);
  EXPECT_EQ(layout::original_w13_row(15, 64), 71);
  EXPECT_EQ(layout::original_w13_row(16, 64), 8);
  EXPECT_EQ(layout::original_w13_row(24, 64), 72);
}

TEST(PrepareWeights, Bf16PackIsExactAndInterleaved) {
  test::SeededRng rng;
  const MoeSpec spec = small_spec(Precision::bf16, 3, 128, 64);
  const auto w13 = rng.bf16_normals(3ull * 2 * 64 * 128);
  const auto w2 = rng.bf16_normals(3ull * 128 * 64);
  const PackedWeights packed = prepare_weights(spec, WeightsView{w13.data(), w2.data(), DType::bf16});
  ASSERT_EQ(packed.w13.size(), w13.size() * 2);
  EXPECT_TRUE(packed.w13_scales.empty());
  // Packed row 8 of expert 1 is up row 0, i.e. original row I.
  bf16_t first;
  std::memcpy(&first, packed.w13.data() + (1ull * 2 * 64 * 128 + 8 * 128) * 2, 2);
  EXPECT_EQ(first.bits, w13[1ull * 2 * 64 * 128 + 64 * 128].bits);
  const DequantizedWeights back = unpack_weights(packed);
  for (size_t i = 0; i < w13.size(); ++i) ASSERT_EQ(back.w13[i], w13[i].to_float()) << i;
  for (size_t i = 0; i < w2.size(); ++i) ASSERT_EQ(back.w2[i], w2[i].to_float()) << i;
}

TEST(PrepareWeights, Fp32InputRoundsToBf16) {
  const MoeSpec spec = small_spec(Precision::bf16, 2, 64, 64);
  std::vector<float> w13(2 * 2 * 64 * 64, 1.0f + 0x1p-10f), w2(2 * 64 * 64, -3.0f);
  const DequantizedWeights back = unpack_weights(prepare_weights(spec, WeightsView{w13.data(), w2.data(), DType::fp32}));
  for (float v : back.w13) ASSERT_EQ(v, 1.0f);  // 1 + 2^-10 rounds to 1 in bf16
  for (float v : back.w2) ASSERT_EQ(v, -3.0f);
}

class PrepareFp8 : public ::testing::TestWithParam<ScaleFormat> {};

TEST_P(PrepareFp8, ScalesPerPackedBlockAndBoundedError) {
  test::SeededRng rng;
  MoeSpec spec = small_spec(Precision::fp8_block, 2, 256, 128);
  spec.scale_format = GetParam();
  std::vector<float> w13 = rng.normals(2ull * 256 * 256, 0.05f), w2 = rng.normals(2ull * 256 * 128, 0.05f);
  w13[1ull * 256 * 256 + 200 * 256 + 3] = 4.0f;  // expert 1, up row 72 -> packed row 16*9+8 = 152: block (1, 0)
  const PackedWeights packed = prepare_weights(spec, WeightsView{w13.data(), w2.data(), DType::fp32});
  ASSERT_EQ(packed.w13.size(), w13.size());
  ASSERT_EQ(packed.w13_scales.size(), 2u * 2 * 2);
  ASSERT_EQ(packed.w2_scales.size(), 2u * 2 * 1);
  EXPECT_EQ(layout::packed_w13_row(200, 128), 152);
  if (spec.scale_format == ScaleFormat::fp32) {
    EXPECT_EQ(packed.w13_scales[4 + 1 * 2 + 0], 4.0f / 448.0f);
    EXPECT_EQ(packed.w13[1ull * 256 * 256 + 152 * 256 + 3], 0x7E);
  }
  const DequantizedWeights back = unpack_weights(packed);
  for (size_t i = 0; i < w13.size(); ++i) {
    // Half an E4M3 step of the block's largest value bounds the error of any element.
    ASSERT_NEAR(back.w13[i], w13[i], std::fabs(w13[i]) / 16 + 4.0 / 448 * 0x1p-10 * 2 + 1e-7) << i;
  }
  for (size_t i = 0; i < w2.size(); ++i) ASSERT_NEAR(back.w2[i], w2[i], std::fabs(w2[i]) / 16 + 1e-5) << i;
  EXPECT_EQ(packed.bytes_per_expert(), 3ull * 256 * 128 + 3ull * 2 * 4);
}

INSTANTIATE_TEST_SUITE_P(Formats, PrepareFp8, ::testing::Values(ScaleFormat::fp32, ScaleFormat::ue8m0));

// A DeepSeek-V3-style checkpoint: E4M3 bytes with one amax/448 scale per 128x128 block of the
// original layout.
struct Fp8Checkpoint {
  std::vector<uint8_t> w13, w2;
  std::vector<float> w13_scales, w2_scales;
  std::vector<float> w13_values, w2_values;  // decode(byte) * scale, what the checkpoint means
};

Fp8Checkpoint make_checkpoint(test::SeededRng& rng, int E, int H, int I) {
  Fp8Checkpoint c;
  auto quantize = [&](int rows, int cols, std::vector<uint8_t>& codes, std::vector<float>& scales,
                      std::vector<float>& values) {
    const size_t count = static_cast<size_t>(rows) * cols, blocks = count / (128 * 128);
    codes.resize(E * count);
    scales.resize(E * blocks);
    values.resize(E * count);
    for (int e = 0; e < E; ++e) {
      std::vector<float> original = rng.normals(count, 0.05f);
      original[rng.integer(0, static_cast<int>(count) - 1)] = 0.9f;  // blocks with different scales
      quant::quantize_blocks_128x128(original.data(), rows, cols, ScaleFormat::fp32, codes.data() + e * count,
                                   scales.data() + e * blocks);
      for (size_t i = 0; i < count; ++i) {
        const int block = static_cast<int>((i / cols) / 128 * (cols / 128) + (i % cols) / 128);
        values[e * count + i] = quant::e4m3_decode(codes[e * count + i]) * scales[e * blocks + block];
      }
    }
  };
  quantize(2 * I, H, c.w13, c.w13_scales, c.w13_values);
  quantize(H, I, c.w2, c.w2_scales, c.w2_values);
  return c;
}

TEST(PrepareWeights, Fp8CheckpointInput) {
  test::SeededRng rng;
  const int E = 2, H = 256, I = 256;
  const Fp8Checkpoint c = make_checkpoint(rng, E, H, I);
  const WeightsView view{c.w13.data(), c.w2.data(), DType::fp8_e4m3, c.w13_scales.data(), c.w2_scales.data()};

  // fp8_block with fp32 scales: w2's blocks are the checkpoint's, so its values survive exactly;
  // each packed w13 block mixes two checkpoint blocks and is re-rounded on the larger scale's grid.
  const PackedWeights fp8 = prepare_weights(small_spec(Precision::fp8_block, E, H, I), view);
  const DequantizedWeights back = unpack_weights(fp8);
  for (size_t i = 0; i < c.w2_values.size(); ++i) ASSERT_EQ(back.w2[i], c.w2_values[i]) << i;
  double largest_scale = 0;
  for (float scale : fp8.w13_scales) largest_scale = std::max<double>(largest_scale, scale);
  long changed = 0;
  for (size_t i = 0; i < c.w13_values.size(); ++i) {
    // Half an E4M3 step: 1/16 relative for normal codes, 2^-10 of the scale below them.
    ASSERT_NEAR(back.w13[i], c.w13_values[i], std::fabs(c.w13_values[i]) / 16 + largest_scale * 0x1p-10) << i;
    changed += back.w13[i] != c.w13_values[i];
  }
  EXPECT_GT(changed, 0) << "blocks with different scales were merged, so some values must move";

  // bf16: the decoded values, rounded to bf16.
  const DequantizedWeights bf16 = unpack_weights(prepare_weights(small_spec(Precision::bf16, E, H, I), view));
  for (size_t i = 0; i < c.w13_values.size(); ++i) {
    ASSERT_EQ(bf16.w13[i], bf16_t::from_float(c.w13_values[i]).to_float()) << i;
  }
  for (size_t i = 0; i < c.w2_values.size(); ++i) {
    ASSERT_EQ(bf16.w2[i], bf16_t::from_float(c.w2_values[i]).to_float()) << i;
  }
}

// A checkpoint with one scale per row (output channel), as FP8-dynamic checkpoints store it, packs
// as its decoded values do: the same bytes as from those values in fp32. I = 192 is not a multiple
// of 128, which per-row scales, unlike blocks, allow (a bf16 layer takes multiples of 64).
TEST(PrepareWeights, Fp8CheckpointWithRowScales) {
  test::SeededRng rng;
  for (const auto& [precision, format, I] : {std::tuple{Precision::fp8_block, ScaleFormat::fp32, 128},
                                            std::tuple{Precision::fp8_block, ScaleFormat::ue8m0, 128},
                                            std::tuple{Precision::bf16, ScaleFormat::fp32, 192}}) {
    const int E = 2, H = 256;
    auto quantize_rows = [&](int rows, int cols, std::vector<uint8_t>& codes, std::vector<float>& scales,
                             std::vector<float>& values) {
      const std::vector<float> original = rng.normals(static_cast<size_t>(E) * rows * cols, 0.05f);
      codes.resize(original.size());
      values.resize(original.size());
      scales.resize(static_cast<size_t>(E) * rows);
      for (size_t row = 0; row < scales.size(); ++row) {
        const float* in = original.data() + row * cols;
        float amax = 0.0f;
        for (int c = 0; c < cols; ++c) amax = std::max(amax, std::fabs(in[c]));
        scales[row] = amax / 448.0f * (1.0f + static_cast<float>(row % 3));  // largest codes below 448 too
        for (int c = 0; c < cols; ++c) {
          codes[row * cols + c] = quant::e4m3_encode(in[c] / scales[row]);
          values[row * cols + c] = quant::e4m3_decode(codes[row * cols + c]) * scales[row];
        }
      }
    };
    std::vector<uint8_t> w13, w2;
    std::vector<float> w13_scales, w2_scales, w13_values, w2_values;
    quantize_rows(2 * I, H, w13, w13_scales, w13_values);
    quantize_rows(H, I, w2, w2_scales, w2_values);
    MoeSpec spec = small_spec(precision, E, H, I);
    spec.scale_format = format;
    const PackedWeights from_codes =
        prepare_weights(spec, WeightsView{w13.data(), w2.data(), DType::fp8_e4m3, w13_scales.data(), w2_scales.data(),
                                          ScaleLayout::per_row, ScaleLayout::per_row});
    const PackedWeights from_values = prepare_weights(spec, WeightsView{w13_values.data(), w2_values.data(), DType::fp32});
    EXPECT_EQ(from_codes.w13, from_values.w13) << to_string(precision) << " I=" << I;
    EXPECT_EQ(from_codes.w2, from_values.w2);
    EXPECT_EQ(from_codes.w13_scales, from_values.w13_scales);
    EXPECT_EQ(from_codes.w2_scales, from_values.w2_scales);
    // One layout per matrix: w2 with block scales beside per-row w13 scales.
    if (I % 128 == 0) {
      std::vector<float> w2_blocks(static_cast<size_t>(E) * (H / 128) * (I / 128), 1.0f);
      const PackedWeights mixed = prepare_weights(
          spec, WeightsView{w13.data(), w2.data(), DType::fp8_e4m3, w13_scales.data(), w2_blocks.data(),
                            ScaleLayout::per_row, ScaleLayout::block_128x128});
      EXPECT_EQ(mixed.w13, from_values.w13);
    }
  }
}

TEST(PrepareWeights, RejectsBadInput) {
  const MoeSpec spec = small_spec(Precision::fp8_block);
  std::vector<float> w(3ull * 2 * 128 * 256);
  auto code_of = [&](const WeightsView& view, const MoeSpec& s) -> std::optional<ErrorCode> {
    try {
      prepare_weights(s, view);
    } catch (const Error& e) {
      return e.code();
    }
    return std::nullopt;
  };
  EXPECT_EQ(code_of(WeightsView{nullptr, w.data(), DType::fp32}, spec), ErrorCode::null_pointer);
  EXPECT_EQ(code_of(WeightsView{w.data(), nullptr, DType::fp32}, spec), ErrorCode::null_pointer);
  EXPECT_EQ(code_of(WeightsView{w.data(), w.data(), DType::fp8_e4m3}, spec), ErrorCode::null_pointer);
  std::vector<float> scales(3 * 2 * 2, 1.0f);
  scales[5] = std::nanf("");
  EXPECT_EQ(code_of(WeightsView{w.data(), w.data(), DType::fp8_e4m3, scales.data(), scales.data()}, spec),
            ErrorCode::invalid_argument);
  scales[5] = 0.0f;
  EXPECT_EQ(code_of(WeightsView{w.data(), w.data(), DType::fp8_e4m3, scales.data(), scales.data()}, spec),
            ErrorCode::invalid_argument);
  MoeSpec bad = spec;
  bad.hidden = 200;
  EXPECT_EQ(code_of(WeightsView{w.data(), w.data(), DType::fp32}, bad), ErrorCode::invalid_spec);
  // Per-row scales are checked too (one not positive), and block scales need whole blocks: a bf16
  // layer with I = 192 takes its w2 scales per row only.
  std::vector<float> row_scales(3 * 256, 1.0f);
  row_scales.back() = -1.0f;
  EXPECT_EQ(code_of(WeightsView{w.data(), w.data(), DType::fp8_e4m3, row_scales.data(), row_scales.data(),
                                ScaleLayout::per_row, ScaleLayout::per_row},
                    spec),
            ErrorCode::invalid_argument);
  MoeSpec odd = small_spec(Precision::bf16, 3, 256, 192);
  std::vector<uint8_t> codes(3ull * 2 * 192 * 256);
  const std::vector<float> ones(3 * 2 * 192, 1.0f);
  EXPECT_EQ(code_of(WeightsView{codes.data(), codes.data(), DType::fp8_e4m3, ones.data(), ones.data(),
                                ScaleLayout::per_row, ScaleLayout::per_row},
                    odd),
            std::nullopt);
  EXPECT_EQ(code_of(WeightsView{codes.data(), codes.data(), DType::fp8_e4m3, ones.data(), ones.data(),
                                ScaleLayout::per_row, ScaleLayout::block_128x128},
                    odd),
            ErrorCode::invalid_argument);
}

// A view names the same bytes with the sizes its shapes imply; a view or a pack that does not
// match its spec, lacks a pointer, or holds the wrong number of bytes is refused.
TEST(PackedWeights, ViewsAreCheckedAgainstTheSpec) {
  test::SeededRng rng;
  const std::vector<float> w13 = rng.normals(3ull * 2 * 128 * 256, 0.05f), w2 = rng.normals(3ull * 256 * 128, 0.05f);
  for (Precision precision : {Precision::bf16, Precision::fp8_block}) {
    SCOPED_TRACE(to_string(precision));
    const MoeSpec spec = small_spec(precision);
    PackedWeights packed = prepare_weights(spec, WeightsView{w13.data(), w2.data(), DType::fp32});
    const PackedWeightsView view = packed.view();
    EXPECT_EQ(view.w13, packed.w13.data());
    EXPECT_EQ(view.w13_bytes(), packed.w13.size());
    EXPECT_EQ(view.w2_bytes(), packed.w2.size());
    EXPECT_EQ(view.w13_scale_count(), packed.w13_scales.size());
    EXPECT_EQ(view.w2_scale_count(), packed.w2_scales.size());
    EXPECT_EQ(view.w13_scales == nullptr, precision == Precision::bf16);
    EXPECT_NO_THROW(validate_packed(spec, view));
    PackedWeightsView no_w2 = view;
    no_w2.w2 = nullptr;
    EXPECT_THROW(validate_packed(spec, no_w2), Error);
    MoeSpec other = spec;
    other.intermediate = 256;
    EXPECT_THROW(validate_packed(other, view), Error);
    packed.w2.pop_back();
    EXPECT_THROW(validate_packed(spec, packed), Error);
  }
  const PackedWeights bf16 = prepare_weights(small_spec(Precision::bf16), WeightsView{w13.data(), w2.data(), DType::fp32});
  PackedWeightsView fp8_without_scales = bf16.view();
  fp8_without_scales.precision = Precision::fp8_block;
  EXPECT_THROW(validate_packed(small_spec(Precision::fp8_block), fp8_without_scales), Error);
}

}  // namespace
}  // namespace megamoe
