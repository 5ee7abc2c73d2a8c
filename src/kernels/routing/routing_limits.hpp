// Sizes the routing kernel is built for, and its modes; the host checks specs against them.
#pragma once

namespace megamoe::kernels {

inline constexpr int kMaxRoutingExperts = 512;  // one token's scores per warp in shared memory
inline constexpr int kMaxGroups = 32;           // one group score per lane (and a 32-bit group mask)
inline constexpr int kMaxTopK = 32;             // lane j of a token's warp holds slot j

// The router's modes: megamoe::Routing's alternatives, as the kernel takes them.
enum class RoutingMode : int { softmax_topk, deepseek_grouped, precomputed };

}  // namespace megamoe::kernels
