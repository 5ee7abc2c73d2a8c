// cp.async wrappers (PTX ISA "cp.async", "cp.async.mbarrier.arrive", "cp.async.wait_group"): small
// global -> shared copies whose completion an mbarrier phase tracks together with the TMA bytes of
// the same stage, or a thread's own groups of them.
#pragma once

#include <cstdint>

#include "kernels/ptx/mbarrier.cuh"

namespace megamoe::ptx {

__device__ __forceinline__ void cp_async_4(void* smem_destination, const void* global_source) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem_address(smem_destination)), "l"(global_source)
               : "memory");
}

// 16 bytes past L1 (cp.async.cg), or 16 zero bytes where `fill` is false (source size 0: nothing
// is read, so `global_source` need only be some valid address).
__device__ __forceinline__ void cp_async_16_or_zero(void* smem_destination, const void* global_source, bool fill) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_address(smem_destination)),
               "l"(global_source), "r"(fill ? 16 : 0)
               : "memory");
}

// As above, the source's L2 lines under `l2_policy` (ptx::l2_policy_evict_first: read once).
__device__ __forceinline__ void cp_async_16_or_zero(void* smem_destination, const void* global_source, bool fill,
                                                    uint64_t l2_policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;" ::"r"(smem_address(smem_destination)),
               "l"(global_source), "r"(fill ? 16 : 0), "l"(l2_policy)
               : "memory");
}

// 4 bytes, or 4 zero bytes where `fill` is false.
__device__ __forceinline__ void cp_async_4_or_zero(void* smem_destination, const void* global_source, bool fill) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(smem_address(smem_destination)),
               "l"(global_source), "r"(fill ? 4 : 0)
               : "memory");
}

// `bytes` (a multiple of 16) from global to shared memory by the bulk-copy unit, counted against
// `barrier`'s transaction count (PTX "cp.async.bulk"): what a TMA load writes into a stage, without
// a tensor map.
__device__ __forceinline__ void bulk_copy_to_shared(void* smem_destination, const void* global_source, uint32_t bytes,
                                                    uint64_t* barrier) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_address(smem_destination)),
               "l"(global_source), "r"(bytes), "r"(smem_address(barrier))
               : "memory");
}

// Closes the group of this thread's cp.async issued since the last commit (PTX
// "cp.async.commit_group"): cp_async_wait_pending counts groups.
__device__ __forceinline__ void cp_async_commit_group() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// Waits until at most `pending` of this thread's committed groups, the newest, are still in flight
// (PTX "cp.async.wait_group", whose count is an immediate: one instruction per count up to
// kMaxPending, a larger `pending` waits as for kMaxPending).
template <int kMaxPending>
__device__ __forceinline__ void cp_async_wait_pending(int pending) {
  if constexpr (kMaxPending > 0) {
    if (pending < kMaxPending) return cp_async_wait_pending<kMaxPending - 1>(pending);
  }
  asm volatile("cp.async.wait_group %0;" ::"n"(kMaxPending) : "memory");
}

// One arrival on the current phase of `barrier`, made when every cp.async this thread issued so far
// has landed. The arrival is one of those the barrier was initialized to expect (.noinc): a
// barrier that also waits for TMA bytes counts it next to the arrive.expect_tx.
__device__ __forceinline__ void cp_async_mbarrier_arrive_noinc(uint64_t* barrier) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_address(barrier)) : "memory");
}

}  // namespace megamoe::ptx
