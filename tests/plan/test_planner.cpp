#include "plan/planner.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <sstream>

#include "megamoe/error.hpp"
#include "plan/workloads.hpp"

namespace megamoe::plan {
namespace {

MoeSpec workload(const std::string& name, Precision precision) {
  MoeSpec spec = find_workload(name).spec;
  spec.precision = precision;
  return spec;
}

TEST(Planner, SwapAbWithTokenTileCoveringRowsPerExpert) {
  const DeviceFacts h200 = DeviceFacts::h200_measured();
  for (const Workload& w : named_workloads()) {
    for (Precision precision : {Precision::bf16, Precision::fp8_block}) {
      MoeSpec spec = w.spec;
      spec.precision = precision;
      for (int tokens : kTokenBuckets) {
        const MoePlan plan = plan_moe(spec, tokens, 8192, h200);
        SCOPED_TRACE(w.name + " tokens=" + std::to_string(tokens));
        for (const GemmConfig* c : {&plan.fc1, &plan.fc2}) {
          EXPECT_TRUE(c->swap_ab);
          EXPECT_GE(c->token_tile, std::min(plan.expected_rows_per_expert, 64));
          EXPECT_TRUE(c->token_tile == 16 || c->token_tile == 32 || c->token_tile == 64);
          EXPECT_EQ(c->block_n, c->token_tile);
          EXPECT_EQ(c->block_m, 256);
          EXPECT_EQ(c->block_k, precision == Precision::fp8_block ? 128 : 64);
          EXPECT_GE(c->stages, 3) << "every named workload must get enough stages to hide TMA latency";
          EXPECT_LE(c->smem_bytes, h200.smem_per_block_optin);
          EXPECT_EQ(c->block_m % 64, 0) << "wgmma M is 64 per warpgroup";
          EXPECT_FALSE(c->reasons.empty());
        }
      }
    }
  }
}

TEST(Planner, OneTokenTouchesTopKExpertsWithOneRowEach) {
  const MoePlan plan = plan_moe(workload("qwen35-a3b", Precision::fp8_block), 1, 128, DeviceFacts::h200_measured());
  EXPECT_EQ(plan.expected_rows_per_expert, 1);
  EXPECT_TRUE(plan.fc1.swap_ab);
  EXPECT_EQ(plan.fc1.token_tile, 16);
  EXPECT_EQ(plan.fc1.expected_tiles, 8 * (2 * 512 / 256));
}

TEST(Planner, LargeBatchesTakeTheWidestTokenTile) {
  const MoePlan plan = plan_moe(workload("dsv3", Precision::fp8_block), 8192, 8192, DeviceFacts::h200_measured());
  EXPECT_EQ(plan.expected_rows_per_expert, 256);
  EXPECT_EQ(plan.fc1.token_tile, 64);
  EXPECT_EQ(plan.fc1.expected_tiles, 256 * (2 * 2048 / 256) * (256 / 64));
}

// FC1 copies its token rows only where experts get few rows, where it was measured to win.
TEST(Planner, Fc1CopiesTokenRowsOnlyForFewRowsPerExpert) {
  const MoeSpec fp8 = workload("qwen35-a3b", Precision::fp8_block);
  for (int tokens : {1, 16, 128, 1024}) EXPECT_TRUE(fc1_copies_token_rows(fp8, tokens)) << tokens << " tokens";
  for (int tokens : {2048, 8192}) EXPECT_FALSE(fc1_copies_token_rows(fp8, tokens)) << tokens << " tokens";
  EXPECT_FALSE(fc1_copies_token_rows(workload("qwen35-a3b", Precision::bf16), 1)) << "rows are copied from fp8 only";
  EXPECT_FALSE(fc1_copies_token_rows(workload("dsv3", Precision::fp8_block), 8192));
}

// MoeLayer allocates the planner's workspace once for max_tokens and picks a token tile per call:
// every call's tile must fit the padding of that one allocation.
TEST(Planner, WorkspacePaddingCoversTheTileOfEveryCallUpToCapacity) {
  const DeviceFacts h200 = DeviceFacts::h200_measured();
  MoeSpec small;
  small.num_experts = 16;
  small.top_k = 4;
  small.hidden = 256;
  small.intermediate = 256;
  std::vector<MoeSpec> specs = {small};
  for (const Workload& w : named_workloads()) specs.push_back(w.spec);
  for (const MoeSpec& spec : specs) {
    for (int max_tokens : {1, 3, 16, 100, 1000, 4096, 8192}) {
      const layout::MoeWorkspaceLayout workspace = plan_moe(spec, max_tokens, max_tokens, h200).workspace;
      for (int tokens = 1; tokens <= max_tokens; tokens += 1 + tokens / 8) {
        SCOPED_TRACE("E=" + std::to_string(spec.num_experts) + " max_tokens=" + std::to_string(max_tokens) +
                     " tokens=" + std::to_string(tokens));
        EXPECT_LE(choose_token_tile(spec, tokens), workspace.row_padding);
      }
    }
  }
}

TEST(Planner, IsDeterministicAndPrintable) {
  const MoeSpec spec = workload("qwen3-30b-a3b", Precision::bf16);
  std::ostringstream a, b;
  a << plan_moe(spec, 128, 2048, DeviceFacts::h200_measured());
  b << plan_moe(spec, 128, 2048, DeviceFacts::h200_measured());
  EXPECT_EQ(a.str(), b.str());
  EXPECT_NE(a.str().find("swapAB"), std::string::npos);
}

TEST(Planner, RejectsImpossibleRequests) {
  const MoeSpec spec = workload("qwen35-a3b", Precision::fp8_block);
  DeviceFacts tiny = DeviceFacts::h200_measured();
  tiny.smem_per_block_optin = 40 * 1024;
  EXPECT_THROW(plan_moe(spec, 4096, 8192, tiny), Error);
  EXPECT_THROW(plan_moe(spec, 0, 8, DeviceFacts::h200_measured()), Error);
  EXPECT_THROW(plan_moe(spec, 9, 8, DeviceFacts::h200_measured()), Error);
  DeviceFacts none;
  EXPECT_THROW(plan_moe(spec, 1, 8, none), Error);
}

TEST(Floors, OneTokenStreamsExactlyTopKExperts) {
  const MoeSpec spec = workload("qwen35-a3b", Precision::fp8_block);
  const DeviceFacts h200 = DeviceFacts::h200_measured();
  const Floors f = expected_floors(spec, 1, h200);
  EXPECT_NEAR(f.touched_experts, 8.0, 1e-9);
  const double expert_bytes = 3.0 * 2048 * 512 + 3.0 * 16 * 4 * 4;
  EXPECT_DOUBLE_EQ(expert_weight_bytes(spec), expert_bytes);
  EXPECT_NEAR(f.weight_bytes, 8 * expert_bytes, 1e-3);
  EXPECT_NEAR(f.useful_flops, 2.0 * 8 * 3 * 2048 * 512, 1);
  EXPECT_NEAR(f.floor_us, f.weight_bytes / 4.18e12 * 1e6, 1e-9);
  EXPECT_STREQ(f.bound, "hbm");
}

TEST(Floors, ExpectedTouchedExpertsMatchesTheClosedForm) {
  const MoeSpec spec = workload("qwen35-a3b", Precision::fp8_block);
  const Floors f128 = expected_floors(spec, 128, DeviceFacts::h200_measured());
  EXPECT_NEAR(f128.touched_experts, 256 * (1 - std::pow(1 - 8.0 / 256, 128)), 1e-9);
  // The seeds' note: at 128 tokens almost every expert is touched, so ~0.19 ms of weights.
  EXPECT_GT(f128.touched_experts, 250);
  EXPECT_NEAR(f128.floor_us, 190, 10);
  const Floors big = expected_floors(workload("dsv3", Precision::fp8_block), 8192, DeviceFacts::h200_measured());
  EXPECT_STREQ(big.bound, "compute");
}

TEST(Floors, RoutedFloorsCountDistinctValidExperts) {
  const MoeSpec spec = workload("qwen35-a3b", Precision::bf16);
  std::vector<int32_t> ids = {0, 1, 2, 3, 4, 5, 6, 7,  // token 0
                              0, 1, 2, 3, -1, 300, 9, 9};  // token 1: -1 unused, 300 invalid, 9 twice
  const Floors f = routed_floors(spec, ids.data(), 2, DeviceFacts::h200_measured());
  EXPECT_EQ(f.touched_experts, 9);
  EXPECT_EQ(f.routed_rows, 8 + 5);
  EXPECT_NEAR(f.weight_bytes, 9 * 3.0 * 2048 * 512 * 2, 1e-3);
}

// The token tile holds the mean rows per touched expert plus their spread (planner.hpp): uniform
// routing over qwen35-a3b's 256 experts moves to 32-token tiles at a mean of ~9.8 rows (313
// tokens) and to 64 at ~22.5 (721), and the bench's buckets keep the tiles measured there.
TEST(Planner, TokenTileCoversTheSpreadOfRowsPerExpert) {
  const MoeSpec spec = workload("qwen35-a3b", Precision::fp8_block);
  const std::pair<int, int> tile_at[] = {{1, 16},    {16, 16},   {128, 16},  {312, 16},  {313, 32},
                                         {512, 32},  {720, 32},  {721, 64},  {1000, 64}, {1024, 64},
                                         {2048, 64}, {8192, 64}};
  for (const auto& [tokens, tile] : tile_at) EXPECT_EQ(choose_token_tile(spec, tokens), tile) << tokens << " tokens";
}

}  // namespace
}  // namespace megamoe::plan
