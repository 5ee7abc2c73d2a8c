// Front role of the single-kernel forward (scheduler/forward_items.hpp): the whole CTA takes route
// items and gather items until none is left. A route item routes one token per warp
// (route_token); the last route item to finish scans the expert segments and publishes them. A
// gather item waits for that publication and quantizes its tokens into the pool (kGatherGroups
// groups of threads, a token each at a time: gather_token_by_group), then publishes itself for
// FC1's token producers. Where one route item holds every token (a decode batch), it counts in
// shared memory and scans, and where those are at most kLoneGatherTokens it gathers them itself:
// no global counter and no hand-off between CTAs before FC1. A CTA leaves once no front item is
// left and the routing is published, while other CTAs may still gather: its FC1 weight stream
// needs only the expert segments, and FC1's token producer waits for the rows.
#pragma once

#include <cstdint>

#include "kernels/epilogue/gemm_op.hpp"
#include "kernels/layout/forward_timeline.hpp"
#include "kernels/permute/gather_quantize.cuh"
#include "kernels/pipeline/last_block.cuh"
#include "kernels/pipeline/timeline.cuh"
#include "kernels/ptx/mbarrier.cuh"
#include "kernels/ptx/memory.cuh"
#include "kernels/ptx/sync.cuh"
#include "kernels/routing/route_token.cuh"
#include "kernels/routing/routing_limits.hpp"
#include "kernels/scheduler/forward_items.hpp"

