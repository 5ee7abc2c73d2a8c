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
  WeightsView view() const { return WeightsView{w13.data(), w2.data(), DType::bf16}; }
};

RandomWeights make_random_weights(const MoeSpec& spec, uint64_t seed);

// Precomputed routing drawn uniformly: top_k distinct experts per token, weights uniform in
// [0.05, 1).
struct RandomRouting {
  std::vector<int32_t> ids;     // [T, k]
  std::vector<float> weights;   // [T, k]
};
RandomRouting make_random_routing(int tokens, int top_k, int num_experts, uint64_t seed);

}  // namespace megamoe::ref
