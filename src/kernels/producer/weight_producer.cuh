// Weight producer role of the swapAB grouped GEMM (one lane of the producer warpgroup's warp 0):
// claims the tiles (GroupedTileScheduler), hands each to the other producer roles
// (pipeline/tile_queue.cuh) and tags each tile's first stage with it, then streams the tile's
// weight blocks into the stage ring by TMA. Weights depend on no earlier kernel, so the first
// tile's first stages stream in before the dependency wait, overlapping the previous kernel's
// tail; the last stage it fills carries the end tag (expert -1) and no bytes.
#pragma once

#include <cute/tensor.hpp>

#include "kernels/mma/grouped_gemm_config.cuh"
#include "kernels/pipeline/pair_claims.cuh"
#include "kernels/pipeline/pipeline_state.cuh"
#include "kernels/pipeline/tile_queue.cuh"
#include "kernels/ptx/cluster.cuh"
#include "kernels/ptx/grid_dependency.cuh"
#include "kernels/ptx/mbarrier.cuh"

namespace megamoe::kernels {

template <class Config, class Params>
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
  int linear = p.scheduler.first_tile();
  int prefetched = 0;
  GroupedTile tile{};
  if (linear < num_tiles) {
    tile = take(linear);
    for (; prefetched < k_blocks && prefetched < kStages; ++prefetched) load_weights(tile, prefetched, prefetched);
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
