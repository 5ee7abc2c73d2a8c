// Named barriers, register reallocation and the thread's index (PTX "bar.sync", "setmaxnreg",
// %tid).
#pragma once

#include <cstdint>

namespace megamoe::ptx {

// Synchronizes `threads` threads (a multiple of 32) on hardware barrier `id`; id 0 is
// __syncthreads(), so kernels name theirs from 1 (see NamedBarrier in each kernel).
__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// The same for threads that reach the barrier from different places in the code (PTX
// "barrier.sync" without .aligned, which bar.sync implies: an aligned barrier must be the same
// instruction in every thread that executes it).
__device__ __forceinline__ void named_barrier_sync_from_anywhere(uint32_t id, uint32_t threads) {
  asm volatile("barrier.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// threadIdx.x read from its special register each call. Roles whose registers are tight after
// `setmaxnreg` call this where they need their index once a tile: the compiler may not keep a
// volatile read's value, so it cannot hold the index (and values derived from it) in registers
// through the mainloop, which spilled them to local memory (docs/design.md#single-kernel-token-tiles).
__device__ __forceinline__ uint32_t thread_index_x() {
  uint32_t index;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(index));
  return index;
}

template <uint32_t kRegisters>
__device__ __forceinline__ void setmaxnreg_increase() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegisters));
}

template <uint32_t kRegisters>
__device__ __forceinline__ void setmaxnreg_decrease() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegisters));
}

}  // namespace megamoe::ptx
