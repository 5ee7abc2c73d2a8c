#include "kernels/layout/moe_workspace.hpp"

#include <gtest/gtest.h>

#include "common/layout_checks.hpp"

#include <algorithm>
#include <utility>
#include <vector>

#include "plan/planner.hpp"
#include "plan/workloads.hpp"

namespace megamoe::layout {
namespace {

TEST(MoeWorkspaceLayout, WorstCasePoolCoversEveryRoutingThatFits) {
  // Adversarial routings for E=8, k=2, T=5, padding 4: count each expert's padded rows.
  const int E = 8, k = 2, T = 5, pad = 4;
  const size_t bound = MoeWorkspaceLayout::worst_case_pool_rows(E, k, T, pad);
  // 10 routed rows spread over 8 experts: 2 experts with 2 rows and 6 with 1 -> 8 tiles of 4.
  EXPECT_GE(bound, 32u);
  // All on as many experts as possible can never exceed routed + nonempty * (pad - 1).
  EXPECT_EQ(bound, 10u + 8u * 3u + (pad - (10 + 24) % pad) % pad);
  EXPECT_EQ(MoeWorkspaceLayout::worst_case_pool_rows(256, 8, 1, 8), 64u);  // 8 experts, 1 row each, 7 padding
}

TEST(MoeWorkspaceLayout, RegionsAreAlignedDisjointAndInOrder) {
  const std::vector<std::pair<Precision, InputScales>> kinds = {
      {Precision::bf16, InputScales::from_checkpoint}, {Precision::fp8_block, InputScales::from_checkpoint},
      {Precision::fp8_tensor, InputScales::from_checkpoint}, {Precision::fp8_tensor, InputScales::dynamic},
      {Precision::fp8_block, InputScales::dynamic}};  // read by fp8_tensor only
  for (const auto& [precision, input_scales] : kinds) {
    const MoeWorkspaceLayout l = MoeWorkspaceLayout::make(256, 8, 7168, 2048, 4096, 128, precision, input_scales);
    const bool fp8 = precision != Precision::bf16, block_scales = precision == Precision::fp8_block;
    const bool tensor = precision == Precision::fp8_tensor, dynamic = tensor && input_scales == InputScales::dynamic;
    EXPECT_EQ(l.tensor_scales, tensor);
    EXPECT_EQ(l.dynamic_scales, dynamic);
    const size_t slots = 4096ull * 8;
    const std::vector<std::pair<size_t, size_t>> regions = {
        {l.expert_counts, 4 * 256},
        {l.routing_blocks_done, 4},
        {l.expert_rows, 4 * 256},
        {l.expert_offsets, 4 * 257},
        {l.token_tile_prefix, 4 * 257},
        {l.token_tile_expert, 4 * slots},
        {l.gemm_tiles_claimed, 8},
        {l.fc1_tiles_done, 4 * 257},
        {l.fc1_blocks_issued, 4},
        {l.routed_ids, 4 * slots},
        {l.routed_weights, 4 * slots},
        {l.slot_rank, 4 * slots},
        {l.pool_slot, 4 * l.pool_rows},
        {l.activations, l.pool_rows * 7168 * (fp8 ? 1 : 2)},
        {l.activation_scales, block_scales ? l.pool_rows * 56 * 4 : 0},
        {l.fc1_output, l.pool_rows * 2048 * (fp8 ? 1 : 2)},
        {l.fc1_output_bf16, dynamic ? l.pool_rows * 2048 * 2 : 0},
        {l.fc1_scales, block_scales ? l.pool_rows * 16 * 4 : 0},
        {l.slot_outputs, slots * 7168 * 2},
        {l.y_accumulator, 4096ull * 7168 * 4},
        {l.error_flags, 16},
        {l.forward_counters, 4 * kForwardCounterSlots},
        {l.tensor_scale_slots, tensor ? sizeof(TensorScaleSlots) : 0}};
    test::expect_aligned_disjoint(regions, l.total_bytes, kRegionAlignment);
    EXPECT_EQ(l.pool_rows % 128, 0u);
  }
}

TEST(MoeWorkspaceLayout, PlannerSizesThePoolForTheWidestTileUpToCapacity) {
  MoeSpec spec = plan::find_workload("qwen35-a3b").spec;
  spec.precision = Precision::fp8_block;
  const plan::DeviceFacts h200 = plan::DeviceFacts::h200_measured();
  const plan::LayerPlan layer = plan::plan_layer(spec, 8192, {}, h200);
  for (int tokens : {1, 100, 1000, 8192}) {
    const plan::ForwardPlan forward = plan::plan_forward(spec, layer, tokens, CombineMode::deterministic, h200);
    EXPECT_GE(layer.workspace.row_padding, forward.token_tile) << "one allocation must serve every token count";
  }
}

}  // namespace
}  // namespace megamoe::layout
