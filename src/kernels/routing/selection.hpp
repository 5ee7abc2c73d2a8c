// What routing selects on, shared by the router kernel and the CPU reference (src/ref/routing.cpp)
// so the two cannot disagree: sanitized logits, and order keys, 32-bit unsigned integers that order
// floats the way `>` does, so that a warp finds its best candidate with two integer reductions
// (redux.sync: the highest key, then the lowest index holding it).
#pragma once

#include <cfloat>
#include <cstdint>
#include <cstring>

#include "kernels/layout/weight_layout.hpp"

namespace megamoe::kernels {

// NaN becomes the lowest finite value and +-inf +-FLT_MAX, so every token still gets k distinct
// valid experts, and no selection value is NaN (the router's mark for a taken expert).
MEGAMOE_HOST_DEVICE inline float sanitize_logit(float logit) {
  if (logit != logit) return -FLT_MAX;
  if (logit > FLT_MAX) return FLT_MAX;
  if (logit < -FLT_MAX) return -FLT_MAX;
  return logit;
}

// key(a) > key(b) exactly when a > b, and key(a) == key(b) exactly when a == b, for any two
// non-NaN floats (-0 and +0 share a key). NaN, which the router writes to mark an expert taken or
// ineligible, gets key 0, below every number.
MEGAMOE_HOST_DEVICE inline uint32_t order_key(float v) {
  if (v != v) return 0u;
  if (v == 0.0f) v = 0.0f;
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
}

// The float a non-zero key came from (+0 for the key of -0).
MEGAMOE_HOST_DEVICE inline float from_order_key(uint32_t key) {
  const uint32_t bits = (key & 0x80000000u) ? key & 0x7fffffffu : ~key;
  float v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

}  // namespace megamoe::kernels
