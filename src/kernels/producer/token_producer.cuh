// Token producer role of the swapAB grouped GEMM (the producer warpgroup's warp 1): fills each
// stage's token block, for the tiles the weight producer hands over (pipeline/tile_queue.cuh).
// Either one lane's TMA loads of the gathered pool (one or two 32-row subtiles at 64-token tiles:
// an expert's short last tile takes one) and, for fp8_block, of the tokens' per-128 scales; or, for
// fp8_block FC1 with kCopiesTokenRows, the whole warp copying the tile's rows of x's quantized copy
// (permute/stage_row_copy.cuh). Token blocks are the previous kernel's output: FC1 waits for the
// whole previous grid, FC2 per tile for FC1's tiles of the tile's expert (pipeline/fc1_handoff.cuh).
#pragma once

#include <cute/tensor.hpp>

#include <cstdint>

#include "kernels/mma/grouped_gemm_config.cuh"
#include "kernels/permute/stage_row_copy.cuh"
#include "kernels/pipeline/fc1_handoff.cuh"
#include "kernels/pipeline/pipeline_state.cuh"
#include "kernels/pipeline/tile_queue.cuh"
#include "kernels/ptx/grid_dependency.cuh"
#include "kernels/ptx/mbarrier.cuh"
#include "kernels/ptx/memory.cuh"

namespace megamoe::kernels {

template <class Config, class Params>
__device__ __forceinline__ void token_producer(const Params& p, typename Config::SharedStorage& smem, int k_blocks) {
  using namespace cute;
  constexpr int kStages = Config::kStages;
  if constexpr (Config::kCopiesTokenRows) {
    ptx::wait_for_prerequisite_grids();  // x's quantized copy and the pool slots are the gather's
    TileQueueState<Config> queue;
    StageRowCopy<Config>::run(p.token_rows, reinterpret_cast<uint8_t*>(smem.b.begin()), smem.token_scales, smem.full,
                              smem.empty, k_blocks, [&] { return take_tile<Config>(smem, queue); });
    return;
  }
  // Token blocks travel in subtiles: view index stage * kSubtiles + subtile.
  using Subtiles = GemmTileColumns<Config, Config::kTokenSubtile>;
  Tensor sB = make_tensor(make_smem_ptr(smem.b.begin()), typename Subtiles::SmemLayoutB{});  // (BS, BK, S x subtiles)
  Tensor mB = p.tma_b.get_tma_tensor(make_shape(p.pool_rows, p.k));
  Tensor gB = local_tile(mB, make_shape(Int<Config::kTokenSubtile>{}, Int<Config::kBlockK>{}), make_coord(_, _));  // (BS,BK,n,k)
  const auto b_slices = tma_partition(p.tma_b, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sB), group_modes<0, 2>(gB));
  Tensor tBgB = get<0>(b_slices);
  Tensor tBsB = get<1>(b_slices);
  // One subtile, then the second unless the tile is short: no run-time loop, which made this
  // chain (then the only producer's) a generic unrolled loop of loads
  // (docs/decisions.md#32-row-subtile).
  static_assert(Config::kSubtiles <= 2, "a stage holds one or two token subtiles");
  auto load_subtile = [&](int subtile, int kb, int stage, int view) {
    copy(p.tma_b.with(smem.full[stage]), tBgB(_, subtile, kb), tBsB(_, view));
    if constexpr (Config::kBlockScales) {
      Tensor sS = make_tensor(make_smem_ptr(smem.token_scales), typename Config::SmemLayoutScales{});  // (BS,1,S x subtiles)
      Tensor mS = p.tma_token_scales.get_tma_tensor(make_shape(p.pool_rows, k_blocks));
      Tensor gS = local_tile(mS, make_shape(Int<Config::kTokenSubtile>{}, _1{}), make_coord(_, _));  // (BS,1,n,kb)
      auto [tSgS, tSsS] =
          tma_partition(p.tma_token_scales, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sS), group_modes<0, 2>(gS));
      copy(p.tma_token_scales.with(smem.full[stage]), tSgS(_, subtile, kb), tSsS(_, view));
    }
  };
  auto load_tokens = [&](const GroupedTile& tile, int kb, int stage) {
    const int first_subtile = tile.pool_row / Config::kTokenSubtile;
    const int subtiles = Config::tile_subtiles(tile);
    load_subtile(first_subtile, kb, stage, stage * Config::kSubtiles);
    if (Config::kSubtiles == 2 && subtiles == 2) load_subtile(first_subtile + 1, kb, stage, stage * Config::kSubtiles + 1);
    ptx::mbarrier_arrive(&smem.full[stage]);
  };
  // The token blocks are the previous kernel's output: for FC1 they wait for the whole previous
  // grid (in the single-kernel forward, for the gather's items), for FC2 per tile for the tile's
  // expert.
  if constexpr (!Config::kWaitsForFc1) {
    if (p.tokens_ready != nullptr) {
      ptx::wait_until([&] { return ptx::ld_acquire_gpu(p.tokens_ready) >= p.tokens_ready_count; });
      ptx::fence_proxy_async_global();  // the gather's generic stores, read here by TMA
    } else {
      ptx::wait_for_prerequisite_grids();
    }
  }
  // With dynamic fp8_tensor scales FC2's rows are the encoding grid's, whose completion implies FC1's:
  // the counters below then read complete at once.
  if (Config::kWaitsForFc1 && p.token_operand_of_previous_grid) ptx::wait_for_prerequisite_grids();
  Fc1Progress fc1{p.fc1_tiles_done, p.num_experts,
                   static_cast<uint32_t>(p.fc1_channel_blocks * p.scheduler.token_tiles())};
  pipeline::PipelineState<kStages> state;
  TileQueueState<Config> queue;
  for (GroupedTile tile = take_tile<Config>(smem, queue); tile.expert >= 0; tile = take_tile<Config>(smem, queue)) {
    for (int kb = 0; kb < k_blocks; ++kb) {
      ptx::wait_parity(&smem.empty[state.stage], state.phase ^ 1);
      if (Config::kWaitsForFc1 && kb == 0) fc1.wait_for_expert(tile.expert, p.fc1_channel_blocks * tile.expert_token_tiles);
      load_tokens(tile, kb, state.stage);
      state.advance();
    }
  }
  // FC2 reads what it needs of FC1 through the counters; this wait only makes FC2's completion
  // imply FC1's, which the kernels after it (and the next forward) rely on.
  if constexpr (Config::kWaitsForFc1) ptx::wait_for_prerequisite_grids();
}

}  // namespace megamoe::kernels
