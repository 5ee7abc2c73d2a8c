// The hand-off of tiles between the grouped GEMM's producer roles: the weight producer claims the
// tiles (GroupedTileScheduler) and hands each, in claim order, to the other producers through a
// ring of Config::kTileQueue slots in shared memory (tile_queue, queue_full, queue_empty of the
// config's SharedStorage), so that no role re-derives the order. A tile of expert -1 ends it.
#pragma once

#include "kernels/pipeline/pipeline_state.cuh"
#include "kernels/ptx/mbarrier.cuh"
#include "kernels/scheduler/grouped_tile_scheduler.cuh"

namespace megamoe::kernels {

template <class Config>
using TileQueueState = pipeline::PipelineState<Config::kTileQueue>;

// The weight producer's next tile, into the next free slot.
template <class Config>
__device__ __forceinline__ void hand_over_tile(typename Config::SharedStorage& smem, TileQueueState<Config>& queue,
                                               const GroupedTile& tile) {
  ptx::wait_parity(&smem.queue_empty[queue.stage], queue.phase ^ 1);
  smem.tile_queue[queue.stage] = tile;
  ptx::mbarrier_arrive(&smem.queue_full[queue.stage]);
  queue.advance();
}

// A follower's next tile from the weight producer (expert -1: none left).
template <class Config>
__device__ __forceinline__ GroupedTile take_tile(typename Config::SharedStorage& smem, TileQueueState<Config>& queue) {
  ptx::wait_parity(&smem.queue_full[queue.stage], queue.phase);
  const GroupedTile tile = smem.tile_queue[queue.stage];
  ptx::mbarrier_arrive(&smem.queue_empty[queue.stage]);
  queue.advance();
  return tile;
}

}  // namespace megamoe::kernels
