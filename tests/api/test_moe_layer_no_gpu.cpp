// MoeLayer where no GPU is visible (a CPU machine, or CUDA_VISIBLE_DEVICES empty): the error
// says so in a user's words, as Python's does, and names what the layer needs.
#include <gtest/gtest.h>

#include <string>

#include "megamoe/error.hpp"
#include "megamoe/layer.hpp"
#include "megamoe/weights.hpp"

namespace megamoe {
namespace {

TEST(MoeLayerWithoutGpu, SaysNoDeviceIsVisible) {
  MoeSpec spec;
  spec.num_experts = 4;
  spec.top_k = 2;
  spec.hidden = 128;
  spec.intermediate = 128;
  spec.precision = Precision::fp8_block;
  std::vector<float> w13(4ull * 2 * 128 * 128, 0.01f), w2(4ull * 128 * 128, -0.02f);
  const PackedWeights packed = prepare_weights(spec, {w13.data(), w2.data(), DType::fp32});
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

}  // namespace
}  // namespace megamoe
