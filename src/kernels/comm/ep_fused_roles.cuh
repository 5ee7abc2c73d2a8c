// Expert parallelism inside the persistent kernel: the roles the single-kernel forward runs before
// and after its GEMMs when it is one rank's whole expert-parallel forward
// (docs/design.md#expert-parallelism-inside-the-persistent-kernel). Each rank publishes its tokens
// in its own symmetric buffer (layout/ep_fused_buffers.hpp) and the owners pull what they need:
//   publish items  (claimed first) this rank's rows quantized once (or copied) with their ids and
//                  weights into its ids, weights and rows regions, FP8 rows by groups of threads
//                  a token each; the last to finish writes its count into every rank and arrives
//                  there
//   route items    an owner's virtual tokens v = (source s, token t), a warp each: s's arrival
//                  and count acquired, the token's ids read over NVLink, the slots of this
//                  rank's experts counted as local ids; the last scans the expert segments as the
//                  single-GPU front does and lays out the combine's chunks per source
//   gather items   each routed virtual token's row copied from its source into the pool, three
//                  groups of threads a token each
//   FC1, FC2       the single kernel's GEMMs, unchanged
//   combine chunks (claimed) a chunk of a source's tokens (as many chunks as CTAs while the
//                  tokens allow): each token's weighted sum over this rank's experts, its slot
//                  rows staged in the idle stage ring, stored into the source's `returned` region
//                  over NVLink (FP8 partial sums: stored here, then quantized per 128 channels into
//                  the source's returned_codes and returned_scales); the CTA that completes the
//                  last chunk arrives at every source
//   reduce chunks  (claimed, sized alike) this rank's own tokens: every owner's arrival acquired,
//                  then the owners' partial sums added in rank order (fp32, rounded once: the
//                  staged reduce's arithmetic) into y
// Work that other work waits for is always claimed (never a fixed share), so CTAs that are not
// resident slow the forward down and cannot hang it. The cross-rank waits end in a RankFault after
// the layer's timeout, without printing (a printf in a kernel that issues wgmma serializes its
// wgmma); from then on the rank reads and writes no peer's memory and y is NaN.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/combine/combine_slots.cuh"
#include "kernels/combine/combine_staged.cuh"
#include "kernels/comm/ep_fused_params.hpp"
#include "kernels/comm/ep_rows.cuh"
#include "kernels/comm/fp8_partials.cuh"
#include "kernels/comm/peer_wait.cuh"
#include "kernels/epilogue/gemm_op.hpp"
#include "kernels/layout/ep_buffers.hpp"
#include "kernels/layout/ep_fused_buffers.hpp"
#include "kernels/layout/forward_timeline.hpp"
#include "kernels/pipeline/last_block.cuh"
#include "kernels/pipeline/timeline.cuh"
#include "kernels/ptx/memory.cuh"
#include "kernels/ptx/sync.cuh"
#include "kernels/routing/front_items.cuh"
#include "kernels/routing/route_token.cuh"

