// Thread-block cluster wrappers (PTX ISA "barrier.cluster", "mapa", "st" and "mbarrier.arrive"
// with .shared::cluster, "mbarrier.try_wait" with .acquire.cluster, "cp.async.bulk" with
// .multicast::cluster): CTAs of one cluster write each other's shared memory, signal each other's
// barriers and receive one copy of the same bytes.
#pragma once

#include <cstdint>

#include "kernels/ptx/mbarrier.cuh"

namespace megamoe::ptx {

__device__ __forceinline__ uint32_t cluster_cta_rank() {
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  return rank;
}

// The address of `local`'s offset in the shared memory of CTA `cta_rank` of the cluster.
__device__ __forceinline__ uint32_t cluster_shared_address(const void* local, uint32_t cta_rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_address(local)), "r"(cta_rank));
  return remote;
}

// Every thread of every CTA of the cluster: what each wrote before (barrier initialization
// included) is visible to the others after.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// One arrival on the barrier at `barrier`'s offset in the shared memory of CTA `cta_rank` of the
// cluster (this CTA's own included), with the instruction's default ordering (release at CTA
// scope), as CUTLASS's cluster pipelines hand a multicast stage back.
__device__ __forceinline__ void mbarrier_arrive_cluster(uint64_t* barrier, uint32_t cta_rank) {
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(cluster_shared_address(barrier, cta_rank))
               : "memory");
}

// `value` into the word at `local`'s offset in the shared memory of CTA `cta_rank`.
__device__ __forceinline__ void st_shared_cluster(const int32_t* local, uint32_t cta_rank, int32_t value) {
  asm volatile("st.shared::cluster.s32 [%0], %1;" ::"r"(cluster_shared_address(local, cta_rank)), "r"(value) : "memory");
}

// One arrival on the barrier at `barrier`'s offset in CTA `cta_rank`, releasing at cluster scope:
// this thread's earlier writes to that CTA's shared memory (st_shared_cluster) are visible to
// whoever acquires the phase there (wait_parity_cluster).
__device__ __forceinline__ void mbarrier_arrive_release_cluster(uint64_t* barrier, uint32_t cta_rank) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(
                   cluster_shared_address(barrier, cta_rank))
               : "memory");
}

__device__ __forceinline__ bool mbarrier_try_wait_parity_cluster(uint64_t* barrier, uint32_t parity) {
  uint32_t done;
  asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
               : "=r"(done) : "r"(smem_address(barrier)), "r"(parity) : "memory");
  return done != 0;
}

// Waits until the phase with `parity` of this CTA's `barrier` completes, acquiring at cluster
// scope what the other CTA's arrivals released.
__device__ __forceinline__ void wait_parity_cluster(uint64_t* barrier, uint32_t parity) {
  wait_until([&] { return mbarrier_try_wait_parity_cluster(barrier, parity); });
}

// `bytes` (a multiple of 16) from global memory into the shared memory of every CTA in
// `cta_mask`, each at `smem_destination`'s offset, each counted against the barrier at
// `barrier`'s offset in that CTA: one L2 read for all of them.
__device__ __forceinline__ void bulk_copy_multicast(void* smem_destination, const void* global_source, uint32_t bytes,
                                                    uint64_t* barrier, uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1], %2, [%3], %4;" ::"r"(
          smem_address(smem_destination)),
      "l"(global_source), "r"(bytes), "r"(smem_address(barrier)), "h"(cta_mask)
      : "memory");
}

}  // namespace megamoe::ptx
