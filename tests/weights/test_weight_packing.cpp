#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <utility>

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

// The error prepare_weights throws for this input, if any, and its message.
std::optional<ErrorCode> code_of(const WeightsView& view, const MoeSpec& spec, std::string* message = nullptr) {
  try {
    prepare_weights(spec, view);
  } catch (const Error& e) {
    if (message) *message = e.what();
    return e.code();
  }
  return std::nullopt;
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

// Scales beside bf16 or fp32 values were dropped without a word: codes upcast from an fp8
// checkpoint but passed with their scales packed each value off by its scale. Refused, naming the
// scales given and the dtype; the same values without scales pack as before.
TEST(PrepareWeights, RefusesScalesBesideValuesThatTakeNone) {
  const MoeSpec spec = small_spec(Precision::fp8_block);  // E = 3, H = 256, I = 128
  const std::vector<float> w(3ull * 2 * 128 * 256, 0.25f);
  const std::vector<float> w13_blocks(3 * 2 * 2, 2.0f), w2_blocks(3 * 2 * 1, 2.0f);
  for (DType dtype : {DType::fp32, DType::bf16}) {
    SCOPED_TRACE(to_string(dtype));
    std::vector<bf16_t> w_bf16(w.size(), bf16_t::from_float(0.25f));
    const void* values = dtype == DType::fp32 ? static_cast<const void*>(w.data()) : w_bf16.data();
    EXPECT_EQ(code_of(WeightsView{values, values, dtype}, spec), std::nullopt);
    const std::pair<WeightsView, std::string> cases[] = {
        {WeightsView{values, values, dtype, w13_blocks.data(), w2_blocks.data()}, "weights.w13_scales is set"},
        {WeightsView{values, values, dtype, nullptr, w2_blocks.data()}, "weights.w2_scales is set"},
    };
    for (const auto& [view, expected] : cases) {
      std::string message;
      EXPECT_EQ(code_of(view, spec, &message), ErrorCode::invalid_argument) << expected;
      EXPECT_NE(message.find(expected + ", but weights.dtype=" + to_string(dtype) + " takes no scales"),
                std::string::npos)
          << message;
    }
  }
}

// A NaN or inf weight, in any dtype and scale layout, is refused and named by its place in the
// caller's [E, rows, cols] tensor (it would spoil its quantization block and every token routed to
// its expert); a NaN code of an E4M3 checkpoint too, kept as it is by fp8_tensor or decoded by the
// others.
TEST(PrepareWeights, RefusesWeightsThatAreNotFinite) {
  const int E = 3, H = 256, I = 128;
  const size_t w13_count = static_cast<size_t>(E) * 2 * I * H, w2_count = static_cast<size_t>(E) * H * I;
  const size_t w2_place = (1ull * H + 3) * I + 5;  // w2[1, 3, 5]
  auto expect_refused = [&](const WeightsView& view, Precision precision, const std::string& place) {
    SCOPED_TRACE(place + " as " + to_string(view.dtype) + " for " + to_string(precision));
    std::string message;
    EXPECT_EQ(code_of(view, small_spec(precision, E, H, I), &message), ErrorCode::invalid_argument);
    EXPECT_NE(message.find(place), std::string::npos) << message;
  };
  for (float bad : {std::nanf(""), INFINITY, -INFINITY}) {
    std::vector<float> w13(w13_count, 0.01f), w2(w2_count, 0.01f);
    w2[w2_place] = bad;
    const std::string value = bad != bad ? "nan" : bad > 0 ? "inf" : "-inf";
    expect_refused(WeightsView{w13.data(), w2.data(), DType::fp32}, Precision::fp8_block,
                   "weights.w2[1, 3, 5] = " + value);
    std::vector<bf16_t> w13_bf16(w13_count, bf16_t::from_float(0.01f)), w2_bf16(w2_count, bf16_t::from_float(0.01f));
    w13_bf16[(2ull * 2 * I + 7) * H + 9] = bf16_t::from_float(bad);  // w13[2, 7, 9]
    expect_refused(WeightsView{w13_bf16.data(), w2_bf16.data(), DType::bf16}, Precision::bf16,
                   "weights.w13[2, 7, 9] = " + value);
  }
  std::vector<uint8_t> w13_codes(w13_count, 0x30), w2_codes(w2_count, 0x30);
  w2_codes[w2_place] = quant::kE4M3NaN | 0x80;
  const std::vector<float> block_scales(E * 2 * 2, 1e-3f), expert_scales(E, 1e-3f);
  for (Precision precision : {Precision::fp8_block, Precision::fp8_tensor}) {
    expect_refused(WeightsView{w13_codes.data(), w2_codes.data(), DType::fp8_e4m3, block_scales.data(),
                               block_scales.data()},
                   precision, "weights.w2[1, 3, 5] = nan");
    WeightsView per_tensor{w13_codes.data(), w2_codes.data(), DType::fp8_e4m3, expert_scales.data(),
                           expert_scales.data(), ScaleLayout::per_tensor, ScaleLayout::per_tensor};
    expect_refused(per_tensor, precision, "weights.w2[1, 3, 5] = nan");
  }
}

// A finite scale large enough that decode(code) x scale passes FLT_MAX makes an inf weight as surely
// as a NaN code does. The precisions that decode the checkpoint refuse it; fp8_tensor, which keeps
// the codes and scale as they are (and multiplies the scale into every output of that expert),
// refuses the same place.
TEST(PrepareWeights, RefusesScalesThatMakeAWeightInfinite) {
  const int E = 3, H = 256, I = 128;
  const std::vector<uint8_t> w13_codes(static_cast<size_t>(E) * 2 * I * H, 0x30);  // 0.5
  std::vector<uint8_t> w2_codes(static_cast<size_t>(E) * H * I, 0x30);
  w2_codes[(1ull * H + 3) * I + 5] = 0x7E;  // 448 at w2[1, 3, 5]
  const std::vector<float> w13_scales(E, 1e-3f);
  std::vector<float> w2_scales(E, 1e-3f);
  w2_scales[1] = 1e36f;  // 448 x 1e36 is past FLT_MAX; 0.5 x 1e36 is not
  const WeightsView view{w13_codes.data(), w2_codes.data(), DType::fp8_e4m3, w13_scales.data(), w2_scales.data(),
                         ScaleLayout::per_tensor, ScaleLayout::per_tensor};
  for (Precision precision : {Precision::fp8_tensor, Precision::fp8_block, Precision::bf16}) {
    std::string message;
    EXPECT_EQ(code_of(view, small_spec(precision, E, H, I), &message), ErrorCode::invalid_argument)
        << to_string(precision);
    EXPECT_NE(message.find("weights.w2[1, 3, 5] = inf"), std::string::npos) << to_string(precision) << ": " << message;
  }
}

// A scale layout or dtype that names no enumerator (a cast from another language's integer) would
// read every value of every expert with the first scale and check none of the others: it is
// refused, for either matrix, and named by its integer.
TEST(PrepareWeights, ScaleLayoutsMustNameAnEnumerator) {
  const MoeSpec spec = small_spec(Precision::fp8_block);  // E = 3, H = 256, I = 128
  const std::vector<uint8_t> codes(3ull * 2 * 128 * 256, 0x38);
  const std::vector<float> w13_blocks(3 * 2 * 2, 1.0f), w2_blocks(3 * 2 * 1, 1.0f);
  const WeightsView good{codes.data(), codes.data(), DType::fp8_e4m3, w13_blocks.data(), w2_blocks.data()};
  ASSERT_EQ(code_of(good, spec), std::nullopt);
  for (const bool w13 : {true, false}) {
    WeightsView bad = good;
    (w13 ? bad.w13_scale_layout : bad.w2_scale_layout) = static_cast<ScaleLayout>(9);
    const std::string field = w13 ? "weights.w13_scale_layout=9" : "weights.w2_scale_layout=9";
    std::string message;
    EXPECT_EQ(code_of(bad, spec, &message), ErrorCode::invalid_argument) << field;
    EXPECT_NE(message.find(field), std::string::npos) << "message '" << message << "' should name " << field;
  }
  WeightsView bad_dtype = good;
  bad_dtype.dtype = static_cast<DType>(7);
  std::string message;
  EXPECT_EQ(code_of(bad_dtype, spec, &message), ErrorCode::invalid_argument);
  EXPECT_NE(message.find("weights.dtype=7 is none of"), std::string::npos) << message;
}

// ---- fp8_tensor: one scale per expert matrix (gate and up rows apart) and static activation scales.

// An fp8_tensor layer's activation scales, as a checkpoint carries them: `count` per matrix.
struct CheckpointInputScales {
  std::vector<float> w13, w2;
};

CheckpointInputScales make_input_scales(test::SeededRng& rng, int count) {
  CheckpointInputScales s;
  for (int i = 0; i < count; ++i) {
    s.w13.push_back(rng.uniform(0.005f, 0.05f));
    s.w2.push_back(rng.uniform(0.0005f, 0.005f));
  }
  return s;
}

WeightsView with_input_scales(WeightsView view, const CheckpointInputScales& scales) {
  view.w13_input_scale = scales.w13.data();
  view.w2_input_scale = scales.w2.data();
  view.input_scale_count = static_cast<int>(scales.w13.size());
  return view;
}

// The largest |value| of `count` values.
float amax_of(const float* values, size_t count) {
  float amax = 0.0f;
  for (size_t i = 0; i < count; ++i) amax = std::max(amax, std::fabs(values[i]));
  return amax;
}

// From values, each expert's gate rows, up rows and w2 are quantized as one block each: scale
// amax / 448 and codes e4m3(v * 448 / amax) (quantize_block's factor), the rows moved to the packed
// interleaved order; unpacked, every value is within half an E4M3 step.
TEST(PrepareFp8Tensor, QuantizesEachExpertMatrixAsOneBlock) {
  test::SeededRng rng;
  const int E = 3, H = 256, I = 128;
  const MoeSpec spec = small_spec(Precision::fp8_tensor, E, H, I);
  const std::vector<bf16_t> w13 = rng.bf16_normals(static_cast<size_t>(E) * 2 * I * H, 0.05f);
  const std::vector<bf16_t> w2 = rng.bf16_normals(static_cast<size_t>(E) * H * I, 0.05f);
  const CheckpointInputScales input = make_input_scales(rng, 1);
  const PackedWeights packed =
      prepare_weights(spec, with_input_scales(WeightsView{w13.data(), w2.data(), DType::bf16}, input));
  ASSERT_EQ(packed.element_bytes(), 1);
  ASSERT_EQ(packed.w13.size(), w13.size());
  ASSERT_EQ(packed.w2.size(), w2.size());
  ASSERT_EQ(packed.w13_scales.size(), 2u * E);
  ASSERT_EQ(packed.w2_scales.size(), 1u * E);
  EXPECT_EQ(packed.fc1_input_scale, input.w13[0]);
  EXPECT_EQ(packed.fc2_input_scale, input.w2[0]);
  EXPECT_EQ(packed.bytes_per_expert(), 3ull * H * I + 3 * sizeof(float));

  std::vector<float> w13_values(w13.size()), w2_values(w2.size());
  for (size_t i = 0; i < w13.size(); ++i) w13_values[i] = w13[i].to_float();
  for (size_t i = 0; i < w2.size(); ++i) w2_values[i] = w2[i].to_float();
  const size_t part = static_cast<size_t>(I) * H;
  for (int e = 0; e < E; ++e) {
    const float* gate = w13_values.data() + 2 * e * part;
    const float* up = gate + part;
    const float* down = w2_values.data() + e * part;
    const float amax[3] = {amax_of(gate, part), amax_of(up, part), amax_of(down, part)};
    ASSERT_EQ(packed.w13_scales[2 * e], amax[0] / 448.0f);
    ASSERT_EQ(packed.w13_scales[2 * e + 1], amax[1] / 448.0f);
    ASSERT_EQ(packed.w2_scales[e], amax[2] / 448.0f);
    for (int row = 0; row < 2 * I; ++row) {
      const float factor = 448.0f / amax[row < I ? 0 : 1];
      const uint8_t* codes = packed.w13.data() + (2ull * e * I + layout::packed_w13_row(row, I)) * H;
      for (int c = 0; c < H; ++c) {
        ASSERT_EQ(codes[c], quant::e4m3_encode(gate[static_cast<size_t>(row) * H + c] * factor)) << e << " " << row;
      }
    }
    for (size_t i = 0; i < part; ++i) {
      ASSERT_EQ(packed.w2[e * part + i], quant::e4m3_encode(down[i] * (448.0f / amax[2])));
    }
  }
  const DequantizedWeights back = unpack_weights(packed);
  for (size_t i = 0; i < w13_values.size(); ++i) {
    const double scale = packed.w13_scales[2 * (i / (2 * part)) + (i % (2 * part) >= part ? 1 : 0)];
    // Half an E4M3 step: 1/16 relative for normal codes, 2^-10 of the scale below them.
    ASSERT_NEAR(back.w13[i], w13_values[i], std::fabs(w13_values[i]) / 16 + scale * 0x1p-10) << i;
  }
  for (size_t i = 0; i < w2_values.size(); ++i) {
    ASSERT_NEAR(back.w2[i], w2_values[i], std::fabs(w2_values[i]) / 16 + packed.w2_scales[i / part] * 0x1p-10) << i;
  }
}

// A vLLM fp8 checkpoint: E4M3 bytes (any finite code) with one scale per expert matrix, w13's
// per_tensor [E] or per_gate_up [E, 2], w2's per_tensor [E].
struct TensorCheckpoint {
  std::vector<uint8_t> w13, w2;
  std::vector<float> w13_scales, w2_scales;
  ScaleLayout w13_layout;
  std::vector<float> w13_values, w2_values;  // decode(byte) * scale, what the checkpoint means
  WeightsView view() const {
    return WeightsView{w13.data(), w2.data(), DType::fp8_e4m3, w13_scales.data(), w2_scales.data(), w13_layout,
                       ScaleLayout::per_tensor};
  }
};

TensorCheckpoint make_tensor_checkpoint(test::SeededRng& rng, int E, int H, int I, ScaleLayout w13_layout) {
  auto finite_codes = [&](size_t count) {
    std::vector<uint8_t> codes(count);
    for (uint8_t& code : codes) {
      do code = static_cast<uint8_t>(rng.integer(0, 255));
      while (code == quant::kE4M3NaN || code == (quant::kE4M3NaN | 0x80));
    }
    return codes;
  };
  auto scales = [&](size_t count) {
    std::vector<float> v(count);
    for (float& s : v) s = rng.uniform(1e-4f, 1e-3f);
    return v;
  };
  TensorCheckpoint c;
  c.w13 = finite_codes(static_cast<size_t>(E) * 2 * I * H);
  c.w2 = finite_codes(static_cast<size_t>(E) * H * I);
  c.w13_scales = scales(w13_layout == ScaleLayout::per_gate_up ? 2 * E : E);
  c.w2_scales = scales(E);
  c.w13_layout = w13_layout;
  const size_t part = static_cast<size_t>(I) * H;  // one expert's gate rows, up rows or w2
  for (size_t i = 0; i < c.w13.size(); ++i) {
    const size_t e = i / (2 * part), up = i % (2 * part) >= part ? 1 : 0;
    const float scale = c.w13_scales[w13_layout == ScaleLayout::per_gate_up ? 2 * e + up : e];
    c.w13_values.push_back(quant::e4m3_decode(c.w13[i]) * scale);
  }
  for (size_t i = 0; i < c.w2.size(); ++i) c.w2_values.push_back(quant::e4m3_decode(c.w2[i]) * c.w2_scales[i / part]);
  return c;
}

// Per-tensor input keeps its codes bit for bit (only w13's rows move to the interleaved order) and
// its scales ([E] serves gate and up), so unpacking gives the checkpoint's values exactly.
TEST(PrepareFp8Tensor, KeepsPerTensorCheckpointCodesAndScales) {
  test::SeededRng rng;
  const int E = 3, H = 128, I = 256;
  const MoeSpec spec = small_spec(Precision::fp8_tensor, E, H, I);
  for (ScaleLayout w13_layout : {ScaleLayout::per_tensor, ScaleLayout::per_gate_up}) {
    SCOPED_TRACE(w13_layout == ScaleLayout::per_tensor ? "per_tensor" : "per_gate_up");
    const TensorCheckpoint c = make_tensor_checkpoint(rng, E, H, I, w13_layout);
    const PackedWeights packed = prepare_weights(spec, with_input_scales(c.view(), make_input_scales(rng, 1)));
    EXPECT_EQ(packed.w2, c.w2);
    EXPECT_EQ(packed.w2_scales, c.w2_scales);
    const bool per_gate_up = w13_layout == ScaleLayout::per_gate_up;
    for (int e = 0; e < E; ++e) {
      EXPECT_EQ(packed.w13_scales[2 * e], c.w13_scales[per_gate_up ? 2 * e : e]);
      EXPECT_EQ(packed.w13_scales[2 * e + 1], c.w13_scales[per_gate_up ? 2 * e + 1 : e]);
      for (int row = 0; row < 2 * I; ++row) {
        const size_t original = (2ull * e * I + row) * H, moved = (2ull * e * I + layout::packed_w13_row(row, I)) * H;
        ASSERT_EQ(std::memcmp(packed.w13.data() + moved, c.w13.data() + original, H), 0) << e << " " << row;
      }
    }
    const DequantizedWeights back = unpack_weights(packed);
    EXPECT_EQ(back.w13, c.w13_values);
    EXPECT_EQ(back.w2, c.w2_values);
  }
}

// The same codes and scales in both packs.
void expect_same_pack(const PackedWeights& got, const PackedWeights& want) {
  EXPECT_EQ(got.w13, want.w13);
  EXPECT_EQ(got.w2, want.w2);
  EXPECT_EQ(got.w13_scales, want.w13_scales);
  EXPECT_EQ(got.w2_scales, want.w2_scales);
}

// Every other input is decoded first, then quantized per matrix: an fp8_tensor pack of a block
// checkpoint equals the pack of its decoded values, and so does a pack of w13 kept from a
// per_gate_up checkpoint beside a w2 with block scales (one layout per matrix).
TEST(PrepareFp8Tensor, OtherCheckpointsPackAsTheirDecodedValues) {
  test::SeededRng rng;
  const int E = 2, H = 256, I = 256;
  const MoeSpec spec = small_spec(Precision::fp8_tensor, E, H, I);
  const CheckpointInputScales input = make_input_scales(rng, E);
  const Fp8Checkpoint blocks = make_checkpoint(rng, E, H, I);
  const PackedWeights from_blocks = prepare_weights(
      spec, with_input_scales(WeightsView{blocks.w13.data(), blocks.w2.data(), DType::fp8_e4m3,
                                          blocks.w13_scales.data(), blocks.w2_scales.data()},
                              input));
  const PackedWeights from_values = prepare_weights(
      spec, with_input_scales(WeightsView{blocks.w13_values.data(), blocks.w2_values.data(), DType::fp32}, input));
  expect_same_pack(from_blocks, from_values);

  const TensorCheckpoint tensor = make_tensor_checkpoint(rng, E, H, I, ScaleLayout::per_gate_up);
  WeightsView mixed = tensor.view();
  mixed.w2 = blocks.w2.data();
  mixed.w2_scales = blocks.w2_scales.data();
  mixed.w2_scale_layout = ScaleLayout::block_128x128;
  const PackedWeights from_mixed = prepare_weights(spec, with_input_scales(mixed, input));
  EXPECT_EQ(from_mixed.w13, prepare_weights(spec, with_input_scales(tensor.view(), input)).w13);
  EXPECT_EQ(from_mixed.w2, from_values.w2);
  EXPECT_EQ(from_mixed.w2_scales, from_values.w2_scales);
}

// The other precisions take per-tensor checkpoints too, decoded: fp8_block re-quantizes the
// decoded values in 128x128 blocks, bf16 rounds them.
TEST(PrepareWeights, PerTensorCheckpointForOtherPrecisions) {
  test::SeededRng rng;
  const int E = 2, H = 256, I = 128;
  for (ScaleLayout w13_layout : {ScaleLayout::per_tensor, ScaleLayout::per_gate_up}) {
    const TensorCheckpoint c = make_tensor_checkpoint(rng, E, H, I, w13_layout);
    for (Precision precision : {Precision::fp8_block, Precision::bf16}) {
      SCOPED_TRACE(to_string(precision));
      const MoeSpec spec = small_spec(precision, E, H, I);
      const PackedWeights from_codes = prepare_weights(spec, c.view());
      const PackedWeights from_values =
          prepare_weights(spec, WeightsView{c.w13_values.data(), c.w2_values.data(), DType::fp32});
      expect_same_pack(from_codes, from_values);
      EXPECT_EQ(from_codes.fc1_input_scale, 0.0f) << "only fp8_tensor reads input scales";
    }
  }
}

// The packed activation scales are the largest of the checkpoint's (one per layer or per expert).
TEST(PrepareFp8Tensor, InputScalesAreTheLargestGiven) {
  test::SeededRng rng;
  const int E = 4;
  const MoeSpec spec = small_spec(Precision::fp8_tensor, E, 128, 128);
  const std::vector<bf16_t> w13 = rng.bf16_normals(static_cast<size_t>(E) * 2 * 128 * 128, 0.05f);
  const std::vector<bf16_t> w2 = rng.bf16_normals(static_cast<size_t>(E) * 128 * 128, 0.05f);
  for (int count : {1, E}) {
    const CheckpointInputScales input = make_input_scales(rng, count);
    const PackedWeights packed =
        prepare_weights(spec, with_input_scales(WeightsView{w13.data(), w2.data(), DType::bf16}, input));
    EXPECT_EQ(packed.fc1_input_scale, *std::max_element(input.w13.begin(), input.w13.end())) << count;
    EXPECT_EQ(packed.fc2_input_scale, *std::max_element(input.w2.begin(), input.w2.end())) << count;
    EXPECT_EQ(packed.input_scales, InputScales::from_checkpoint);
    const PackedWeightsView view = packed.view();
    EXPECT_EQ(view.input_scales, InputScales::from_checkpoint);
    EXPECT_EQ(view.fc1_input_scale, packed.fc1_input_scale);
    EXPECT_EQ(view.fc2_input_scale, packed.fc2_input_scale);
  }
}

// Without activation scales (vLLM's activation_scheme "dynamic") the pack says so and holds none;
// the weights are packed as with them, and the view passes validation.
TEST(PrepareFp8Tensor, NoInputScalesPackDynamicScales) {
  test::SeededRng rng;
  const int E = 2;
  const MoeSpec spec = small_spec(Precision::fp8_tensor, E, 128, 128);
  const std::vector<bf16_t> w13 = rng.bf16_normals(static_cast<size_t>(E) * 2 * 128 * 128, 0.05f);
  const std::vector<bf16_t> w2 = rng.bf16_normals(static_cast<size_t>(E) * 128 * 128, 0.05f);
  const WeightsView without = WeightsView{w13.data(), w2.data(), DType::bf16};
  const PackedWeights dynamic = prepare_weights(spec, without);
  EXPECT_EQ(dynamic.input_scales, InputScales::dynamic);
  EXPECT_EQ(dynamic.fc1_input_scale, 0.0f);
  EXPECT_EQ(dynamic.fc2_input_scale, 0.0f);
  EXPECT_EQ(dynamic.view().input_scales, InputScales::dynamic);
  EXPECT_NO_THROW(validate_packed(spec, dynamic));
  const PackedWeights fixed = prepare_weights(spec, with_input_scales(without, make_input_scales(rng, 1)));
  EXPECT_EQ(dynamic.w13, fixed.w13);
  EXPECT_EQ(dynamic.w13_scales, fixed.w13_scales);
  EXPECT_EQ(dynamic.w2, fixed.w2);
  EXPECT_EQ(dynamic.w2_scales, fixed.w2_scales);
  // A from_checkpoint view without its scales is refused.
  PackedWeightsView unscaled = dynamic.view();
  unscaled.input_scales = InputScales::from_checkpoint;
  EXPECT_THROW(validate_packed(spec, unscaled), Error);
  // Nor is a value that names neither kind (a cast from another language's integer).
  PackedWeightsView unnamed = dynamic.view();
  unnamed.input_scales = static_cast<InputScales>(7);
  EXPECT_THROW(validate_packed(spec, unnamed), Error);
}

TEST(PrepareFp8Tensor, RejectsBadInput) {
  test::SeededRng rng;
  const int E = 3, H = 128, I = 128;
  const MoeSpec spec = small_spec(Precision::fp8_tensor, E, H, I);
  const TensorCheckpoint c = make_tensor_checkpoint(rng, E, H, I, ScaleLayout::per_gate_up);
  const CheckpointInputScales input = make_input_scales(rng, E);
  const WeightsView good = with_input_scales(c.view(), input);
  ASSERT_EQ(code_of(good, spec), std::nullopt);
  // Checks `view` fails with `code` and a message that names `field`.
  auto expect_rejected = [&](const WeightsView& view, ErrorCode code, const char* field, const MoeSpec& s) {
    std::string message;
    EXPECT_EQ(code_of(view, s, &message), code) << field;
    EXPECT_NE(message.find(field), std::string::npos) << "message '" << message << "' should name " << field;
  };

  WeightsView no_weight_scales = good;
  no_weight_scales.w2_scales = nullptr;
  expect_rejected(no_weight_scales, ErrorCode::null_pointer, "w2_scales", spec);
  // One static activation scale without the other: neither static nor dynamic.
  for (bool keep_fc1 : {true, false}) {
    WeightsView one_input_scale = good;
    (keep_fc1 ? one_input_scale.w2_input_scale : one_input_scale.w13_input_scale) = nullptr;
    expect_rejected(one_input_scale, ErrorCode::null_pointer, "together", spec);
    expect_rejected(one_input_scale, ErrorCode::null_pointer, keep_fc1 ? "only w13_input_scale" : "only w2_input_scale",
                    spec);
  }
  for (int count : {0, 2, E + 1}) {
    WeightsView bad_count = good;
    bad_count.input_scale_count = count;
    expect_rejected(bad_count, ErrorCode::invalid_argument, "input_scale_count", spec);
  }
  for (float bad : {0.0f, -0.01f, std::nanf(""), INFINITY, 1e-40f /* subnormal: 1 / scale overflows */}) {
    CheckpointInputScales bad_input = input;
    bad_input.w13[E - 1] = bad;
    expect_rejected(with_input_scales(c.view(), bad_input), ErrorCode::invalid_argument, "w13_input_scale[2]", spec);
  }
  for (float bad : {0.0f, std::nanf("")}) {
    TensorCheckpoint bad_scales = c;
    bad_scales.w13_scales[2 * E - 1] = bad;  // the last up scale: [E, 2] are all checked
    expect_rejected(with_input_scales(bad_scales.view(), input), ErrorCode::invalid_argument, "w13_scales[5]", spec);
    bad_scales = c;
    bad_scales.w2_scales[E - 1] = bad;
    expect_rejected(with_input_scales(bad_scales.view(), input), ErrorCode::invalid_argument, "w2_scales[2]", spec);
  }
  WeightsView w2_per_gate_up = good;
  w2_per_gate_up.w2_scale_layout = ScaleLayout::per_gate_up;
  expect_rejected(w2_per_gate_up, ErrorCode::invalid_argument, "w2_scale_layout", spec);
  MoeSpec ue8m0 = spec;
  ue8m0.scale_format = ScaleFormat::ue8m0;
  expect_rejected(good, ErrorCode::invalid_spec, "ue8m0", ue8m0);

  // The other precisions leave the input scales unread, whatever they hold.
  CheckpointInputScales unread = input;
  unread.w13[0] = std::nanf("");
  WeightsView unread_view = with_input_scales(c.view(), unread);
  unread_view.input_scale_count = 2;
  EXPECT_EQ(code_of(unread_view, small_spec(Precision::fp8_block, E, H, I)), std::nullopt);
  EXPECT_EQ(code_of(unread_view, small_spec(Precision::bf16, E, H, I)), std::nullopt);
}

// A view names the same bytes with the sizes its shapes imply; a view or a pack that does not
// match its spec, lacks a pointer, or holds the wrong number of bytes is refused.
TEST(PackedWeights, ViewsAreCheckedAgainstTheSpec) {
  test::SeededRng rng;
  const std::vector<float> w13 = rng.normals(3ull * 2 * 128 * 256, 0.05f), w2 = rng.normals(3ull * 256 * 128, 0.05f);
  const CheckpointInputScales input = make_input_scales(rng, 1);
  const WeightsView weights = with_input_scales(WeightsView{w13.data(), w2.data(), DType::fp32}, input);
  for (Precision precision : {Precision::bf16, Precision::fp8_block, Precision::fp8_tensor}) {
    SCOPED_TRACE(to_string(precision));
    const MoeSpec spec = small_spec(precision);
    PackedWeights packed = prepare_weights(spec, weights);
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
    PackedWeights short_scales = packed;
    if (!short_scales.w2_scales.empty()) {
      short_scales.w2_scales.pop_back();
      EXPECT_THROW(validate_packed(spec, short_scales), Error);
    }
    packed.w2.pop_back();
    EXPECT_THROW(validate_packed(spec, packed), Error);
  }
  // fp8_tensor views need their scales and finite, positive, normal activation scales; a pack of
  // the other fp8 precision is refused.
  const MoeSpec tensor_spec = small_spec(Precision::fp8_tensor);
  const PackedWeights tensor = prepare_weights(tensor_spec, weights);
  PackedWeightsView no_scales = tensor.view();
  no_scales.w13_scales = nullptr;
  EXPECT_THROW(validate_packed(tensor_spec, no_scales), Error);
  for (float bad : {0.0f, -1.0f, std::nanf(""), INFINITY, 1e-40f}) {
    PackedWeightsView bad_fc1 = tensor.view(), bad_fc2 = tensor.view();
    bad_fc1.fc1_input_scale = bad;
    bad_fc2.fc2_input_scale = bad;
    EXPECT_THROW(validate_packed(tensor_spec, bad_fc1), Error) << bad;
    EXPECT_THROW(validate_packed(tensor_spec, bad_fc2), Error) << bad;
  }
  EXPECT_THROW(validate_packed(small_spec(Precision::fp8_block), tensor.view()), Error);
  const PackedWeights bf16 = prepare_weights(small_spec(Precision::bf16), WeightsView{w13.data(), w2.data(), DType::fp32});
  PackedWeightsView fp8_without_scales = bf16.view();
  fp8_without_scales.precision = Precision::fp8_block;
  EXPECT_THROW(validate_packed(small_spec(Precision::fp8_block), fp8_without_scales), Error);
}

// A pack checked against another spec names the first field that differs, with both values, and
// a missing pointer by its name: a caller holding the packs of several layers can tell which is
// wrong and how.
TEST(PackedWeights, MismatchesNameTheFieldAndBothValues) {
  const MoeSpec spec = small_spec(Precision::fp8_block);  // E = 3, H = 256, I = 128
  const std::vector<float> w13(3ull * 2 * 128 * 256, 0.01f), w2(3ull * 256 * 128, 0.01f);
  const PackedWeights packed = prepare_weights(spec, WeightsView{w13.data(), w2.data(), DType::fp32});
  const std::pair<void (*)(MoeSpec&), const char*> cases[] = {
      {[](MoeSpec& s) { s.num_experts = 4; }, "packed weights have num_experts=3 where the spec has num_experts=4"},
      {[](MoeSpec& s) { s.hidden = 512; }, "hidden=256 where the spec has hidden=512"},
      {[](MoeSpec& s) { s.intermediate = 256; }, "intermediate=128 where the spec has intermediate=256"},
      {[](MoeSpec& s) { s.precision = Precision::fp8_tensor; }, "precision=fp8_block where the spec has precision=fp8_tensor"},
      {[](MoeSpec& s) { s.scale_format = ScaleFormat::ue8m0; }, "scale_format=fp32 where the spec has scale_format=ue8m0"},
  };
  auto expect_refused = [](auto&& call, ErrorCode code, const std::string& expected) {
    try {
      call();
      ADD_FAILURE() << "accepted; expected: " << expected;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), code) << e.what();
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
  };
  for (const auto& [mutate, expected] : cases) {
    MoeSpec other = spec;
    mutate(other);
    expect_refused([&] { validate_packed(other, packed); }, ErrorCode::invalid_argument, expected);
  }
  PackedWeightsView no_w2 = packed.view();
  no_w2.w2 = nullptr;
  expect_refused([&] { validate_packed(spec, no_w2); }, ErrorCode::null_pointer, "packed weights: w2 is null");
  PackedWeightsView no_scales = packed.view();
  no_scales.w13_scales = nullptr;
  expect_refused([&] { validate_packed(spec, no_scales); }, ErrorCode::null_pointer, "w13_scales is null");
}

