// Memory wrappers: ordering (PTX ISA "ld", "st", "red" with .sem and .scope qualifiers) for flags
// that other ranks (system scope) or other CTAs (gpu scope) read and write, and cache prefetch.
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

__device__ __forceinline__ void red_add_release_sys(uint32_t* address, uint32_t value) {
  asm volatile("red.release.sys.global.add.u32 [%0], %1;" ::"l"(address), "r"(value) : "memory");
}

__device__ __forceinline__ void red_add_release_gpu(uint32_t* address, uint32_t value) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(address), "r"(value) : "memory");
}

// A count that orders nothing (a hint of progress another CTA paces itself by), and its read.
__device__ __forceinline__ void red_add_relaxed_gpu(uint32_t* address, uint32_t value) {
  asm volatile("red.relaxed.gpu.global.add.u32 [%0], %1;" ::"l"(address), "r"(value) : "memory");
}

__device__ __forceinline__ uint32_t ld_relaxed_gpu(const uint32_t* address) {
  uint32_t value;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(value) : "l"(address) : "memory");
  return value;
}

__device__ __forceinline__ uint32_t ld_acquire_gpu(const uint32_t* address) {
  uint32_t value;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(value) : "l"(address) : "memory");
  return value;
}

// Orders this thread's global accesses through the generic proxy (ld, st) with those through the
// async proxy (TMA), both ways: data written with st.global and read by a TMA load elsewhere needs
// one on each side of the release/acquire that hands it over.
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

// The same for shared memory: bytes cp.async (generic proxy) put into a stage, made visible to the
// wgmma (async proxy) that reads them after the stage's barrier.
__device__ __forceinline__ void fence_proxy_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// An L2 eviction policy (PTX "createpolicy") for the accesses that take one: their lines go first
// when L2 evicts.
__device__ __forceinline__ uint64_t l2_policy_evict_first() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

// A 16-byte load under an L2 policy. Volatile, so that it stays after the dependency wait of the
// kernel that reads what an earlier grid wrote (the asm names no memory operand to order it by).
__device__ __forceinline__ uint4 ld_global_v4(const void* address, uint64_t l2_policy) {
  uint4 v;
  asm volatile("ld.global.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(address), "l"(l2_policy));
  return v;
}

// Starts bringing the line holding `address` into this SM's L1; does not wait for it.
__device__ __forceinline__ void prefetch_l1(const void* address) {
  asm volatile("prefetch.global.L1 [%0];" ::"l"(address));
}

}  // namespace megamoe::ptx