namespace megamoe::kernels {

// Counters of the fused forward beyond the single kernel's: the same workspace slots, zeroed by the
// last CTA to finish.
enum EpForwardCounter : int {
  kPublishItemsDone = kForwardCounters,  // publish items finished
  kCombineChunksClaimed,
  kCombineChunksDone,
  kReduceChunksClaimed,
  kEpForwardCounters,
};
static_assert(kEpForwardCounters <= layout::kForwardCounterSlots, "the workspace holds every counter");

__device__ __forceinline__ uint32_t* ep_counter(const ForwardItems& items, EpForwardCounter c) {
  return items.counters + c;
}

// Tokens a combine or reduce chunk takes in this grid (layout::EpFusedLayout::chunk_tokens).
__device__ __forceinline__ int ep_chunk_tokens(long tokens) {
  return layout::EpFusedLayout::chunk_tokens(tokens, static_cast<int>(gridDim.x));
}

// The back role's shared state, kept in the staging memory's reserve (kCombineStagingReserve) while
// the rows before it are staged: the claimed chunk, whether every owner arrived, and the owners of
// a reduce chunk's tokens.
struct EpBackScratch {
  uint64_t owners[layout::EpFusedLayout::kMaxChunkTokens];
  int chunk;
  bool arrived;
};
static_assert(sizeof(EpBackScratch) + 16 <= kCombineStagingReserve, "the back role's scratch fits the reserve");

namespace ep_fused_detail {

template <class T>
__device__ __forceinline__ T* region_of(const EpFusedParams& p, int rank, size_t offset) {
  return ep_detail::region<T>(p.peer_bases[rank], offset);
}

// This rank's slot of `rank`'s arrival counters at `offset` (published or returned_from).
__device__ __forceinline__ uint64_t* arrival_slot(const EpFusedParams& p, int rank, size_t offset) {
  return region_of<uint64_t>(p, rank, offset) + p.rank;
}

// The calls' number this forward's arrivals count to (read after the previous forward's end).
__device__ __forceinline__ uint64_t this_call(const EpFusedParams& p) { return *p.calls + 1; }

// One thread: adds one arrival to this rank's slot at `offset` of every rank (release, system
// scope), after the writes the caller ordered before it; none after a fault.
__device__ __forceinline__ void arrive_everywhere(const EpFusedParams& p, size_t offset) {
  for (int peer = 0; peer < p.layout.world_size; ++peer) {
    if (rank_fault_seen(p.fault)) return;
    ptx::red_add_release_sys(arrival_slot(p, peer, offset), 1);
  }
}

// One thread: whether every rank arrived at this rank's slots at `offset` for this call (false
// once a wait gave up).
__device__ __forceinline__ bool all_arrived(const EpFusedParams& p, size_t offset) {
  const uint64_t call = this_call(p);
  const uint64_t* slots = region_of<const uint64_t>(p, p.rank, offset);
  for (int peer = 0; peer < p.layout.world_size; ++peer) {
    if (wait_for_peer(slots + peer, peer, call, p.timeout_ns, p.fault) != PeerWait::arrived) return false;
  }
  return true;
}

// Threads that quantize one FP8 row together: a lane per 16 channels (block_quantize_row), whole
// warps, at most the CTA.
__device__ __forceinline__ int publish_group_threads(int hidden) {
  return min(kFrontThreads, (hidden / 16 + 31) / 32 * 32);
}

// Publish item `item`, the whole CTA: its tokens' rows (FP8 codes and scales by the gather's rule,
// or bf16 as given), ids and weights into this rank's buffer; the last item to finish writes the
// count into every rank and arrives there. FP8 rows are quantized by groups of threads, a token
// each at a time, so that one row's round trips do not leave the rest of the CTA idle.
__device__ __forceinline__ void publish_item(const EpFusedParams& p, FrontScratch& s, const ForwardItems& items,
                                             const Timeline& timeline, int item) {
  const layout::EpFusedLayout& l = p.layout;
  const int first = item * p.publish_tokens, end = min(p.num_tokens, first + p.publish_tokens);
  const int k = l.top_k;
  const auto x_row = [&](int t) { return p.x + static_cast<size_t>(t) * (l.hidden / 8); };
  if (l.fp8_rows) {
    const int group_threads = publish_group_threads(l.hidden), groups = kFrontThreads / group_threads;
    const int group = static_cast<int>(threadIdx.x) / group_threads;
    const int thread = static_cast<int>(threadIdx.x) % group_threads;
    // A group's trip count is the same in each of its warps (the quantizer shuffles over whole warps).
    for (int t = first + group; group < groups && t < end; t += groups) {
      uint4* codes = region_of<uint4>(p, p.rank, l.rows) + static_cast<size_t>(t) * (l.hidden / 16);
      float* scales = region_of<float>(p, p.rank, l.row_scales) + t;
      ep_detail::block_quantize_row(x_row(t), &codes, &scales, 1, l.hidden,
                                    static_cast<size_t>(l.max_tokens_per_rank), p.ue8m0, thread, group_threads);
    }
  } else {
    for (int t = first; t < end; ++t) {
      uint4* copy = region_of<uint4>(p, p.rank, l.rows) + static_cast<size_t>(t) * (l.hidden / 8);
      ep_detail::block_copy_row(x_row(t), &copy, 1, l.hidden / 8);
    }
  }
  // A slot that routes nowhere is published as -1 (the staged layer's rule), so that whoever reads
  // the ids (the owners' route items, this rank's reduce) sees which slots have a row; the slots
  // whose id is invalid (out of range, or repeating an earlier slot) are counted here, once.
  int invalid = 0;
  for (long slot = static_cast<long>(first) * k + threadIdx.x; slot < static_cast<long>(end) * k; slot += blockDim.x) {
    bool bad = false;
    region_of<int32_t>(p, p.rank, l.ids)[slot] = layout::ep_slot_expert(p.topk_ids, k, p.num_experts, slot, &bad);
    region_of<float>(p, p.rank, l.weights)[slot] = p.topk_weights[slot];
    invalid += bad;
  }
  if (invalid > 0) atomicAdd(p.error_flags, invalid);
  if (!last_to_finish(ep_counter(items, kPublishItemsDone), static_cast<uint32_t>(p.publish_items), &s.last)) {
    return;
  }
  if (threadIdx.x < l.world_size && !rank_fault_seen(p.fault)) {
    region_of<int32_t>(p, threadIdx.x, l.counts_in)[p.rank] = p.num_tokens;
  }
  __syncthreads();
  __threadfence_system();
  if (threadIdx.x == 0) arrive_everywhere(p, l.published);
  timeline.mark(layout::kEpPublished);
}

// Virtual token v by one warp: its source's publication acquired (lane 0), its slots as this
// rank's local experts written into the routing's tables and counted. A slot past its source's
// count is left as it is: the gather and the combine never read it.
__device__ __forceinline__ void route_virtual_token(const RoutingParams& r, const EpFusedParams& p, long v, int lane) {
  const layout::EpFusedLayout& l = p.layout;
  const int source = static_cast<int>(v / l.max_tokens_per_rank);
  const int t = static_cast<int>(v % l.max_tokens_per_rank);
  int count = 0;
  if (lane == 0) {
    const uint64_t* arrivals = region_of<const uint64_t>(p, p.rank, l.published) + source;
    if (wait_for_peer(arrivals, source, this_call(p), p.timeout_ns, p.fault) == PeerWait::arrived) {
      count = region_of<const int32_t>(p, p.rank, l.counts_in)[source];
    }
  }
  __syncwarp();  // the other lanes' loads of the source's ids come after lane 0's acquire
  count = __shfl_sync(0xffffffffu, count, 0);
  if (t >= count) return;
  const int k = l.top_k;
  int id = -1;
  float weight = 0.0f;
  if (lane < k) {
    id = region_of<const int32_t>(p, source, l.ids)[static_cast<size_t>(t) * k + lane];
    weight = region_of<const float>(p, source, l.weights)[static_cast<size_t>(t) * k + lane];
  }
  // Invalid ids (counted by their source) and slots of other ranks' experts route nowhere here.
  const bool duplicate = repeats_an_earlier_slot(id, lane, k);
  const bool mine = id >= 0 && id < p.num_experts && !duplicate && id / l.experts_per_rank == p.rank;
  const int local = mine ? id % l.experts_per_rank : -1;
  if (lane < k) {
    const size_t slot = static_cast<size_t>(v) * k + lane;
    r.routed_ids[slot] = local;
    r.routed_weights[slot] = weight;
    r.slot_rank[slot] = local >= 0 ? atomicAdd(&r.expert_counts[local], 1) : -1;
  }
}

// The combine's chunks per source, from every source's count (the last route item, after every
// publication was acquired or given up on): this rank's source_counts, and chunk_prefix with the
// tokens a chunk takes in its last entry.
__device__ __forceinline__ void lay_out_combine_chunks(const EpFusedParams& p) {
  if (threadIdx.x != 0) return;
  const layout::EpFusedLayout& l = p.layout;
  int32_t* counts = region_of<int32_t>(p, p.rank, l.source_counts);
  int32_t* prefix = region_of<int32_t>(p, p.rank, l.chunk_prefix);
  long tokens = 0;
  for (int source = 0; source < l.world_size; ++source) {
    counts[source] = rank_fault_seen(p.fault) ? 0 : region_of<const int32_t>(p, p.rank, l.counts_in)[source];
    tokens += counts[source];
  }
  const int chunk_tokens = ep_chunk_tokens(tokens);
  int chunks = 0;
  for (int source = 0; source < l.world_size; ++source) {
    prefix[source] = chunks;
    chunks += (counts[source] + chunk_tokens - 1) / chunk_tokens;
  }
  prefix[l.world_size] = chunks;
  prefix[layout::EpFusedLayout::kChunkTokensEntry] = chunk_tokens;
}

// Route item `item`, the whole CTA: a virtual token per warp; returns whether this CTA published
// the routing (the last item to finish scans the segments).
__device__ __forceinline__ bool route_item(const FrontParams& f, const EpFusedParams& p, FrontScratch& s, int item) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const long v = static_cast<long>(item) * kFrontWarps + warp;
  f.timeline.mark(layout::kRouteItemClaimed);
  if (v < p.layout.virtual_tokens()) route_virtual_token(f.routing, p, v, lane);
  f.timeline.mark(layout::kRouteItemDone);  // thread 0's virtual token
  if (!last_to_finish(f.items.counter(kRoutedItems), f.items.route_items, &s.last)) return false;
  front_detail::scan_global_counts(f, s);
  lay_out_combine_chunks(p);
  front_detail::publish_routing(f);
  return true;
}

// Virtual token v (-1: none this round) by a group of kGatherGroupThreads threads (`thread` its index
// there, `sync` its barrier, `slot_rows` its row of the scratch): its pool slots, then its row from
// its source into each. Slots past their source's count (most of them, below max_tokens_per_rank
// tokens) route nowhere: the group takes only its barriers (the counts were laid out before the
// routing was published).
template <class Sync>
__device__ __forceinline__ void gather_virtual_token(const GatherParams& g, const EpFusedParams& p, int32_t* slot_rows,
                                                     int v, int thread, Sync sync) {
  const layout::EpFusedLayout& l = p.layout;
  const int32_t* counts = region_of<const int32_t>(p, p.rank, l.source_counts);
  const bool live = v >= 0 && v % l.max_tokens_per_rank < counts[v / l.max_tokens_per_rank];
  if (live && thread < g.top_k) slot_rows[thread] = place_slot(g, v, thread);
  sync();
  bool used = false;
  for (int j = 0; live && j < g.top_k; ++j) used |= slot_rows[j] >= 0;
  if (used && !rank_fault_seen(p.fault)) {
    const int source = v / l.max_tokens_per_rank;
    const size_t t = static_cast<size_t>(v % l.max_tokens_per_rank);
    const uint4* row = reinterpret_cast<const uint4*>(region_of<const char>(p, source, l.rows) + t * l.row_bytes());
    if (l.fp8_rows) {
      copy_row_to_slots<kGatherGroupThreads, true>(g, slot_rows, row, l.hidden / 16,
                                                   region_of<const float>(p, source, l.row_scales) + t,
                                                   static_cast<size_t>(l.max_tokens_per_rank), thread);
    } else {
      copy_row_to_slots<kGatherGroupThreads, false>(g, slot_rows, row, l.hidden / 8, nullptr, 0, thread);
    }
  }
  sync();  // slot_rows is rewritten by the group's next token
}

}  // namespace ep_fused_detail

