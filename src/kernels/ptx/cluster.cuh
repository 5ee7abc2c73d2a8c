// Thread-block cluster wrappers (PTX ISA "barrier.cluster", "mapa", "mbarrier.arrive" with
// .shared::cluster, "cp.async.bulk" with .multicast::cluster): CTAs of one cluster signal each
// other's barriers and receive one copy of the same bytes.
#pragma once

#include <cstdint>

#include "kernels/ptx/mbarrier.cuh"

namespace megamoe::ptx {

__device__ __forceinline__ uint32_t cluster_cta_rank() {
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  return rank;
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
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_address(barrier)), "r"(cta_rank));
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
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
