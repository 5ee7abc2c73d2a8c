// Electing the last block of a launch to finish, for work that needs every block's results (the
// router's expert scan, the expert-parallel count exchange and barriers) without a launch of its
// own.
#pragma once

#include <cstdint>

namespace megamoe::kernels {

// True (in every thread) in the block that is the `count`-th to call it with `ticket`; what any of
// those blocks wrote before the call, to this GPU or a peer, is ordered before what that block
// does afterwards (a system-scope release by it, such as a barrier arrival, then publishes those
// writes to the peers: the fences here only need GPU scope). Every thread of each block calls it;
// `last` is one bool of the block's shared memory. The ticket is zero before the first call, and
// the last caller leaves it zero.
__device__ __forceinline__ bool last_to_finish(uint32_t* ticket, uint32_t count, bool* last) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) *last = atomicAdd(ticket, 1u) == count - 1;
  __syncthreads();
  if (!*last) return false;
  __threadfence();
  if (threadIdx.x == 0) *ticket = 0;
  return true;
}

// The block of the launch that finishes last (every block of the grid calls it).
__device__ __forceinline__ bool last_block_to_finish(uint32_t* ticket) {
  __shared__ bool last;
  return last_to_finish(ticket, gridDim.x, &last);
}

}  // namespace megamoe::kernels
