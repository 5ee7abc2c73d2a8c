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
  Timeline timeline;
};

constexpr int kEpReduceThreads = 256;
constexpr int kEpReduceVectorsPerThread = 4;  // a thread's vectors, with every owner's partial sum, in flight together
constexpr int kEpReduceChunk = kEpReduceThreads * kEpReduceVectorsPerThread;
constexpr int kEpReduceOwnersPerPass = 2;

// Grid: any number of blocks; each takes chunks of kEpReduceChunk vectors of y in turn (a grid of
// about one block per SM starts without a ramp of block launches), after a cross-rank barrier that
// follows every rank's local pass.
__global__ void __launch_bounds__(kEpReduceThreads) ep_reduce_kernel(EpCombineParams p) {
  const int world = p.layout.world_size, vectors = p.layout.hidden / 8;
  const long total = static_cast<long>(p.num_tokens) * vectors;
  ptx::wait_for_prerequisite_grids();
  ptx::allow_dependent_launch();
  p.timeline.mark(layout::kReduceStart);
  for (long chunk = blockIdx.x * static_cast<long>(kEpReduceChunk); chunk < total;
       chunk += static_cast<long>(gridDim.x) * kEpReduceChunk) {
    Bf16x8Sum sum[kEpReduceVectorsPerThread];
    for (int first = 0; first < world; first += kEpReduceOwnersPerPass) {
      uint4 partial[kEpReduceVectorsPerThread][kEpReduceOwnersPerPass];
      bool present[kEpReduceVectorsPerThread][kEpReduceOwnersPerPass];
#pragma unroll
      for (int v = 0; v < kEpReduceVectorsPerThread; ++v) {
        const long index = chunk + v * kEpReduceThreads + threadIdx.x;
        const long token = index / vectors;
#pragma unroll
        for (int i = 0; i < kEpReduceOwnersPerPass; ++i) {
          const int owner = first + i;
          const long position = index < total && owner < world ? p.token_dest[token * world + owner] : -1;
          present[v][i] = position >= 0;
          if (present[v][i]) {
            partial[v][i] = ep_detail::region<const uint4>(p.peer_bases[owner],
                                                           p.layout.partial_sums)[position * vectors + index % vectors];
          }
        }
      }
      // In rank order per vector: deterministic.
#pragma unroll
      for (int v = 0; v < kEpReduceVectorsPerThread; ++v) {
#pragma unroll
        for (int i = 0; i < kEpReduceOwnersPerPass; ++i)
          if (present[v][i]) sum[v].add(partial[v][i]);
      }
    }
#pragma unroll
    for (int v = 0; v < kEpReduceVectorsPerThread; ++v) {
      const long index = chunk + v * kEpReduceThreads + threadIdx.x;
      if (index < total) reinterpret_cast<uint4*>(p.y)[index] = sum[v].rounded();
    }
  }
  p.timeline.mark(layout::kReduceDone);
}

}  // namespace megamoe::kernels
