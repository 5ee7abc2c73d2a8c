// Math role of the grouped GEMM's tokens-on-M layout (token tile 128): the ordinary orientation,
//   out[tokens, channels] = X_pool[tokens, K] * W_e[channels, K]^T
// with the tile's 128 token rows on wgmma M (math warpgroup w takes rows [64 w, 64 w + 64)) and
// its 256 output channels on N, as two n128 halves (docs/decisions.md#tokens-on-m-tile). The
// producers fill the same stages as for swapAB (a block of 256 weight rows, the tile's token rows
// in two 64-row subtiles); only the wgmma's operand roles and the fragments differ. fp8 promotes
// each half's K block through one temporary fragment: 2 x 64 accumulators and 64 temporaries per
// thread, where two full n256 fragments (256) would not fit the registers. A tile of at most 64
// rows loads one subtile, and the second warpgroup waits and hands its stages back without math.
#pragma once

#include <cute/tensor.hpp>

#include "kernels/epilogue/fc1_swiglu_tokens_on_m.cuh"
#include "kernels/epilogue/fc2_tokens_on_m.cuh"
#include "kernels/epilogue/gemm_op.hpp"
#include "kernels/mma/grouped_gemm_config.cuh"
#include "kernels/pipeline/fc1_handoff.cuh"
#include "kernels/pipeline/pipeline_state.cuh"
#include "kernels/ptx/mbarrier.cuh"
#include "kernels/scheduler/grouped_tile_scheduler.cuh"

namespace megamoe::kernels {

template <class Config>
struct TokensOnMTile {
  using Element = typename Config::Element;
  static constexpr int kRows = Config::kBlockN;  // token rows of the tile: 64 per math warpgroup
  static constexpr int kHalves = 2;
  static constexpr int kHalfChannels = Config::kBlockM / kHalves;
  static_assert(Config::kTokensOnM && kRows == 64 * Config::kMathWarpgroups, "one m64 block per math warpgroup");
  static_assert(kHalfChannels == Config::kQuantBlock, "each half lies in one weight scale block");
  static_assert(Config::kSubtiles == Config::kMathWarpgroups, "a token subtile is one warpgroup's rows");
  // A stage's 256 weight rows, seen as two blocks of 128: the same bytes (a K-major SW128 block is
  // its rows of 128 bytes in order, and 128 rows are whole 1 KiB swizzle atoms), half h of stage s
  // at view 2 s + h.
  using SmemLayoutWeightHalves = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_K_SW128_Atom<Element>{},
      cute::Shape<cute::Int<kHalfChannels>, cute::Int<Config::kBlockK>, cute::Int<Config::kStages * kHalves>>{}));
  using MmaAtom = decltype(cute::GMMA::ss_op_selector<Element, Element, float,
                                                      cute::Shape<cute::_64, cute::Int<kHalfChannels>, cute::Int<Config::kBlockK>>,
                                                      cute::GMMA::Major::K, cute::GMMA::Major::K>());
  using TiledMma = decltype(cute::make_tiled_mma(
      MmaAtom{}, cute::Layout<cute::Shape<cute::Int<Config::kMathWarpgroups>, cute::_1, cute::_1>>{}));
  using HalfMN = cute::Shape<cute::Int<kRows>, cute::Int<kHalfChannels>>;
  static_assert(cute::cosize_v<SmemLayoutWeightHalves> == cute::cosize_v<typename Config::SmemLayoutA>,
                "the halves view covers the weight stages exactly");
};