// A pack filled outside prepare_weights (a converter of the caller's, a file) holds its fp8 scales
// on the host: a NaN, inf, zero or negative one passed every check and silently turned each output
// row of its expert into NaN, inf or zeros. It is refused, named by its index and value, in either
// fp8 precision and either matrix.
TEST(PackedWeights, HostScalesMustBeFiniteAndPositive) {
  const std::vector<float> w13(3ull * 2 * 128 * 256, 0.01f), w2(3ull * 256 * 128, 0.01f);
  for (Precision precision : {Precision::fp8_block, Precision::fp8_tensor}) {
    SCOPED_TRACE(to_string(precision));
    const MoeSpec spec = small_spec(precision);
    const PackedWeights packed = prepare_weights(spec, WeightsView{w13.data(), w2.data(), DType::fp32});
    ASSERT_NO_THROW(validate_packed(spec, packed));
    for (float bad : {std::nanf(""), INFINITY, 0.0f, -0.5f}) {
      for (const bool in_w13 : {true, false}) {
        PackedWeights corrupt = packed;
        std::vector<float>& scales = in_w13 ? corrupt.w13_scales : corrupt.w2_scales;
        scales.back() = bad;
        const std::string expected = std::string("packed weights: ") + (in_w13 ? "w13_scales[" : "w2_scales[") +
                                     std::to_string(scales.size() - 1) + "] = ";
        try {
          validate_packed(spec, corrupt);
          ADD_FAILURE() << "accepted a scale of " << bad;
        } catch (const Error& e) {
          EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
          EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
          EXPECT_NE(std::string(e.what()).find("must be finite and positive"), std::string::npos) << e.what();
        }
      }
    }
  }
}

