// Math role of the swapAB grouped GEMM (the math warpgroups, after their register increase and,
// for FC1, the dependency wait: see the kernels): the wgmma mainloop over each tile's
// stages (fp8_block: with the per-K-block scale promotion into fp32 accumulators; fp8_tensor: the
// per-tensor scales applied to the accumulators after the last K block), then the tile's
// epilogue in registers (FC1: SwiGLU + requantization, epilogue/fc1_swiglu.cuh, and the FC1 tile's
// publication for FC2; FC2: slot store or atomic combine, epilogue/fc2_combine.cuh). The tiles
// come in the order the weight producer tagged the stages with; a stage tagged expert -1 ends it.
#pragma once

#include <cute/tensor.hpp>

#include "kernels/epilogue/fc1_swiglu.cuh"
#include "kernels/epilogue/fc2_combine.cuh"
#include "kernels/epilogue/gemm_op.hpp"
#include "kernels/epilogue/tensor_scales.cuh"
#include "kernels/mma/grouped_gemm_config.cuh"
#include "kernels/mma/tile_walk.cuh"
#include "kernels/pipeline/pipeline_state.cuh"
#include "kernels/ptx/grid_dependency.cuh"
#include "kernels/ptx/mbarrier.cuh"
#include "kernels/ptx/sync.cuh"

