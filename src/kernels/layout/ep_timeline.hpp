// The points of an expert-parallel call that the diagnostic timeline marks (kernels/pipeline/
// timeline.cuh), in call order; the host tool prints them by these names.
#pragma once

namespace megamoe::layout {

enum EpTimelineEvent : int {
  kCountStart,          // count launch, every block, after the previous kernel
  kCountScanned,        // the last count block, before the count exchange's barrier
  kCountExchanged,      // the last count block, after it
  kPushStart,           // push launch, every block, after the count launch
  kPushRowsSent,        // push launch, every block, after its rows
  kPushDelivered,       // the last push block, after the barrier: every row has arrived
  kCombineBarrierStart, // the combine's barrier launch, after the local pass
  kCombineBarrierDone,
  kReduceStart,         // reduce launch, every block, after the barrier launch
  kReduceDone,          // every block, after its sums are stored
  kEpTimelineEvents
};

inline constexpr const char* kEpTimelineEventNames[] = {
    "count start", "count scanned", "count exchanged", "push start", "push rows sent", "push delivered",
    "combine barrier start", "combine barrier done", "reduce start", "reduce done"};
static_assert(sizeof(kEpTimelineEventNames) / sizeof(kEpTimelineEventNames[0]) == kEpTimelineEvents,
              "a name for every point");

}  // namespace megamoe::layout
