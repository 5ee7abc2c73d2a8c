// Routing role of the per-stage forward: one warp per token routes it (route_token.cuh); the last
// block to finish (or the only one) turns the counts into the padded expert segments the GEMMs walk.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/pipeline/last_block.cuh"
#include "kernels/ptx/grid_dependency.cuh"
#include "kernels/routing/route_token.cuh"
#include "kernels/routing/routing_limits.hpp"
#include "kernels/routing/valid_tokens.cuh"
#include "kernels/scheduler/grouped_tile_scheduler.cuh"

namespace megamoe::kernels {

// Sixteen tokens, a common decode batch, are still one block: the multi-block path's global
// counters and last-block scan took the router from 10.3 to 11.7 us at 16 tokens.
inline constexpr int kRouterWarps = 16;
inline constexpr int kRouterThreads = 32 * kRouterWarps;

// A block's dynamic shared memory: each warp's row of selection values, then each warp's row of
// weight scores, E floats a row.
__host__ __device__ constexpr size_t router_smem_bytes(int num_experts) {
  return sizeof(float) * 2 * kRouterWarps * static_cast<size_t>(num_experts);
}

__global__ void __launch_bounds__(kRouterThreads, 1) route_and_count_kernel(RoutingParams p) {
  // Per warp: what selection ranks (logit or choice; its order keys during the passes) and what the
  // weights use (logit or sigmoid score); sized by E (router_smem_bytes).
  extern __shared__ float routing_rows[];
  float* selection_values = routing_rows;
  float* weight_scores = routing_rows + kRouterWarps * p.num_experts;
  // Up to kRouterWarps tokens are one block: its counters stay in shared memory and it scans them
  // itself, without the global atomics, fences and arrival round trips of the last-block scan
  // (~2-3 us of a one-token forward's dependent chain).
  __shared__ int32_t block_counts[kMaxRoutingExperts];
  const bool one_block = gridDim.x == 1;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int token = blockIdx.x * kRouterWarps + warp;
  if (one_block) {
    for (int e = threadIdx.x; e < p.num_experts; e += kRouterThreads) block_counts[e] = 0;
    __syncthreads();
  }
  ptx::wait_for_prerequisite_grids();
  ptx::allow_dependent_launch();
  if (token < valid_tokens(p.num_tokens, p.num_valid_tokens)) {
    route_token(p, token, lane, selection_values + warp * p.num_experts, weight_scores + warp * p.num_experts,
                one_block ? block_counts : p.expert_counts);
  }
  __shared__ int2 scan_sums[kRouterThreads / 32];
  if (one_block) {
    __syncthreads();
    scan_expert_segments<kRouterThreads, true>(block_counts, p.num_experts, p.token_tile_rows,
                                               p.expert_rows, p.expert_offsets, p.token_tile_prefix,
                                               p.token_tile_expert, p.gemm, scan_sums);
    return;
  }

  // The last block to finish scans the counts: one launch fewer than a scan kernel of its own.
  if (!last_block_to_finish(p.blocks_done)) return;
  scan_expert_segments<kRouterThreads>(p.expert_counts, p.num_experts, p.token_tile_rows,
                                       p.expert_rows, p.expert_offsets, p.token_tile_prefix, p.token_tile_expert,
                                       p.gemm, scan_sums);
}

}  // namespace megamoe::kernels