namespace megamoe::kernels {

template <class Config, class Params>
__device__ __forceinline__ void math_warpgroups(const Params& p, typename Config::SharedStorage& smem, int k_blocks) {
  using namespace cute;
  constexpr int kStages = Config::kStages;
  Tensor sA = make_tensor(make_smem_ptr(smem.a.begin()), typename Config::SmemLayoutA{});  // (BM, BK, S)
  // Read afresh at each per-tile use (ptx::thread_index_x): held through the mainloop it spilled.
  auto consumer_thread = [] { return static_cast<int>(ptx::thread_index_x()) - 128; };
  const int lane = threadIdx.x % 32;
  pipeline::PipelineState<kStages> state;
  // After the block's batch has completed its reads of the stage.
  auto release_stage = [&](int stage) {
    if constexpr (Config::kEmptyArrivalsPerWarp == 32) {
      ptx::mbarrier_arrive(&smem.empty[stage]);
    } else {
      __syncwarp();
      if (lane == 0) ptx::mbarrier_arrive(&smem.empty[stage]);
    }
  };

  // One tile of Columns::kBlockN token columns, from its first stage (already full) to its stored
  // output. Instantiated for the token tile and, where there is one, for the short last tile of
  // one subtile; the compiler gives both the same registers.
  auto consume_tile = [&](auto columns, const GroupedTile& tile) {
    using Columns = decltype(columns);
    typename Columns::TiledMma mma;
    ThrMMA thr_mma = mma.get_thread_slice(consumer_thread());
    Tensor sB = make_tensor(make_smem_ptr(smem.b.begin()), typename Columns::SmemLayoutB{});  // (BN, BK, S x views)
    Tensor tCrA = thr_mma.make_fragment_A(thr_mma.partition_A(sA));  // (MMA, kMBlocks, MMA_K, S)
    Tensor tCrB = thr_mma.make_fragment_B(thr_mma.partition_B(sB));  // (MMA, 1, MMA_K, S x views)
    using TileMN = Shape<Int<Columns::kBlockM>, Int<Columns::kBlockN>>;
    Tensor acc = partition_fragment_C(mma, TileMN{});                // (MMA=(2,2,N/8), kMBlocks, 1)
    // fp8_block: each K block accumulates unscaled into `partial`, then is promoted into `acc` with its
    // weight scale times each token's scale.
    Tensor partial = partition_fragment_C(mma, TileMN{});
    // Tile coordinates of this thread's fragment: element (v0, v1, v2) of m-block m sits at row
    // base_row[m] + 8 v1 and column base_col + 8 v2 + v0 (the sm90 GMMA accumulator layout).
    Tensor coords = thr_mma.partition_C(make_identity_tensor(TileMN{}));
    static_assert(decltype(size<1>(acc))::value == Config::kMBlocks, "one fragment mode per m64 block");
    int base_row[Config::kMBlocks];
    CUTE_UNROLL
    for (int m = 0; m < Config::kMBlocks; ++m) base_row[m] = get<0>(coords(make_coord(0, 0, 0), m, 0));
    const int base_col = get<1>(coords(make_coord(0, 0, 0), 0, 0));

    // The 4 k32 steps of the K block in `stage`, as one wgmma batch into `out` (accumulating, or
    // overwriting it first when `accumulate` is false).
    auto issue_block = [&](auto& out, int stage, bool accumulate) {
      warpgroup_fence_operand(out);
      warpgroup_arrive();
      mma.accumulate_ = accumulate ? GMMA::ScaleOut::One : GMMA::ScaleOut::Zero;
      CUTE_UNROLL
      for (int k = 0; k < size<2>(tCrA); ++k) {
        gemm(mma, tCrA(_, _, k, stage), tCrB(_, _, k, stage * Columns::kViewsPerStage), out);
        mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
    };
    // fp8_block: the scales of one K block as this thread applies them, weight scale times token scale
    // for each of its (N/8) x 2 (v2, v0) columns (all m64 blocks of a warpgroup share the weight
    // scale, see PermutationM). Read from shared memory as soon as the stage is full, so that the
    // reads overlap the wgmma batch instead of following it.
    constexpr int kColGroups = Columns::kBlockN / 8;
    using BlockScales = float[kColGroups][2];
    auto read_block_scales = [&](int stage, BlockScales& scales) {
      // The lane that hands the stage back reads the weight scale and broadcasts it: the
      // producer's cp.async that later rewrites it is then ordered after the read by that lane's
      // own arrival (a read by the other lanes would be ordered by the __syncwarp alone, which
      // compute-sanitizer racecheck does not follow).
      const float mine = lane == 0 ? smem.weight_scales[stage][base_row[0] / Config::kQuantBlock] : 0.0f;
      const float weight_scale = __shfl_sync(0xffffffffu, mine, 0);
      const float* token_scale = smem.token_scales + stage * Config::kScaleStageStride;
      CUTE_UNROLL
      for (int v2 = 0; v2 < kColGroups; ++v2) {
        // Columns base_col + 8 v2 + {0, 1}: base_col is even, so one 8-byte load.
        const float2 ts = *reinterpret_cast<const float2*>(token_scale + base_col + 8 * v2);
        scales[v2][0] = weight_scale * ts.x;
        scales[v2][1] = weight_scale * ts.y;
      }
    };
    auto promote = [&](auto& block, const BlockScales& scales) {
      CUTE_UNROLL
      for (int v2 = 0; v2 < kColGroups; ++v2)
        CUTE_UNROLL
        for (int v0 = 0; v0 < 2; ++v0)
          CUTE_UNROLL
          for (int m = 0; m < Config::kMBlocks; ++m)
            CUTE_UNROLL
            for (int v1 = 0; v1 < 2; ++v1)
              acc(make_coord(v0, v1, v2), m, 0) += block(make_coord(v0, v1, v2), m, 0) * scales[v2][v0];
    };

    gemm_detail::Fc2TileSlots<Columns> slots;
    if constexpr (Config::kGemmOp != GemmOp::fc1_swiglu) slots.load(p, tile, base_col, lane);
    [[maybe_unused]] gemm_detail::TensorScales tensor_scales;
    if constexpr (Config::kTensorScales) tensor_scales.load<Config>(p, tile);
    clear(acc);
    for (int kb = 0; kb < k_blocks; ++kb) {
      if (kb > 0) ptx::wait_parity(&smem.full[state.stage], state.phase);  // K block 0's: before the tile
      // Copied rows came through the generic proxy; the wgmma reads through the async one.
      if constexpr (Config::kCopiesTokenRows) ptx::fence_proxy_async_shared();
      if constexpr (Config::kBlockScales) {
        BlockScales scales;
        read_block_scales(state.stage, scales);
        issue_block(partial, state.stage, false);
        warpgroup_wait<0>();
        warpgroup_fence_operand(partial);
        release_stage(state.stage);
        promote(partial, scales);
      } else {
        // Without promotion the batch accumulates into acc; waiting for it before the next K block
        // costs nothing measurable (docs/decisions.md#mainloop-without-promotion).
        issue_block(acc, state.stage, true);
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc);
        release_stage(state.stage);
      }
      state.advance();
    }
    if constexpr (Config::kTensorScales) {
      // Rows base_row + 8 v1 of each m64 block: of an FC1 tile, v1 = 0 are gate rows and v1 = 1 up
      // rows (the interleave by 8 of layout/weight_layout.hpp).
      CUTE_UNROLL
      for (int v2 = 0; v2 < kColGroups; ++v2)
        CUTE_UNROLL
        for (int v0 = 0; v0 < 2; ++v0)
          CUTE_UNROLL
          for (int m = 0; m < Config::kMBlocks; ++m) {
            acc(make_coord(v0, 0, v2), m, 0) *= tensor_scales.gate;
            acc(make_coord(v0, 1, v2), m, 0) *= tensor_scales.up;
          }
    }

    if constexpr (Config::kGemmOp == GemmOp::fc1_swiglu) {
      gemm_detail::fc1_swiglu_epilogue<Columns>(p, tile, acc, base_row, base_col, smem, consumer_thread());
    } else {
      gemm_detail::fc2_epilogue<Columns>(p, tile, acc, base_row, base_col, lane, slots);
    }
    publish_tile<Config>(p, tile, consumer_thread());
  };

  using WholeTile = GemmTileColumns<Config, Config::kBlockN>;
  using ShortTile = GemmTileColumns<Config, Config::kTokenSubtile>;
  for_each_tagged_tile<Config>(smem, state, lane, 0, [&](const GroupedTile& tile) {
    if (Config::tile_subtiles(tile) < Config::kSubtiles) consume_tile(ShortTile{}, tile);
    else consume_tile(WholeTile{}, tile);
  });
}

}  // namespace megamoe::kernels
