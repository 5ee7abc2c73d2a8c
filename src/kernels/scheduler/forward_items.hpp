// The work of the single-kernel forward (docs/design.md#single-kernel-forward) and the counters
// that hand it from stage to stage. Every CTA claims its work from global counters, in the order
// the stages depend on each other:
//   front items    route items (kFrontWarps tokens each; the last to finish scans the expert
//                  segments), then gather items (gather_tokens tokens each); where one route
//                  item holds at most kLoneGatherTokens tokens, it gathers them itself and there
//                  are no gather items
//   FC1 tiles      claimed after the routing is published (GroupedTileScheduler, first_wave 0)
//   FC2 tiles      claimed once FC1's are all claimed; each waits for FC1's tiles of its expert
//   combine        after every FC2 tile is stored, each CTA its fixed share of the output
//                  (combine/combine_share.cuh): nothing waits for it, so it needs no claim
// A CTA moves to the next kind of work only when its claim finds none of the current kind left,
// so every item that some work waits for has been claimed by a CTA that is running and that
// waits only on items claimed before it: the forward needs no grid-wide barrier, and CTAs that
// are not resident (SMs held by another stream's kernel) slow it down but cannot hang it.
// Plain C++ as well, for the CPU tests of how a forward is cut into items.
#pragma once

#include <cstdint>

#include "kernels/layout/moe_workspace.hpp"
#include "kernels/layout/weight_layout.hpp"

namespace megamoe::kernels {

inline constexpr int kFrontThreads = 384;              // the whole CTA (the GEMMs' block)
inline constexpr int kFrontWarps = kFrontThreads / 32;  // a route item's tokens: one per warp
inline constexpr int kGatherGroups = 3;                 // tokens a gather item quantizes at once
inline constexpr int kGatherGroupThreads = kFrontThreads / kGatherGroups;  // a token's threads there
static_assert(kFrontThreads % (32 * kGatherGroups) == 0, "a gather group is whole warps");

// The counters, zero between forwards: last_to_finish leaves kRoutedItems zero, and the last CTA
// to finish zeroes the others.
enum ForwardCounter : int {
  kFrontTickets,     // front items claimed (every CTA claims once past the last)
  kRoutedItems,      // route items finished
  kRoutingReady,     // 1 once the expert segments are published
  kGatheredItems,    // gather items finished (one, where the route item gathered)
  kFc2TilesStored,   // FC2 tiles stored
  kCtasDone,         // CTAs finished
  kForwardCounters,
};
static_assert(kForwardCounters <= layout::kForwardCounterSlots, "the workspace holds every counter");

struct ForwardItems {
  uint32_t* counters;  // [kForwardCounters]
  int route_items;
  int gather_items;
  int gather_tokens;

  MEGAMOE_HOST_DEVICE uint32_t* counter(ForwardCounter c) const { return counters + c; }
  // What FC1's token producer waits for: every gather item, or the one route item's gather.
  MEGAMOE_HOST_DEVICE uint32_t gathered_when_ready() const {
    return static_cast<uint32_t>(gather_items > 0 ? gather_items : 1);
  }
};

// Tokens a lone route item gathers itself: the CTA takes ~1.3 us per token (one H200, qwen35-a3b),
// about what handing the gather to other CTAs costs, so only a token or two stay with it.
inline constexpr int kLoneGatherTokens = 2;

// How a forward of `tokens` rows is cut into items on a grid of `ctas` CTAs.
// A gather item is about half a CTA's share of the tokens, at least one: a claim is an atomic
// round trip, and the items should still spread over every CTA.
inline ForwardItems make_forward_items(uint32_t* counters, int tokens, int ctas) {
  ForwardItems items{};
  items.counters = counters;
  items.route_items = (tokens + kFrontWarps - 1) / kFrontWarps;
  items.gather_tokens = (tokens + 2 * ctas - 1) / (2 * ctas);
  const bool lone = items.route_items == 1 && tokens <= kLoneGatherTokens;
  items.gather_items = lone ? 0 : (tokens + items.gather_tokens - 1) / items.gather_tokens;
  return items;
}

}  // namespace megamoe::kernels
