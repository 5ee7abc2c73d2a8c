// Tile claims of a CTA pair (weight multicast, docs/decisions.md#weight-multicast-pairs): the
// pair's first CTA claims each unit of two tiles (2u, 2u + 1) from the global counter, as a single
// CTA claims a tile, and posts it into a mailbox in the second CTA's shared memory, so that the
// pairs take their units in claim order and run side by side on neighbouring tiles, as single
// CTAs do (a static walk let pairs drift apart and read weight blocks from HBM twice).
//
// Split in two as a single CTA's claim is: claim() as a tile starts (the atomic's round trip
// overlaps the tile's loads), exchange() after the tile's loads are issued (the first CTA posts,
// the second takes). Called by each CTA's weight producer once per tile, in the same sequence in
// both CTAs.
#pragma once

#include <cstdint>

#include "kernels/ptx/cluster.cuh"
#include "kernels/ptx/mbarrier.cuh"
#include "kernels/scheduler/grouped_tile_scheduler.cuh"

namespace megamoe::kernels {

// Units the first CTA may claim before the second has taken the earlier ones.
inline constexpr int kPairMailboxSlots = 2;

template <class SharedStorage>
struct PairClaims {
  int units = 0;  // posted (first CTA) or taken (second CTA) so far

  // The first CTA's claim of the next unit (its first tile); nothing in the second CTA.
  __device__ __forceinline__ static int claim(const GroupedTileScheduler& scheduler, uint32_t cta_rank) {
    return cta_rank == 0 ? scheduler.claim_next_unit() : 0;
  }

  // This CTA's tile of the unit `claimed` (>= num_tiles when none is left: the first CTA posts
  // that too).
  __device__ __forceinline__ int exchange(int claimed, SharedStorage& smem, uint32_t cta_rank) {
    const int slot = units % kPairMailboxSlots;
    const uint32_t phase = static_cast<uint32_t>(units / kPairMailboxSlots) & 1u;
    ++units;
    if (cta_rank == 0) {
      ptx::wait_parity_cluster(&smem.pair_mailbox_empty[slot], phase ^ 1u);  // the second CTA took what it held
      ptx::st_shared_cluster(&smem.pair_mailbox[slot], 1, claimed);
      ptx::mbarrier_arrive_release_cluster(&smem.pair_mailbox_full[slot], 1);
      return claimed;
    }
    ptx::wait_parity_cluster(&smem.pair_mailbox_full[slot], phase);
    const int first = *static_cast<volatile int32_t*>(&smem.pair_mailbox[slot]);
    ptx::mbarrier_arrive_release_cluster(&smem.pair_mailbox_empty[slot], 0);
    return first + 1;
  }
};

}  // namespace megamoe::kernels
