// Cross-rank barrier role: every rank adds one to its own slot in every peer's signal array
// (release, system scope) and waits until each peer has done the same to it (acquire). Counters
// only grow, so the n-th barrier waits for n arrivals from each rank and nothing needs cleaning
// between calls; n is counted on the device (every rank runs the same sequence of barriers), so a
// captured CUDA graph replays correctly. One block runs it (the last block of a dispatch launch, or
// a launch of its own, as in the combine): no grid-wide wait, so it is safe when other work holds
// SMs. A peer that does not arrive within the timeout (it stalled or died) ends in a diagnostic
// and a RankFault, not a hang and not a trap: the barrier gives up, and from then on every
// expert-parallel kernel of this rank returns at once (rank_fault_seen) without touching a peer's
// memory, so the process and its CUDA context stay usable and the host reports the fault
// (comm::EpLayer::check_peers).
//
// The arrivals double as the per-source completion counters of the data phases: when rank r's
// slot here reaches an epoch, everything r wrote into this rank's buffer before arriving is
// visible (what a fused consumer would acquire instead of waiting for every rank).
#pragma once

#include <cstdint>
#include <cstdio>

#include "kernels/comm/peer_wait.cuh"
#include "kernels/comm/rank_fault.hpp"
#include "kernels/pipeline/timeline.cuh"
#include "kernels/ptx/grid_dependency.cuh"
#include "kernels/ptx/memory.cuh"
#include "kernels/ptx/timer.cuh"

namespace megamoe::kernels {

struct RankBarrierParams {
  void* const* peer_bases;   // [world] base of every rank's symmetric buffer
  size_t signals_offset;     // EpBufferLayout::signals
  int rank;
  int world_size;
  long long timeout_ns;
  uint64_t* passed;          // device, this rank only: barriers run so far
  RankFault* fault;          // device, this rank only
};

// The number of the next barrier, to be loaded by each thread below world_size of the block that
// will run it, early in its launch (after the previous kernel's writes are visible): the load is
// then off the barrier's critical path. Only barriers advance the count, and a launch runs at most
// one.
__device__ __forceinline__ uint64_t next_barrier_epoch(const RankBarrierParams& p) {
  return threadIdx.x < p.world_size ? *p.passed + 1 : 0;
}

// Every thread of one block calls it (blockDim.x >= world_size), one block per launch, with the
// epoch its thread loaded by next_barrier_epoch. Writes made before the call by any thread of the
// block (or made visible to it) are visible to every peer's block after its return, and
// conversely.
__device__ __forceinline__ void cross_rank_barrier(const RankBarrierParams& p, uint64_t epoch) {
  const int peer = threadIdx.x;
  __syncthreads();
  // After a fault the peers' buffers are not touched again (a peer that died may have unmapped them).
  if (peer < p.world_size && !rank_fault_seen(p.fault)) {
    if (peer == 0) *p.passed = epoch;
    __threadfence_system();
    uint64_t* remote = reinterpret_cast<uint64_t*>(static_cast<char*>(p.peer_bases[peer]) + p.signals_offset);
    ptx::red_add_release_sys(remote + p.rank, 1);
    const uint64_t* mine =
        reinterpret_cast<const uint64_t*>(static_cast<const char*>(p.peer_bases[p.rank]) + p.signals_offset) + peer;
    if (wait_for_peer(mine, peer, epoch, p.timeout_ns, p.fault) == PeerWait::gave_up_first) {
      printf("megamoe: rank %d timed out in cross-rank barrier %llu: rank %d has arrived %llu times, %llu expected; "
             "this rank's expert-parallel calls stop here\n",
             p.rank, static_cast<unsigned long long>(epoch), peer, static_cast<unsigned long long>(p.fault->seen),
             static_cast<unsigned long long>(epoch));
    }
  }
  __syncthreads();
}

// A barrier of its own launch: it may be launched overlapping the previous kernel, and arrives only
// once that kernel's writes are visible. The timeline marks `started_event` and the event after it.
__global__ void rank_barrier_kernel(RankBarrierParams p, Timeline timeline, int started_event) {
  ptx::wait_for_prerequisite_grids();
  ptx::allow_dependent_launch();
  const uint64_t epoch = next_barrier_epoch(p);
  timeline.mark(started_event);
  cross_rank_barrier(p, epoch);
  timeline.mark(started_event + 1);
}

}  // namespace megamoe::kernels
