#include "plan/planner.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ostream>
#include <sstream>

#include "kernels/layout/gemm_smem.hpp"
#include "megamoe/error.hpp"

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

std::string format(const char* fmt, long long a, long long b = 0, long long c = 0, long long d = 0) {
  char buffer[256];
  std::snprintf(buffer, sizeof buffer, fmt, a, b, c, d);
  return buffer;
}

double expected_touched_experts(const MoeSpec& spec, int tokens) {
  const double untouched_by_one = 1.0 - static_cast<double>(spec.top_k) / spec.num_experts;
  return spec.num_experts * (1.0 - std::pow(untouched_by_one, tokens));
}

double mean_rows_per_expert(const MoeSpec& spec, int tokens) {
  return static_cast<double>(tokens) * spec.top_k / expected_touched_experts(spec, tokens);
}

// The rows a token tile should hold so that few experts take a second one: the mean rows per
// touched expert plus kTokenTileSpread standard deviations of the counts (uniform routing's are
// Poisson-like: the deviation is the mean's square root).
double rows_to_cover(double mean_rows) { return mean_rows + kTokenTileSpread * std::sqrt(mean_rows); }

// fc1_copies_token_rows' rule, from the mean rows per touched expert.
bool copies_rows_for(const MoeSpec& spec, double mean_rows) {
  return spec.precision != Precision::bf16 && mean_rows <= kMaxRowsPerExpertForRowCopy;
}

// The row copy fills swapAB's token blocks only.
bool copies_rows_for(const MoeSpec& spec, double mean_rows, int token_tile) {
  return !layout::gemm_tokens_on_m(token_tile) && copies_rows_for(spec, mean_rows);
}

// 16, 32 or 64 (swapAB) while the rows to cover fit 64, else 128 (tokens on M).
int token_tile_for_rows(double mean_rows) {
  return std::clamp(next_pow2(static_cast<int>(std::ceil(rows_to_cover(mean_rows)))), kMinTokenTile,
                    layout::kGemmTokensOnMTile);
}

GemmConfig choose_gemm(const char* name, const MoeSpec& spec, int token_tile, double mean_rows, double touched_experts,
                       int out_channels, PlanDetail detail) {
  const bool block_scales = spec.precision == Precision::fp8_block;
  const bool explain = detail == PlanDetail::explained;
  GemmConfig c;
  c.name = name;
  c.block_k = spec.precision == Precision::bf16 ? 64 : 128;
  c.swap_ab = !layout::gemm_tokens_on_m(token_tile);
  c.math_warpgroups = layout::kGemmMathWarpgroups;
  c.channel_tile = layout::kGemmChannelTile;
  c.token_tile = token_tile;
  c.block_m = c.swap_ab ? c.channel_tile : c.token_tile;
  c.block_n = c.swap_ab ? c.token_tile : c.channel_tile;
  c.stage_bytes = layout::gemm_stage_bytes(c.token_tile, block_scales);
  // The kernels are compiled for sm_90's opt-in limit; plan_layer refused devices offering less.
  c.stages = layout::gemm_stages(c.token_tile, block_scales, layout::kSm90SmemPerBlockOptin);
  c.smem_bytes = c.stages * c.stage_bytes + layout::gemm_fixed_bytes();
  if (!explain) return c;
  const int rows_per_expert = static_cast<int>(std::ceil(mean_rows));
  switch (spec.precision) {
    case Precision::fp8_block:
      c.reasons.push_back("block_k=128: one FP8 scale block per K step, so promotion happens once per stage");
      break;
    case Precision::fp8_tensor:
      c.reasons.push_back("block_k=128: one 128-byte swizzled row of E4M3 per K step; per-tensor scales apply in the "
                          "epilogue, so K blocks accumulate without promotion");
      break;
    case Precision::bf16: c.reasons.push_back("block_k=64: one 128-byte swizzled row of bf16 per K step"); break;
  }
  if (c.swap_ab) {
    c.reasons.push_back(format("swapAB: expert channels on wgmma M (%lld rows: %lld math warpgroups x %lld x m64), "
                               "tokens on N, so small batches pad N instead of M=64",
                               c.channel_tile, c.math_warpgroups,
                               c.channel_tile / (c.math_warpgroups * kWgmmaRowsPerWarpgroup)));
  } else {
    c.reasons.push_back(format("tokens on M: %lld token rows (%lld math warpgroups x m64) x %lld channels on N in two "
                               "n128 halves, 1.5x the MACs per stage byte of a 256 x 64 swapAB tile",
                               c.token_tile, c.math_warpgroups, c.channel_tile));
  }
  c.reasons.push_back(format("%lld stages: as many %lld-byte stages as fit next to the epilogue exchange "
                             "(>= 3 hides TMA latency; capped at 8)",
                             c.stages, c.stage_bytes));
  c.expected_tiles = static_cast<long long>(std::ceil(touched_experts)) * ceil_div(out_channels, c.channel_tile) *
                     ceil_div(rows_per_expert, c.token_tile);
  return c;
}

}  // namespace

