// Combine role of the single-kernel forward (scheduler/forward_items.hpp): the math warpgroups,
// once this CTA's FC2 tiles are done, wait until every FC2 tile of the forward is stored, then
// combine their CTA's share of the output vectors: vector v belongs to CTA (v / math threads) mod
// grid, a whole grid's wave of vectors at a time, kCombineBatch vectors per thread in flight.
// The share is fixed, not claimed: nothing waits for the combine, so a CTA that becomes resident
// late (SMs held by another stream) delays the end of the forward and blocks nothing, and no
// claim's atomic round trip stands between the last FC2 tile and the output.
#pragma once

#include <cstdint>

#include "kernels/combine/combine_slots.cuh"
#include "kernels/epilogue/gemm_op.hpp"
#include "kernels/layout/forward_timeline.hpp"
#include "kernels/pipeline/timeline.cuh"
#include "kernels/ptx/mbarrier.cuh"
#include "kernels/ptx/memory.cuh"
#include "kernels/ptx/sync.cuh"

namespace megamoe::kernels {

// Vectors a math thread combines at once: each of them costs the round trips of one.
inline constexpr int kCombineBatch = 2;

// By each of the `math_threads` math threads; `fc2_tiles_stored` reaches `fc2_tiles` when every
// FC2 tile is stored. `waited()` runs in every math thread once all of them are past that wait, the
// share's last access to a forward counter. `output` says where each token's vectors go
// (combine_vectors).
template <bool kDeterministic, class Waited, class Output = CombineIntoY>
__device__ __forceinline__ void combine_share(const CombineParams& p, const uint32_t* fc2_tiles_stored,
                                              uint32_t fc2_tiles, int math_thread, int math_threads,
                                              const Timeline& timeline, Waited waited, const Output& output = {}) {
  constexpr uint32_t kBarrier = static_cast<uint32_t>(NamedBarrier::kCombineShare);
  const int valid = valid_tokens(p.num_tokens, p.num_valid_tokens);
  const long vectors = static_cast<long>(valid) * (p.hidden / Bf16x8Sum::kChannels);
  const long wave = static_cast<long>(gridDim.x) * math_threads;
  const long mine = static_cast<long>(blockIdx.x) * math_threads + math_thread;
  // The routing is final since the front role: the first batch's ids and weights come into L1
  // while the last FC2 tiles finish, so that after the wait only the slot rows are a round trip
  // away (as in combine_kernel).
  if constexpr (kDeterministic) {
    const int vectors_per_token = p.hidden / Bf16x8Sum::kChannels;
#pragma unroll
    for (int b = 0; b < kCombineBatch; ++b) {
      const long index = mine + b * wave;
      if (index >= vectors) break;
      prefetch_token_routing(p, static_cast<int>(index / vectors_per_token));
    }
  }
  if (math_thread == 0) {
    ptx::wait_until([&] { return ptx::ld_acquire_gpu(fc2_tiles_stored) >= fc2_tiles; }, 64);
  }
  ptx::named_barrier_sync(kBarrier, static_cast<uint32_t>(math_threads));
  waited();
  timeline.mark(layout::kCombineStarted, static_cast<int>(threadIdx.x) - math_thread);
  for (long first = mine; first < vectors; first += kCombineBatch * wave) {
    combine_vectors<kDeterministic, kCombineBatch>(p, first, wave, valid, output);
  }
}

}  // namespace megamoe::kernels
