// MoeLayer where no GPU is visible (a CPU machine, or CUDA_VISIBLE_DEVICES empty): the error
// says so in a user's words, as Python's does, and names what the layer needs.
#include <gtest/gtest.h>

#include <string>
#include <tuple>

#include "megamoe/error.hpp"
#include "megamoe/layer.hpp"
#include "megamoe/weights.hpp"

namespace megamoe {
namespace {

MoeSpec small_spec() {
  MoeSpec spec;
  spec.num_experts = 4;
  spec.top_k = 2;
  spec.hidden = 128;
  spec.intermediate = 128;
  spec.precision = Precision::fp8_block;
  return spec;
}

PackedWeights small_packed(const MoeSpec& spec) {
  std::vector<float> w13(4ull * 2 * 128 * 128, 0.01f), w2(4ull * 128 * 128, -0.02f);
  return prepare_weights(spec, {w13.data(), w2.data(), DType::fp32});
}

TEST(MoeLayerWithoutGpu, SaysNoDeviceIsVisible) {
  const MoeSpec spec = small_spec();
  const PackedWeights packed = small_packed(spec);
  try {
    MoeLayer layer(spec, packed, 16);
    FAIL() << "a layer was built without a visible GPU";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::no_device);
    const std::string message = e.what();
    EXPECT_NE(message.find("no CUDA device is visible"), std::string::npos) << message;
    EXPECT_NE(message.find("needs a Hopper GPU"), std::string::npos) << message;
    EXPECT_EQ(message.find(".cpp:"), std::string::npos) << "a source location is no user's message: " << message;
  }
}

// A bad max_tokens is an argument error like a bad spec or option, named as such with or without a
// GPU: it is checked with them, before the device is looked for.
TEST(MoeLayerWithoutGpu, NamesABadMaxTokensFirst) {
  const MoeSpec spec = small_spec();
  const PackedWeights packed = small_packed(spec);
  for (const int max_tokens : {0, -5}) {
    try {
      MoeLayer layer(spec, packed, max_tokens);
      FAIL() << "a layer was built for max_tokens=" << max_tokens;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
      EXPECT_NE(std::string(e.what()).find("max_tokens=" + std::to_string(max_tokens)), std::string::npos) << e.what();
    }
  }
}

// An invalid spec is named as such before the packed weights are held against it: compared first,
// a typo in the spec was reported as weights "prepared for a different spec", and a pack as invalid
// as its spec (num_experts=-1 in both) by byte counts wrapped past 2^64.
TEST(MoeLayerWithoutGpu, NamesABadSpecBeforeItsWeights) {
  const MoeSpec spec = small_spec();
  MoeSpec bad_hidden = spec;
  bad_hidden.hidden = 192;
  MoeSpec no_experts = spec;
  no_experts.num_experts = -1;
  PackedWeights no_experts_pack;
  no_experts_pack.num_experts = -1;
  no_experts_pack.hidden = spec.hidden;
  no_experts_pack.intermediate = spec.intermediate;
  no_experts_pack.precision = spec.precision;
  const std::tuple<MoeSpec, PackedWeights, std::string> cases[] = {
      {bad_hidden, small_packed(spec), "hidden=192 must be a positive multiple of 128"},
      {no_experts, no_experts_pack, "num_experts=-1 must be >= 1"},
  };
  for (const auto& [bad, packed, expected] : cases) {
    try {
      MoeLayer layer(bad, packed, 16);
      FAIL() << "a layer was built for an invalid spec: " << expected;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_spec) << e.what();
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace megamoe
