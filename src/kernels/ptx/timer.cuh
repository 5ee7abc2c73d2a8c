// The GPU's global nanosecond timer (PTX special register %globaltimer), for timelines that
// compare blocks and kernels of one GPU (clock64 counts one SM's cycles only).
#pragma once

#include <cstdint>

namespace megamoe::ptx {

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t ns;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  return ns;
}

}  // namespace megamoe::ptx