// The front role, every thread of the CTA: publish, route and gather items until none is left;
// returns once the expert segments are published.
__device__ __forceinline__ void ep_front_items(const FrontParams& f, const EpFusedParams& p, FrontScratch& s) {
  const ForwardItems& items = f.items;
  const int publish = p.publish_items, routes = publish + items.route_items;
  bool routing_seen = false;
  for (;;) {
    const int ticket = front_detail::claim_ticket(items, s);
    if (ticket >= routes + items.gather_items) break;
    if (ticket < publish) {
      ep_fused_detail::publish_item(p, s, items, f.timeline, ticket);
      continue;
    }
    if (ticket < routes) {
      routing_seen |= ep_fused_detail::route_item(f, p, s, ticket - publish);
      continue;
    }
    if (!routing_seen) front_detail::wait_for(items, kRoutingReady, 1);
    routing_seen = true;
    const int first = (ticket - routes) * items.gather_tokens;
    const int end = static_cast<int>(min(static_cast<long>(first + items.gather_tokens), p.layout.virtual_tokens()));
    front_detail::gather_by_groups_and_publish(f, first, end, [&](int v, int group, int thread, auto group_sync) {
      ep_fused_detail::gather_virtual_token(f.gather, p, s.slot_rows[group], v, thread, group_sync);
    });
  }
  if (!routing_seen) front_detail::wait_for(items, kRoutingReady, 1);
  f.timeline.mark(layout::kFrontDone);
}

