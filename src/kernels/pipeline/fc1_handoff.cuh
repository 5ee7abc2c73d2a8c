// FC1 -> FC2 hand-off per expert (docs/decisions.md#fc2-waits-per-expert): each FC1 tile, once its epilogue has
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
// `tiles_done` is [E + 1]: per expert, then all of FC1's.
__device__ __forceinline__ void publish_fc1_tile(uint32_t* tiles_done, int expert, int num_experts,
                                                 uint32_t barrier_id, uint32_t math_threads, int math_thread) {
  ptx::fence_proxy_async_global();
  ptx::named_barrier_sync(barrier_id, math_threads);
  if (math_thread == 0) {
    ptx::red_add_release_gpu(tiles_done + expert, 1u);
    ptx::red_add_release_gpu(tiles_done + num_experts, 1u);
  }
}

// The same for an FC2 tile in the single-kernel forward, whose combine reads the stored rows (or
// the accumulator) with generic loads: no proxy fence. `to_peers`: the tile's rows went into other
// GPUs' memory; the counting thread's release at system scope after the barrier orders every math
// thread's stores before the count (docs/decisions.md#one-system-fence-per-stored-tile).
__device__ __forceinline__ void publish_stored_tile(uint32_t* tiles_stored, uint32_t barrier_id, uint32_t math_threads,
                                                    int math_thread, bool to_peers) {
  ptx::named_barrier_sync(barrier_id, math_threads);
  if (math_thread == 0) {
    if (to_peers) ptx::red_add_release_sys(tiles_stored, 1u);
    else ptx::red_add_release_gpu(tiles_stored, 1u);
  }
}

// FC2's producer thread, before each tile's first token load. FC1's CTAs were all running before
// FC2 could launch and never wait for FC2, so the counts arrive; a wait past kWaitTimeoutCycles (a
// lost publication) traps instead of hanging. Once all of FC1 is seen stored, the remaining tiles
// skip the acquire and the proxy fence (a fence per tile cost FC2 ~4% at 8192 tokens).
struct Fc1Progress {
  const uint32_t* tiles_done;  // [E + 1], as published above
  int num_experts;
  uint32_t all_tiles;          // FC1's tiles in this forward
  bool complete = false;

  __device__ __forceinline__ void wait_for_expert(int expert, uint32_t expert_tiles) {
    if (complete) return;
    if (ptx::ld_acquire_gpu(tiles_done + num_experts) >= all_tiles) {
      complete = true;
    } else {
      ptx::wait_until([&] { return ptx::ld_acquire_gpu(tiles_done + expert) >= expert_tiles; }, 64);
    }
    ptx::fence_proxy_async_global();
  }
};

}  // namespace megamoe::kernels
