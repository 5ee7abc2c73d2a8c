// Expert-parallel dispatch roles (staged: one launch per phase, cross-rank barriers between).
//   1. count (source): the slots are cut into tiles of kDispatchTileSlots; each block counts its
//      tile's rows per expert, and the last block to finish turns the tile counts into prefixes
//      over tiles and writes each expert's total into its owner's recv_counts[src].
//   2. publish (source): after the count exchange, each block ranks its tile's slots again (same
//      code, same result), adds the tile prefix and the expert's canonical base in the owner, and
//      writes (src, token, slot, local expert) there; every block also stages x in send_tokens.
//   3. pull (owner): every received row is read from its source's send_tokens over NVLink into
//      recv_tokens, and arrivals[local expert] is released once per row.
// Canonical order inside an owner: local expert, then source rank, then token, then slot (the
// order of ref::plan_dispatch). Nothing is serial in the number of tokens.
#pragma once

#include <cstdint>

#include "kernels/comm/ep_rows.cuh"
#include "kernels/layout/ep_buffers.hpp"
#include "kernels/ptx/memory.cuh"

namespace megamoe::kernels {

constexpr int kDispatchTileSlots = 256;  // one slot per thread of the count and publish blocks
constexpr int kDispatchWarps = kDispatchTileSlots / 32;

struct EpDispatchParams {
  void* const* peer_bases;        // [world]
  layout::EpBufferLayout layout;
  int rank;
  int num_tokens;
  int num_experts;
  const int32_t* topk_ids;        // [T, k], this rank's routing
  const uint4* x;                 // [T, H] bf16 as 16-byte vectors
  int32_t* slot_rank;             // [T, k] out: rank of the slot inside its expert, -1 unused
  int32_t* error_flags;           // [0] += invalid ids
  int32_t* recv_local_expert;     // [max_recv_rows] owner: local expert of each received row
  int32_t* tile_counts;           // [tiles, E] scratch: rows per expert of each tile, then prefixes
  uint32_t* tiles_done;           // [1] zero between calls
};

// Dynamic shared memory of the count and publish kernels.
inline size_t ep_count_smem_bytes(int num_experts) { return sizeof(int32_t) * kDispatchWarps * num_experts; }
inline size_t ep_publish_smem_bytes(int num_experts, int world_size) {
  return sizeof(int32_t) * (kDispatchWarps + 2 + world_size) * num_experts;
}
__host__ __device__ inline int ep_dispatch_tiles(int num_tokens, int top_k) {
  const long slots = static_cast<long>(num_tokens) * top_k;
  return slots == 0 ? 1 : static_cast<int>((slots + kDispatchTileSlots - 1) / kDispatchTileSlots);
}

namespace ep_detail {

struct RankedSlot {
  long slot;
  int expert;        // -1: the slot sends nothing
  bool invalid;
  int rank_in_tile;  // among this tile's earlier slots on the same expert
};

// Ranks this thread's slot inside the block's tile. warp_counts [kDispatchWarps][E] (shared) ends
// up holding every warp's rows per expert; the tile's count of expert e is the sum over warps.
__device__ __forceinline__ RankedSlot rank_in_tile(const EpDispatchParams& p, int32_t* warp_counts) {
  const int E = p.num_experts, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int i = threadIdx.x; i < kDispatchWarps * E; i += blockDim.x) warp_counts[i] = 0;
  RankedSlot r{static_cast<long>(blockIdx.x) * kDispatchTileSlots + threadIdx.x, -1, false, 0};
  if (r.slot < static_cast<long>(p.num_tokens) * p.layout.top_k) {
    r.expert = layout::ep_slot_expert(p.topk_ids, p.layout.top_k, E, r.slot, &r.invalid);
  }
  __syncthreads();
  // Lanes on the same expert find each other; unused slots get a key no expert has.
  const uint32_t same = __match_any_sync(0xffffffffu, r.expert >= 0 ? r.expert : -1 - lane);
  const int in_warp = __popc(same & ((1u << lane) - 1u));
  if (r.expert >= 0 && in_warp == 0) warp_counts[warp * E + r.expert] = __popc(same);
  __syncthreads();
  if (r.expert >= 0) {
    r.rank_in_tile = in_warp;
    for (int w = 0; w < warp; ++w) r.rank_in_tile += warp_counts[w * E + r.expert];
  }
  return r;
}

}  // namespace ep_detail

// Grid: ep_dispatch_tiles blocks of kDispatchTileSlots threads.
__global__ void __launch_bounds__(kDispatchTileSlots) ep_count_kernel(EpDispatchParams p) {
  extern __shared__ int32_t warp_counts[];  // [kDispatchWarps][E]
  const int E = p.num_experts;
  const ep_detail::RankedSlot mine = ep_detail::rank_in_tile(p, warp_counts);
  if (mine.invalid) atomicAdd(&p.error_flags[0], 1);
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int count = 0;
    for (int w = 0; w < kDispatchWarps; ++w) count += warp_counts[w * E + e];
    p.tile_counts[static_cast<long>(blockIdx.x) * E + e] = count;
  }
  // The last block to finish sees every tile's counts.
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(p.tiles_done, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  const int epr = p.layout.experts_per_rank;
  constexpr int kBatch = 16;  // independent loads in flight per thread
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int running = 0;
    for (int first = 0; first < static_cast<int>(gridDim.x); first += kBatch) {
      int counts[kBatch];
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        counts[i] = first + i < static_cast<int>(gridDim.x) ? __ldcg(&p.tile_counts[static_cast<long>(first + i) * E + e]) : 0;
      }
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        if (first + i < static_cast<int>(gridDim.x)) p.tile_counts[static_cast<long>(first + i) * E + e] = running;
        running += counts[i];
      }
    }
    ep_detail::region<int32_t>(p.peer_bases[e / epr], p.layout.recv_counts)[p.rank * epr + e % epr] = running;
  }
  if (threadIdx.x == 0) *p.tiles_done = 0;
}

