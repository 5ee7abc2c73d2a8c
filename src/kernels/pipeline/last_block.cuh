// Electing the last block of a launch to finish, for work that needs every block's results (the
// router's expert scan, the expert-parallel count exchange and barriers) without a launch of its
// own.
#pragma once

#include <cstdint>

namespace megamoe::kernels {

// True (in every thread) in the block that finishes last; what any block wrote before the call,
// to this GPU or a peer, is ordered before what that block does afterwards (a system-scope
// release by it, such as a barrier arrival, then publishes those writes to the peers: the fences
// here only need GPU scope). Every thread of every block calls it. The ticket is zero between
// launches, and the last block leaves it zero.
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

}  // namespace megamoe::kernels
