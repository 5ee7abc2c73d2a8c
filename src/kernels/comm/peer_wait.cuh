// Waiting for a peer rank's arrivals (release/acquire counters in this rank's symmetric buffer)
// with a timeout that ends in a RankFault instead of a hang: the cross-rank barrier's wait
// (comm/rank_barrier.cuh) and the fused expert-parallel forward's (comm/ep_fused_roles.cuh).
#pragma once

#include <cstdint>

#include "kernels/comm/rank_fault.hpp"
#include "kernels/ptx/memory.cuh"
#include "kernels/ptx/timer.cuh"

namespace megamoe::kernels {

// Whether a wait of this rank for a peer has given up (by any thread, after the previous kernel's
// writes are visible, or after the wait in the same block).
__device__ __forceinline__ bool rank_fault_seen(const RankFault* fault) {
  return *static_cast<volatile const uint32_t*>(&fault->failed) != 0;
}

// How a wait for a peer's arrivals ended.
enum class PeerWait { arrived, gave_up, gave_up_first };

// Polls `arrivals` (the slot this rank's buffer keeps for `peer`) until it reaches `epoch`. Past
// `timeout_ns` it records a RankFault (the first wait of the rank to give up fills it in: then
// gave_up_first) and returns; once another wait of the rank gave up it returns at once. One thread.
__device__ __forceinline__ PeerWait wait_for_peer(const uint64_t* arrivals, int peer, uint64_t epoch,
                                                  long long timeout_ns, RankFault* fault) {
  if (rank_fault_seen(fault)) return PeerWait::gave_up;
  const uint64_t start = ptx::global_timer_ns();
  uint64_t seen;
  while ((seen = ptx::ld_acquire_sys(arrivals)) < epoch) {
    const uint64_t waited = ptx::global_timer_ns() - start;
    if (waited > static_cast<uint64_t>(timeout_ns)) {
      if (atomicCAS(&fault->failed, 0u, 1u) != 0u) return PeerWait::gave_up;
      fault->peer = peer;
      fault->epoch = epoch;
      fault->seen = seen;
      fault->waited_ns = waited;
      return PeerWait::gave_up_first;
    }
    if (rank_fault_seen(fault)) return PeerWait::gave_up;  // another wait gave up
  }
  return PeerWait::arrived;
}

}  // namespace megamoe::kernels