// Grid: at least ep_dispatch_tiles blocks of kDispatchTileSlots threads; the blocks past the
// tiles only stage x.
__global__ void __launch_bounds__(kDispatchTileSlots) ep_publish_kernel(EpDispatchParams p) {
  extern __shared__ int32_t shared[];
  const int E = p.num_experts, epr = p.layout.experts_per_rank, world = p.layout.world_size;
  const int tiles = ep_dispatch_tiles(p.num_tokens, p.layout.top_k);
  if (static_cast<int>(blockIdx.x) < tiles) {
    int32_t* warp_counts = shared;                             // [kDispatchWarps][E]
    int32_t* owner_counts = warp_counts + kDispatchWarps * E;  // [owner][src][local] = [E / epr][world][epr]
    int32_t* expert_prefix = owner_counts + world * E;         // [E]: per owner, over its local experts
    int32_t* expert_base = expert_prefix + E;                  // [E]: this rank's first row in the owner
    // Every owner's recv_counts, read once over NVLink.
    for (int i = threadIdx.x; i < world * E; i += blockDim.x) {
      const int owner = i / (world * epr);
      owner_counts[i] = ep_detail::region<const int32_t>(p.peer_bases[owner], p.layout.recv_counts)[i % (world * epr)];
    }
    __syncthreads();
    if (threadIdx.x < 32) {
      // One warp scans the rows each expert receives (from all sources) within each owner.
      const int lane = threadIdx.x;
      const int per_lane = (E + 31) / 32;
      int sum = 0;
      for (int e = lane * per_lane; e < min(E, (lane + 1) * per_lane); ++e) {
        int rows = 0;
        for (int s = 0; s < world; ++s) rows += owner_counts[(e / epr) * world * epr + s * epr + e % epr];
        expert_prefix[e] = rows;
        sum += rows;
      }
      int before = sum;
      for (int offset = 1; offset < 32; offset *= 2) {
        const int other = __shfl_up_sync(0xffffffffu, before, offset);
        if (lane >= offset) before += other;
      }
      before -= sum;
      for (int e = lane * per_lane; e < min(E, (lane + 1) * per_lane); ++e) {
        const int rows = expert_prefix[e];
        expert_prefix[e] = before;
        before += rows;
      }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
      const int owner = e / epr;
      const int32_t* prefix_of_owner = expert_prefix + owner * epr;
      // The scan ran across owners; each owner's rows start at zero.
      expert_base[e] = static_cast<int32_t>(
          layout::ep_segment_base(owner_counts + owner * world * epr, prefix_of_owner, epr, p.rank, e % epr) -
          prefix_of_owner[0]);
    }
    const ep_detail::RankedSlot mine = ep_detail::rank_in_tile(p, warp_counts);
    if (mine.slot < static_cast<long>(p.num_tokens) * p.layout.top_k) {
      int rank_in_expert = -1;
      if (mine.expert >= 0) {
        const int e = mine.expert, k = p.layout.top_k;
        rank_in_expert = p.tile_counts[static_cast<long>(blockIdx.x) * E + e] + mine.rank_in_tile;
        const long position = expert_base[e] + rank_in_expert;
        int4* sources = ep_detail::region<int4>(p.peer_bases[e / epr], p.layout.recv_sources);
        sources[position] = make_int4(p.rank, static_cast<int>(mine.slot / k), static_cast<int>(mine.slot % k), e % epr);
      }
      p.slot_rank[mine.slot] = rank_in_expert;
    }
  }
  uint4* send = ep_detail::region<uint4>(p.peer_bases[p.rank], p.layout.send_tokens);
  const long vectors = static_cast<long>(p.num_tokens) * (p.layout.hidden / 8);
  const long stride = static_cast<long>(gridDim.x) * blockDim.x;
  for (long v = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x; v < vectors; v += stride) send[v] = p.x[v];
}

// One warp per received row, grid-stride; the row count comes from recv_counts.
__global__ void __launch_bounds__(256) ep_pull_kernel(EpDispatchParams p) {
  const int epr = p.layout.experts_per_rank, world = p.layout.world_size;
  const int total = ep_detail::received_rows(
      ep_detail::region<const int32_t>(p.peer_bases[p.rank], p.layout.recv_counts), world * epr);
  const int4* sources = ep_detail::region<const int4>(p.peer_bases[p.rank], p.layout.recv_sources);
  uint4* received = ep_detail::region<uint4>(p.peer_bases[p.rank], p.layout.recv_tokens);
  uint32_t* arrivals = ep_detail::region<uint32_t>(p.peer_bases[p.rank], p.layout.arrivals);
  const int lane = threadIdx.x % 32;
  const int vectors_per_row = p.layout.hidden / 8;
  const long warps = static_cast<long>(gridDim.x) * blockDim.x / 32;
  for (long row = (blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x) / 32; row < total; row += warps) {
    const int4 source = sources[row];  // (src, token, slot, local expert)
    const uint4* from = ep_detail::region<const uint4>(p.peer_bases[source.x], p.layout.send_tokens) +
                        static_cast<long>(source.y) * vectors_per_row;
    ep_detail::warp_copy_row(received + row * vectors_per_row, from, vectors_per_row, lane);
    __syncwarp();
    if (lane == 0) {
      p.recv_local_expert[row] = source.w;
      __threadfence();
      ptx::red_add_release_gpu(&arrivals[source.w], 1);
    }
  }
}

}  // namespace megamoe::kernels
