// Row movement shared by the expert-parallel dispatch and combine roles: carving a rank's
// symmetric buffer, copying a whole row with one block, and electing the last block of a launch.
#pragma once

#include <cstdint>

namespace megamoe::kernels {

constexpr int kEpRowThreads = 256;  // threads of the blocks that move rows

}  // namespace megamoe::kernels

namespace megamoe::kernels::ep_detail {

template <class T>
__device__ __forceinline__ T* region(void* base, size_t offset) {
  return reinterpret_cast<T*>(static_cast<char*>(base) + offset);
}

// The block copies one row of `vectors` 16-byte vectors from `from` to each of to[0..count): each
// vector is loaded once, kBatch loads per thread in flight before their stores (the destinations
// are usually peers: the stores are posted NVLink writes, the loads local).
template <int kBatch = 4>
__device__ __forceinline__ void block_copy_row(const uint4* from, uint4* const* to, int count, int vectors) {
  for (int first = threadIdx.x; first < vectors; first += kBatch * blockDim.x) {
    uint4 staged[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int v = first + i * blockDim.x;
      if (v < vectors) staged[i] = from[v];
    }
    for (int d = 0; d < count; ++d) {
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int v = first + i * blockDim.x;
        if (v < vectors) to[d][v] = staged[i];
      }
    }
  }
}

// True (in every thread) in the block that finishes last; what any block wrote before the call,
// to this GPU or a peer, is ordered before what that block does afterwards (a system-scope
// release by it, such as a barrier arrival, then publishes those writes to the peers: the fences
// here only need GPU scope). The ticket is zero between launches.
__device__ __forceinline__ bool last_block_to_finish(uint32_t* ticket) {
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(ticket, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last) return false;
  __threadfence();
  if (threadIdx.x == 0) *ticket = 0;
  return true;
}

}  // namespace megamoe::kernels::ep_detail
