// Expert-parallel dispatch roles: two launches, each ending in a cross-rank barrier run by its last
// block, and no host synchronization. A source token sends one row to each rank owning one of its
// experts (layout/ep_buffers.hpp).
//   1. count (source): one thread per token, in tiles of kDispatchTileTokens. Each token's
//      destination ranks, its rank among the tile's rows to each destination (warp ballots) and the
//      tile's rows per destination. The last block (a batch of one tile: its only block) turns the
//      tile counts into prefixes over tiles, writes this rank's row of the count matrix into every
//      rank and runs the barrier; then,
//      from its own copy of the matrix, where this rank's rows start in each owner (after the rows
//      of lower source ranks) and how many rows this rank receives in total.
//   2. push (source): one block per token at a time, one thread per (destination, slot). The
//      token's position in each destination (base + tile prefix + rank in tile), its origin, its
//      slots as the owner's local expert ids and its routing weights go into the owner's buffer,
//      then the row itself: loaded once, written to every destination (NVLink writes); with FP8
//      rows (layout.fp8_rows) quantized once on the way, the gather's rule, codes and scales to
//      every destination. The last block runs the barrier: after it, every row sent to this rank
//      has arrived.
// Canonical order inside an owner: source rank, then token (the order of ref::plan_dispatch).
#pragma once

#include <cstdint>

#include "kernels/comm/ep_rows.cuh"
#include "kernels/comm/rank_barrier.cuh"
#include "kernels/layout/ep_buffers.hpp"
#include "kernels/layout/ep_timeline.hpp"
#include "kernels/pipeline/last_block.cuh"
#include "kernels/pipeline/timeline.cuh"
#include "kernels/ptx/grid_dependency.cuh"
#include "kernels/ptx/memory.cuh"

