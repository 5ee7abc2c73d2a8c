// Shared-memory budget of the grouped GEMM, used by the planner (to report) and the kernel (to
// size its pipeline), so the two cannot disagree.
#pragma once

#include "kernels/layout/weight_layout.hpp"

namespace megamoe::layout {

// Output channels of one tile in both layouts: swapAB's wgmma M (4 x m64, over the math
// warpgroups), and the tokens-on-M layout's N (two n128 halves), where 256 packed FC1 rows are the
// 128 output channels of one requantization block (docs/decisions.md#tokens-on-m-tile).
inline constexpr int kGemmChannelTile = 256;
inline constexpr int kGemmKBytes = 128;               // one 128-byte swizzle row of K per stage
// Token tiles: 16, 32 or 64 tokens on wgmma N (swapAB), or 128 on M (64 per math warpgroup).
inline constexpr int kGemmSwapAbMaxTokenTile = 64;
inline constexpr int kGemmTokensOnMTile = 128;
inline constexpr int kGemmMaxStages = 8;
// Math warpgroups per CTA, each owning kGemmChannelTile / kGemmMathWarpgroups consecutive rows
// (2: two m64 blocks each, 224 registers per thread; 4: one, 112 registers). Four would give each
// SM sub-partition four consumer warps to hide latency with (docs/decisions.md#four-math-warpgroups).
inline constexpr int kGemmMathWarpgroups = 2;
inline constexpr int kGemmConsumerWarps = 4 * kGemmMathWarpgroups;
// FC1's amax exchange: swapAB's per-warp partials and token amaxes; the tokens-on-M tile uses 512
// bytes of it, for a short tile's row amaxes of the two warpgroups.
inline constexpr int kGemmExchangeBytes = (kGemmConsumerWarps + 1) * kGemmSwapAbMaxTokenTile * 4;
inline constexpr int kGemmBarrierBytes = 1024;         // mbarriers, per-stage weight scales and tile tags
inline constexpr int kSm90SmemPerBlockOptin = 232448;  // 227 KiB

MEGAMOE_HOST_DEVICE constexpr bool gemm_tokens_on_m(int token_tile) { return token_tile == kGemmTokensOnMTile; }

// Floats between the token scales of consecutive stages: TMA writes start on 128-byte lines.
MEGAMOE_HOST_DEVICE constexpr int gemm_token_scale_stride(int token_tile) { return token_tile < 32 ? 32 : token_tile; }

// Rows of the token blocks a stage is loaded in. With 64-token tiles an expert's last tile drops
// to 32 rows when at most 32 of its rows are left (the planner picks 64 from ~23 expected rows
// per expert, so without it half of those experts' tiles would be padding, and the math warps
// spend their time on padded columns), and each expert's pool segment is padded to 32 rows only.
// Smaller tiles keep one block: a half of 16 rows would put the second half's 16 token scales
// (64 bytes) off the 128-byte line a TMA write must start on. The tokens-on-M tile's halves are
// its math warpgroups' rows; a last tile of at most 64 rows loads one, which both warpgroups then
// multiply (a channel half each).
MEGAMOE_HOST_DEVICE constexpr int gemm_token_subtile(int token_tile) {
  return token_tile >= kGemmSwapAbMaxTokenTile ? token_tile / 2 : token_tile;
}

// token_scales: the stage also holds its token rows' block scales (fp8_block).
MEGAMOE_HOST_DEVICE constexpr int gemm_stage_bytes(int token_tile, bool token_scales) {
  return (kGemmChannelTile + token_tile) * kGemmKBytes + (token_scales ? gemm_token_scale_stride(token_tile) * 4 : 0);
}

MEGAMOE_HOST_DEVICE constexpr int gemm_fixed_bytes() {
  return kGemmExchangeBytes + kGemmBarrierBytes;
}

MEGAMOE_HOST_DEVICE constexpr int gemm_stages(int token_tile, bool token_scales, int smem_per_block) {
  const int stages = (smem_per_block - gemm_fixed_bytes()) / gemm_stage_bytes(token_tile, token_scales);
  return stages < kGemmMaxStages ? stages : kGemmMaxStages;
}

}  // namespace megamoe::layout
