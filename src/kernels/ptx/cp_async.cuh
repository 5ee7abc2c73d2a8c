// cp.async wrappers (PTX ISA "cp.async", "cp.async.mbarrier.arrive"): small global -> shared
// copies whose completion an mbarrier phase tracks together with the TMA bytes of the same stage.
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

// One arrival on the current phase of `barrier`, made when every cp.async this thread issued so far
// has landed. The arrival is one of those the barrier was initialized to expect (.noinc): a
// barrier that also waits for TMA bytes counts it next to the arrive.expect_tx.
__device__ __forceinline__ void cp_async_mbarrier_arrive_noinc(uint64_t* barrier) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_address(barrier)) : "memory");
}

}  // namespace megamoe::ptx
