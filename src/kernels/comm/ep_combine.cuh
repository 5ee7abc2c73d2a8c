// Expert-parallel combine role: each owner's local pass leaves, for every row it received, the
// weighted partial sum of its local experts in its own symmetric buffer (partial_sums); after one
// cross-rank barrier (every local pass is done) each source reads the partial sums of its tokens
// from their owners over NVLink and adds them in rank order, accumulated in fp32 and rounded once
// to bf16 (deterministic); 0 for a token routed nowhere.
//
// Why the source pulls in this staged layer rather than the owner pushing: the partial sums are all
// complete before the combine starts, so reading them lets the reduction overlap the transfer
// token by token, where a push must finish (and pass a barrier) before the reduction can start.
// The fused kernel, whose FC2 epilogue produces rows while others are still being computed, is
// where pushing pays.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/combine/bf16x8.cuh"
#include "kernels/comm/ep_rows.cuh"
#include "kernels/comm/rank_barrier.cuh"
#include "kernels/layout/ep_buffers.hpp"
#include "kernels/layout/ep_timeline.hpp"
#include "kernels/pipeline/timeline.cuh"
#include "kernels/ptx/grid_dependency.cuh"

namespace megamoe::kernels {

struct EpCombineParams {
  void* const* peer_bases;
  layout::EpBufferLayout layout;
  int num_tokens;
  const int32_t* token_dest;  // [T, world]: position of the token's row in each owner, -1 where none went
  __nv_bfloat16* y;           // [T, H]
  const RankFault* fault;     // this rank's barriers' record
  Timeline timeline;
};

constexpr int kEpReduceThreads = 256;

// Grid: one thread per 16-byte vector of y, after a cross-rank barrier that follows every rank's
// local pass.
__global__ void __launch_bounds__(kEpReduceThreads) ep_reduce_kernel(EpCombineParams p) {
  const int world = p.layout.world_size, vectors = p.layout.hidden / 8;
  const long index = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x;
  ptx::wait_for_prerequisite_grids();
  ptx::allow_dependent_launch();
  p.timeline.mark(layout::kReduceStart);
  if (index >= static_cast<long>(p.num_tokens) * vectors) return;
  if (rank_fault_seen(p.fault)) {
    // A barrier gave up: the owners' partial sums are not there. NaN, never a plausible output.
    reinterpret_cast<uint4*>(p.y)[index] = make_uint4(0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu);
    return;
  }
  const long token = index / vectors;
  const long vector = index % vectors;
  const int32_t* positions = p.token_dest + token * world;
  Bf16x8Sum sum;
  // Owners' partial sums (already weighted) in rank order; a group's NVLink reads all in flight
  // before its first addition.
  sum.add_rows<8>(world, [&](int owner, const uint4*& row, float& weight) {
    const long position = positions[owner];
    if (position < 0) return;
    row = &ep_detail::region<const uint4>(p.peer_bases[owner], p.layout.partial_sums)[position * vectors + vector];
    weight = 1.0f;
  });
  reinterpret_cast<uint4*>(p.y)[index] = sum.rounded();
  p.timeline.mark(layout::kReduceDone);
}

}  // namespace megamoe::kernels
