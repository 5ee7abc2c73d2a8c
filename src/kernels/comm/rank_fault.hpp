// What a rank's cross-rank barriers record when one gives up (kernels/comm/rank_barrier.cuh): one
// struct in device memory, read by the host (comm::EpLayer::check_peers). Zero while every peer
// keeps up; once set it stays, since the ranks' barrier counts no longer pair up.
#pragma once

#include <cstdint>

namespace megamoe::kernels {

struct RankFault {
  uint32_t failed;     // 1 once a barrier gave up
  int32_t peer;        // the peer it gave up on first
  uint64_t epoch;      // that barrier's number (1 for the first barrier of the layer's life)
  uint64_t seen;       // the peer's arrivals by then
  uint64_t waited_ns;  // how long it waited
};

}  // namespace megamoe::kernels
