// Combine role of the single-kernel forward (scheduler/forward_items.hpp): the math warpgroups,
// once this CTA's FC2 tiles are done, wait until every FC2 tile of the forward is stored, then
// take combine items (kCombineItemVectors output vectors each, one per math thread) until none
// is left.
#pragma once

#include <cstdint>

#include "kernels/combine/combine_slots.cuh"
#include "kernels/epilogue/gemm_op.hpp"
#include "kernels/ptx/mbarrier.cuh"
#include "kernels/ptx/memory.cuh"
#include "kernels/ptx/sync.cuh"
#include "kernels/scheduler/forward_items.hpp"

namespace megamoe::kernels {

// By each of the `math_threads` math threads (math_thread 0 claims); `ticket` is one int of the
// CTA's shared memory outside the stages.
template <bool kDeterministic>
__device__ __forceinline__ void combine_items(const CombineParams& p, const ForwardItems& items, uint32_t fc2_tiles,
                                              int math_thread, uint32_t math_threads, int* ticket) {
  constexpr uint32_t kBarrier = static_cast<uint32_t>(NamedBarrier::kCombineItem);
  if (math_thread == 0) {
    ptx::wait_until([&] { return ptx::ld_acquire_gpu(items.counter(kFc2TilesStored)) >= fc2_tiles; }, 64);
  }
  const int valid = valid_tokens(p.num_tokens, p.num_valid_tokens);
  for (;;) {
    if (math_thread == 0) *ticket = static_cast<int>(atomicAdd(items.counter(kCombineTickets), 1u));
    ptx::named_barrier_sync(kBarrier, math_threads);
    const int item = *ticket;
    ptx::named_barrier_sync(kBarrier, math_threads);
    if (item >= items.combine_items) return;
    for (int v = math_thread; v < kCombineItemVectors; v += static_cast<int>(math_threads)) {
      combine_vector<kDeterministic>(p, static_cast<long>(item) * kCombineItemVectors + v, valid);
    }
  }
}

}  // namespace megamoe::kernels
