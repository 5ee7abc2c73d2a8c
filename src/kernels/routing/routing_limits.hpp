// Sizes the routing kernel holds in registers; the host checks specs against them.
#pragma once

namespace megamoe::kernels {

inline constexpr int kMaxExpertsPerLane = 16;                       // experts one lane holds
inline constexpr int kMaxRoutingExperts = 32 * kMaxExpertsPerLane;  // E <= 512
inline constexpr int kMaxGroups = 32;                               // one group score per lane

}  // namespace megamoe::kernels
