// What both math roles of the grouped GEMM (mma/swapab_mainloop.cuh, mma/tokens_on_m_mainloop.cuh)
// do around a tile's math: walk the tiles in the order the weight producer tagged the stages with
// (a stage tagged expert -1 ends the walk), and publish each stored tile to whoever waits for it.
#pragma once

#include "kernels/epilogue/gemm_op.hpp"
#include "kernels/pipeline/fc1_handoff.cuh"
#include "kernels/pipeline/pipeline_state.cuh"
#include "kernels/ptx/mbarrier.cuh"
#include "kernels/scheduler/grouped_tile_scheduler.cuh"

namespace megamoe::kernels {

// Calls consume(tile) for each tile, its first stage already full; consume advances `state` over
// the tile's stages. The first stage of each tile names it. The lane that hands stages back to
// this CTA (`reader_lane`) reads the tag for its warp: its own arrival on the stage's empty barrier
// then orders the read before any rewrite.
template <class Config, class Consume>
__device__ __forceinline__ void for_each_tagged_tile(typename Config::SharedStorage& smem,
                                                     pipeline::PipelineState<Config::kStages>& state, int lane,
                                                     int reader_lane, Consume&& consume) {
  auto stage_tile = [&](int stage) {
    return broadcast_from_lane(lane == reader_lane ? smem.stage_tile[stage] : GroupedTile{}, reader_lane);
  };
  ptx::wait_parity(&smem.full[state.stage], state.phase);
  for (GroupedTile tile = stage_tile(state.stage); tile.expert >= 0;) {
    consume(tile);
    ptx::wait_parity(&smem.full[state.stage], state.phase);
    tile = stage_tile(state.stage);
  }
}

// By every math thread after its last store of the tile: an FC1 tile to FC2's producers
// (pipeline/fc1_handoff.cuh); an FC2 tile, in the single-kernel forward, to its combine.
template <class Config, class Params>
__device__ __forceinline__ void publish_tile(const Params& p, const GroupedTile& tile, int consumer_thread) {
  if constexpr (Config::kGemmOp == GemmOp::fc1_swiglu) {
    publish_fc1_tile(p.fc1_tiles_done, tile.expert, p.num_experts, static_cast<uint32_t>(NamedBarrier::kFc1TileStored),
                     Config::kConsumerThreads, consumer_thread);
  } else if (p.tiles_stored != nullptr) {
    publish_stored_tile(p.tiles_stored, static_cast<uint32_t>(NamedBarrier::kTileStored), Config::kConsumerThreads,
                        consumer_thread, Params::kStoresToPeers);
  }
}

}  // namespace megamoe::kernels