namespace megamoe::kernels {

// The front role's shared memory, laid over the GEMM stages (which are idle until it is done).
struct FrontScratch {
  float selection[kFrontWarps][kMaxRoutingExperts];  // route_token's rows, one per warp
  float scores[kFrontWarps][kMaxRoutingExperts];
  int32_t counts[kMaxRoutingExperts];                // expert counters of a lone route item
  int2 scan_sums[kFrontWarps];                       // scan_expert_segments' warp sums
  int32_t slot_rows[kGatherGroups][kMaxTopK];        // gather_token_by_group's, one row per group
  int ticket;
  bool last;
};

struct FrontParams {
  RoutingParams routing;
  GatherParams gather;
  ForwardItems items;
  Timeline timeline;  // diagnostic, off by default
};

namespace front_detail {

// Every thread: the next front item's ticket, the same in every thread.
__device__ __forceinline__ int claim_ticket(const ForwardItems& items, FrontScratch& s) {
  if (threadIdx.x == 0) s.ticket = static_cast<int>(atomicAdd(items.counter(kFrontTickets), 1u));
  __syncthreads();
  const int ticket = s.ticket;
  __syncthreads();
  return ticket;
}

// Every thread of the CTA, after a barrier that follows the writes (the scan's tables, the
// gather's rows): thread 0 publishes them with a release.
__device__ __forceinline__ void publish(uint32_t* counter) {
  if (threadIdx.x == 0) ptx::red_add_release_gpu(counter, 1u);
}

// Every thread: returns once `counter` reaches `count`.
__device__ __forceinline__ void wait_for(const ForwardItems& items, ForwardCounter counter, uint32_t count) {
  if (threadIdx.x == 0) ptx::wait_until([&] { return ptx::ld_acquire_gpu(items.counter(counter)) >= count; }, 64);
  __syncthreads();
}

// Every thread, once a gather item's tokens are in the pool: thread 0 publishes the item.
__device__ __forceinline__ void publish_gathered(const FrontParams& p) {
  ptx::fence_proxy_async_global();  // FC1 reads the rows by TMA
  __syncthreads();
  publish(p.items.counter(kGatheredItems));
  p.timeline.mark(layout::kGatherItemDone);
}

// Tokens [first, end) into the pool, one after another by the whole CTA (gather_one(token)), then
// published.
template <class GatherOne>
__device__ __forceinline__ void gather_and_publish(const FrontParams& p, int first, int end, GatherOne gather_one) {
  for (int token = first; token < end; ++token) gather_one(token);
  publish_gathered(p);
}

// Every thread: tokens [first, end) by kGatherGroups groups of kGatherGroupThreads threads, a
// token each at a time (gather_one(token, group, thread, sync): `thread` its index in the group,
// `sync` the group's barrier), then published. Every group runs every round, one without a token
// with token -1 (its barriers only): compute-sanitizer racecheck reported the next front item's
// ticket as racing where groups had taken their barriers different numbers of times.
template <class GatherOne>
__device__ __forceinline__ void gather_by_groups_and_publish(const FrontParams& p, int first, int end,
                                                             GatherOne gather_one) {
  const int group = static_cast<int>(threadIdx.x) / kGatherGroupThreads;
  const uint32_t barrier = static_cast<uint32_t>(NamedBarrier::kGatherGroupFirst) + group;
  // A group without a token branches past its loads and stores where the others do not, and an
  // aligned barrier requires every thread of the CTA to take the same branches to it: the unaligned
  // form.
  const auto group_sync = [barrier] { ptx::named_barrier_sync_from_anywhere(barrier, kGatherGroupThreads); };
  for (int round = first; round < end; round += kGatherGroups) {
    const int token = round + group < end ? round + group : -1;
    gather_one(token, group, static_cast<int>(threadIdx.x) % kGatherGroupThreads, group_sync);
  }
  publish_gathered(p);
}

// Every thread: the caller's tokens [first, end), quantized into the pool, then published. Items of
// at least kGatherGroups tokens are gathered by kGatherGroups groups of threads at once, a token
// each (a token's chain of round trips, x and its routing, then its pool rows, left the whole CTA
// waiting on it: docs/design.md#single-kernel-gather); fewer by the whole CTA, one after another.
template <Precision kPrecision>
__device__ __forceinline__ void gather_tokens(const FrontParams& p, FrontScratch& s, int first, int end) {
  const auto always = [] { return true; };
  if (end - first < kGatherGroups) {
    return gather_and_publish(p, first, end, [&](int token) {
      gather_token_by_block<kPrecision, kFrontThreads>(p.gather, token, s.slot_rows[0], always);
    });
  }
  gather_by_groups_and_publish(p, first, end, [&](int token, int group, int thread, auto group_sync) {
    gather_token_by_group<kPrecision, kGatherGroupThreads>(p.gather, token, s.slot_rows[group], thread, always,
                                                           group_sync);
  });
}

// The route item that finished last, every thread: the expert segments from the global counts.
__device__ __forceinline__ void scan_global_counts(const FrontParams& p, FrontScratch& s) {
  scan_expert_segments<kFrontThreads>(p.routing.expert_counts, p.routing.num_experts, p.routing.token_tile_rows,
                                      p.routing.expert_rows, p.routing.expert_offsets, p.routing.token_tile_prefix,
                                      p.routing.token_tile_expert, p.routing.gemm, s.scan_sums);
}

// Every thread, once the segments are written: they are published for the GEMMs' tile claims.
__device__ __forceinline__ void publish_routing(const FrontParams& p) {
  __syncthreads();
  publish(p.items.counter(kRoutingReady));
  p.timeline.mark(layout::kRoutingPublished);
}

// Returns whether this CTA published the routing.
template <Precision kPrecision>
__device__ __forceinline__ bool route_item(const FrontParams& p, FrontScratch& s, int item) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int valid = valid_tokens(p.routing.num_tokens, p.routing.num_valid_tokens);
  const int token = item * kFrontWarps + warp;
  p.timeline.mark(layout::kRouteItemClaimed);
  const bool alone = p.items.route_items == 1;
  if (alone) {
    for (int e = threadIdx.x; e < p.routing.num_experts; e += kFrontThreads) s.counts[e] = 0;
    __syncthreads();
  }
  if (token < valid) {
    route_token(p.routing, token, lane, s.selection[warp], s.scores[warp], alone ? s.counts : p.routing.expert_counts);
  }
  p.timeline.mark(layout::kRouteItemDone);  // thread 0's token
  // The route item that finishes last (or the lone one) scans the counts and publishes the segments.
  if (alone) {
    __syncthreads();
    scan_expert_segments<kFrontThreads, true>(s.counts, p.routing.num_experts, p.routing.token_tile_rows,
                                              p.routing.expert_rows, p.routing.expert_offsets,
                                              p.routing.token_tile_prefix, p.routing.token_tile_expert,
                                              p.routing.gemm, s.scan_sums);
  } else {
    if (!last_to_finish(p.items.counter(kRoutedItems), p.items.route_items, &s.last)) return false;
    scan_global_counts(p, s);
  }
  publish_routing(p);
  if (p.items.gather_items == 0) gather_tokens<kPrecision>(p, s, 0, valid);  // only a lone item has none
  return true;
}

template <Precision kPrecision>
__device__ __forceinline__ void gather_item(const FrontParams& p, FrontScratch& s, int item) {
  const int valid = valid_tokens(p.gather.num_tokens, p.gather.num_valid_tokens);
  const int first = item * p.items.gather_tokens;
  gather_tokens<kPrecision>(p, s, first, min(first + p.items.gather_tokens, valid));
}

}  // namespace front_detail

// Every thread of the CTA, with `s` laid over the GEMM stages. Returns once every front item is
// claimed and the expert segments are published, which the GEMMs' tile claims read.
template <Precision kPrecision>
__device__ __forceinline__ void front_items(const FrontParams& p, FrontScratch& s) {
  const ForwardItems& items = p.items;
  bool routing_seen = false;
  for (;;) {
    const int ticket = front_detail::claim_ticket(items, s);
    if (ticket >= items.route_items + items.gather_items) break;
    if (ticket < items.route_items) {
      routing_seen |= front_detail::route_item<kPrecision>(p, s, ticket);
      continue;
    }
    if (!routing_seen) front_detail::wait_for(items, kRoutingReady, 1);
    routing_seen = true;
    front_detail::gather_item<kPrecision>(p, s, ticket - items.route_items);
  }
  if (!routing_seen) front_detail::wait_for(items, kRoutingReady, 1);
  p.timeline.mark(layout::kFrontDone);
}

}  // namespace megamoe::kernels
