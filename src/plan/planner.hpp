// The host planner: MoeSpec + token count + device facts -> tile, pipeline and workspace
// configuration, and the floors a call is measured against. Pure C++, deterministic.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

#include "kernels/layout/moe_workspace.hpp"
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

struct MoePlan {
  int max_tokens = 0;
  int tokens = 0;               // the token count the tiles were chosen for
  int expected_rows_per_expert = 0;
  GemmConfig fc1;
  GemmConfig fc2;
  layout::MoeWorkspaceLayout workspace;
};

// Token tile (wgmma N) of the grouped GEMMs for a call of `tokens` tokens: the narrowest of 16, 32
// and 64 that holds the expected rows per touched expert under uniform routing plus
// kTokenTileSpread standard deviations of their spread. A tile that only holds the mean leaves the
// ~45% of experts above it a second tile, which streams their weights again: at 512 and 1024
// qwen35-a3b tokens (16 and 32 rows per expert) tiles of 32 and 64 beat 16 and 32 by 24 and 20 us
// (bench/NOTES.md, eighteenth session, run 5). With two deviations the tile changes at 313 and 721
// qwen35-a3b tokens; measured between the buckets (nineteenth session, run 2) it matched the best
// of the three fixed tiles at every count and beat the mean's tile by 22 us at 500 tokens, 16 us
// at 1000, and 212 and 124 us for dsv3 at 500 and 1000.
inline constexpr double kTokenTileSpread = 2.0;
int choose_token_tile(const MoeSpec& spec, int tokens);

// Whether fp8 FC1 copies its token rows from the gather's one quantized row per token
// (kernels/permute/stage_row_copy.cuh) instead of loading a pool of k copies per token: where the
// expected rows per touched expert stay within kMaxRowsPerExpertForRowCopy. The copying warp
// pays per row: at 1024 qwen35-a3b tokens (~32 rows per expert) the layer gained 17 us, at 2048
// (~64) it lost 17 and at 8192 (~256, full 64-row tiles) FC1 lost 50% (bench/NOTES.md, seventeenth
// session, run 5, and eighteenth, run 2).
inline constexpr double kMaxRowsPerExpertForRowCopy = 40;
bool fc1_copies_token_rows(const MoeSpec& spec, int tokens);

// The workspace of up to `max_tokens` tokens with each expert's pool segment padded to
// `row_padding` rows (the largest token tile a call may use).
layout::MoeWorkspaceLayout workspace_layout(const MoeSpec& spec, int max_tokens, int row_padding);

// Chooses configs for `tokens` and sizes the workspace for up to `max_tokens`
// (1 <= tokens <= max_tokens). Throws megamoe::Error when the device cannot host any config.
MoePlan plan_moe(const MoeSpec& spec, int tokens, int max_tokens, const DeviceFacts& facts);

// The floor of one call (DESIGN.md "Measuring"): touched-expert weight bytes over HBM read
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
// Exact, from the routing of a call (invalid and -1 ids excluded).
Floors routed_floors(const MoeSpec& spec, const int32_t* topk_ids, int tokens, const DeviceFacts& facts);

// Bytes of one expert's packed weights and scales.
double expert_weight_bytes(const MoeSpec& spec);

std::ostream& operator<<(std::ostream& os, const GemmConfig& config);
std::ostream& operator<<(std::ostream& os, const MoePlan& plan);
std::ostream& operator<<(std::ostream& os, const Floors& floors);

}  // namespace megamoe::plan
