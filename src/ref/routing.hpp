// Reference routing: router logits -> top-k expert ids and weights.
//
// Conventions the device kernels follow too:
//  - logits are sanitized first: NaN -> -FLT_MAX (never preferred), +-inf -> +-FLT_MAX, so every
//    row yields k distinct valid ids and finite weights;
//  - ties are broken by the lower expert (or group) index;
//  - scores are computed in double and rounded to float.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/routing/selection.hpp"
#include "megamoe/spec.hpp"
#include "plan/planner.hpp"

namespace megamoe::ref {

struct RoutingResult {
  int num_tokens = 0;
  int top_k = 0;
  std::vector<int32_t> ids;     // [T, k]; ordered by decreasing preference
  std::vector<float> weights;   // [T, k]
};

// softmax_topk or deepseek_grouped; logits [T, E]. Throws for precomputed routing.
RoutingResult route(const MoeSpec& spec, const float* logits, int num_tokens);

using kernels::sanitize_logit;  // the router kernel's rule (kernels/routing/selection.hpp)

// Per-token validity of precomputed ids: an id is used iff 0 <= id < E and no earlier slot of the
// same token holds it; -1 is silently unused; any other unused id counts as invalid.
struct RoutingCheck {
  std::vector<uint8_t> used;  // [T, k]
  long invalid_ids = 0;
};
RoutingCheck check_routing(const int32_t* ids, int num_tokens, int top_k, int num_experts);

// The floors of a call routed by `ids` [T, k] (invalid and -1 ids excluded): its used slots and
// the distinct experts they touch, through plan::floors_of.
plan::Floors routed_floors(const MoeSpec& spec, const int32_t* ids, int num_tokens, const plan::DeviceFacts& facts);

}  // namespace megamoe::ref
