// Math role of the grouped GEMM's tokens-on-M layout (token tile 128): the ordinary orientation,
//   out[tokens, channels] = X_pool[tokens, K] * W_e[channels, K]^T
// with the tile's 128 token rows on wgmma M (math warpgroup w takes rows [64 w, 64 w + 64)) and
// its 256 output channels on N, as two n128 halves (docs/decisions.md#tokens-on-m-tile). The
// producers fill the same stages as for swapAB (a block of 256 weight rows, the tile's token rows
// in two 64-row subtiles); only the wgmma's operand roles and the fragments differ. fp8_block promotes
// each half's K block through one temporary fragment: 2 x 64 accumulators and 64 temporaries per
// thread, where two full n256 fragments (256) would not fit the registers; bf16 and fp8_tensor
// accumulate into the two halves directly (fp8_tensor then applies its per-tensor scales,
// epilogue/tensor_scales.cuh). A short tile (an
// expert's last, of at most 64 rows) loads one subtile, and both warpgroups multiply its rows, one
// n128 half of the channels each, so that neither idles.
#pragma once

#include <cute/tensor.hpp>

#include "kernels/epilogue/fc1_swiglu_tokens_on_m.cuh"
#include "kernels/epilogue/fc2_tokens_on_m.cuh"
#include "kernels/epilogue/tensor_scales.cuh"
#include "kernels/mma/grouped_gemm_config.cuh"
#include "kernels/mma/tile_walk.cuh"
#include "kernels/pipeline/pipeline_state.cuh"
#include "kernels/ptx/cluster.cuh"
#include "kernels/ptx/mbarrier.cuh"
#include "kernels/ptx/sync.cuh"

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
  // Read afresh at each per-tile use (ptx::thread_index_x), as in the swapAB mainloop: the single
  // kernel's math path has more values live beside the mainloop than the GEMM kernel's.
  auto consumer_thread = [] { return static_cast<int>(ptx::thread_index_x()) - 128; };
  const int lane = consumer_thread() % 32;
  const int warpgroup = consumer_thread() / 128;
  typename Tile::TiledMma mma;
  // This thread's slice for the warpgroup's own rows, and (a short tile) the first warpgroup's
  // slice at the same place, whose rows are the only ones loaded.
  ThrMMA thr_mma = mma.get_thread_slice(consumer_thread());
  ThrMMA thr_mma_short = mma.get_thread_slice(consumer_thread() % 128);
  Tensor tCrX = thr_mma.make_fragment_A(thr_mma.partition_A(sX));              // (MMA, 1, MMA_K, S)
  Tensor tCrX_short = thr_mma_short.make_fragment_A(thr_mma_short.partition_A(sX));
  Tensor tCrW = thr_mma.make_fragment_B(thr_mma.partition_B(sW));              // (MMA, 1, MMA_K, 2S)
  // Per half: (MMA=(2,2,16), 1, 1); element (v0, v1, v2) sits at row base_row + 8 v1 and column
  // base_col + 8 v2 + v0 of the half (the sm90 GMMA accumulator layout).
  Tensor acc_low = partition_fragment_C(mma, typename Tile::HalfMN{});   // a short tile: this warpgroup's half
  Tensor acc_high = partition_fragment_C(mma, typename Tile::HalfMN{});
  Tensor partial = partition_fragment_C(mma, typename Tile::HalfMN{});  // fp8_block: one half's K block, unscaled
  auto first_coord = [&](auto& slice) {
    return slice.partition_C(make_identity_tensor(typename Tile::HalfMN{}))(make_coord(0, 0, 0), 0, 0);
  };
  const int base_row = get<0>(first_coord(thr_mma));
  const int short_base_row = get<0>(first_coord(thr_mma_short));
  const int base_col = get<1>(first_coord(thr_mma));
  pipeline::PipelineState<kStages> state;
  // As in the swapAB mainloop: one lane's arrival after __syncwarp hands a stage back; in a CTA
  // pair lane c's to CTA c, whose weight load may also have written this CTA's stage, and a tile
  // alone in its pair (the other tile past the last) both lanes' to this CTA, whose producer alone
  // waits for it. The lane that arrives here reads what the producers rewrite once the stage is
  // free (tile tags, weight scales).
  const int reader_lane = Config::kSharesWeights ? static_cast<int>(ptx::cluster_cta_rank()) : 0;
  uint32_t hand_back_cta = static_cast<uint32_t>(lane);  // pairs, lanes below the cluster size
  auto release_stage = [&](int stage) {
    __syncwarp();
    if constexpr (Config::kSharesWeights) {
      if (lane < Config::kClusterSize) ptx::mbarrier_arrive_cluster(&smem.empty[stage], hand_back_cta);
    } else if (lane == 0) {
      ptx::mbarrier_arrive(&smem.empty[stage]);
    }
  };
  // The k steps of one half's K block in `stage`, from token fragment `x`, as one wgmma batch into `out`.
  auto issue_half = [&](auto& out, auto& x, int stage, int half, bool accumulate) {
    warpgroup_fence_operand(out);
    warpgroup_arrive();
    mma.accumulate_ = accumulate ? GMMA::ScaleOut::One : GMMA::ScaleOut::Zero;
    CUTE_UNROLL
    for (int k = 0; k < size<2>(x); ++k) {
      gemm(mma, x(_, _, k, stage), tCrW(_, _, k, Tile::kHalves * stage + half), out);
      mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
  };
  // fp8_block: a half's K block into its accumulators, each row with its token scale times the half's
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
  // fp8_block: the stage's weight scale of `half`, read by the lane that hands the stage back (see the
  // swapAB mainloop), and the token scales of rows `row` and `row + 8`.
  auto weight_scale = [&](int stage, int half) {
    return __shfl_sync(0xffffffffu, lane == reader_lane ? smem.weight_scales[stage][half] : 0.0f, reader_lane);
  };
  auto token_scales = [&](int stage, int row, float (&scale)[2]) {
    const float* stage_scales = smem.token_scales + stage * Config::kScaleStageStride;
    scale[0] = stage_scales[row];
    scale[1] = stage_scales[row + 8];
  };
  // A K block of the warpgroup's own 64 rows: both halves, into acc_low and acc_high (without
  // promotion, waited for like fp8_block's: docs/decisions.md#mainloop-without-promotion).
  auto whole_rows_block = [&](int stage) {
    if constexpr (Config::kBlockScales) {
      const float weight_low = weight_scale(stage, 0), weight_high = weight_scale(stage, 1);
      float token_scale[2];
      token_scales(stage, base_row, token_scale);
      issue_half(partial, tCrX, stage, 0, false);
      warpgroup_wait<0>();
      warpgroup_fence_operand(partial);
      promote(acc_low, weight_low, token_scale);
      issue_half(partial, tCrX, stage, 1, false);
      warpgroup_wait<0>();
      warpgroup_fence_operand(partial);
      release_stage(stage);
      promote(acc_high, weight_high, token_scale);
    } else {
      issue_half(acc_low, tCrX, stage, 0, true);
      issue_half(acc_high, tCrX, stage, 1, true);
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_low);
      warpgroup_fence_operand(acc_high);
      release_stage(stage);
    }
  };
  // A K block of a short tile: the first subtile's rows, this warpgroup's half, into acc_low.
  auto short_rows_block = [&](int stage) {
    if constexpr (Config::kBlockScales) {
      const float weight = weight_scale(stage, warpgroup);
      float token_scale[2];
      token_scales(stage, short_base_row, token_scale);
      issue_half(partial, tCrX_short, stage, warpgroup, false);
      warpgroup_wait<0>();
      warpgroup_fence_operand(partial);
      release_stage(stage);
      promote(acc_low, weight, token_scale);
    } else {
      issue_half(acc_low, tCrX_short, stage, warpgroup, true);
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_low);
      release_stage(stage);
    }
  };

  // A tile's K blocks, k_block(stage) for each once its stage is full. One loop per kind of tile
  // rather than a branch per K block, whose join keeps both kinds' registers live (the fp8 build
  // spilled).
  auto k_loop = [&](auto k_block) {
    for (int kb = 0; kb < k_blocks; ++kb) {
      if (kb > 0) ptx::wait_parity(&smem.full[state.stage], state.phase);  // K block 0's: before the tile
      k_block(state.stage);
      state.advance();
    }
  };

  auto consume_tile = [&](const GroupedTile& tile) {
    hand_back_cta = static_cast<uint32_t>(tile.alone_in_pair ? reader_lane : lane);
    // A tile of one subtile has rows for the first warpgroup only: both take them, a half each.
    const bool short_tile = Config::tile_subtiles(tile) == 1;
    const int row = short_tile ? short_base_row : base_row;
    gemm_detail::Fc2RowSlots slots;
    if constexpr (Config::kGemmOp != GemmOp::fc1_swiglu) slots.load(p, tile, row);
    [[maybe_unused]] gemm_detail::TensorScales tensor_scales;
    if constexpr (Config::kTensorScales) tensor_scales.load<Config>(p, tile);
    clear(acc_low);
    clear(acc_high);
    if (short_tile) {
      k_loop(short_rows_block);
    } else {
      k_loop(whole_rows_block);
    }
    if constexpr (Config::kTensorScales) {
      // Column groups v2 of a half: of an FC1 tile, even ones are gate rows and odd ones up rows
      // (the interleave by 8 of layout/weight_layout.hpp). A short tile's acc_high is unused.
      auto apply = [&](auto& acc) {
        CUTE_UNROLL
        for (int v2 = 0; v2 < Tile::kHalfChannels / 8; ++v2)
          CUTE_UNROLL
          for (int v1 = 0; v1 < 2; ++v1)
            CUTE_UNROLL
            for (int v0 = 0; v0 < 2; ++v0)
              acc(make_coord(v0, v1, v2), 0, 0) *= v2 % 2 == 0 ? tensor_scales.gate : tensor_scales.up;
      };
      apply(acc_low);
      if (!short_tile) apply(acc_high);
    }

    float* row_amax = &smem.amax_exchange[0][0];
    if constexpr (Config::kGemmOp == GemmOp::fc1_swiglu) {
      if (short_tile) {
        gemm_detail::fc1_swiglu_tokens_on_m_epilogue<Config, 1>(p, tile, acc_low, acc_low, warpgroup, row, base_col,
                                                                row_amax);
      } else {
        gemm_detail::fc1_swiglu_tokens_on_m_epilogue<Config, 2>(p, tile, acc_low, acc_high, 0, row, base_col, row_amax);
      }
    } else if (short_tile) {
      gemm_detail::fc2_tokens_on_m_epilogue<Config, 1>(p, tile, acc_low, acc_low, warpgroup, row, base_col, slots);
    } else {
      gemm_detail::fc2_tokens_on_m_epilogue<Config, 2>(p, tile, acc_low, acc_high, 0, row, base_col, slots);
    }
    publish_tile<Config>(p, tile, consumer_thread());
  };
  for_each_tagged_tile<Config>(smem, state, lane, reader_lane, consume_tile);
}

}  // namespace megamoe::kernels
