// Random expert weights for tests and benchmarks: bf16 values uniform with the standard
// deviation of N(0, 1/fan_in), so activations keep realistic magnitudes through both GEMMs.
// Generated in parallel, one independent stream per expert: the same seed gives the same weights.
#pragma once

#include <cstdint>
#include <vector>

#include "megamoe/dtypes.hpp"
#include "megamoe/spec.hpp"
#include "megamoe/weights.hpp"

namespace megamoe::ref {

struct RandomWeights {
  std::vector<bf16_t> w13;  // [E, 2I, H], vLLM layout
  std::vector<bf16_t> w2;   // [E, H, I]
  // fp8_tensor: the static activation scales (0 for other precisions).
  float fc1_input_scale = 0.0f;
  float fc2_input_scale = 0.0f;
  // The weights, with the activation scales where there are some.
  WeightsView view() const;
  // Every expert-parallel rank's share of a layer of `spec` (these weights): rank r's experts
  // [r E / world, (r + 1) E / world), activation scales included, packed as a layer of E / world.
  std::vector<PackedWeights> pack_rank_shares(const MoeSpec& spec, int world) const;
};

// Tokens an fp8_tensor spec's activation scales are calibrated on.
inline constexpr int kCalibrationTokens = 64;

// For an fp8_tensor spec with input_scales from_checkpoint, also the static activation scales,
// calibrated (calibrate_input_scales) the way a checkpoint's are, on sample inputs:
// kCalibrationTokens tokens of bf16 N(0, 1) activations (the distribution the tests and benchmarks
// draw) with uniform random routing. Inputs beyond what the sample held saturate, as they would
// with a checkpoint's scales. With input_scales dynamic the weights come without them (and pack
// InputScales::dynamic).
RandomWeights make_random_weights(const MoeSpec& spec, uint64_t seed,
                                  InputScales input_scales = InputScales::from_checkpoint);

// Precomputed routing drawn uniformly: top_k distinct experts per token, weights uniform in
// [0.05, 1).
struct RandomRouting {
  std::vector<int32_t> ids;     // [T, k]
  std::vector<float> weights;   // [T, k]
};
RandomRouting make_random_routing(int tokens, int top_k, int num_experts, uint64_t seed);
// Precomputed routing that gives every expert the same number of rows (T k / E, or one apart where
// E does not divide T k): token t takes the experts t k, t k + 1, ..., t k + k - 1 (mod E), distinct
// for k <= E; weights as above. What a grouped GEMM benchmark with equal rows per expert measures.
RandomRouting make_balanced_routing(int tokens, int top_k, int num_experts, uint64_t seed);

}  // namespace megamoe::ref