// unpack_weights reads a pack by its own shapes: one whose buffers are short of them, or whose
// precision names none (read as fp8_block, from scales a bf16 pack lacks), is refused instead of
// read past its end.
TEST(PackedWeights, UnpackChecksThePackFirst) {
  const MoeSpec spec = small_spec(Precision::bf16);
  const std::vector<float> w13(3ull * 2 * 128 * 256, 0.01f), w2(3ull * 256 * 128, 0.01f);
  const PackedWeights packed = prepare_weights(spec, WeightsView{w13.data(), w2.data(), DType::fp32});
  EXPECT_EQ(unpack_weights(packed).w2.size(), w2.size());
  const auto expect_refused = [](const PackedWeights& bad, ErrorCode code, const std::string& expected) {
    try {
      unpack_weights(bad);
      ADD_FAILURE() << "a pack was unpacked that should say: " << expected;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), code) << e.what();
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
  };
  PackedWeights short_w2 = packed;
  short_w2.w2.pop_back();
  expect_refused(short_w2, ErrorCode::invalid_argument, "packed weights hold 393216 + 196607 bytes");
  PackedWeights unnamed = packed;
  unnamed.precision = static_cast<Precision>(3);
  expect_refused(unnamed, ErrorCode::invalid_spec, "precision=3");
}

}  // namespace
}  // namespace megamoe
