// Expert-parallel combine roles.
//   push (owner): each received row's output (the local experts' weighted partial sum for that
//   token) goes back to its source rank's combine_rows[owner][token] (NVLink writes); rows this
//   rank sent to itself stay where the local pass wrote them. The last block runs the cross-rank
//   barrier, after which every partial sum for this rank has arrived.
//   reduce (source): y[t] = sum over the ranks its row went to, in rank order, of their partial
//   sums, accumulated in fp32 and rounded once to bf16 (deterministic); 0 for a token routed nowhere.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/combine/bf16x8.cuh"
#include "kernels/comm/ep_rows.cuh"
#include "kernels/comm/rank_barrier.cuh"
#include "kernels/layout/ep_buffers.hpp"
#include "kernels/pipeline/last_block.cuh"
#include "kernels/ptx/grid_dependency.cuh"

namespace megamoe::kernels {

struct EpCombineParams {
  void* const* peer_bases;
  layout::EpBufferLayout layout;
  RankBarrierParams barrier;
  int rank;
  int num_tokens;
  const int32_t* recv_total;    // owner: rows received in this call
  const uint4* expert_rows;     // [received rows, H] bf16 partial sums of the local experts
  const int32_t* token_dest;    // source: [T, world], -1 where no row went
  __nv_bfloat16* y;             // source: [T, H]
  uint32_t* ticket;             // zero between calls
};

// Grid: any number of blocks (at least one) of kEpRowThreads threads.
__global__ void __launch_bounds__(kEpRowThreads) ep_combine_push_kernel(EpCombineParams p) {
  ptx::wait_for_prerequisite_grids();
  ptx::allow_dependent_launch();
  const int total = *p.recv_total;
  const int2* origins = ep_detail::region<const int2>(p.peer_bases[p.rank], p.layout.recv_origin);
  const int vectors = p.layout.hidden / 8;
  for (long row = blockIdx.x; row < total; row += gridDim.x) {
    const int2 origin = origins[row];  // (source rank, token)
    if (origin.x == p.rank) continue;  // the reduce reads it in place
    uint4* const to = ep_detail::region<uint4>(p.peer_bases[origin.x], p.layout.combine_rows) +
                      (static_cast<long>(p.rank) * p.layout.max_tokens_per_rank + origin.y) * vectors;
    ep_detail::block_copy_row(p.expert_rows + row * vectors, &to, 1, vectors);
  }
  if (!last_block_to_finish(p.ticket)) return;
  cross_rank_barrier(p.barrier);
}

__global__ void __launch_bounds__(256) ep_reduce_kernel(EpCombineParams p) {
  const int world = p.layout.world_size, H = p.layout.hidden;
  const long index = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x;
  ptx::wait_for_prerequisite_grids();
  ptx::allow_dependent_launch();
  if (index >= static_cast<long>(p.num_tokens) * (H / 8)) return;
  const int token = static_cast<int>(index / (H / 8));
  const int column = static_cast<int>(index % (H / 8)) * 8;
  const __nv_bfloat16* rows = ep_detail::region<const __nv_bfloat16>(p.peer_bases[p.rank], p.layout.combine_rows);
  Bf16x8Sum sum;
  for (int r = 0; r < world; ++r) {
    const long position = p.token_dest[static_cast<long>(token) * world + r];
    if (position < 0) continue;
    sum.add(r == p.rank ? p.expert_rows[(position * H + column) / 8]
                        : *reinterpret_cast<const uint4*>(
                              rows + (static_cast<long>(r) * p.layout.max_tokens_per_rank + token) * H + column));
  }
  *reinterpret_cast<uint4*>(p.y + static_cast<long>(token) * H + column) = sum.rounded();
}

}  // namespace megamoe::kernels
