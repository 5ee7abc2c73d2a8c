// A diagnostic timeline of a chain of small kernels: at named points, thread 0 of every block
// folds the global timer into the earliest and the latest time any block reached that point, so a
// host tool sees where the chain's time goes across kernels and blocks (megamoe-ep-bench
// --timeline, megamoe-bench --breakdown of the single kernel). Off (a null stamp array, the
// default) it costs one branch per point.
#pragma once

#include <cstdint>

#include "kernels/ptx/timer.cuh"

namespace megamoe::kernels {

struct Timeline {
  // [event][2]: earliest and latest ns; the host sets them to UINT64_MAX and 0 before a call.
  unsigned long long* stamps = nullptr;

  // By thread `thread` of each block that passes the point (a role's first thread).
  __device__ __forceinline__ void mark(int event, int thread = 0) const {
    if (stamps == nullptr || static_cast<int>(threadIdx.x) != thread) return;
    const unsigned long long now = ptx::global_timer_ns();
    atomicMin(&stamps[2 * event], now);
    atomicMax(&stamps[2 * event + 1], now);
  }
};

}  // namespace megamoe::kernels
