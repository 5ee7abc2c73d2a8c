// Expert-parallel dispatch roles (staged: one launch per phase, cross-rank barriers between).
//   1. count (source): rows per expert and each slot's rank within its expert, in token order;
//      the counts are written into each owner's recv_counts[src].
//   2. publish (source): after the count exchange, each routed slot's (src, token, slot) goes to
//      its canonical position in the owner's recv_sources; the tokens are staged in send_tokens.
//   3. pull (owner): every received row is read from its source's send_tokens over NVLink into
//      recv_tokens, and arrivals[local expert] is released once per row.
// Canonical order inside an owner: local expert, then source rank, then token, then slot (the
// order of ref::plan_dispatch).
#pragma once

#include <cstdint>

#include "kernels/layout/ep_buffers.hpp"
#include "kernels/ptx/memory.cuh"

namespace megamoe::kernels {

struct EpDispatchParams {
  void* const* peer_bases;        // [world]
  layout::EpBufferLayout layout;
  int rank;
  int num_tokens;
  int num_experts;
  const int32_t* topk_ids;        // [T, k], this rank's routing
  const uint4* x;                 // [T, H] bf16 as 16-byte vectors
  int32_t* slot_rank;             // [T, k] scratch: rank of the slot inside its expert, -1 unused
  int32_t* error_flags;           // [0] += invalid ids
  int32_t* recv_local_expert;     // [max_recv_rows] owner scratch: local expert of each received row
};

namespace ep_detail {

template <class T>
__device__ __forceinline__ T* region(void* base, size_t offset) {
  return reinterpret_cast<T*>(static_cast<char*>(base) + offset);
}

}  // namespace ep_detail

// One block; one thread per expert walks the slots in token order, so ranks are deterministic.
__global__ void __launch_bounds__(1024) ep_count_kernel(EpDispatchParams p) {
  const int k = p.layout.top_k;
  const int slots = p.num_tokens * k;
  // Unused slots stay -1; ep_rank_slots_of_expert fills the used ones.
  for (int s = threadIdx.x; s < slots; s += blockDim.x) {
    p.slot_rank[s] = -1;
    const int id = p.topk_ids[s];
    if (id < -1 || id >= p.num_experts) atomicAdd(&p.error_flags[0], 1);
  }
  __syncthreads();
  for (int expert = threadIdx.x; expert < p.num_experts; expert += blockDim.x) {
    int duplicates = 0;
    const int count = layout::ep_rank_slots_of_expert(p.topk_ids, p.num_tokens, k, expert, p.slot_rank, &duplicates);
    if (duplicates > 0) atomicAdd(&p.error_flags[0], duplicates);
    const int owner = expert / p.layout.experts_per_rank, local = expert % p.layout.experts_per_rank;
    ep_detail::region<int32_t>(p.peer_bases[owner], p.layout.recv_counts)[p.rank * p.layout.experts_per_rank + local] =
        count;
  }
}

// Grid-stride over slots and token vectors; each block first derives the canonical base of every
// expert from the owners' recv_counts (small remote reads).
__global__ void __launch_bounds__(1024) ep_publish_kernel(EpDispatchParams p) {
  extern __shared__ int32_t expert_base[];  // [num_experts]
  const int epr = p.layout.experts_per_rank, world = p.layout.world_size;
  for (int expert = threadIdx.x; expert < p.num_experts; expert += blockDim.x) {
    const int owner = expert / epr, local = expert % epr;
    const int32_t* counts = ep_detail::region<const int32_t>(p.peer_bases[owner], p.layout.recv_counts);
    expert_base[expert] = static_cast<int32_t>(layout::ep_row_position(counts, epr, world, p.rank, local, 0));
  }
  __syncthreads();
  const int k = p.layout.top_k;
  const long stride = static_cast<long>(gridDim.x) * blockDim.x;
  const long first = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x;
  for (long s = first; s < static_cast<long>(p.num_tokens) * k; s += stride) {
    const int rank_in_expert = p.slot_rank[s];
    if (rank_in_expert < 0) continue;
    const int expert = p.topk_ids[s];
    int32_t* sources = ep_detail::region<int32_t>(p.peer_bases[expert / epr], p.layout.recv_sources);
    const long position = expert_base[expert] + rank_in_expert;
    sources[3 * position + 0] = p.rank;
    sources[3 * position + 1] = static_cast<int32_t>(s / k);
    sources[3 * position + 2] = static_cast<int32_t>(s % k);
  }
  uint4* send = ep_detail::region<uint4>(p.peer_bases[p.rank], p.layout.send_tokens);
  const long vectors = static_cast<long>(p.num_tokens) * (p.layout.hidden / 8);
  for (long v = first; v < vectors; v += stride) send[v] = p.x[v];
}

// One warp per received row, grid-stride; the row count comes from recv_counts.
__global__ void __launch_bounds__(256) ep_pull_kernel(EpDispatchParams p) {
  const int epr = p.layout.experts_per_rank, world = p.layout.world_size;
  const int32_t* counts = ep_detail::region<const int32_t>(p.peer_bases[p.rank], p.layout.recv_counts);
  int total = 0;
  for (int i = 0; i < world * epr; ++i) total += counts[i];
  const int32_t* sources = ep_detail::region<const int32_t>(p.peer_bases[p.rank], p.layout.recv_sources);
  uint4* received = ep_detail::region<uint4>(p.peer_bases[p.rank], p.layout.recv_tokens);
  uint32_t* arrivals = ep_detail::region<uint32_t>(p.peer_bases[p.rank], p.layout.arrivals);
  const int lane = threadIdx.x % 32;
  const int vectors_per_row = p.layout.hidden / 8;
  const long warps = static_cast<long>(gridDim.x) * blockDim.x / 32;
  for (long row = (blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x) / 32; row < total; row += warps) {
    const int src = sources[3 * row + 0], token = sources[3 * row + 1];
    const uint4* from = ep_detail::region<const uint4>(p.peer_bases[src], p.layout.send_tokens) +
                        static_cast<long>(token) * vectors_per_row;
    for (int v = lane; v < vectors_per_row; v += 32) received[row * vectors_per_row + v] = from[v];
    __syncwarp();
    if (lane == 0) {
      const int local = layout::ep_local_expert_of_row(counts, epr, world, row);
      p.recv_local_expert[row] = local;
      __threadfence();
      ptx::red_add_release_gpu(&arrivals[local], 1);
    }
  }
}

}  // namespace megamoe::kernels
