#include <gtest/gtest.h>

#include <limits>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "megamoe/error.hpp"
#include "megamoe/forward.hpp"
#include "megamoe/spec.hpp"

namespace megamoe {
namespace {

MoeSpec valid_spec() {
  MoeSpec spec;
  spec.num_experts = 16;
  spec.top_k = 4;
  spec.hidden = 256;
  spec.intermediate = 128;
  spec.precision = Precision::fp8_block;
  return spec;
}

template <class F>
std::optional<ErrorCode> error_of(F&& call, std::string* message = nullptr) {
  try {
    call();
  } catch (const Error& e) {
    if (message) *message = e.what();
    return e.code();
  }
  return std::nullopt;
}

TEST(ValidateSpec, AcceptsValidSpecs) {
  EXPECT_EQ(error_of([] { validate(valid_spec()); }), std::nullopt);
  MoeSpec bf16 = valid_spec();
  bf16.precision = Precision::bf16;
  bf16.hidden = 192;
  bf16.intermediate = 64;
  EXPECT_EQ(error_of([&] { validate(bf16); }), std::nullopt);
}

TEST(ValidateSpec, EachErrorNamesTheField) {
  struct Case {
    const char* field;
    void (*mutate)(MoeSpec&);
  };
  const Case cases[] = {
      {"num_experts", [](MoeSpec& s) { s.num_experts = 0; }},
      {"top_k", [](MoeSpec& s) { s.top_k = 17; }},
      {"top_k", [](MoeSpec& s) { s.top_k = 0; }},
      {"hidden", [](MoeSpec& s) { s.hidden = 192; }},  // fp8_block needs multiples of 128
      {"intermediate", [](MoeSpec& s) { s.intermediate = 0; }},
      {"hidden", [](MoeSpec& s) { s.precision = Precision::bf16; s.hidden = 96; }},
      {"ue8m0", [](MoeSpec& s) { s.precision = Precision::bf16; s.scale_format = ScaleFormat::ue8m0; }},
      {"n_group", [](MoeSpec& s) { s.routing = DeepseekGrouped{.n_group = 3, .topk_group = 1}; }},
      {"topk_group", [](MoeSpec& s) { s.routing = DeepseekGrouped{.n_group = 4, .topk_group = 5}; }},
      {"top_k", [](MoeSpec& s) { s.routing = DeepseekGrouped{.n_group = 8, .topk_group = 1}; }},  // 2 experts reachable
      {"routed_scaling_factor", [](MoeSpec& s) { s.routing = DeepseekGrouped{.n_group = 4, .topk_group = 2, .routed_scaling_factor = 0.0f}; }},
      {"e_score_correction_bias", [](MoeSpec& s) {
         s.routing = DeepseekGrouped{.n_group = 4, .topk_group = 2, .e_score_correction_bias = {1.0f, 2.0f}};
       }},
      // Values that name no enumerator (a cast from another language's integer).
      {"precision=3", [](MoeSpec& s) { s.precision = static_cast<Precision>(3); }},
      {"scale_format=2", [](MoeSpec& s) { s.scale_format = static_cast<ScaleFormat>(2); }},
  };
  for (const Case& c : cases) {
    MoeSpec spec = valid_spec();
    c.mutate(spec);
    std::string message;
    EXPECT_EQ(error_of([&] { validate(spec); }, &message), ErrorCode::invalid_spec) << c.field;
    EXPECT_NE(message.find(c.field), std::string::npos) << "message '" << message << "' should name " << c.field;
  }
}

// A refused routing value is named with the value given, as the other fields are.
TEST(ValidateSpec, RoutingErrorsGiveTheValue) {
  std::vector<float> bias(16, 0.0f);
  bias[2] = std::numeric_limits<float>::infinity();
  const std::pair<DeepseekGrouped, const char*> cases[] = {
      {{.n_group = 4, .topk_group = 2, .routed_scaling_factor = -2.5f},
       "routed_scaling_factor=-2.5 must be finite and > 0"},
      {{.n_group = 4, .topk_group = 2, .routed_scaling_factor = std::numeric_limits<float>::quiet_NaN()},
       "routed_scaling_factor=nan must be finite and > 0"},
      {{.n_group = 4, .topk_group = 2, .e_score_correction_bias = bias},
       "e_score_correction_bias[2] = inf: the bias must be finite"},
  };
  for (const auto& [routing, expected] : cases) {
    MoeSpec spec = valid_spec();
    spec.routing = routing;
    std::string message;
    EXPECT_EQ(error_of([&] { validate(spec); }, &message), ErrorCode::invalid_spec) << expected;
    EXPECT_NE(message.find(expected), std::string::npos) << "message '" << message << "' should say " << expected;
  }
}

// Sizes derived from the shapes are counted in int (W13's 2I rows) and size_t (the packed bytes):
// shapes past either would wrap them (the byte counts of a pack of E = 512, H = 2^31 - 128,
// I = 2^30 - 128 wrap past 2^64), so they are refused with the figures; DeepSeek-V3 is far within.
TEST(ValidateSpec, RefusesShapesWhoseSizesWrap) {
  MoeSpec dsv3 = valid_spec();
  dsv3.num_experts = 256;
  dsv3.top_k = 8;
  dsv3.hidden = 7168;
  dsv3.intermediate = 2048;
  EXPECT_EQ(error_of([&] { validate(dsv3); }), std::nullopt);
  const std::pair<MoeSpec, const char*> cases[] = {
      {{.num_experts = 1, .top_k = 1, .hidden = 128, .intermediate = 1 << 30, .precision = Precision::fp8_block},
       "intermediate=1073741824 must be at most 1073741823"},
      {{.num_experts = 512, .top_k = 8, .hidden = 2147483520, .intermediate = 1073741696, .precision = Precision::fp8_block},
       "num_experts=512, hidden=2147483520 and intermediate=1073741696 make packed weights of 3 x E x H x I x 1"},
  };
  for (const auto& [spec, expected] : cases) {
    std::string message;
    EXPECT_EQ(error_of([&] { validate(spec); }, &message), ErrorCode::invalid_spec) << expected;
    EXPECT_NE(message.find(expected), std::string::npos) << "message '" << message << "' should say " << expected;
  }
}

// A routing whose assignment threw holds none of its alternatives; unchecked, a forward would ask
// for router logits (it is not Precomputed) and the kernels would route it as precomputed.
TEST(ValidateSpec, RefusesAValuelessRouting) {
  struct ThrowsOnConversion {
    operator DeepseekGrouped() const { throw std::runtime_error("conversion failed"); }
  };
  MoeSpec spec = valid_spec();
  EXPECT_THROW(spec.routing.emplace<DeepseekGrouped>(ThrowsOnConversion{}), std::runtime_error);
  ASSERT_TRUE(spec.routing.valueless_by_exception());
  std::string message;
  EXPECT_EQ(error_of([&] { validate(spec); }, &message), ErrorCode::invalid_spec);
  EXPECT_NE(message.find("routing holds no value"), std::string::npos) << message;
  EXPECT_EQ(to_string(spec.routing), "none (valueless)");
}

// fp8_tensor: channels in multiples of 128 (one 128-byte K slice of E4M3), fp32 scales only, and
// printed without a scale format (it has one kind).
TEST(ValidateSpec, Fp8Tensor) {
  MoeSpec spec = valid_spec();
  spec.precision = Precision::fp8_tensor;
  EXPECT_EQ(channel_granularity(Precision::fp8_tensor), 128);
  EXPECT_EQ(error_of([&] { validate(spec); }), std::nullopt);
  EXPECT_STREQ(to_string(spec.precision), "fp8_tensor");
  std::ostringstream printed;
  printed << spec;
  EXPECT_NE(printed.str().find("precision=fp8_tensor"), std::string::npos) << printed.str();
  EXPECT_EQ(printed.str().find("scales="), std::string::npos) << printed.str();
  for (auto [field, value] : {std::pair{"hidden", 192}, std::pair{"intermediate", 64}}) {
    MoeSpec bad = spec;
    (std::string(field) == "hidden" ? bad.hidden : bad.intermediate) = value;
    std::string message;
    EXPECT_EQ(error_of([&] { validate(bad); }, &message), ErrorCode::invalid_spec) << field;
    EXPECT_NE(message.find(field), std::string::npos) << message;
    EXPECT_NE(message.find("K slice of E4M3"), std::string::npos) << message;
  }
  MoeSpec ue8m0 = spec;
  ue8m0.scale_format = ScaleFormat::ue8m0;
  std::string message;
  EXPECT_EQ(error_of([&] { validate(ue8m0); }, &message), ErrorCode::invalid_spec);
  EXPECT_NE(message.find("ue8m0"), std::string::npos) << message;
  EXPECT_NE(message.find("fp8_tensor"), std::string::npos) << message;
}

class ValidateForward : public ::testing::Test {
 protected:
  static constexpr int kTokens = 4;
  alignas(16) uint16_t x[kTokens * 256] = {};
  alignas(16) uint16_t y[kTokens * 256] = {};
  alignas(16) float logits[kTokens * 16] = {};
  alignas(16) int32_t ids[kTokens * 4] = {};
  alignas(16) float weights[kTokens * 4] = {};

