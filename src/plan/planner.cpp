#include "plan/planner.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ostream>
#include <sstream>

#include "kernels/layout/gemm_smem.hpp"
#include "megamoe/error.hpp"
#include "ref/routing.hpp"

namespace megamoe::plan {
namespace {

constexpr int kWgmmaRowsPerWarpgroup = 64;  // wgmma M is fixed at 64 per instruction
constexpr int kMinTokenTile = 16;

int next_pow2(int v) {
  int p = 1;
  while (p < v) p *= 2;
  return p;
}

long long ceil_div(long long a, long long b) { return (a + b - 1) / b; }

std::string format(const char* fmt, long long a, long long b = 0, long long c = 0) {
  char buffer[256];
  std::snprintf(buffer, sizeof buffer, fmt, a, b, c);
  return buffer;
}

double expected_touched_experts(const MoeSpec& spec, int tokens) {
  const double untouched_by_one = 1.0 - static_cast<double>(spec.top_k) / spec.num_experts;
  return spec.num_experts * (1.0 - std::pow(untouched_by_one, tokens));
}

double mean_rows_per_expert(const MoeSpec& spec, int tokens) {
  return static_cast<double>(tokens) * spec.top_k / expected_touched_experts(spec, tokens);
}

int expected_rows_per_expert(const MoeSpec& spec, int tokens) {
  return static_cast<int>(std::ceil(mean_rows_per_expert(spec, tokens)));
}

// The rows a token tile should hold so that few experts take a second one: the mean rows per
// touched expert plus kTokenTileSpread standard deviations of the counts (uniform routing's are
// Poisson-like: the deviation is the mean's square root).
double rows_to_cover(double mean_rows) { return mean_rows + kTokenTileSpread * std::sqrt(mean_rows); }

int token_tile_for_rows(double mean_rows) {
  return std::clamp(next_pow2(static_cast<int>(std::ceil(rows_to_cover(mean_rows)))), kMinTokenTile,
                    layout::kGemmMaxTokenTile);
}

GemmConfig choose_gemm(const char* name, const MoeSpec& spec, double mean_rows, double touched_experts,
                       int out_channels, const DeviceFacts& facts) {
  const int rows_per_expert = static_cast<int>(std::ceil(mean_rows));
  const bool fp8 = spec.precision == Precision::fp8_block;
  GemmConfig c;
  c.name = name;
  c.block_k = fp8 ? 128 : 64;
  c.reasons.push_back(fp8 ? "block_k=128: one FP8 scale block per K step, so promotion happens once per stage"
                          : "block_k=64: one 128-byte swizzled row of bf16 per K step");
  c.swap_ab = true;
  c.math_warpgroups = layout::kGemmMathWarpgroups;
  c.channel_tile = layout::kGemmChannelTile;
  c.token_tile = token_tile_for_rows(mean_rows);
  c.block_m = c.channel_tile;
  c.block_n = c.token_tile;
  c.reasons.push_back(format("swapAB: expert channels on wgmma M (%lld rows: %lld math warpgroups x %lld x m64), "
                             "tokens on N, so small batches pad N instead of M=64",
                             c.channel_tile, c.math_warpgroups,
                             c.channel_tile / (c.math_warpgroups * kWgmmaRowsPerWarpgroup)));
  c.reasons.push_back(format("token tile %lld: ~%lld rows per touched expert, ~%lld with their spread, within "
                             "[16, 64] (two fp32 accumulator sets of 256 channels x 64 tokens per CTA are the "
                             "register budget)",
                             c.token_tile, rows_per_expert, static_cast<long long>(std::ceil(rows_to_cover(mean_rows)))));
  c.stage_bytes = layout::gemm_stage_bytes(c.token_tile, fp8);
  const int fixed_bytes = layout::gemm_fixed_bytes();
  c.stages = layout::gemm_stages(c.token_tile, fp8, facts.smem_per_block_optin);
  if (c.stages < 2) {
    throw Error(ErrorCode::unsupported, format("device offers %lld bytes of shared memory per CTA; a %lld-byte stage "
                                               "needs at least 2 stages",
                                               facts.smem_per_block_optin, c.stage_bytes));
  }
  c.reasons.push_back(format("%lld stages: as many %lld-byte stages as fit next to the epilogue exchange "
                             "(>= 3 hides TMA latency; capped at 8)",
                             c.stages, c.stage_bytes));
  c.smem_bytes = c.stages * c.stage_bytes + fixed_bytes;
  c.expected_tiles = static_cast<long long>(std::ceil(touched_experts)) * ceil_div(out_channels, c.channel_tile) *
                     ceil_div(rows_per_expert, c.token_tile);
  return c;
}

Floors make_floors(const MoeSpec& spec, int tokens, double routed_rows, double touched, const DeviceFacts& facts) {
  Floors f;
  f.tokens = tokens;
  f.routed_rows = routed_rows;
  f.touched_experts = touched;
  f.weight_bytes = touched * expert_weight_bytes(spec);
  f.useful_flops = 2.0 * routed_rows * 3.0 * spec.hidden * spec.intermediate;
  f.hbm_us = f.weight_bytes / facts.hbm_read_bytes_per_s * 1e6;
  f.compute_us = f.useful_flops / facts.dense_flops_per_s(spec.precision) * 1e6;
  f.floor_us = std::max(f.hbm_us, f.compute_us);
  f.bound = f.hbm_us >= f.compute_us ? "hbm" : "compute";
  return f;
}

}  // namespace

int choose_token_tile(const MoeSpec& spec, int tokens) {
  return token_tile_for_rows(mean_rows_per_expert(spec, tokens));
}

bool fc1_copies_token_rows(const MoeSpec& spec, int tokens) {
  return spec.precision == Precision::fp8_block && mean_rows_per_expert(spec, tokens) <= kMaxRowsPerExpertForRowCopy;
}

layout::MoeWorkspaceLayout workspace_layout(const MoeSpec& spec, int max_tokens, int row_padding) {
  return layout::MoeWorkspaceLayout::make(spec.num_experts, spec.top_k, spec.hidden, spec.intermediate, max_tokens,
                                          row_padding, spec.precision == Precision::fp8_block);
}

DeviceFacts DeviceFacts::h200_measured() {
  DeviceFacts f;
  f.name = "NVIDIA H200 (figures measured 2026-11-29)";
  f.num_sms = 132;
  f.smem_per_block_optin = 232448;
  f.l2_bytes = 60LL * 1024 * 1024;
  f.hbm_read_bytes_per_s = 4.18e12;
  f.dense_fp8_flops_per_s = 1267e12;
  f.dense_bf16_flops_per_s = 700e12;
  return f;
}

double expert_weight_bytes(const MoeSpec& spec) {
  const double elements = 3.0 * spec.hidden * spec.intermediate;
  if (spec.precision == Precision::fp8_block) {
    return elements + 3.0 * (spec.hidden / 128) * (spec.intermediate / 128) * sizeof(float);
  }
  return elements * 2.0;
}

MoePlan plan_moe(const MoeSpec& spec, int tokens, int max_tokens, const DeviceFacts& facts) {
  validate(spec);
  if (max_tokens < 1) throw Error(ErrorCode::invalid_argument, "max_tokens must be >= 1");
  if (tokens < 1 || tokens > max_tokens) {
    throw Error(ErrorCode::invalid_argument, format("tokens=%lld must be in [1, max_tokens=%lld]", tokens, max_tokens));
  }
  if (facts.num_sms < 1 || facts.smem_per_block_optin < 1) {
    throw Error(ErrorCode::invalid_argument, "device facts are missing the SM count or shared-memory limit");
  }
  MoePlan plan;
  plan.max_tokens = max_tokens;
  plan.tokens = tokens;
  const double touched = expected_touched_experts(spec, tokens);
  plan.expected_rows_per_expert = expected_rows_per_expert(spec, tokens);
  const double mean_rows = mean_rows_per_expert(spec, tokens);
  plan.fc1 = choose_gemm("fc1", spec, mean_rows, touched, 2 * spec.intermediate, facts);
  plan.fc2 = choose_gemm("fc2", spec, mean_rows, touched, spec.hidden, facts);

  // The pool is sized for the largest token tile any token count up to max_tokens may choose.
  const int row_padding = std::max({plan.fc1.token_tile, plan.fc2.token_tile, choose_token_tile(spec, max_tokens)});
  plan.workspace = workspace_layout(spec, max_tokens, row_padding);
  return plan;
}

Floors expected_floors(const MoeSpec& spec, int tokens, const DeviceFacts& facts) {
  validate(spec);
  return make_floors(spec, tokens, static_cast<double>(tokens) * spec.top_k, expected_touched_experts(spec, tokens),
                     facts);
}

Floors routed_floors(const MoeSpec& spec, const int32_t* topk_ids, int tokens, const DeviceFacts& facts) {
  validate(spec);
  const ref::RoutingCheck check = ref::check_routing(topk_ids, tokens, spec.top_k, spec.num_experts);
  std::vector<uint8_t> touched(spec.num_experts, 0);
  double rows = 0;
  for (size_t i = 0; i < check.used.size(); ++i) {
    if (!check.used[i]) continue;
    touched[topk_ids[i]] = 1;
    rows += 1;
  }
  return make_floors(spec, tokens, rows, std::count(touched.begin(), touched.end(), 1), facts);
}

std::ostream& operator<<(std::ostream& os, const DeviceFacts& f) {
  return os << f.name << ": " << f.num_sms << " SMs, " << f.smem_per_block_optin / 1024 << " KiB smem/CTA, "
            << f.l2_bytes / (1024 * 1024) << " MiB L2, HBM " << f.hbm_read_bytes_per_s / 1e12 << " TB/s, FP8 "
            << f.dense_fp8_flops_per_s / 1e12 << " TFLOP/s, bf16 " << f.dense_bf16_flops_per_s / 1e12 << " TFLOP/s";
}

std::ostream& operator<<(std::ostream& os, const GemmConfig& c) {
  os << c.name << ": " << (c.swap_ab ? "swapAB " : "") << "block " << c.block_m << "x" << c.block_n << "x"
     << c.block_k << " (tokens " << c.token_tile << " x channels " << c.channel_tile << "), " << c.math_warpgroups
     << " math WG, " << c.stages << " stages, " << c.smem_bytes / 1024.0 << " KiB smem, ~" << c.expected_tiles
     << " tiles";
  for (const std::string& reason : c.reasons) os << "\n    - " << reason;
  return os;
}

std::ostream& operator<<(std::ostream& os, const MoePlan& p) {
  const auto& w = p.workspace;
  return os << "plan for " << p.tokens << " tokens (capacity " << p.max_tokens << "), ~"
            << p.expected_rows_per_expert << " rows per touched expert\n  " << p.fc1 << "\n  " << p.fc2
            << "\n  workspace: " << w.total_bytes / 1048576.0 << " MiB (pool " << w.pool_rows << " rows padded to "
            << w.row_padding << ")";
}

std::ostream& operator<<(std::ostream& os, const Floors& f) {
  return os << f.tokens << " tokens: " << f.touched_experts << " experts touched, " << f.weight_bytes / 1e6
            << " MB weights, " << f.useful_flops / 1e9 << " GFLOP useful; floor " << f.floor_us << " us ("
            << f.bound << "-bound: HBM " << f.hbm_us << " us, compute " << f.compute_us << " us)";
}

}  // namespace megamoe::plan
