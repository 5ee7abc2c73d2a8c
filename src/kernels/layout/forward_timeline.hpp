// The points of a single-kernel forward (impls/sm90_moe_single_kernel.cuh) that the diagnostic
// timeline marks (kernels/pipeline/timeline.cuh), in the order a CTA passes them; the host tools
// print them by these names (megamoe-bench --breakdown; megamoe-ep-bench --fused --timeline, where
// the kernel is one rank's expert-parallel forward and passes the "ep" points too).
#pragma once

namespace megamoe::layout {

enum ForwardTimelineEvent : int {
  kForwardStart,       // every CTA, after the previous kernel
  kEpPublished,        // expert parallelism: the last publish item, its count and arrivals sent (or
                       // given up on after a fault)
  kRouteItemClaimed,   // each route item, its ticket back
  kRouteItemDone,      // each route item, thread 0's token routed and counted
  kRoutingPublished,   // the scanning CTA, the expert segments published
  kGatherItemDone,     // each gather item (or the lone route item's gather), its rows published
  kFrontDone,          // every CTA, leaving the front role: the routing published
  kFc1Streamed,        // every CTA's weight producer, its last FC1 stage issued
  kFc1Done,            // every CTA's math warpgroups, their last FC1 tile stored
  kFc2Started,         // every CTA, its stage ring set up for FC2
  kFc2Streamed,        // every CTA's weight producer, its last FC2 stage issued
  kFc2Done,            // every CTA's math warpgroups, their last FC2 tile stored
  kCombineStarted,     // every CTA's math warpgroups, every FC2 tile seen stored
  kEpPartialSumsSent,  // expert parallelism: the last combine chunk's CTA, its arrivals at every
                       // source sent (or given up on after a fault)
  kEpOwnersArrived,    // expert parallelism: every CTA's math warpgroups, every owner's arrival
                       // acquired (or given up on after a fault)
  kCombineDone,        // every CTA's math warpgroups, their share of the combine stored
  kForwardDone,        // the last CTA past its last counter access, the counters zeroed for the next
                       // forward (single GPU: before that CTA's combine share, which overlaps it)
  kForwardTimelineEvents
};

inline constexpr const char* kForwardTimelineEventNames[] = {
    "forward start", "ep published", "route item claimed", "route item done", "routing published",
    "gather item done", "front done", "fc1 streamed", "fc1 done",
    "fc2 started", "fc2 streamed", "fc2 done", "combine started", "ep partial sums sent",
    "ep owners arrived", "combine done", "forward done"};
static_assert(sizeof(kForwardTimelineEventNames) / sizeof(kForwardTimelineEventNames[0]) == kForwardTimelineEvents,
              "a name for every point");

}  // namespace megamoe::layout