  MoeInputs inputs() { return MoeInputs{kTokens, x, logits, ids, weights}; }
};

TEST_F(ValidateForward, AcceptsValidCallsAndEmptyBatches) {
  EXPECT_EQ(error_of([&] { validate_forward_args(valid_spec(), 8, inputs(), MoeOutputs{y}); }), std::nullopt);
  MoeInputs empty = inputs();
  empty.num_tokens = 0;
  empty.x = nullptr;
  EXPECT_EQ(error_of([&] { validate_forward_args(valid_spec(), 8, empty, MoeOutputs{nullptr}); }), std::nullopt);
}

TEST_F(ValidateForward, RejectsEachBadArgument) {
  const MoeSpec spec = valid_spec();
  MoeSpec precomputed = spec;
  precomputed.routing = Precomputed{};
  auto check = [&](ErrorCode expected, const MoeSpec& s, int capacity, MoeInputs in, MoeOutputs out) {
    EXPECT_EQ(error_of([&] { validate_forward_args(s, capacity, in, out); }), expected);
  };
  MoeInputs in = inputs();
  check(ErrorCode::capacity_exceeded, spec, 3, in, MoeOutputs{y});
  in.num_tokens = -1;
  check(ErrorCode::invalid_argument, spec, 8, in, MoeOutputs{y});
  in = inputs();
  in.x = nullptr;
  check(ErrorCode::null_pointer, spec, 8, in, MoeOutputs{y});
  in = inputs();
  in.x = reinterpret_cast<const char*>(x) + 2;
  check(ErrorCode::misaligned_pointer, spec, 8, in, MoeOutputs{y});
  check(ErrorCode::null_pointer, spec, 8, inputs(), MoeOutputs{nullptr});
  check(ErrorCode::misaligned_pointer, spec, 8, inputs(), MoeOutputs{reinterpret_cast<char*>(y) + 8});
  in = inputs();
  in.router_logits = nullptr;
  check(ErrorCode::null_pointer, spec, 8, in, MoeOutputs{y});
  check(ErrorCode::null_pointer, precomputed, 8, MoeInputs{kTokens, x, logits, nullptr, weights}, MoeOutputs{y});
  check(ErrorCode::null_pointer, precomputed, 8, MoeInputs{kTokens, x, logits, ids, nullptr}, MoeOutputs{y});
  check(ErrorCode::aliasing, spec, 8, inputs(), MoeOutputs{x});
  check(ErrorCode::aliasing, spec, 8, inputs(), MoeOutputs{x + 128});
  MoeSpec bad = spec;
  bad.top_k = 0;
  check(ErrorCode::invalid_spec, bad, 8, inputs(), MoeOutputs{y});
  // The planning hint: only with a device row count, and within [0, T].
  const int32_t device_count = 2;
  in = inputs();
  in.expected_valid_tokens = 2;
  check(ErrorCode::invalid_argument, spec, 8, in, MoeOutputs{y});
  in.num_valid_tokens = &device_count;
  EXPECT_EQ(error_of([&] { validate_forward_args(spec, 8, in, MoeOutputs{y}); }), std::nullopt);
  in.expected_valid_tokens = kTokens + 1;
  check(ErrorCode::invalid_argument, spec, 8, in, MoeOutputs{y});
  in.expected_valid_tokens = -1;
  check(ErrorCode::invalid_argument, spec, 8, in, MoeOutputs{y});
}

// x already quantized (MoeInputs::x_scales): fp8_block only, a stride of at least T, aligned
// scales, and neither codes nor scales inside y; x then holds T x H bytes, not 2 T x H.
TEST_F(ValidateForward, QuantizedInputsAreChecked) {
  const MoeSpec spec = valid_spec();
  alignas(16) float scales[2 * 8] = {};
  auto error = [&](const MoeSpec& s, const MoeInputs& in, const void* out, std::string* message = nullptr) {
    return error_of([&] { validate_forward_args(s, 8, in, MoeOutputs{const_cast<void*>(out)}); }, message);
  };
  MoeInputs in = inputs();
  in.x_scales = scales;
  EXPECT_EQ(error(spec, in, y), std::nullopt);
  in.x_scale_stride = 8;
  EXPECT_EQ(error(spec, in, y), std::nullopt);
  std::string message;
  in.x_scale_stride = kTokens - 1;
  EXPECT_EQ(error(spec, in, y, &message), ErrorCode::invalid_argument);
  EXPECT_NE(message.find("x_scale_stride"), std::string::npos) << message;
  in.x_scale_stride = 0;
  in.x_scales = reinterpret_cast<const float*>(reinterpret_cast<const char*>(scales) + 2);
  EXPECT_EQ(error(spec, in, y), ErrorCode::misaligned_pointer);
  for (Precision other : {Precision::bf16, Precision::fp8_tensor}) {
    MoeSpec s = spec;
    s.precision = other;
    in = inputs();
    in.x_scales = scales;
    EXPECT_EQ(error(s, in, y, &message), ErrorCode::invalid_argument) << to_string(other);
    EXPECT_NE(message.find("fp8_block"), std::string::npos) << message;
  }
  in = inputs();
  in.x_scale_stride = kTokens;
  EXPECT_EQ(error(spec, in, y, &message), ErrorCode::invalid_argument);
  EXPECT_NE(message.find("without x_scales"), std::string::npos) << message;
  // Codes take one byte per value: y right after T x H bytes of codes does not overlap them; y
  // over the scales does.
  in = inputs();
  in.x_scales = scales;
  EXPECT_EQ(error(spec, in, reinterpret_cast<const char*>(x) + kTokens * 256), std::nullopt);
  EXPECT_EQ(error(spec, in, reinterpret_cast<const char*>(x) + kTokens * 256 - 16), ErrorCode::aliasing);
  in.x_scales = reinterpret_cast<const float*>(y);
  EXPECT_EQ(error(spec, in, y, &message), ErrorCode::aliasing);
  EXPECT_NE(message.find("x_scales"), std::string::npos) << message;
}

// The device row count is an input like the others: every kernel that reads it may run while the
// combine writes y's rows, so a count kept inside y is refused.
TEST_F(ValidateForward, RefusesAnOutputOverlappingTheDeviceRowCount) {
  MoeInputs in = inputs();
  in.num_valid_tokens = reinterpret_cast<const int32_t*>(y) + 5;
  std::string message;
  EXPECT_EQ(error_of([&] { validate_forward_args(valid_spec(), 8, in, MoeOutputs{y}); }, &message),
            ErrorCode::aliasing);
  EXPECT_NE(message.find("y overlaps num_valid_tokens"), std::string::npos) << message;
  alignas(16) int32_t count_apart = 2;
  in.num_valid_tokens = &count_apart;
  EXPECT_EQ(error_of([&] { validate_forward_args(valid_spec(), 8, in, MoeOutputs{y}); }), std::nullopt);
}

}  // namespace
}  // namespace megamoe
