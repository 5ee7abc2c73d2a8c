#include "plan/planner.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <sstream>

#include "megamoe/error.hpp"
#include "kernels/layout/gemm_smem.hpp"
#include "plan/workloads.hpp"

namespace megamoe::plan {
namespace {

MoeSpec workload(const std::string& name, Precision precision) {
  MoeSpec spec = find_workload(name).spec;
  spec.precision = precision;
  return spec;
}

// The plan of a forward of `tokens` rows in a layer for `max_tokens`, with `options`.
ForwardPlan forward_plan(const MoeSpec& spec, int tokens, int max_tokens, const MoeLayerOptions& options = {},
                         const DeviceFacts& facts = DeviceFacts::h200_measured()) {
  return plan_forward(spec, plan_layer(spec, max_tokens, options, facts), tokens, options.combine, facts);
}

// The planner's own choice is a token tile covering the rows per expert: swapAB up to 64 rows, the
// tokens-on-M tile of 128 beyond.
TEST(Planner, TokenTileCoveringRowsPerExpertInEitherLayout) {
  const DeviceFacts h200 = DeviceFacts::h200_measured();
  for (const Workload& w : named_workloads()) {
    for (Precision precision : {Precision::bf16, Precision::fp8_block}) {
      MoeSpec spec = w.spec;
      spec.precision = precision;
      for (int tokens : kTokenBuckets) {
        const ForwardPlan plan = forward_plan(spec, tokens, 8192);
        SCOPED_TRACE(w.name + " tokens=" + std::to_string(tokens));
        for (const GemmConfig* c : {&plan.fc1, &plan.fc2}) {
          EXPECT_EQ(c->token_tile, plan.token_tile);
          EXPECT_GE(c->token_tile, std::min(plan.expected_rows_per_expert, 128));
          EXPECT_TRUE(c->token_tile == 16 || c->token_tile == 32 || c->token_tile == 64 || c->token_tile == 128);
          EXPECT_EQ(c->swap_ab, c->token_tile <= 64);
          EXPECT_EQ(c->swap_ab ? c->block_n : c->block_m, c->token_tile);
          EXPECT_EQ(c->swap_ab ? c->block_m : c->block_n, 256);
          EXPECT_EQ(c->channel_tile, 256);
          EXPECT_EQ(c->block_k, precision == Precision::fp8_block ? 128 : 64);
          EXPECT_GE(c->stages, 3) << "every named workload must get enough stages to hide TMA latency";
          EXPECT_LE(c->smem_bytes, h200.smem_per_block_optin);
          EXPECT_EQ(c->block_m % 64, 0) << "wgmma M is 64 per warpgroup";
          EXPECT_FALSE(c->reasons.empty());
        }
        EXPECT_FALSE(plan.token_tile == 128 && plan.fc1_copies_token_rows) << "the row copy fills swapAB's blocks";
      }
    }
  }
}

TEST(Planner, OneTokenTouchesTopKExpertsWithOneRowEach) {
  const ForwardPlan plan = forward_plan(workload("qwen35-a3b", Precision::fp8_block), 1, 128);
  EXPECT_EQ(plan.expected_rows_per_expert, 1);
  EXPECT_TRUE(plan.fc1.swap_ab);
  EXPECT_EQ(plan.fc1.token_tile, 16);
  EXPECT_EQ(plan.fc1.expected_tiles, 8 * (2 * 512 / 256));
}

TEST(Planner, TheTokensOnMTileAtLargeBatches) {
  const ForwardPlan plan = forward_plan(workload("dsv3", Precision::fp8_block), 8192, 8192, {.token_tile = 128});
  EXPECT_EQ(plan.expected_rows_per_expert, 256);
  EXPECT_EQ(plan.fc1.token_tile, 128);
  EXPECT_FALSE(plan.fc1.swap_ab);
  for (const GemmConfig* c : {&plan.fc1, &plan.fc2}) {
    EXPECT_EQ(c->block_m, 128) << "tokens on M";
    EXPECT_EQ(c->block_n, 256) << "channels on N";
    EXPECT_NE(c->reasons[1].find("tokens on M"), std::string::npos) << c->reasons[1];
  }
  EXPECT_EQ(plan.fc1.expected_tiles, 256 * (2 * 2048 / 256) * (256 / 128));
  EXPECT_EQ(plan.fc2.expected_tiles, 256 * (7168 / 256) * (256 / 128));
  // Four 48.5 KB stages (256 weight rows and 128 token rows of 128 bytes, and 128 token scales).
  EXPECT_EQ(plan.fc1.stage_bytes, (256 + 128) * 128 + 128 * 4);
  EXPECT_EQ(plan.fc1.stages, 4);
}

// A layer fixed to the tokens-on-M tile takes it at any token count, and never the row copy.
TEST(Planner, AFixedTokensOnMTileReadsThePoolAtAnyTokenCount) {
  const MoeSpec spec = workload("qwen35-a3b", Precision::fp8_block);
  for (int tokens : {1, 16, 128}) {
    const ForwardPlan plan = forward_plan(spec, tokens, 128, {.token_tile = 128});
    EXPECT_EQ(plan.token_tile, 128);
    EXPECT_FALSE(plan.fc1.swap_ab);
    EXPECT_FALSE(plan.fc1_copies_token_rows) << tokens << " tokens";
  }
}

// FC1 copies its token rows only where experts get few rows, where it was measured to win.
TEST(Planner, Fc1CopiesTokenRowsOnlyForFewRowsPerExpert) {
  const MoeSpec fp8 = workload("qwen35-a3b", Precision::fp8_block);
  for (int tokens : {1, 16, 128, 1024}) EXPECT_TRUE(fc1_copies_token_rows(fp8, tokens)) << tokens << " tokens";
  for (int tokens : {2048, 8192}) EXPECT_FALSE(fc1_copies_token_rows(fp8, tokens)) << tokens << " tokens";
  EXPECT_FALSE(fc1_copies_token_rows(workload("qwen35-a3b", Precision::bf16), 1)) << "rows are copied from fp8 only";
  for (int tokens : {1, 1024}) {
    EXPECT_TRUE(fc1_copies_token_rows(workload("qwen35-a3b", Precision::fp8_tensor), tokens))
        << tokens << " tokens: fp8_tensor's copy is its codes alone";
  }
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
      const layout::MoeWorkspaceLayout workspace = plan_layer(spec, max_tokens, {}, h200).workspace;
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
  a << forward_plan(spec, 128, 2048);
  b << forward_plan(spec, 128, 2048);
  EXPECT_EQ(a.str(), b.str());
  EXPECT_NE(a.str().find("swapAB"), std::string::npos);
  EXPECT_NE(a.str().find("token tile 16"), std::string::npos) << a.str();
}

// A forward launches the decisions alone; the explained plan that is printed must carry the
// same ones.
TEST(Planner, TheExplainedPlanHoldsTheLaunchedDecisions) {
  const DeviceFacts h200 = DeviceFacts::h200_measured();
  for (const Workload& w : named_workloads()) {
    MoeSpec spec = w.spec;
    spec.precision = Precision::fp8_block;
    const LayerPlan layer = plan_layer(spec, 8192, {}, h200);
    for (int tokens : {1, 7, 128, 1000, 4096, 8192}) {
      for (CombineMode combine : {CombineMode::deterministic, CombineMode::fast}) {
        const ForwardPlan launched = plan_forward(spec, layer, tokens, combine, h200, PlanDetail::decisions);
        const ForwardPlan printed = plan_forward(spec, layer, tokens, combine, h200, PlanDetail::explained);
        EXPECT_TRUE(launched.reasons.empty() && launched.fc1.reasons.empty());
        EXPECT_FALSE(printed.reasons.empty() || printed.fc1.reasons.empty());
        EXPECT_EQ(launched.token_tile, printed.token_tile);
        EXPECT_EQ(launched.fc1_copies_token_rows, printed.fc1_copies_token_rows);
        EXPECT_EQ(launched.combine, printed.combine);
        EXPECT_EQ(launched.grid, printed.grid);
        EXPECT_EQ(launched.single_kernel, printed.single_kernel);
        EXPECT_EQ(launched.fc1.stages, printed.fc1.stages);
        EXPECT_EQ(launched.fc2.stages, printed.fc2.stages);
      }
    }
  }
}

// Options replace the planner's choices, and the plan says so.
TEST(Planner, OptionsReplaceThePlannersChoices) {
  const MoeSpec spec = workload("qwen35-a3b", Precision::fp8_block);
  const ForwardPlan planner = forward_plan(spec, 2048, 8192);
  EXPECT_EQ(planner.token_tile, 128);
  EXPECT_FALSE(planner.fc1_copies_token_rows);
  EXPECT_EQ(planner.grid, 132);

  const MoeLayerOptions options{.token_tile = 16, .fc1_token_rows = Fc1TokenRows::row_copy,
                                .combine = CombineMode::fast, .num_sms = 100};
  const ForwardPlan chosen = forward_plan(spec, 2048, 8192, options);
  EXPECT_EQ(chosen.token_tile, 16);
  EXPECT_TRUE(chosen.fc1_copies_token_rows);
  EXPECT_EQ(chosen.combine, CombineMode::fast);
  EXPECT_EQ(chosen.grid, 100);
  std::ostringstream os;
  os << chosen;
  for (const char* reason : {"options.token_tile", "options.fc1_token_rows=row_copy", "options.num_sms", "combine fast"}) {
    EXPECT_NE(os.str().find(reason), std::string::npos) << reason << " in\n" << os.str();
  }
  EXPECT_FALSE(forward_plan(spec, 1, 8192, {.fc1_token_rows = Fc1TokenRows::pool}).fc1_copies_token_rows);
  EXPECT_EQ(forward_plan(spec, 1, 8192, {.num_sms = 1000}).grid, 132) << "never more CTAs than SMs";
}

// The single kernel runs where options.launch names it, with the token tile the five kernels would
// take (both layouts, in every precision) and FC1 reading the pool; under auto it runs where
// kMaxSingleKernelTokens lets it (today nowhere: it was slower than the five kernels in every
// bucket measured, docs/design.md#single-kernel-forward).
TEST(Planner, TheSingleKernelRunsWhereTheOptionOrTheRuleSaysSo) {
  for (Precision precision : {Precision::fp8_block, Precision::bf16, Precision::fp8_tensor}) {
    const MoeSpec spec = workload("qwen35-a3b", precision);
    for (int tokens : {1, 16, 128, 2048, 8192}) {
      SCOPED_TRACE(std::string(to_string(precision)) + ", " + std::to_string(tokens) + " tokens");
      const ForwardPlan automatic = forward_plan(spec, tokens, 8192);
      EXPECT_EQ(automatic.single_kernel, tokens <= kMaxSingleKernelTokens);
      EXPECT_FALSE(forward_plan(spec, tokens, 8192, {.launch = ForwardLaunch::per_stage}).single_kernel);
      const ForwardPlan single = forward_plan(spec, tokens, 8192, {.launch = ForwardLaunch::single_kernel});
      EXPECT_TRUE(single.single_kernel);
      EXPECT_EQ(single.token_tile, automatic.token_tile);
      if (tokens == 8192) {
        EXPECT_EQ(automatic.token_tile, 128) << "8192 tokens plan the tokens-on-M tile";
      }
      const ForwardPlan named =
          forward_plan(spec, tokens, 8192, {.token_tile = 128, .launch = ForwardLaunch::single_kernel});
      EXPECT_EQ(named.token_tile, 128);
      EXPECT_TRUE(named.single_kernel);
      EXPECT_FALSE(single.fc1_copies_token_rows);
      std::ostringstream os;
      os << single;
      EXPECT_NE(os.str().find("one kernel"), std::string::npos) << os.str();
      EXPECT_NE(os.str().find("options.launch=single_kernel"), std::string::npos) << os.str();
    }
  }
}

// fp8_tensor streams E4M3 like fp8_block, but its stages carry no token scales (its scales apply
// in the epilogues) and it copies rows where fp8_block does (codes alone); the automatic launch
// keeps it to five kernels as it does the other precisions.
TEST(Planner, Fp8TensorStagesHoldCodesOnly) {
  const MoeSpec tensor = workload("qwen35-a3b", Precision::fp8_tensor);
  const MoeSpec block = workload("qwen35-a3b", Precision::fp8_block);
  for (int tokens : {1, 128, 8192}) {
    SCOPED_TRACE(tokens);
    const ForwardPlan t = forward_plan(tensor, tokens, 8192), b = forward_plan(block, tokens, 8192);
    EXPECT_EQ(t.token_tile, b.token_tile);
    EXPECT_EQ(t.fc1.block_k, 128);
    EXPECT_EQ(t.fc1.stage_bytes, (layout::kGemmChannelTile + t.token_tile) * layout::kGemmKBytes);
    EXPECT_LT(t.fc1.stage_bytes, b.fc1.stage_bytes);
    EXPECT_GE(t.fc1.stages, b.fc1.stages);
    EXPECT_EQ(t.fc1_copies_token_rows, b.fc1_copies_token_rows) << "the row copy carries codes alone for fp8_tensor";
    EXPECT_EQ(t.single_kernel, b.single_kernel);
  }
}

// The single kernel takes fp8_tensor with static activation scales; dynamic ones need waits on the
// whole grid (x's amax before any row is encoded, FC1's before FC2's input is): refused by name.
TEST(Planner, TheSingleKernelTakesStaticTensorScalesOnly) {
  const DeviceFacts h200 = DeviceFacts::h200_measured();
  const MoeSpec tensor = workload("qwen35-a3b", Precision::fp8_tensor);
  const MoeLayerOptions single{.launch = ForwardLaunch::single_kernel};
  const LayerPlan fixed = plan_layer(tensor, 4096, single, h200);
  for (int tokens : {1, 128, 4096}) {
    SCOPED_TRACE(tokens);
    const ForwardPlan p = plan_forward(tensor, fixed, tokens, CombineMode::deterministic, h200, PlanDetail::explained);
    EXPECT_TRUE(p.single_kernel);
    EXPECT_EQ(p.launches, 1);
  }
  try {
    plan_layer(tensor, 4096, single, h200, InputScales::dynamic);
    ADD_FAILURE() << "a single kernel with dynamic fp8_tensor scales was planned";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("single_kernel with precision fp8_tensor takes static activation scales"),
              std::string::npos)
        << e.what();
  }
  // The automatic launch never takes it with dynamic scales, whatever the single kernel's rule.
  const LayerPlan dynamic = plan_layer(tensor, 4096, {}, h200, InputScales::dynamic);
  for (int tokens : {1, 128}) EXPECT_FALSE(plan_forward(tensor, dynamic, tokens, CombineMode::deterministic, h200).single_kernel);
}

// fp8_tensor with dynamic activation scales: the same tiles as with static ones, seven launches (x's
// amax, FC1's output encoded) said in the printed plan with the reason, and a bf16 copy of FC1's
// output in the workspace; other precisions ignore the input scales.
TEST(Planner, DynamicInputScalesAddTwoLaunchesAndABf16Fc1Output) {
  const DeviceFacts h200 = DeviceFacts::h200_measured();
  const MoeSpec tensor = workload("qwen35-a3b", Precision::fp8_tensor);
  const LayerPlan fixed = plan_layer(tensor, 4096, {}, h200);
  const LayerPlan dynamic = plan_layer(tensor, 4096, {}, h200, InputScales::dynamic);
  EXPECT_TRUE(fixed.workspace.tensor_scales && !fixed.workspace.dynamic_scales);
  EXPECT_TRUE(dynamic.workspace.dynamic_scales);
  EXPECT_EQ(dynamic.workspace.total_bytes - fixed.workspace.total_bytes,
            layout::align_up(dynamic.workspace.pool_rows * tensor.intermediate * 2, layout::kRegionAlignment));
  for (int tokens : {1, 128, 4096}) {
    SCOPED_TRACE(tokens);
    const ForwardPlan f = plan_forward(tensor, fixed, tokens, CombineMode::deterministic, h200, PlanDetail::explained);
    const ForwardPlan d = plan_forward(tensor, dynamic, tokens, CombineMode::deterministic, h200, PlanDetail::explained);
    EXPECT_EQ(f.launches, 5);
    EXPECT_EQ(d.launches, 7);
    EXPECT_EQ(d.token_tile, f.token_tile);
    std::ostringstream printed;
    printed << d;
    EXPECT_NE(printed.str().find("seven kernels"), std::string::npos) << printed.str();
    EXPECT_NE(printed.str().find("dynamic activation scales"), std::string::npos) << printed.str();
    // Without the reasons (a forward's own plan) the count is the same.
    EXPECT_EQ(plan_forward(tensor, dynamic, tokens, CombineMode::deterministic, h200, PlanDetail::decisions).launches, 7);
  }
  const MoeSpec block = workload("qwen35-a3b", Precision::fp8_block);
  EXPECT_FALSE(plan_layer(block, 4096, {}, h200, InputScales::dynamic).workspace.dynamic_scales);
}

// A layer whose option fixes the token tile pads its pool for that tile, not the planner's.
TEST(Planner, AFixedTokenTilePadsTheWorkspaceForIt) {
  const MoeSpec spec = workload("qwen35-a3b", Precision::fp8_block);
  const DeviceFacts h200 = DeviceFacts::h200_measured();
  EXPECT_EQ(plan_layer(spec, 128, {}, h200).workspace.row_padding, 16);
  EXPECT_EQ(plan_layer(spec, 128, {.token_tile = 64}, h200).workspace.row_padding, 64);
  EXPECT_EQ(plan_layer(spec, 128, {.token_tile = 128}, h200).workspace.row_padding, 128);
  EXPECT_EQ(forward_plan(spec, 100, 128, {.token_tile = 64}).token_tile, 64);
}

TEST(Planner, RejectsImpossibleRequests) {
  const MoeSpec spec = workload("qwen35-a3b", Precision::fp8_block);
  const DeviceFacts h200 = DeviceFacts::h200_measured();
  DeviceFacts tiny = h200;
  tiny.smem_per_block_optin = 40 * 1024;
  EXPECT_THROW(plan_layer(spec, 8192, {}, tiny), Error);
  const LayerPlan layer = plan_layer(spec, 8, {}, h200);
  EXPECT_THROW(plan_forward(spec, layer, 0, CombineMode::deterministic, h200), Error);
  EXPECT_THROW(plan_forward(spec, layer, 9, CombineMode::deterministic, h200), Error);
  EXPECT_THROW(plan_layer(spec, 0, {}, h200), Error);
  EXPECT_THROW(plan_layer(spec, (1 << 24) + 1, {}, h200), Error);
  EXPECT_THROW(plan_layer(spec, 8, {.token_tile = 48}, h200), Error);
  DeviceFacts none;
  EXPECT_THROW(plan_layer(spec, 8, {}, none), Error);
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
  EXPECT_NEAR(f.floor_us, f.weight_bytes / h200.hbm_read_bytes_per_s * 1e6, 1e-9);
  EXPECT_STREQ(f.bound, "hbm");
}

TEST(Floors, ExpectedTouchedExpertsMatchesTheClosedForm) {
  const MoeSpec spec = workload("qwen35-a3b", Precision::fp8_block);
  const Floors f128 = expected_floors(spec, 128, DeviceFacts::h200_measured());
  EXPECT_NEAR(f128.touched_experts, 256 * (1 - std::pow(1 - 8.0 / 256, 128)), 1e-9);
  // At 128 tokens almost every expert is touched: ~0.18 ms of weights at 4.45 TB/s.
  EXPECT_GT(f128.touched_experts, 250);
  EXPECT_NEAR(f128.floor_us, 177, 10);
  const Floors big = expected_floors(workload("dsv3", Precision::fp8_block), 8192, DeviceFacts::h200_measured());
  EXPECT_STREQ(big.bound, "compute");
}

// The token tile holds the mean rows per touched expert plus their spread (planner.hpp): uniform
// routing over qwen35-a3b's 256 experts moves to 32-token tiles at a mean of ~9.8 rows (313
// tokens), to 64 at ~22.5 (721) and to the tokens-on-M tile of 128 at ~49.9 (1597).
TEST(Planner, TokenTileCoversTheSpreadOfRowsPerExpert) {
  const MoeSpec spec = workload("qwen35-a3b", Precision::fp8_block);
  const std::pair<int, int> tile_at[] = {{1, 16},    {16, 16},   {128, 16},  {312, 16},  {313, 32},
                                         {512, 32},  {720, 32},  {721, 64},  {1000, 64}, {1024, 64},
                                         {1596, 64}, {1597, 128}, {2048, 128}, {3072, 128}, {8192, 128}};
  for (const auto& [tokens, tile] : tile_at) EXPECT_EQ(choose_token_tile(spec, tokens), tile) << tokens << " tokens";
}

// A forced row copy keeps the planner's tile in swapAB, whose token blocks it fills, and says so.
TEST(Planner, AForcedRowCopyKeepsTheTileInSwapAb) {
  const MoeSpec spec = workload("qwen35-a3b", Precision::fp8_block);
  const ForwardPlan automatic = forward_plan(spec, 8192, 8192);
  EXPECT_EQ(automatic.token_tile, 128);
  EXPECT_FALSE(automatic.fc1_copies_token_rows);
  const ForwardPlan copying = forward_plan(spec, 8192, 8192, {.fc1_token_rows = Fc1TokenRows::row_copy});
  EXPECT_EQ(copying.token_tile, 64);
  EXPECT_TRUE(copying.fc1_copies_token_rows);
  EXPECT_TRUE(copying.fc1.swap_ab);
  EXPECT_NE(copying.reasons[0].find("row_copy"), std::string::npos) << copying.reasons[0];
}

// Weight multicast pairs the GEMMs' CTAs where the tile is tokens on M, on an even grid, and says
// why not elsewhere.
TEST(Planner, WeightMulticastPairsTheTokensOnMTilesOnAnEvenGrid) {
  const MoeSpec spec = workload("qwen35-a3b", Precision::fp8_block);
  const ForwardPlan large = forward_plan(spec, 8192, 8192, {.weight_multicast = true});
  EXPECT_TRUE(large.weight_multicast);
  EXPECT_EQ(large.grid, 132);
  const ForwardPlan odd = forward_plan(spec, 8192, 8192, {.num_sms = 101, .weight_multicast = true});
  EXPECT_TRUE(odd.weight_multicast);
  EXPECT_EQ(odd.grid, 100) << "a pair needs two SMs";
  std::ostringstream odd_plan;
  odd_plan << odd;
  EXPECT_NE(odd_plan.str().find("one CTA fewer"), std::string::npos) << odd_plan.str();
  const ForwardPlan single_cta = forward_plan(spec, 8192, 8192, {.num_sms = 1, .weight_multicast = true});
  EXPECT_FALSE(single_cta.weight_multicast);
  EXPECT_EQ(single_cta.grid, 1);
  const ForwardPlan small = forward_plan(spec, 16, 8192, {.num_sms = 101, .weight_multicast = true});
  EXPECT_FALSE(small.weight_multicast) << "swapAB tiles run alone";
  EXPECT_EQ(small.grid, 101);
  std::ostringstream os;
  os << small;
  EXPECT_NE(os.str().find("tokens-on-M tile only"), std::string::npos) << os.str();
  EXPECT_FALSE(forward_plan(spec, 8192, 8192).weight_multicast) << "off by default";
}

}  // namespace
}  // namespace megamoe::plan