// Where a virtual token's partial sum goes: its source's `returned` region, at this rank's row of
// the token; with FP8 partial sums this rank's own `returned` region at the token's virtual row,
// from where a remote source's rows are quantized (the source's own row is the same place as
// without). Only tokens with a slot here are stored, and nothing after a fault.
struct EpPartialSumRows {
  static constexpr bool kRoutedOnly = true;
  const EpFusedParams* p;
  __device__ __forceinline__ __nv_bfloat16* row(const CombineParams&, int v) const {
    if (rank_fault_seen(p->fault)) return nullptr;
    const layout::EpFusedLayout& l = p->layout;
    if (l.fp8_partials) {
      return ep_fused_detail::region_of<__nv_bfloat16>(*p, p->rank, l.returned) + static_cast<size_t>(v) * l.hidden;
    }
    const int source = v / l.max_tokens_per_rank, t = v % l.max_tokens_per_rank;
    return ep_fused_detail::region_of<__nv_bfloat16>(*p, source, l.returned) +
           (static_cast<size_t>(p->rank) * l.max_tokens_per_rank + t) * l.hidden;
  }
};

namespace ep_fused_detail {

// The math threads' next chunk from `claimed` (the same in every math thread), or -1 past `chunks`.
__device__ __forceinline__ int claim_chunk(uint32_t* claimed, int chunks, int math_thread, int math_threads,
                                           int* shared_chunk) {
  if (math_thread == 0) {
    const int chunk = static_cast<int>(atomicAdd(claimed, 1u));
    *shared_chunk = chunk < chunks ? chunk : -1;
  }
  ptx::named_barrier_sync(static_cast<uint32_t>(NamedBarrier::kEpChunkClaimed), static_cast<uint32_t>(math_threads));
  // Rewritten by the next claim only after every math thread passed a barrier past this read.
  return *shared_chunk;
}

// The virtual tokens [first, end) of combine chunk `chunk`, all of one source.
struct ChunkTokens {
  int source;
  long first, end;
};
__device__ __forceinline__ ChunkTokens chunk_tokens(const EpFusedParams& p, int chunk) {
  const int32_t* prefix = region_of<const int32_t>(p, p.rank, p.layout.chunk_prefix);
  const int per_chunk = prefix[layout::EpFusedLayout::kChunkTokensEntry];
  int source = 0;
  while (prefix[source + 1] <= chunk) ++source;
  const long source_first = static_cast<long>(source) * p.layout.max_tokens_per_rank;
  const long first = source_first + static_cast<long>(chunk - prefix[source]) * per_chunk;
  const int count = region_of<const int32_t>(p, p.rank, p.layout.source_counts)[source];
  return ChunkTokens{source, first, min(first + per_chunk, source_first + count)};
}

// This math thread's output vectors of the tokens [first, end): vector first * H/8 + math_thread +
// i * math_threads for i < count.
struct ChunkVectors {
  long first;
  int count;
  int stride;
};
__device__ __forceinline__ ChunkVectors chunk_vectors(int hidden, long first_token, long end_token, int math_thread,
                                                      int math_threads) {
  const int vectors_per_token = hidden / Bf16x8Sum::kChannels;
  const long first = first_token * vectors_per_token + math_thread, end = end_token * vectors_per_token;
  return {first, first < end ? static_cast<int>((end - first + math_threads - 1) / math_threads) : 0, math_threads};
}

// The vectors of `tokens` (rows of `c`'s tables) summed from their slot rows staged in `staged`
// (combine_staged_vectors) into `output`.
template <class Output>
__device__ __forceinline__ void combine_tokens_staged(const CombineParams& c, const combine_detail::StagedRows& staged,
                                                      long first_token, long end_token, int math_thread,
                                                      int math_threads, const Output& output) {
  const ChunkVectors v = chunk_vectors(c.hidden, first_token, end_token, math_thread, math_threads);
  const auto place = [&](int i) { return combine_detail::vector_place(c, v.first + static_cast<long>(i) * v.stride); };
  combine_staged_vectors(c, staged, v.count, place, output);
}

// A combine chunk's virtual tokens, of one source (none after a fault: a lost peer's buffer may be
// gone).
__device__ __forceinline__ void combine_chunk(const CombineParams& c, const EpFusedParams& p, const ChunkTokens& tokens,
                                              const combine_detail::StagedRows& staged, int math_thread,
                                              int math_threads) {
  if (rank_fault_seen(p.fault)) return;
  combine_tokens_staged(c, staged, tokens.first, tokens.end, math_thread, math_threads, EpPartialSumRows{&p});
}

// FP8 partial sums: a combine chunk's rows, of a remote source, which the math threads stored here
// (a barrier between), quantized once per 128 channels (the staged layer's rule and code) into the
// source's returned_codes and returned_scales at this rank's row of the token; a token without a
// slot here has no row.
__device__ __forceinline__ void quantize_chunk(const CombineParams& c, const EpFusedParams& p,
                                               const ChunkTokens& tokens, int math_thread, int math_threads) {
  const layout::EpFusedLayout& l = p.layout;
  for (long v = tokens.first; v < tokens.end; ++v) {
    bool used = false;
    for (int j = 0; j < c.top_k; ++j) used |= c.routed_ids[v * c.top_k + j] >= 0;
    if (!used) continue;  // the same for every math thread: the trip counts stay uniform
    // A fault seen by any lane stops the whole warp (the quantizer shuffles over full warps), and
    // no row goes to a peer after it; warps may part here (no barrier inside).
    if (__any_sync(0xffffffffu, rank_fault_seen(p.fault))) return;
    const size_t t = static_cast<size_t>(v % l.max_tokens_per_rank);
    const size_t remote_row = static_cast<size_t>(p.rank) * l.max_tokens_per_rank + t;
    const uint4* row = region_of<const uint4>(p, p.rank, l.returned) + static_cast<size_t>(v) * (l.hidden / 8);
    quantize_partial_sum_row(row, region_of<uint4>(p, tokens.source, l.returned_codes) + remote_row * (l.hidden / 16),
                             region_of<float>(p, tokens.source, l.returned_scales) + remote_row * (l.hidden / 128),
                             l.hidden, math_thread, math_threads);
  }
}

// fc2_stores: this rank's tokens as the single-GPU combine sees them, their expert rows stored here
// by the owners' FC2 epilogues and their ids published with -1 for the slots that route nowhere.
__device__ __forceinline__ CombineParams own_expert_rows(const EpFusedParams& p) {
  const layout::EpFusedLayout& l = p.layout;
  CombineParams c{};
  c.num_tokens = p.num_tokens;
  c.top_k = l.top_k;
  c.hidden = l.hidden;
  c.routed_ids = region_of<const int32_t>(p, p.rank, l.ids);
  c.routed_weights = p.topk_weights;
  c.slot_outputs = region_of<const __nv_bfloat16>(p, p.rank, l.expert_rows);
  c.y = p.y;
  return c;
}

// Vectors a thread of the reduce sums at once, their owners' rows in flight together: with one
// owner (one rank, or a token routed to one rank's experts) a vector is a single load.
inline constexpr int kReduceBatch = 4;

// This rank's tokens [first, end) of a reduce chunk.
struct ReduceTokens {
  int first, end;
};

// Reduce chunk `chunk` of `tokens` a chunk: this rank's tokens into y: each owner's partial sum (the
// owners its ids name, found once a token into `s.owners`) in rank order, or with fc2_stores the
// token's expert rows, weighted, in slot order (the single-GPU combine, staged in `staged`); NaN
// where not every owner arrived when this CTA waited (`s.arrived`): a vector is its sum or NaN,
// never a sum of what did not arrive. Every math thread takes the barrier inside alike.
__device__ __forceinline__ void reduce_chunk(const EpFusedParams& p, ReduceTokens tokens, EpBackScratch& s,
                                             const combine_detail::StagedRows& staged, int math_thread,
                                             int math_threads) {
  const layout::EpFusedLayout& l = p.layout;
  const ChunkVectors v = chunk_vectors(l.hidden, tokens.first, tokens.end, math_thread, math_threads);
  uint4* y = reinterpret_cast<uint4*>(p.y);
  if (!s.arrived) {
    for (int i = 0; i < v.count; ++i) {
      y[v.first + static_cast<long>(i) * v.stride] = make_uint4(0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu);
    }
    return;
  }
  if (l.fc2_stores) {
    combine_tokens_staged(own_expert_rows(p), staged, tokens.first, tokens.end, math_thread, math_threads,
                          CombineIntoY{});
    return;
  }
  // A token's owners from the ids its publish items wrote (-1 where a slot routes nowhere, the
  // staged rule of ep_token_destinations): independent loads, no search for repeated ids.
  if (math_thread < tokens.end - tokens.first) {
    const int32_t* ids =
        region_of<const int32_t>(p, p.rank, l.ids) + static_cast<size_t>(tokens.first + math_thread) * l.top_k;
    uint64_t owners = 0;
#pragma unroll 8
    for (int j = 0; j < l.top_k; ++j) {
      const int id = ids[j];
      if (id >= 0) owners |= uint64_t{1} << (id / l.experts_per_rank);
    }
    s.owners[math_thread] = owners;
  }
  ptx::named_barrier_sync(static_cast<uint32_t>(NamedBarrier::kEpChunkStored), static_cast<uint32_t>(math_threads));
  const int vectors_per_token = l.hidden / Bf16x8Sum::kChannels;
  // Owner o's partial sum of this rank's token t, at [o][t] of this rank's returned region.
  const auto partial_row = [&](int owner, int t) {
    return static_cast<size_t>(owner) * l.max_tokens_per_rank + t;
  };
  if (l.fp8_partials) {
    const size_t blocks = l.hidden / 128;
    for (int i = 0; i < v.count; ++i) {
      const long index = v.first + static_cast<long>(i) * v.stride;
      const int t = static_cast<int>(index / vectors_per_token), vector = static_cast<int>(index % vectors_per_token);
      const uint64_t owners = s.owners[t - tokens.first];
      Bf16x8Sum sum;
      add_fp8_partials_in_rank_order(
          sum, l.world_size, p.rank, [&](int owner, const uint4*& own, const uint2*& codes, const float*& scale) {
            if (!((owners >> owner) & 1u)) return false;
            const size_t row = partial_row(owner, t);
            own = region_of<const uint4>(p, p.rank, l.returned) + row * vectors_per_token + vector;
            codes = region_of<const uint2>(p, p.rank, l.returned_codes) + row * vectors_per_token + vector;
            scale = region_of<const float>(p, p.rank, l.returned_scales) + row * blocks + vector / 16;
            return true;
          });
      y[index] = sum.rounded();
    }
    return;
  }
  // bf16 partial sums: kReduceBatch vectors a thread, up to four owners' rows of each in flight at once.
  const uint4* returned = region_of<const uint4>(p, p.rank, l.returned);
  for (int i = 0; i < v.count; i += kReduceBatch) {
    Bf16x8Sum sum[kReduceBatch];
    add_rows_batched<kReduceBatch, 4>(sum, l.world_size, [&](int b, int owner, const uint4*& row, float& weight) {
      if (i + b >= v.count) return;
      const long index = v.first + static_cast<long>(i + b) * v.stride;
      const int t = static_cast<int>(index / vectors_per_token);
      if (!((s.owners[t - tokens.first] >> owner) & 1u)) return;
      row = returned + partial_row(owner, t) * vectors_per_token + index % vectors_per_token;
      weight = 1.0f;
    });
#pragma unroll
    for (int b = 0; b < kReduceBatch; ++b) {
      if (i + b < v.count) y[v.first + static_cast<long>(i + b) * v.stride] = sum[b].rounded();
    }
  }
}

// Claimed combine chunks, once every FC2 tile is stored: each owner's partial sums into their
// sources (EpCombine::owner_sums), their slot rows staged in `staged`; the CTA that completes the
// last chunk arrives at every source.
__device__ __forceinline__ void send_partial_sums(const CombineParams& c, const EpFusedParams& p,
                                                  const ForwardItems& items, const Timeline& timeline,
                                                  const combine_detail::StagedRows& staged, int math_thread,
                                                  int math_threads, int* shared_chunk) {
  const auto stored = static_cast<uint32_t>(NamedBarrier::kEpChunkStored);
  const int lead = static_cast<int>(threadIdx.x) - math_thread;  // the timeline's marking thread
  const int combine_chunks = region_of<const int32_t>(p, p.rank, p.layout.chunk_prefix)[p.layout.world_size];
  for (;;) {
    const int chunk =
        claim_chunk(ep_counter(items, kCombineChunksClaimed), combine_chunks, math_thread, math_threads, shared_chunk);
    if (chunk < 0) break;
    const ChunkTokens tokens = chunk_tokens(p, chunk);
    combine_chunk(c, p, tokens, staged, math_thread, math_threads);
    // A remote source's rows, stored here by every math thread, quantized for it (its own stay bf16).
    if (p.layout.fp8_partials && tokens.source != p.rank) {
      ptx::named_barrier_sync(stored, static_cast<uint32_t>(math_threads));
      quantize_chunk(c, p, tokens, math_thread, math_threads);
    }
    __threadfence_system();  // this thread's stores into the sources' buffers, before the count
    ptx::named_barrier_sync(stored, static_cast<uint32_t>(math_threads));
    if (math_thread == 0 &&
        atomicAdd(ep_counter(items, kCombineChunksDone), 1u) + 1 == static_cast<uint32_t>(combine_chunks)) {
      __threadfence_system();
      arrive_everywhere(p, p.layout.returned_from);
      timeline.mark(layout::kEpPartialSumsSent, lead);
    }
  }
  // A rank with no token to combine here still arrives, once (the claim that found none first).
  if (combine_chunks == 0 && math_thread == 0 && atomicAdd(ep_counter(items, kCombineChunksDone), 1u) == 0) {
    arrive_everywhere(p, p.layout.returned_from);
    timeline.mark(layout::kEpPartialSumsSent, lead);
  }
}

}  // namespace ep_fused_detail

