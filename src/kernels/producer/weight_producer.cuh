// Weight producer role of the swapAB grouped GEMM (one lane of the producer warpgroup's warp 0):
// claims the tiles (GroupedTileScheduler), hands each to the other producer roles
// (pipeline/tile_queue.cuh) and tags each tile's first stage with it, then streams the tile's
// weight blocks into the stage ring by TMA. Weights depend on no earlier kernel, so the first
// tile's first stages stream in before the dependency wait, overlapping the previous kernel's
// tail; the last stage it fills carries the end tag (expert -1) and no bytes. In a decode-sized
// forward of the five kernels FC1 counts the blocks it issues and FC2's early CTAs pace their
// first loads by it.
#pragma once

#include <cute/tensor.hpp>

#include "kernels/mma/grouped_gemm_config.cuh"
#include "kernels/pipeline/pair_claims.cuh"
#include "kernels/pipeline/pipeline_state.cuh"
#include "kernels/pipeline/tile_queue.cuh"
#include "kernels/ptx/cluster.cuh"
#include "kernels/ptx/grid_dependency.cuh"
#include "kernels/ptx/mbarrier.cuh"
#include "kernels/ptx/memory.cuh"

namespace megamoe::kernels {

// Decode-sized forwards, where FC1 has fewer tiles than the grid has CTAs: the CTAs without an FC1
// tile reach FC2 at once, and its weights would stream beside FC1's, whose end the whole forward
// waits on. So FC1 counts the weight blocks it issues, and FC2's early CTAs hold back their first
// loads until FC1 has at most `lead` blocks left to issue: none where their blocks fit in the time
// between FC1's last load and its last stored tile (kFc2BlocksAfterFc1), else the excess
// (docs/decisions.md#fc2-weights-after-fc1s-stream). Every FC1 tile belongs to a CTA that is
// running and whose loads wait on nothing of FC2's, so the count arrives. Only where FC1 and FC2
// are grids of their own (kPacesFc2ByFc1, the per-stage forward): inside the single kernel the
// same hold-back did not pay.
template <class Params>
__device__ __forceinline__ uint32_t fc1_tiles_of(const Params& p) {
  return static_cast<uint32_t>(p.scheduler.token_tiles() * p.fc1_channel_blocks);
}

// The one test of both sides: FC1 counts its issued blocks where, and only where, FC2's early CTAs
// wait for the count (both GEMMs launch on one grid), or FC2 would wait until its timeout traps.
template <class Params>
__device__ __forceinline__ bool fc1_is_decode_sized(const Params& p) {
  return fc1_tiles_of(p) < gridDim.x;
}

// FC2's weight blocks that HBM delivers between FC1's last weight load and its last stored tile at
// one token (~3-4 us on one H100): held behind all of FC1's loads, qwen35-a3b's 256 (8.4 MB)
// streamed there without delaying FC2, qwen3-30b-a3b's 384 delayed it by ~2.8 us.
inline constexpr uint32_t kFc2BlocksAfterFc1 = 256;

template <class Config, class Params>
__device__ __forceinline__ void wait_for_fc1_weights(const Params& p, int k_blocks) {
  if (!fc1_is_decode_sized(p)) return;
  const uint32_t fc1_tiles = fc1_tiles_of(p), ctas = gridDim.x;
  const uint32_t fc1_blocks = fc1_tiles * static_cast<uint32_t>(p.a_rows / Config::kBlockK);  // FC1's K: FC2's rows
  const uint32_t early_tiles = min(static_cast<uint32_t>(p.scheduler.num_tiles()), ctas - fc1_tiles);
  const uint32_t early_blocks = early_tiles * static_cast<uint32_t>(min(k_blocks, Config::kStages));
  const uint32_t lead = early_blocks > kFc2BlocksAfterFc1 ? early_blocks - kFc2BlocksAfterFc1 : 0u;
  const uint32_t target = fc1_blocks > lead ? fc1_blocks - lead : 0u;
  ptx::wait_until([&] { return ptx::ld_relaxed_gpu(p.fc1_blocks_issued) >= target; }, 64);
}

template <class Config, bool kPacesFc2ByFc1, class Params>
__device__ __forceinline__ void weight_producer(const Params& p, typename Config::SharedStorage& smem, int k_blocks) {
  using namespace cute;
  constexpr int kStages = Config::kStages;
  Tensor sA = make_tensor(make_smem_ptr(smem.a.begin()), typename Config::SmemLayoutA{});  // (BM, BK, S)
  Tensor mA = p.tma_a.get_tma_tensor(make_shape(p.a_rows, p.k, p.num_experts));
  Tensor gA = local_tile(mA, typename Config::TileShape{}, make_coord(_, _, _), Step<_1, X, _1>{});  // (BM,BK,m,k,E)
  // (Named tensors rather than structured bindings: the loader below captures them.) In a CTA
  // pair the block's rows are two slices, one per CTA: where the pair's tiles share the block,
  // each CTA's load writes its own slice into both CTAs; where not, each CTA loads both slices
  // into itself.
  const int cta_rank = Config::kSharesWeights ? static_cast<int>(ptx::cluster_cta_rank()) : 0;
  auto slice = [&](int rank) {
    return tma_partition(p.tma_a, rank, Layout<Int<Config::kClusterSize>>{}, group_modes<0, 2>(sA), group_modes<0, 2>(gA));
  };
  const auto own_slice = slice(cta_rank);
  Tensor tAgA = get<0>(own_slice);
  Tensor tAsA = get<1>(own_slice);
  // A tile's first stage carries its tag, written before the stage's first arrival, which
  // orders it before the consumers' wait (they read the tag only where a tile starts).
  // The weights of an expert with one token tile are read once in the forward: they go into
  // L2 first in line for eviction, and what is read again (the gathered tokens, FC1's output,
  // the slot rows the combine reads) stays. An expert with more token tiles has them running
  // side by side on other CTAs, so even its last tile's loads may come before another tile's
  // reads of the same rows (with the hint there, 2048 tokens lost ~9 us).
  // (A shared block belongs to an expert with two token tiles or more: pairs that share never
  // take the hint.)
  bool shared_block = false;  // a pair's current tiles multiply one weight block
  auto load_weights = [&](const GroupedTile& tile, int kb, int stage) {
    if (kb == 0) smem.stage_tile[stage] = tile;
    ptx::mbarrier_arrive_expect_tx(&smem.full[stage], Config::stage_tx_bytes(Config::tile_subtiles(tile)));
    const auto hint = tile.expert_token_tiles == 1 ? TMA::CacheHintSm90::EVICT_FIRST : TMA::CacheHintSm90::EVICT_NORMAL;
    const uint16_t own_cta = static_cast<uint16_t>(1u << cta_rank);
    uint16_t destinations = 0;  // a single CTA's load: no multicast
    if constexpr (Config::kSharesWeights) destinations = shared_block ? 0b11 : own_cta;
    copy(p.tma_a.with(smem.full[stage], destinations, hint), tAgA(_, tile.channel_block, kb, tile.expert),
         tAsA(_, stage));
    if constexpr (Config::kSharesWeights) {
      if (!shared_block) {
        const auto other_slice = slice(cta_rank ^ 1);
        copy(p.tma_a.with(smem.full[stage], own_cta, hint), get<0>(other_slice)(_, tile.channel_block, kb, tile.expert),
             get<1>(other_slice)(_, stage));
      }
    }
  };
  // Single CTAs claim tiles; a pair's first CTA claims units for both (tile 2u + rank of unit u).
  // Claimed as a tile starts and taken after its loads, so that the claim's round trip (and a
  // pair's exchange) overlaps the tile's loads.
  PairClaims<typename Config::SharedStorage> pair_claims;
  auto claim = [&] {
    if constexpr (Config::kSharesWeights) {
      return pair_claims.claim(p.scheduler, static_cast<uint32_t>(cta_rank));
    } else {
      return p.scheduler.claim_next_tile();
    }
  };
  auto claimed_tile = [&](int claimed) {
    if constexpr (Config::kSharesWeights) {
      return pair_claims.exchange(claimed, smem, static_cast<uint32_t>(cta_rank));
    } else {
      return claimed;
    }
  };
  TileQueueState<Config> queue;
  const int num_tiles = p.scheduler.num_tiles();
  // Tile `linear` (< num_tiles) decoded and handed to the other producers. Pairs number an
  // expert's short tiles after its full ones, so that a unit's two tiles are alike; a pair's other
  // tile is `linear ^ 1` (units are 2u, 2u + 1): past the last tile, this one's stages go back to
  // this CTA alone (and, the last of its channel block, it shares nothing).
  auto take = [&](int linear) {
    constexpr TileOrder kOrder = Config::kSharesWeights ? TileOrder::short_tiles_last : TileOrder::block_major;
    GroupedTile tile = p.scheduler.template tile<kOrder>(linear);
    if constexpr (Config::kSharesWeights) {
      tile.alone_in_pair = (linear ^ 1) >= num_tiles;
      shared_block = pair_shares_weights(tile, cta_rank, p.scheduler.full_tiles(tile.expert));
    }
    hand_over_tile<Config>(smem, queue, tile);
    return tile;
  };

  // Weights and routing results do not depend on the previous kernel: the routing was
  // complete before this grid could launch (the router and the gather each wait for their
  // predecessor before releasing the next kernel, and this kernel releases its successor only
  // after every CTA has started). So the first tile's first kStages weight blocks stream in
  // before the dependency wait, overlapping the previous kernel's tail (FC1 waits for the
  // whole previous grid after them; FC2 only per expert, in the token producer).
  // FC1 in a decode-sized forward counts its issued weight blocks for FC2's early CTAs.
  const bool counts_blocks = kPacesFc2ByFc1 && Config::kGemmOp == GemmOp::fc1_swiglu && fc1_is_decode_sized(p);
  auto count_fc1_blocks = [&](int blocks) {
    if (counts_blocks && blocks > 0) ptx::red_add_relaxed_gpu(p.fc1_blocks_issued, static_cast<uint32_t>(blocks));
  };
  int linear = p.scheduler.first_tile();
  int prefetched = 0;
  GroupedTile tile{};
  if (linear < num_tiles) {
    tile = take(linear);
    if constexpr (kPacesFc2ByFc1 && Config::kWaitsForFc1) wait_for_fc1_weights<Config>(p, k_blocks);
    for (; prefetched < k_blocks && prefetched < kStages; ++prefetched) load_weights(tile, prefetched, prefetched);
    count_fc1_blocks(prefetched);
  }
  if constexpr (!Config::kWaitsForFc1) ptx::wait_for_prerequisite_grids();
  pipeline::PipelineState<kStages> state;
  int issued = 0;
  while (linear < num_tiles) {
    const int claimed = claim();
    for (int kb = 0; kb < k_blocks; ++kb, ++issued) {
      if (issued >= prefetched) {
        ptx::wait_parity(&smem.empty[state.stage], state.phase ^ 1);
        load_weights(tile, kb, state.stage);
        count_fc1_blocks(1);
      }
      state.advance();
    }
    linear = claimed_tile(claimed);
    if (linear < num_tiles) tile = take(linear);
  }
  GroupedTile end{};
  end.expert = -1;
  hand_over_tile<Config>(smem, queue, end);
  // The end tag: a stage with no bytes, full after this producer's arrivals alone.
  ptx::wait_parity(&smem.empty[state.stage], state.phase ^ 1);
  smem.stage_tile[state.stage].expert = -1;
  for (uint32_t a = 0; a < Config::kFullArrivals; ++a) ptx::mbarrier_arrive(&smem.full[state.stage]);
}

}  // namespace megamoe::kernels