Floors floors_of(const MoeSpec& spec, int tokens, double routed_rows, double touched, const DeviceFacts& facts) {
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

int choose_token_tile(const MoeSpec& spec, int tokens) {
  return token_tile_for_rows(mean_rows_per_expert(spec, tokens));
}

bool fc1_copies_token_rows(const MoeSpec& spec, int tokens) {
  return copies_rows_for(spec, mean_rows_per_expert(spec, tokens));
}

DeviceFacts DeviceFacts::h200_measured() {
  DeviceFacts f;
  f.name = "NVIDIA H200 (figures measured 2026-11-30..12-01)";
  f.num_sms = 132;
  f.smem_per_block_optin = 232448;
  f.l2_bytes = 60LL * 1024 * 1024;
  f.hbm_read_bytes_per_s = 4.45e12;
  f.dense_fp8_flops_per_s = 1459e12;
  f.dense_bf16_flops_per_s = 790e12;
  return f;
}

double expert_weight_bytes(const MoeSpec& spec) {
  const double elements = 3.0 * spec.hidden * spec.intermediate;
  switch (spec.precision) {
    case Precision::fp8_block: return elements + 3.0 * (spec.hidden / 128) * (spec.intermediate / 128) * sizeof(float);
    case Precision::fp8_tensor: return elements + 3.0 * sizeof(float);
    case Precision::bf16: break;
  }
  return elements * 2.0;
}

LayerPlan plan_layer(const MoeSpec& spec, int max_tokens, const MoeLayerOptions& options, const DeviceFacts& facts,
                     InputScales input_scales) {
  validate(spec);
  validate(options, spec);
  validate_max_tokens(max_tokens);
  if (facts.num_sms < 1) throw Error(ErrorCode::invalid_argument, "device facts are missing the SM count");
  if (options.launch == ForwardLaunch::single_kernel && spec.precision == Precision::fp8_tensor &&
      input_scales == InputScales::dynamic) {
    // x's amax must be complete before any row is encoded, and FC1's before FC2's input is: waits
    // on the whole grid, which the single kernel does not have (docs/design.md#single-kernel-forward).
    throw Error(ErrorCode::invalid_argument,
                "options.launch=single_kernel with precision fp8_tensor takes static activation scales (weights "
                "packed with fc1_input_scale and fc2_input_scale); dynamic ones run as seven launches "
                "(launch=per_stage or auto)");
  }
  if (facts.smem_per_block_optin < layout::kSm90SmemPerBlockOptin) {
    throw Error(ErrorCode::unsupported,
                format("the GEMM kernels need %lld bytes of shared memory per CTA; the device offers %lld",
                       layout::kSm90SmemPerBlockOptin, facts.smem_per_block_optin));
  }
  LayerPlan plan;
  plan.max_tokens = max_tokens;
  plan.options = options;
  // Each expert's pool segment is padded to the widest token tile a call may take: the option's,
  // or the planner's at max_tokens (the tile grows with the token count).
  const int row_padding = options.token_tile != 0 ? options.token_tile : choose_token_tile(spec, max_tokens);
  plan.workspace = layout::MoeWorkspaceLayout::make(spec.num_experts, spec.top_k, spec.hidden, spec.intermediate,
                                                    max_tokens, row_padding, spec.precision, input_scales);
  return plan;
}

ForwardPlan plan_forward(const MoeSpec& spec, const LayerPlan& layer, int tokens, CombineMode combine,
                         const DeviceFacts& facts, PlanDetail detail) {
  if (tokens < 1 || tokens > layer.max_tokens) {
    throw Error(ErrorCode::invalid_argument,
                format("tokens=%lld must be in [1, max_tokens=%lld]", tokens, layer.max_tokens));
  }
  const MoeLayerOptions& o = layer.options;
  const bool explain = detail == PlanDetail::explained;
  const double touched = expected_touched_experts(spec, tokens);
  const double mean_rows = mean_rows_per_expert(spec, tokens);
  ForwardPlan p;
  p.tokens = tokens;
  p.expected_rows_per_expert = static_cast<int>(std::ceil(mean_rows));
  p.token_tile = o.token_tile != 0 ? o.token_tile : token_tile_for_rows(mean_rows);
  // The row copy fills swapAB's token blocks only (validate() refused an explicit 128 with it).
  const bool caps_for_row_copy = o.token_tile == 0 && o.fc1_token_rows == Fc1TokenRows::row_copy &&
                                 layout::gemm_tokens_on_m(p.token_tile);
  if (caps_for_row_copy) p.token_tile = layout::kGemmSwapAbMaxTokenTile;
  // Under auto: the single kernel takes fp8_tensor with static activation scales only
  // (plan_layer), and launches no CTA pairs.
  const bool single_kernel_takes_call = tokens <= kMaxSingleKernelTokens && !layer.workspace.dynamic_scales;
  const bool pairs_asked = o.weight_multicast && layout::gemm_tokens_on_m(p.token_tile);
  switch (o.launch) {
    case ForwardLaunch::automatic: p.single_kernel = single_kernel_takes_call && !pairs_asked; break;
    case ForwardLaunch::per_stage: p.single_kernel = false; break;
    case ForwardLaunch::single_kernel: p.single_kernel = true; break;
  }
  if (p.token_tile > layer.workspace.row_padding) {
    throw Error(ErrorCode::unsupported, format("internal: token tile %lld exceeds the workspace padding %lld "
                                               "(planner bug)",
                                               p.token_tile, layer.workspace.row_padding));
  }
  switch (o.fc1_token_rows) {
    case Fc1TokenRows::automatic:
      p.fc1_copies_token_rows = !p.single_kernel && copies_rows_for(spec, mean_rows, p.token_tile);
      break;
    case Fc1TokenRows::pool: p.fc1_copies_token_rows = false; break;
    case Fc1TokenRows::row_copy: p.fc1_copies_token_rows = spec.precision != Precision::bf16; break;
  }
  p.combine = combine;
  const int requested_grid = o.num_sms != 0 ? std::min(o.num_sms, facts.num_sms) : facts.num_sms;
  p.grid = requested_grid;
  // CTA pairs where the tile is tokens on M; a pair needs two SMs, so an odd grid loses one CTA.
  p.weight_multicast = o.weight_multicast && layout::gemm_tokens_on_m(p.token_tile) && p.grid >= 2 && !p.single_kernel;
  if (p.weight_multicast) p.grid -= p.grid % 2;
  p.fc1 = choose_gemm("fc1", spec, p.token_tile, mean_rows, touched, 2 * spec.intermediate, detail);
  p.fc2 = choose_gemm("fc2", spec, p.token_tile, mean_rows, touched, spec.hidden, detail);
  p.launches = p.single_kernel ? 1 : layer.workspace.dynamic_scales ? 7 : 5;
  if (!explain) return p;
  if (o.token_tile != 0) {
    p.reasons.push_back(format("token tile %lld: options.token_tile", p.token_tile));
  } else if (caps_for_row_copy) {
    p.reasons.push_back(format("token tile %lld: ~%lld rows per touched expert would take the tokens-on-M tile, "
                               "but options.fc1_token_rows=row_copy fills swapAB's token blocks only",
                               p.token_tile, p.expected_rows_per_expert));
  } else if (layout::gemm_tokens_on_m(p.token_tile)) {
    p.reasons.push_back(format("token tile %lld (tokens on M): ~%lld rows per touched expert, ~%lld with their "
                               "spread, more than a 64-token swapAB tile holds",
                               p.token_tile, p.expected_rows_per_expert,
                               static_cast<long long>(std::ceil(rows_to_cover(mean_rows)))));
  } else {
    p.reasons.push_back(format("token tile %lld: ~%lld rows per touched expert, ~%lld with their spread, within "
                               "[16, 64] (two fp32 accumulator sets of 256 channels x 64 tokens per CTA are the "
                               "register budget of swapAB; more rows take the tokens-on-M tile of 128)",
                               p.token_tile, p.expected_rows_per_expert,
                               static_cast<long long>(std::ceil(rows_to_cover(mean_rows)))));
  }
  const char* per_stage = p.launches == 7 ? "seven kernels" : "five kernels";
  if (o.launch != ForwardLaunch::automatic) {
    p.reasons.push_back(std::string(p.single_kernel ? "one persistent kernel" : per_stage) +
                        ": options.launch=" + to_string(o.launch));
  } else if (p.single_kernel) {
    p.reasons.push_back(format("one persistent kernel: %lld tokens <= %lld", tokens,
                               static_cast<long long>(kMaxSingleKernelTokens)));
  } else if (single_kernel_takes_call) {
    p.reasons.push_back(std::string(per_stage) +
                        ": options.weight_multicast runs CTA pairs, which the single kernel does not launch");
  } else {
    p.reasons.push_back(std::string(per_stage) +
                        format(": under options.launch=auto the single kernel takes at most %lld tokens "
                               "(0: it is opt-in, not yet faster)",
                               static_cast<long long>(kMaxSingleKernelTokens)));
  }
  if (layer.workspace.dynamic_scales) {
    p.reasons.push_back("seven kernels, not five: fp8_tensor's dynamic activation scales add x's amax before the "
                        "router and the encoding of FC1's bf16 output before FC2 (docs/decisions.md#dynamic-input-scales)");
  }
  if (spec.precision == Precision::bf16) {
    p.reasons.push_back("FC1 reads the gathered pool: rows are copied from an fp8 copy of x only");
  } else if (layout::gemm_tokens_on_m(p.token_tile)) {
    p.reasons.push_back("FC1 reads the gathered pool: the row copy fills swapAB's token blocks only");
  } else if (p.single_kernel) {
    p.reasons.push_back("FC1 reads the gathered pool: the single kernel's FC1 loads rows by TMA");
  } else if (o.fc1_token_rows != Fc1TokenRows::automatic) {
    p.reasons.push_back(std::string("FC1 ") + (p.fc1_copies_token_rows ? "copies its token rows" : "reads the pool") +
                        ": options.fc1_token_rows=" + to_string(o.fc1_token_rows));
  } else {
    p.reasons.push_back(format(p.fc1_copies_token_rows ? "FC1 copies its token rows: ~%lld rows per expert <= %lld"
                                                       : "FC1 reads the gathered pool: ~%lld rows per expert > %lld",
                               p.expected_rows_per_expert, static_cast<long long>(kMaxRowsPerExpertForRowCopy)));
  }
  p.reasons.push_back(std::string("combine ") + to_string(combine) +
                      (combine == CombineMode::deterministic ? ": slot store, then a fixed-order reduction"
                                                             : ": FC2 adds weighted rows with fp32 atomics"));
  p.reasons.push_back(o.num_sms != 0 ? format("grid %lld CTAs: options.num_sms (device has %lld SMs)", p.grid,
                                              facts.num_sms)
                                     : format("grid %lld CTAs: one per SM", p.grid));
  if (p.weight_multicast) {
    p.reasons.push_back(format("weight multicast: options.weight_multicast, %lld CTA pairs each sharing a weight "
                               "block by TMA multicast",
                               p.grid / 2) +
                        (p.grid < requested_grid ? " (one CTA fewer: an odd grid leaves one SM without a pair)" : ""));
  } else if (o.weight_multicast) {
    p.reasons.push_back(layout::gemm_tokens_on_m(p.token_tile)
                            ? "no weight multicast: a grid of one CTA has no pair"
                            : "no weight multicast: options.weight_multicast applies to the tokens-on-M tile only");
  }
  return p;
}

Floors expected_floors(const MoeSpec& spec, int tokens, const DeviceFacts& facts) {
  validate(spec);
  return floors_of(spec, tokens, static_cast<double>(tokens) * spec.top_k, expected_touched_experts(spec, tokens),
                   facts);
}

std::ostream& operator<<(std::ostream& os, const DeviceFacts& f) {
  return os << f.name << ": " << f.num_sms << " SMs, " << f.smem_per_block_optin / 1024 << " KiB smem/CTA, "
            << f.l2_bytes / (1024 * 1024) << " MiB L2, HBM " << f.hbm_read_bytes_per_s / 1e12 << " TB/s, FP8 "
            << f.dense_fp8_flops_per_s / 1e12 << " TFLOP/s, bf16 " << f.dense_bf16_flops_per_s / 1e12 << " TFLOP/s";
}

std::ostream& operator<<(std::ostream& os, const GemmConfig& c) {
  os << c.name << ": " << (c.swap_ab ? "swapAB " : "") << "block " << c.block_m << "x" << c.block_n << "x"
     << c.block_k << " (tokens " << c.token_tile << " x channels " << c.channel_tile << "), " << c.math_warpgroups
     << " math WG, " << c.stages << " stages, <= " << c.smem_bytes / 1024.0 << " KiB smem, ~" << c.expected_tiles
     << " tiles";
  for (const std::string& reason : c.reasons) os << "\n    - " << reason;
  return os;
}

std::ostream& operator<<(std::ostream& os, const LayerPlan& p) {
  const auto& w = p.workspace;
  return os << "layer for up to " << p.max_tokens << " tokens, " << p.options << ": workspace "
            << w.total_bytes / 1048576.0 << " MiB (pool " << w.pool_rows << " rows, segments padded to "
            << w.row_padding << ")";
}

std::ostream& operator<<(std::ostream& os, const ForwardPlan& p) {
  os << "forward of " << p.tokens << " tokens (~" << p.expected_rows_per_expert << " rows per touched expert): "
     << (p.single_kernel ? "one kernel" : p.launches == 7 ? "seven kernels" : "five kernels") << ", token tile "
     << p.token_tile << ", FC1 "
     << (p.fc1_copies_token_rows ? "copies token rows" : "reads the pool") << ", combine "
     << to_string(p.combine) << ", grid " << p.grid << (p.weight_multicast ? " in CTA pairs" : "");
  for (const std::string& reason : p.reasons) os << "\n    - " << reason;
  return os << "\n  " << p.fc1 << "\n  " << p.fc2;
}

std::ostream& operator<<(std::ostream& os, const Floors& f) {
  return os << f.tokens << " tokens: " << f.touched_experts << " experts touched, " << f.weight_bytes / 1e6
            << " MB weights, " << f.useful_flops / 1e9 << " GFLOP useful; floor " << f.floor_us << " us ("
            << f.bound << "-bound: HBM " << f.hbm_us << " us, compute " << f.compute_us << " us)";
}

}  // namespace megamoe::plan