// The role after the GEMMs, by the math threads: once every FC2 tile is stored, the owner's
// partial sums go to their sources in claimed combine chunks, or with fc2_stores (whose FC2 tiles
// stored their rows in the sources, each fenced at system scope) one CTA arrives at every source
// at once; then claimed reduce chunks once every owner has arrived here. `staging` is the idle
// stage ring: slot rows are staged there, and its reserve holds the role's shared state.
__device__ __forceinline__ void ep_back_role(const CombineParams& c, const EpFusedParams& p, const ForwardItems& items,
                                             const Timeline& timeline, uint32_t fc2_tiles,
                                             const CombineStaging& staging, int math_thread, int math_threads) {
  using namespace ep_fused_detail;
  const int rows_bytes = (staging.size - kCombineStagingReserve) & ~15;
  EpBackScratch& s = *reinterpret_cast<EpBackScratch*>(staging.bytes + rows_bytes);
  const combine_detail::StagedRows staged(CombineStaging{staging.bytes, rows_bytes}, math_thread, math_threads,
                                          p.layout.top_k);
  const auto stored = static_cast<uint32_t>(NamedBarrier::kEpChunkStored);
  const int lead = static_cast<int>(threadIdx.x) - math_thread;  // the timeline's marking thread
  if (math_thread == 0) {
    ptx::wait_until([&] { return ptx::ld_acquire_gpu(items.counter(kFc2TilesStored)) >= fc2_tiles; }, 64);
  }
  timeline.mark(layout::kCombineStarted, lead);
  // Every math thread is done with the stage ring before any stages a row in it (and the first
  // claim below writes the scratch).
  ptx::named_barrier_sync(stored, static_cast<uint32_t>(math_threads));
  if (!p.layout.fc2_stores) {
    send_partial_sums(c, p, items, timeline, staged, math_thread, math_threads, &s.chunk);
  } else if (math_thread == 0 && atomicAdd(ep_counter(items, kCombineChunksDone), 1u) == 0) {
    __threadfence_system();
    arrive_everywhere(p, p.layout.returned_from);
    timeline.mark(layout::kEpPartialSumsSent, lead);
  }
  // Every math thread has read the last claim before the next one rewrites the word; the owners'
  // partial sums are acquired (or given up on) by the first math thread.
  if (math_thread == 0) s.arrived = all_arrived(p, p.layout.returned_from);
  timeline.mark(layout::kEpOwnersArrived, lead);
  ptx::named_barrier_sync(stored, static_cast<uint32_t>(math_threads));
  const int per_chunk = ep_chunk_tokens(p.num_tokens);
  const int reduce_chunks = (p.num_tokens + per_chunk - 1) / per_chunk;
  for (;;) {
    const int chunk =
        claim_chunk(ep_counter(items, kReduceChunksClaimed), reduce_chunks, math_thread, math_threads, &s.chunk);
    if (chunk < 0) break;
    reduce_chunk(p, ReduceTokens{chunk * per_chunk, min(p.num_tokens, (chunk + 1) * per_chunk)}, s, staged,
                 math_thread, math_threads);
    ptx::named_barrier_sync(stored, static_cast<uint32_t>(math_threads));
  }
}

}  // namespace megamoe::kernels
