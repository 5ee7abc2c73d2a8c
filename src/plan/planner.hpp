// The host planner: MoeSpec + options + token count + device facts -> the tile, pipeline and
// workspace configuration a forward launches, and the floors a call is measured against. Pure
// C++, deterministic.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

#include "kernels/layout/moe_workspace.hpp"
#include "megamoe/options.hpp"
#include "megamoe/spec.hpp"
#include "plan/device_facts.hpp"

namespace megamoe::plan {

// One grouped GEMM's tiling. With swap_ab the expert's output channels sit on M (block_m) and
// its tokens on N (block_n); without it tokens are on M and channels on N.
struct GemmConfig {
  const char* name = "";        // "fc1" or "fc2"
  bool swap_ab = false;
  int block_m = 0;
  int block_n = 0;
  int block_k = 0;
  int token_tile = 0;           // rows of tokens one tile covers (block_n if swap_ab, else block_m)
  int channel_tile = 0;         // output channels one tile covers
  int math_warpgroups = 0;
  int stages = 0;
  int stage_bytes = 0;
  int smem_bytes = 0;           // pipeline stages + epilogue staging + barriers
  long long expected_tiles = 0; // under uniform routing
  std::vector<std::string> reasons;  // one line per heuristic decision
};

// Token tile of the grouped GEMMs for a call of `tokens` tokens: the narrowest of 16, 32 and 64
// (swapAB: tokens on wgmma N) that holds the expected rows per touched expert under uniform
// routing plus kTokenTileSpread standard deviations of their spread, so that few experts need a
// second tile that streams their weights again (docs/decisions.md#token-tile); where those rows
// exceed 64, the tokens-on-M tile of 128 (docs/decisions.md#tokens-on-m-tile).
inline constexpr double kTokenTileSpread = 2.0;
int choose_token_tile(const MoeSpec& spec, int tokens);

// Whether fp8 FC1 copies its token rows from the gather's one quantized row per token
// (kernels/permute/stage_row_copy.cuh) instead of loading a pool of k copies per token: where the
// expected rows per touched expert stay within kMaxRowsPerExpertForRowCopy. The copying warp pays
// per row, so it wins at a few rows per expert and loses at full tiles
// (docs/decisions.md#fc1-row-copy).
inline constexpr double kMaxRowsPerExpertForRowCopy = 40;
bool fc1_copies_token_rows(const MoeSpec& spec, int tokens);

// Whether a forward runs as one persistent kernel (kernels/impls/sm90_moe_single_kernel.cuh)
// instead of five: options.launch names it, or under options.launch=auto where the call has at most
// kMaxSingleKernelTokens tokens and weight_multicast does not ask for CTA pairs (which it does not
// launch). That is none today: the single kernel was slower than the five in every bucket measured
// (docs/design.md#single-kernel-forward). It takes every token tile the five kernels take, both
// layouts (docs/design.md#single-kernel-token-tiles); the fused expert-parallel forward (the same
// kernel with its own roles before and after the GEMMs) takes the planner's tile too.
inline constexpr int kMaxSingleKernelTokens = 0;

// The layer's plan, fixed when it is built: its options and the workspace for up to max_tokens
// tokens, padded for the widest token tile any call may take.
struct LayerPlan {
  int max_tokens = 0;
  MoeLayerOptions options;
  layout::MoeWorkspaceLayout workspace;
};

// What one forward launches: MoeLayer::forward runs exactly this (the launcher checks the stage
// counts against the kernels it instantiates), and MEGAMOE_PRINT_CONFIGS=1 prints it.
struct ForwardPlan {
  int tokens = 0;                       // the rows the tiles were chosen for
  int expected_rows_per_expert = 0;     // under uniform routing
  int token_tile = 0;                   // 16, 32 or 64 (swapAB) or 128 (tokens on M), for FC1 and FC2
  bool single_kernel = false;           // one persistent launch, else one per stage (launches)
  int launches = 5;                     // kernels per forward: 1, 5, or 7 (fp8_tensor's dynamic scales add two)
  bool weight_multicast = false;        // tokens on M: the GEMMs' CTAs in pairs sharing weight blocks
  bool fc1_copies_token_rows = false;
  CombineMode combine = CombineMode::deterministic;
  int grid = 0;                         // persistent CTAs of each GEMM
  GemmConfig fc1;
  GemmConfig fc2;
  std::vector<std::string> reasons;     // the forward's own decisions (explained plans only)
};

// The layer's plan. Throws megamoe::Error when the spec, the options or max_tokens are invalid or
// the device cannot host the kernels. input_scales: where an fp8_tensor layer's activation scales
// come from (its packed weights'); dynamic ones take a bf16 copy of FC1's output in the workspace.
LayerPlan plan_layer(const MoeSpec& spec, int max_tokens, const MoeLayerOptions& options, const DeviceFacts& facts,
                     InputScales input_scales = InputScales::from_checkpoint);

// The plan of a forward of `tokens` rows (1 <= tokens <= the layer's max_tokens) with `combine`.
// A forward needs the decisions only; `explain` adds the reasons and the expected tile counts
// (formatted strings, which the per-call path does not pay for). Both come from the same code.
enum class PlanDetail { decisions, explained };
ForwardPlan plan_forward(const MoeSpec& spec, const LayerPlan& layer, int tokens, CombineMode combine,
                         const DeviceFacts& facts, PlanDetail detail = PlanDetail::explained);

// The floor of one call (docs/design.md#measuring): touched-expert weight bytes over HBM read
// bandwidth, useful FLOPs (2 * routed rows * 3 * H * I, padding excluded) over the dense rate.
struct Floors {
  int tokens = 0;
  double routed_rows = 0;
  double touched_experts = 0;
  double weight_bytes = 0;
  double useful_flops = 0;
  double hbm_us = 0;
  double compute_us = 0;
  double floor_us = 0;
  const char* bound = "";  // "hbm" or "compute"
};

// Expectation under uniform random routing: an expert is untouched by one token with
// probability 1 - k/E.
Floors expected_floors(const MoeSpec& spec, int tokens, const DeviceFacts& facts);
// From a call's routed rows and touched experts (ref::routed_floors counts them from its ids).
Floors floors_of(const MoeSpec& spec, int tokens, double routed_rows, double touched_experts, const DeviceFacts& facts);

// Bytes of one expert's packed weights and scales.
double expert_weight_bytes(const MoeSpec& spec);

std::ostream& operator<<(std::ostream& os, const GemmConfig& config);
std::ostream& operator<<(std::ostream& os, const LayerPlan& plan);
std::ostream& operator<<(std::ostream& os, const ForwardPlan& plan);
std::ostream& operator<<(std::ostream& os, const Floors& floors);

}  // namespace megamoe::plan