namespace megamoe::kernels {

constexpr int kDispatchTileTokens = 256;  // one token per thread of the count blocks
constexpr int kDispatchWarps = kDispatchTileTokens / 32;

struct EpDispatchParams {
  void* const* peer_bases;        // [world]
  layout::EpBufferLayout layout;
  RankBarrierParams barrier;
  int rank;
  int num_tokens;
  int num_experts;
  const int32_t* topk_ids;        // [T, k], this rank's routing
  const float* topk_weights;      // [T, k]
  const uint4* x;                 // [T, H] bf16 as 16-byte vectors
  bool ue8m0;                     // FP8 rows: power-of-two scales (the layer's ScaleFormat)
  int32_t* token_dest;            // [T, world]: count: rank among its tile's rows to that rank, or -1;
                                  // push: position in that owner (-1 stays: no row sent)
  int32_t* tile_counts;           // [tiles, world]: rows per destination, then prefixes over tiles
  int32_t* dest_base;             // [world]: first position of this rank's rows in each owner
  int32_t* recv_total;            // [1]: rows this rank receives in this call
  int32_t* error_flags;           // [0] += invalid ids
  uint32_t* tickets;              // [2] last-block tickets of count and push, zero between calls
  Timeline timeline;
};

__host__ __device__ inline int ep_dispatch_tiles(int num_tokens) {
  return num_tokens == 0 ? 1 : (num_tokens + kDispatchTileTokens - 1) / kDispatchTileTokens;
}

// Grid: ep_dispatch_tiles blocks of kDispatchTileTokens threads.
__global__ void __launch_bounds__(kDispatchTileTokens) ep_count_kernel(EpDispatchParams p) {
  __shared__ int32_t warp_counts[kDispatchWarps][layout::EpBufferLayout::kSignalSlots];
  const int world = p.layout.world_size, epr = p.layout.experts_per_rank;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const long token = static_cast<long>(blockIdx.x) * kDispatchTileTokens + threadIdx.x;
  const bool real = token < p.num_tokens;
  ptx::wait_for_prerequisite_grids();
  ptx::allow_dependent_launch();
  // After a barrier gave up, nothing is sent or received (rank_barrier.cuh).
  if (rank_fault_seen(p.barrier.fault)) {
    if (blockIdx.x == 0 && threadIdx.x == 0) *p.recv_total = 0;
    return;
  }
  const uint64_t epoch = next_barrier_epoch(p.barrier);
  p.timeline.mark(layout::kCountStart);
  uint64_t destinations = 0;
  if (real) {
    int invalid = 0;
    destinations = layout::ep_token_destinations(p.topk_ids, p.layout.top_k, p.num_experts, epr, token, &invalid);
    if (invalid > 0) atomicAdd(&p.error_flags[0], invalid);
  }
  for (int r = 0; r < world; ++r) {
    const uint32_t senders = __ballot_sync(0xffffffffu, (destinations >> r) & 1);
    if (lane == 0) warp_counts[warp][r] = __popc(senders);
  }
  __syncthreads();
  for (int r = 0; r < world; ++r) {
    const bool sends = (destinations >> r) & 1;
    const uint32_t senders = __ballot_sync(0xffffffffu, sends);
    if (!real) continue;
    int rank_in_tile = -1;
    if (sends) {
      rank_in_tile = __popc(senders & ((1u << lane) - 1u));
      for (int w = 0; w < warp; ++w) rank_in_tile += warp_counts[w][r];
    }
    p.token_dest[token * world + r] = rank_in_tile;
  }
  // Threads below world: this tile's rows to owner threadIdx.x, then every tile's.
  int rows = 0, running = 0;
  if (threadIdx.x < world) {
    for (int w = 0; w < kDispatchWarps; ++w) rows += warp_counts[w][threadIdx.x];
  }
  if (gridDim.x == 1) {
    // One tile: its block is the last to finish by itself, and the prefix before it is zero,
    // without the ticket, fences and counter round trips of the election.
    if (threadIdx.x < world) {
      p.tile_counts[threadIdx.x] = 0;
      running = rows;
    }
  } else {
    if (threadIdx.x < world) p.tile_counts[blockIdx.x * world + threadIdx.x] = rows;
    if (!last_block_to_finish(&p.tickets[0])) return;
    if (threadIdx.x < world) {
      const int owner = threadIdx.x;
      constexpr int kBatch = 16;  // independent loads in flight
      const int tiles = static_cast<int>(gridDim.x);
      for (int first = 0; first < tiles; first += kBatch) {
        int tile_rows[kBatch];
#pragma unroll
        for (int i = 0; i < kBatch; ++i) {
          tile_rows[i] = first + i < tiles ? __ldcg(&p.tile_counts[(first + i) * world + owner]) : 0;
        }
#pragma unroll
        for (int i = 0; i < kBatch; ++i) {
          if (first + i < tiles) p.tile_counts[(first + i) * world + owner] = running;
          running += tile_rows[i];
        }
      }
    }
  }
  if (threadIdx.x < world) {
    const int owner = threadIdx.x;
    for (int peer = 0; peer < world; ++peer) {
      ep_detail::region<int32_t>(p.peer_bases[peer], p.layout.counts)[p.rank * world + owner] = running;
    }
  }
  p.timeline.mark(layout::kCountScanned);
  cross_rank_barrier(p.barrier, epoch);
  p.timeline.mark(layout::kCountExchanged);
  if (rank_fault_seen(p.barrier.fault)) {
    if (threadIdx.x == 0) *p.recv_total = 0;
    return;
  }
  // Every source's row of the count matrix has arrived here.
  if (threadIdx.x < world) {
    const int owner = threadIdx.x;
    const int32_t* counts = ep_detail::region<const int32_t>(p.peer_bases[p.rank], p.layout.counts);
    int base = 0;
    for (int s = 0; s < p.rank; ++s) base += __ldcv(counts + s * world + owner);
    p.dest_base[owner] = base;
    if (owner == p.rank) {
      int total = base;
      for (int s = p.rank; s < world; ++s) total += __ldcv(counts + s * world + owner);
      *p.recv_total = total;
    }
  }
}

// Grid: any number of blocks (at least one) of kEpRowThreads threads; block b pushes tokens b,
// b + gridDim.x, ...
__global__ void __launch_bounds__(kEpRowThreads) ep_push_kernel(EpDispatchParams p) {
  __shared__ uint4* rows_to[layout::EpBufferLayout::kSignalSlots];
  __shared__ float* scales_to[layout::EpBufferLayout::kSignalSlots];  // FP8 rows: each row's block-0 scale
  __shared__ int destinations;
  __shared__ int32_t row_positions[layout::EpBufferLayout::kSignalSlots];  // per owner, -1: no row
  const int world = p.layout.world_size, k = p.layout.top_k, epr = p.layout.experts_per_rank;
  const int vectors = p.layout.hidden / 8;
  const int row_vectors = p.layout.fp8_rows ? p.layout.hidden / 16 : vectors;  // of the row on the wire
  ptx::wait_for_prerequisite_grids();
  ptx::allow_dependent_launch();
  if (rank_fault_seen(p.barrier.fault)) return;  // the count exchange gave up: no positions, no rows
  p.timeline.mark(layout::kPushStart);
  for (long token = blockIdx.x; token < p.num_tokens; token += gridDim.x) {
    // The row's loads are a token's longest wait: start them before its positions are known.
    for (int v = threadIdx.x; v < vectors; v += blockDim.x) ptx::prefetch_l1(p.x + token * vectors + v);
    if (threadIdx.x == 0) destinations = 0;
    for (int owner = threadIdx.x; owner < world; owner += blockDim.x) row_positions[owner] = -1;
    __syncthreads();
    // One thread per (owner, slot): the slot's local id and weight, and the owner's position of
    // the row, are loaded side by side rather than in one thread's chain of dependent loads.
    for (int item = threadIdx.x; item < world * k; item += blockDim.x) {
      const int owner = item / k, j = item % k;
      const int local_id = layout::ep_local_slot_expert(p.topk_ids, k, p.num_experts, epr, token, j, owner);
      const float weight = p.topk_weights[token * k + j];
      int32_t* dest = p.token_dest + token * world + owner;
      const int rank_in_tile = *dest;
      if (rank_in_tile < 0) continue;
      const long tile = token / kDispatchTileTokens;
      const long position = p.dest_base[owner] + p.tile_counts[tile * world + owner] + rank_in_tile;
      void* base = p.peer_bases[owner];
      ep_detail::region<int32_t>(base, p.layout.recv_ids)[position * k + j] = local_id;
      ep_detail::region<float>(base, p.layout.recv_weights)[position * k + j] = weight;
      if (j == 0) {
        row_positions[owner] = static_cast<int32_t>(position);
        ep_detail::region<int2>(base, p.layout.recv_origin)[position] = make_int2(p.rank, static_cast<int>(token));
        const int d = atomicAdd(&destinations, 1);
        rows_to[d] = ep_detail::region<uint4>(base, p.layout.recv_tokens) + position * row_vectors;
        if (p.layout.fp8_rows) scales_to[d] = ep_detail::region<float>(base, p.layout.recv_scales) + position;
      }
    }
    __syncthreads();
    // After every slot has read its owner's rank in the tile: the combine reads positions.
    for (int owner = threadIdx.x; owner < world; owner += blockDim.x) {
      if (row_positions[owner] >= 0) p.token_dest[token * world + owner] = row_positions[owner];
    }
    if (p.layout.fp8_rows) {
      ep_detail::block_quantize_row(p.x + token * vectors, rows_to, scales_to, destinations, p.layout.hidden,
                                    p.layout.max_recv_rows, p.ue8m0);
    } else {
      ep_detail::block_copy_row(p.x + token * vectors, rows_to, destinations, vectors);
    }
    __syncthreads();
  }
  // Loaded here rather than at the start, where the row loop's division calls would spill it; the
  // election's fences wait as long.
  const uint64_t epoch = next_barrier_epoch(p.barrier);
  p.timeline.mark(layout::kPushRowsSent);
  if (!last_block_to_finish(&p.tickets[1])) return;
  cross_rank_barrier(p.barrier, epoch);
  p.timeline.mark(layout::kPushDelivered);
}

}  // namespace megamoe::kernels
