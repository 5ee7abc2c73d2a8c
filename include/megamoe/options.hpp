// MoeLayerOptions: the choices a caller may take from the planner when a layer is built. Every
// field's default lets the planner decide; the planner's configuration (what `megamoe-bench`
// prints, and MEGAMOE_PRINT_CONFIGS=1) is what launches, with these choices in it.
#pragma once

#include <iosfwd>

#include "megamoe/spec.hpp"

namespace megamoe {

enum class CombineMode {
  deterministic,  // per-slot bf16 expert rows reduced in fp32 in fixed slot order: bit-identical across runs
  fast,           // FC2 epilogue adds weighted rows with fp32 atomics; order varies run to run
};

// Where fp8 FC1 reads its token rows from. Both give the same output bit for bit; they differ in
// speed only (docs/decisions.md#fc1-row-copy).
enum class Fc1TokenRows {
  automatic,  // the planner's choice per call: copied where experts get few rows
  pool,       // a pool of k gathered, quantized copies per token (the gather writes them)
  row_copy,   // copied by FC1 from one quantized row per token (fp8_block or fp8_tensor)
};

// How a forward is launched (docs/design.md#single-kernel-forward). Both give the same output bit
// for bit; they differ in speed only.
enum class ForwardLaunch {
  automatic,      // the planner's choice per call
  per_stage,      // five kernels: router, gather, FC1, FC2, combine
  single_kernel,  // one persistent kernel; FC1 reads the pool, no CTA pairs (weight_multicast), the
                  // five kernels' token tiles
};

struct MoeLayerOptions {
  // Tokens one GEMM tile takes per expert for every call: 16, 32 or 64 (the swapAB layout: channels
  // on wgmma M, tokens on N) or 128 (the tokens-on-M layout, for experts with many rows; FC1 reads
  // the pool), or 0 for the planner's choice per call (docs/decisions.md#token-tile,
  // #tokens-on-m-tile). The output does not depend on it.
  int token_tile = 0;
  Fc1TokenRows fc1_token_rows = Fc1TokenRows::automatic;
  // The combine of a forward that does not name one.
  CombineMode combine = CombineMode::deterministic;
  // Persistent CTAs of the GEMMs, at most one per SM: 0 for every SM of the device, or fewer to
  // leave SMs to work on other streams (communication kernels beside the layer).
  int num_sms = 0;
  ForwardLaunch launch = ForwardLaunch::automatic;
  // Experimental, off by default: where a call's token tile is 128 (tokens on M), the GEMMs run
  // their CTAs in clusters of two on neighbouring tiles, which share their weight block by TMA
  // multicast where both tiles multiply it, each CTA loading one half into both
  // (docs/decisions.md#weight-multicast-pairs). The output does not depend on it. The single
  // kernel launches no clusters: not with launch=single_kernel, and under launch=auto a call it
  // would take runs as five kernels instead.
  bool weight_multicast = false;
};

// Throws megamoe::Error(invalid_argument) naming the field and what it takes.
void validate(const MoeLayerOptions& options, const MoeSpec& spec);
// The same for a combine mode alone (`field` names it: options.combine, or a forward's argument).
void validate_combine(CombineMode combine, const char* field);

// The most tokens one layer's call may carry: past it the kernels' 32-bit slot indices (tokens x
// top_k) would overflow. validate_max_tokens throws megamoe::Error(invalid_argument) outside
// [1, kMaxLayerTokens], naming the limit.
inline constexpr long long kMaxLayerTokens = 1 << 24;
void validate_max_tokens(long long max_tokens);

const char* to_string(CombineMode mode);
const char* to_string(Fc1TokenRows rows);
const char* to_string(ForwardLaunch launch);
std::ostream& operator<<(std::ostream& os, const MoeLayerOptions& options);

}  // namespace megamoe
