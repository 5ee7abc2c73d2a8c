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
//
// FP8 partial sums (EpLayerOptions::partial_sums = fp8): before the barrier each owner quantizes
// its partial sums once, per 128 channels (the gather's rule, fp32 scales), and the sources read
// the codes and scales of remote owners, half the bytes over NVLink, dequantizing as they add; a
// source's own partial sum is read as bf16 (it crosses no link). Not the bf16 sums' bits: its
// error is reported against them (docs/decisions.md#fp8-partial-sums).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "kernels/combine/bf16x8.cuh"
#include "kernels/comm/ep_rows.cuh"
#include "kernels/comm/fp8_partials.cuh"
#include "kernels/comm/rank_barrier.cuh"
#include "kernels/layout/ep_buffers.hpp"
#include "kernels/layout/ep_timeline.hpp"
#include "kernels/pipeline/timeline.cuh"
#include "kernels/ptx/grid_dependency.cuh"

namespace megamoe::kernels {

struct EpCombineParams {
  void* const* peer_bases;
  layout::EpBufferLayout layout;
  int rank;
  int num_tokens;
  const int32_t* token_dest;  // [T, world]: position of the token's row in each owner, -1 where none went
  __nv_bfloat16* y;           // [T, H]
  const RankFault* fault;     // this rank's barriers' record
  Timeline timeline;
};

constexpr int kEpReduceThreads = 256;

struct EpQuantizePartialsParams {
  void* local_base;           // this rank's symmetric buffer
  layout::EpBufferLayout layout;
  const int32_t* recv_total;  // rows received in this call
  const RankFault* fault;
};

// Grid: blocks of kEpRowThreads striding over the received rows; after the local pass.
__global__ void __launch_bounds__(kEpRowThreads) ep_quantize_partials_kernel(EpQuantizePartialsParams p) {
  ptx::wait_for_prerequisite_grids();
  ptx::allow_dependent_launch();
  if (rank_fault_seen(p.fault)) return;
  const int rows = *p.recv_total, vectors = p.layout.hidden / 8, blocks = p.layout.hidden / 128;
  const uint4* sums = ep_detail::region<const uint4>(p.local_base, p.layout.partial_sums);
  for (int row = blockIdx.x; row < rows; row += gridDim.x) {
    uint4* codes = ep_detail::region<uint4>(p.local_base, p.layout.partial_codes) + static_cast<size_t>(row) * vectors / 2;
    float* scales = ep_detail::region<float>(p.local_base, p.layout.partial_scales) + static_cast<size_t>(row) * blocks;
    quantize_partial_sum_row(sums + static_cast<size_t>(row) * vectors, codes, scales, p.layout.hidden,
                             static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x));
  }
}

// Each owner's partial sum of (token, vector), from the owners' buffers at the token's positions.
__device__ __forceinline__ void add_fp8_partials(Bf16x8Sum& sum, const EpCombineParams& p, const int32_t* positions,
                                                 long vector) {
  const int vectors = p.layout.hidden / 8, blocks = p.layout.hidden / 128;
  add_fp8_partials_in_rank_order(
      sum, p.layout.world_size, p.rank,
      [&](int owner, const uint4*& own, const uint2*& codes, const float*& scale) {
        const long position = positions[owner];
        if (position < 0) return false;
        own = ep_detail::region<const uint4>(p.peer_bases[owner], p.layout.partial_sums) + position * vectors + vector;
        codes = ep_detail::region<const uint2>(p.peer_bases[owner], p.layout.partial_codes) + position * vectors + vector;
        scale = ep_detail::region<const float>(p.peer_bases[owner], p.layout.partial_scales) + position * blocks +
                vector / 16;
        return true;
      });
}

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
  if (p.layout.fp8_partials) {
    add_fp8_partials(sum, p, positions, vector);
    reinterpret_cast<uint4*>(p.y)[index] = sum.rounded();
    p.timeline.mark(layout::kReduceDone);
    return;
  }
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
