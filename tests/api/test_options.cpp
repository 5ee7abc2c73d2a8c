#include "megamoe/options.hpp"

#include <gtest/gtest.h>

#include <sstream>
#include <string>

#include "megamoe/error.hpp"

namespace megamoe {
namespace {

MoeSpec spec_of(Precision precision) {
  MoeSpec spec;
  spec.num_experts = 16;
  spec.top_k = 4;
  spec.hidden = 256;
  spec.intermediate = 128;
  spec.precision = precision;
  return spec;
}

// The message of the invalid_argument error `options` gets, or "" when they are valid.
std::string rejection(const MoeLayerOptions& options, Precision precision = Precision::fp8_block) {
  try {
    validate(options, spec_of(precision));
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    return e.what();
  }
  return "";
}

TEST(Options, DefaultsLeaveEveryChoiceToThePlanner) {
  const MoeLayerOptions o;
  EXPECT_EQ(o.token_tile, 0);
  EXPECT_EQ(o.fc1_token_rows, Fc1TokenRows::automatic);
  EXPECT_EQ(o.combine, CombineMode::deterministic);
  EXPECT_EQ(o.num_sms, 0);
  EXPECT_EQ(o.launch, ForwardLaunch::automatic);
  EXPECT_EQ(rejection(o), "");
  EXPECT_EQ(rejection(o, Precision::bf16), "");
}

TEST(Options, TokenTileTakesTheKernelsTilesOnly) {
  for (int tile : {16, 32, 64, 128}) EXPECT_EQ(rejection({.token_tile = tile}), "") << tile;
  EXPECT_EQ(rejection({.token_tile = 128}, Precision::bf16), "");
  for (int tile : {-16, 1, 8, 48, 96, 256}) {
    const std::string message = rejection({.token_tile = tile});
    EXPECT_NE(message.find("options.token_tile=" + std::to_string(tile) + " must be 16, 32, 64 or 128"),
              std::string::npos)
        << message;
  }
}

// The tokens-on-M tile (128) loads the pool by TMA: it cannot take the swapAB row copy.
TEST(Options, TheTokensOnMTileReadsThePool) {
  EXPECT_EQ(rejection({.token_tile = 128, .fc1_token_rows = Fc1TokenRows::pool}), "");
  const std::string message = rejection({.token_tile = 128, .fc1_token_rows = Fc1TokenRows::row_copy});
  EXPECT_NE(message.find("options.token_tile=128 (tokens on M) reads FC1's rows from the pool"), std::string::npos)
      << message;
}

TEST(Options, RowCopyNeedsFp8) {
  EXPECT_EQ(rejection({.fc1_token_rows = Fc1TokenRows::row_copy}), "");
  EXPECT_EQ(rejection({.fc1_token_rows = Fc1TokenRows::row_copy}, Precision::fp8_tensor), "");
  EXPECT_EQ(rejection({.fc1_token_rows = Fc1TokenRows::pool}, Precision::bf16), "");
  const std::string message = rejection({.fc1_token_rows = Fc1TokenRows::row_copy}, Precision::bf16);
  EXPECT_NE(message.find("needs precision fp8_block or fp8_tensor, not bf16"), std::string::npos) << message;
}

TEST(Options, NumSmsIsACountOrZero) {
  EXPECT_EQ(rejection({.num_sms = 1}), "");
  EXPECT_EQ(rejection({.num_sms = 100000}), "") << "more than the device has means all of them";
  EXPECT_NE(rejection({.num_sms = -1}).find("options.num_sms=-1"), std::string::npos);
}

TEST(Options, TheSingleKernelTakesPoolRowsEveryTileAndNoPairs) {
  for (ForwardLaunch launch : {ForwardLaunch::automatic, ForwardLaunch::per_stage, ForwardLaunch::single_kernel}) {
    EXPECT_EQ(rejection({.launch = launch}), "");
    EXPECT_EQ(rejection({.launch = launch}, Precision::bf16), "");
    EXPECT_EQ(rejection({.token_tile = 32, .fc1_token_rows = Fc1TokenRows::pool, .launch = launch}), "");
  }
  const std::string row_copy = rejection({.fc1_token_rows = Fc1TokenRows::row_copy, .launch = ForwardLaunch::single_kernel});
  EXPECT_NE(row_copy.find("options.launch=single_kernel reads FC1's rows from the pool"), std::string::npos) << row_copy;
  for (ForwardLaunch launch : {ForwardLaunch::per_stage, ForwardLaunch::single_kernel}) {
    EXPECT_EQ(rejection({.token_tile = 64, .launch = launch}), "");
    for (Precision precision : {Precision::fp8_block, Precision::bf16, Precision::fp8_tensor}) {
      EXPECT_EQ(rejection({.token_tile = 128, .launch = launch}, precision), "") << to_string(precision);
    }
  }
  const std::string pairs = rejection({.token_tile = 128, .launch = ForwardLaunch::single_kernel, .weight_multicast = true},
                                      Precision::bf16);
  EXPECT_NE(pairs.find("options.launch=single_kernel launches no CTA pairs: it takes weight_multicast=false"),
            std::string::npos)
      << pairs;
  EXPECT_EQ(rejection({.token_tile = 128, .launch = ForwardLaunch::per_stage, .weight_multicast = true}), "");
  // fp8_tensor in either launch (the planner refuses the single kernel with dynamic scales, which
  // the weights, not the options, say).
  EXPECT_EQ(rejection({.launch = ForwardLaunch::per_stage}, Precision::fp8_tensor), "");
  EXPECT_EQ(rejection({.launch = ForwardLaunch::single_kernel}, Precision::fp8_tensor), "");
}

// A value that names no enumerator (a cast from another language's integer) would take one branch
// of each choice unannounced: an unnamed combine runs the fast one and prints as deterministic.
TEST(Options, ChoicesMustNameAnEnumerator) {
  const std::string rows = rejection({.fc1_token_rows = static_cast<Fc1TokenRows>(7)});
  EXPECT_NE(rows.find("options.fc1_token_rows=7 is none of"), std::string::npos) << rows;
  const std::string combine = rejection({.combine = static_cast<CombineMode>(7)});
  EXPECT_NE(combine.find("options.combine=7 is neither"), std::string::npos) << combine;
  const std::string launch = rejection({.launch = static_cast<ForwardLaunch>(7)});
  EXPECT_NE(launch.find("options.launch=7 is none of"), std::string::npos) << launch;
}

// The combine a forward names for itself (MoeLayer::forward, describe_plan) is checked the same way.
TEST(Options, ACombineArgumentMustNameAnEnumerator) {
  EXPECT_NO_THROW(validate_combine(CombineMode::deterministic, "combine"));
  EXPECT_NO_THROW(validate_combine(CombineMode::fast, "combine"));
  try {
    validate_combine(static_cast<CombineMode>(5), "combine");
    FAIL() << "a combine of no CombineMode was taken";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("combine=5 is neither"), std::string::npos) << e.what();
  }
}

TEST(Options, PrintEveryField) {
  std::ostringstream os;
  os << MoeLayerOptions{.token_tile = 32, .fc1_token_rows = Fc1TokenRows::pool, .combine = CombineMode::fast,
                        .num_sms = 100, .launch = ForwardLaunch::single_kernel};
  EXPECT_EQ(os.str(),
            "MoeLayerOptions{token_tile=32, fc1_token_rows=pool, combine=fast, num_sms=100, launch=single_kernel}");
  std::ostringstream defaults;
  defaults << MoeLayerOptions{};
  EXPECT_EQ(defaults.str(),
            "MoeLayerOptions{token_tile=auto, fc1_token_rows=auto, combine=deterministic, num_sms=all, launch=auto}");
}

}  // namespace
}  // namespace megamoe
