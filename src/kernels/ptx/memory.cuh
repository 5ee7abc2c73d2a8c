// Memory-ordering wrappers (PTX ISA "ld", "st", "red" with .sem and .scope qualifiers) for flags
// that other ranks (system scope) or other CTAs (gpu scope) read and write.
#pragma once

#include <cstdint>

namespace megamoe::ptx {

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* address) {
  uint64_t value;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(address) : "memory");
  return value;
}

__device__ __forceinline__ void red_add_release_sys(uint64_t* address, uint64_t value) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(address), "l"(value) : "memory");
}

__device__ __forceinline__ void red_add_release_gpu(uint32_t* address, uint32_t value) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(address), "r"(value) : "memory");
}

}  // namespace megamoe::ptx
