// FC1 -> FC2 hand-off per expert (DESIGN.md "fc1_done"): each FC1 tile, once its epilogue has
// stored it, adds one to its expert's counter; an FC2 tile's producer waits until its expert's
// counter holds every FC1 tile of that expert before loading the expert's FC1 output. FC2 then
// starts on the experts FC1 has finished while FC1's last tiles still run, instead of waiting for
// the whole FC1 grid; its CTAs take SMs as FC1's leave them, and they claim tiles dynamically, so
// the late ones take fewer.
#pragma once

#include <cstdint>

#include "kernels/ptx/mbarrier.cuh"
#include "kernels/ptx/memory.cuh"
#include "kernels/ptx/sync.cuh"

namespace megamoe::kernels {

// By every math thread of the CTA after its last store of the tile. The stores are generic and
// FC2 reads them with TMA loads (async proxy), hence the proxy fence before the release.
__device__ __forceinline__ void publish_fc1_tile(uint32_t* expert_tiles_done, uint32_t barrier_id,
                                                 uint32_t math_threads, int math_thread) {
  ptx::fence_proxy_async_global();
  ptx::named_barrier_sync(barrier_id, math_threads);
  if (math_thread == 0) ptx::red_add_release_gpu(expert_tiles_done, 1u);
}

// By FC2's producer thread before the tile's first token load. FC1's CTAs were all running before
// FC2 could launch and never wait for FC2, so the count arrives; a wait past kWaitTimeoutCycles
// (a lost publication) traps instead of hanging.
__device__ __forceinline__ void wait_for_fc1_tiles(const uint32_t* expert_tiles_done, uint32_t tiles) {
  if (ptx::ld_acquire_gpu(expert_tiles_done) < tiles) {
    const long long start = clock64();
    while (ptx::ld_acquire_gpu(expert_tiles_done) < tiles) {
      if (clock64() - start > ptx::kWaitTimeoutCycles) __trap();
      __nanosleep(64);
    }
  }
  ptx::fence_proxy_async_global();
}

}  // namespace megamoe::kernels
