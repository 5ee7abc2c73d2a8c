// Weight-scale producer role of the fp8_block grouped GEMM (one lane of the producer
// warpgroup's warp 2): copies each stage's weight block scales (one per 128 output rows) into the
// stage with cp.async, for the tiles the weight producer hands over (pipeline/tile_queue.cuh).
#pragma once

#include <cstddef>

#include "kernels/mma/grouped_gemm_config.cuh"
#include "kernels/pipeline/pipeline_state.cuh"
#include "kernels/pipeline/tile_queue.cuh"
#include "kernels/ptx/cp_async.cuh"
#include "kernels/ptx/mbarrier.cuh"

namespace megamoe::kernels {

template <class Config, class Params>
__device__ __forceinline__ void weight_scale_producer(const Params& p, typename Config::SharedStorage& smem, int k_blocks) {
  constexpr int kStages = Config::kStages;
  // The weight tile's two block scales travel with each stage (a load per K block in the math
  // warps was a dependent global round trip per block: with the tile search, a third of FC1
  // at one token). They are weights, so they need no dependency wait.
  const int scale_rows = p.a_rows / Config::kQuantBlock;
  pipeline::PipelineState<kStages> state;
  TileQueueState<Config> queue;
  for (GroupedTile tile = take_tile<Config>(smem, queue); tile.expert >= 0; tile = take_tile<Config>(smem, queue)) {
    const float* source[Config::kWeightScaleRows];  // the tile's block scales at K block 0
    for (int r = 0; r < Config::kWeightScaleRows; ++r) {
      // A last channel block with fewer rows repeats its last scale row; those rows are padding.
      const int row = min(tile.channel_block * Config::kWeightScaleRows + r, scale_rows - 1);
      source[r] = p.weight_scales + (static_cast<size_t>(tile.expert) * scale_rows + row) * k_blocks;
    }
    for (int kb = 0; kb < k_blocks; ++kb) {
      ptx::wait_parity(&smem.empty[state.stage], state.phase ^ 1);
      for (int r = 0; r < Config::kWeightScaleRows; ++r) ptx::cp_async_4(&smem.weight_scales[state.stage][r], source[r] + kb);
      ptx::cp_async_mbarrier_arrive_noinc(&smem.full[state.stage]);
      state.advance();
    }
  }
}

}  // namespace megamoe::kernels