template <class Config, class Params>
__device__ __forceinline__ void tokens_on_m_math_warpgroups(const Params& p, typename Config::SharedStorage& smem,
                                                            int k_blocks) {
  using namespace cute;
  using Tile = TokensOnMTile<Config>;
  constexpr int kStages = Config::kStages;
  Tensor sX = make_tensor(make_smem_ptr(smem.b.begin()), typename Config::SmemLayoutB{});             // (128, BK, S)
  Tensor sW = make_tensor(make_smem_ptr(smem.a.begin()), typename Tile::SmemLayoutWeightHalves{});  // (128, BK, 2S)
  const int consumer_thread = threadIdx.x - 128;
  const int lane = consumer_thread % 32;
  const int warpgroup = consumer_thread / 128;
  typename Tile::TiledMma mma;
  ThrMMA thr_mma = mma.get_thread_slice(consumer_thread);
  Tensor tCrX = thr_mma.make_fragment_A(thr_mma.partition_A(sX));  // (MMA, 1, MMA_K, S)
  Tensor tCrW = thr_mma.make_fragment_B(thr_mma.partition_B(sW));  // (MMA, 1, MMA_K, 2S)
  // Per half: (MMA=(2,2,16), 1, 1); element (v0, v1, v2) sits at row base_row + 8 v1 and column
  // base_col + 8 v2 + v0 of the half (the sm90 GMMA accumulator layout).
  Tensor acc_low = partition_fragment_C(mma, typename Tile::HalfMN{});
  Tensor acc_high = partition_fragment_C(mma, typename Tile::HalfMN{});
  Tensor partial = partition_fragment_C(mma, typename Tile::HalfMN{});  // fp8: one half's K block, unscaled
  Tensor coords = thr_mma.partition_C(make_identity_tensor(typename Tile::HalfMN{}));
  const int base_row = get<0>(coords(make_coord(0, 0, 0), 0, 0));
  const int base_col = get<1>(coords(make_coord(0, 0, 0), 0, 0));
  pipeline::PipelineState<kStages> state;
  // As in the swapAB mainloop: one lane's arrival after __syncwarp hands a stage back.
  auto release_stage = [&](int stage) {
    __syncwarp();
    if (lane == 0) ptx::mbarrier_arrive(&smem.empty[stage]);
  };
  // The k steps of one half's K block in `stage`, as one wgmma batch into `out`.
  auto issue_half = [&](auto& out, int stage, int half, bool accumulate) {
    warpgroup_fence_operand(out);
    warpgroup_arrive();
    mma.accumulate_ = accumulate ? GMMA::ScaleOut::One : GMMA::ScaleOut::Zero;
    CUTE_UNROLL
    for (int k = 0; k < size<2>(tCrX); ++k) {
      gemm(mma, tCrX(_, _, k, stage), tCrW(_, _, k, Tile::kHalves * stage + half), out);
      mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
  };
  // fp8: a half's K block into its accumulators, each row with its token scale times the half's
  // weight scale (the same product, in the same order, as the swapAB promotion).
  auto promote = [&](auto& acc, float weight_scale, const float (&token_scale)[2]) {
    const float scale[2] = {weight_scale * token_scale[0], weight_scale * token_scale[1]};
    CUTE_UNROLL
    for (int v2 = 0; v2 < Tile::kHalfChannels / 8; ++v2)
      CUTE_UNROLL
      for (int v1 = 0; v1 < 2; ++v1)
        CUTE_UNROLL
        for (int v0 = 0; v0 < 2; ++v0) acc(make_coord(v0, v1, v2), 0, 0) += partial(make_coord(v0, v1, v2), 0, 0) * scale[v1];
  };

  auto consume_tile = [&](const GroupedTile& tile) {
    // The second warpgroup's rows were loaded only if the tile has more than one subtile of them.
    const bool has_rows = warpgroup < Config::tile_subtiles(tile);
    gemm_detail::Fc2RowSlots slots;
    if constexpr (Config::kGemmOp != GemmOp::fc1_swiglu) slots.load(p, tile, base_row);
    clear(acc_low);
    clear(acc_high);
    for (int kb = 0; kb < k_blocks; ++kb) {
      if (kb > 0) ptx::wait_parity(&smem.full[state.stage], state.phase);  // K block 0's: before the tile
      if (!has_rows) {
        release_stage(state.stage);
      } else if constexpr (Config::kFp8) {
        // The lane that hands the stage back reads the weight scales (see the swapAB mainloop).
        const float low_mine = lane == 0 ? smem.weight_scales[state.stage][0] : 0.0f;
        const float high_mine = lane == 0 ? smem.weight_scales[state.stage][1] : 0.0f;
        const float weight_low = __shfl_sync(0xffffffffu, low_mine, 0);
        const float weight_high = __shfl_sync(0xffffffffu, high_mine, 0);
        const float* stage_scales = smem.token_scales + state.stage * Config::kScaleStageStride;
        const float token_scale[2] = {stage_scales[base_row], stage_scales[base_row + 8]};
        issue_half(partial, state.stage, 0, false);
        warpgroup_wait<0>();
        warpgroup_fence_operand(partial);
        promote(acc_low, weight_low, token_scale);
        issue_half(partial, state.stage, 1, false);
        warpgroup_wait<0>();
        warpgroup_fence_operand(partial);
        release_stage(state.stage);
        promote(acc_high, weight_high, token_scale);
      } else {
        issue_half(acc_low, state.stage, 0, true);
        issue_half(acc_high, state.stage, 1, true);
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc_low);
        warpgroup_fence_operand(acc_high);
        release_stage(state.stage);
      }
      state.advance();
    }

    if constexpr (Config::kGemmOp == GemmOp::fc1_swiglu) {
      if (has_rows) gemm_detail::fc1_swiglu_tokens_on_m_epilogue<Config>(p, tile, acc_low, acc_high, base_row, base_col);
      publish_fc1_tile(p.fc1_tiles_done, tile.expert, p.num_experts, static_cast<uint32_t>(NamedBarrier::kFc1TileStored),
                       Config::kConsumerThreads, consumer_thread);
    } else {
      if (has_rows) gemm_detail::fc2_tokens_on_m_epilogue<Config>(p, tile, acc_low, acc_high, base_row, base_col, slots);
      if (p.tiles_stored != nullptr) {
        publish_stored_tile(p.tiles_stored, static_cast<uint32_t>(NamedBarrier::kTileStored), Config::kConsumerThreads,
                            consumer_thread);
      }
    }
  };

  // The first stage of each tile names it; lane 0 reads the tag for its warp (see the swapAB mainloop).
  auto stage_tile = [&](int stage) { return broadcast_from_lane0(lane == 0 ? smem.stage_tile[stage] : GroupedTile{}); };
  ptx::wait_parity(&smem.full[state.stage], state.phase);
  for (GroupedTile tile = stage_tile(state.stage); tile.expert >= 0;) {
    consume_tile(tile);
    ptx::wait_parity(&smem.full[state.stage], state.phase);
    tile = stage_tile(state.stage);
  }
}

}  // namespace megamoe::kernels
