// Cross-rank barrier role: every rank adds one to its own slot in every peer's signal array
// (release, system scope) and waits until each peer has done the same to it (acquire). Counters
// only grow, so the n-th barrier waits for n arrivals from each rank and nothing needs cleaning
// between calls. It runs as its own one-block launch: no grid-wide wait, so it is safe when other
// work holds SMs. A peer that never arrives ends in a diagnostic and a trap, not a hang.
#pragma once

#include <cstdint>
#include <cstdio>

#include "kernels/ptx/memory.cuh"

namespace megamoe::kernels {

struct RankBarrierParams {
  void* const* peer_bases;   // [world] base of every rank's symmetric buffer
  size_t signals_offset;     // EpBufferLayout::signals
  int rank;
  int world_size;
  uint64_t epoch;            // this is the epoch-th barrier since the buffer was zeroed
  long long timeout_cycles;
};

__global__ void rank_barrier_kernel(RankBarrierParams p) {
  const int peer = threadIdx.x;
  if (peer < p.world_size) {
    // Everything this rank wrote before (earlier kernels, remote stores included) becomes
    // visible to the peer that acquires this arrival.
    __threadfence_system();
    uint64_t* remote = reinterpret_cast<uint64_t*>(static_cast<char*>(p.peer_bases[peer]) + p.signals_offset);
    ptx::red_add_release_sys(remote + p.rank, 1);
  }
  __syncthreads();
  if (peer >= p.world_size) return;
  const uint64_t* mine =
      reinterpret_cast<const uint64_t*>(static_cast<const char*>(p.peer_bases[p.rank]) + p.signals_offset) + peer;
  const long long start = clock64();
  uint64_t seen;
  while ((seen = ptx::ld_acquire_sys(mine)) < p.epoch) {
    if (clock64() - start > p.timeout_cycles) {
      printf("megamoe: rank %d timed out in cross-rank barrier %llu: rank %d has arrived %llu times, %llu expected\n",
             p.rank, static_cast<unsigned long long>(p.epoch), peer, static_cast<unsigned long long>(seen),
             static_cast<unsigned long long>(p.epoch));
      __trap();
    }
  }
}

}  // namespace megamoe::kernels
