// Combine role of the single-kernel forward (scheduler/forward_items.hpp): once this CTA's FC2
// tiles are done, its threads wait until every FC2 tile of the forward is stored, then combine
// their share of the output vectors: vector v belongs to CTA (v / threads) mod grid, a whole grid's
// wave of vectors at a time. The deterministic share keeps several vectors' slot rows a thread in
// flight by cp.async into the idle stage ring (combine/combine_staged.cuh: the combine kernel has
// up to eight blocks a SM for that; this CTA is the SM's only one, and registers would hold two or
// three), on every thread of the block where that spreads the work and the ring holds the top-k
// rows of one vector a thread (combine_share_threads). The share is fixed, not claimed: nothing
// waits for the combine, so a CTA that becomes resident late (SMs held by another stream) delays
// the end of the forward and blocks nothing, and no claim's atomic round trip stands between the
// last FC2 tile and the output.
#pragma once

#include <cstdint>

#include "kernels/combine/combine_slots.cuh"
#include "kernels/combine/combine_staged.cuh"
#include "kernels/epilogue/gemm_op.hpp"
#include "kernels/layout/forward_timeline.hpp"
#include "kernels/pipeline/timeline.cuh"
#include "kernels/ptx/mbarrier.cuh"
#include "kernels/ptx/memory.cuh"
#include "kernels/ptx/sync.cuh"

namespace megamoe::kernels {

// Vectors a thread combines at once where their rows come into registers (combine_vectors of the
// atomic share): each of them costs the round trips of one.
inline constexpr int kCombineBatch = 2;

// The output vectors (8 channels each) of `valid` tokens: what the shares split among the grid.
__device__ __forceinline__ long share_vectors(const CombineParams& p, int valid) {
  return static_cast<long>(valid) * (p.hidden / Bf16x8Sum::kChannels);
}

// The threads of a `block_threads` block that combine: all of them where the math warpgroups
// alone (`math_threads`, for which the callers' static asserts guarantee kMaxTopK staged rows
// each) would take more than one vector each and `staging` holds top_k rows for every thread,
// else the math warpgroups. The share is bound by its threads, not by the rows it keeps in
// flight: it ran 9-15% faster on 384 threads than on 256 (docs/design.md#single-kernel-combine);
// with at most a vector a math thread there is nothing to spread.
__device__ __forceinline__ int combine_share_threads(const CombineParams& p, const CombineStaging& staging,
                                                     int block_threads, int math_threads) {
  const long vectors = share_vectors(p, valid_tokens(p.num_tokens, p.num_valid_tokens));
  const bool spread = vectors > static_cast<long>(gridDim.x) * math_threads;
  const bool fits = static_cast<long>(block_threads) * p.top_k * combine_detail::kStagedRowBytes <= staging.size;
  return spread && fits ? block_threads : math_threads;
}

// By each of the share's `threads` threads (`thread` its index); `fc2_tiles_stored` reaches
// `fc2_tiles` when every FC2 tile is stored. `waited()` runs in the share's first thread once all
// of them are past that wait, the share's last access to a forward counter. The deterministic
// share stages its rows in `staging`, which must hold top_k rows a thread
// (combine_detail::kStagedRowBytes each).
template <bool kDeterministic, class Waited>
__device__ __forceinline__ void combine_share(const CombineParams& p, const uint32_t* fc2_tiles_stored,
                                              uint32_t fc2_tiles, int thread, int threads, const Timeline& timeline,
                                              const CombineStaging& staging, Waited waited) {
  using namespace combine_detail;
  constexpr uint32_t kBarrier = static_cast<uint32_t>(NamedBarrier::kCombineShare);
  const int valid = valid_tokens(p.num_tokens, p.num_valid_tokens);
  const long vectors = share_vectors(p, valid);
  const long wave = static_cast<long>(gridDim.x) * threads;
  const long mine = static_cast<long>(blockIdx.x) * threads + thread;
  const StagedRows staged(staging, thread, threads, p.top_k);
  // Vectors mine + i * wave for i < count.
  const int count = mine < vectors ? static_cast<int>((vectors - mine + wave - 1) / wave) : 0;
  const auto place = [&](int i) { return vector_place(p, mine + i * wave); };
  // The routing is final since the front role: the first vectors' ids and weights come into L1
  // while the last FC2 tiles finish, so that after the wait only the slot rows are a round trip
  // away (as in combine_kernel).
  if constexpr (kDeterministic) {
    for (int i = 0; i < min(count, staged.depth); ++i) prefetch_token_routing(p, place(i).token);
  }
  if (thread == 0) {
    ptx::wait_until([&] { return ptx::ld_acquire_gpu(fc2_tiles_stored) >= fc2_tiles; }, 64);
  }
  // Also: every thread is done with the stage ring the deterministic share stages rows in.
  ptx::named_barrier_sync(kBarrier, static_cast<uint32_t>(threads));
  if (thread == 0) waited();
  timeline.mark(layout::kCombineStarted, static_cast<int>(threadIdx.x) - thread);
  if constexpr (kDeterministic) {
    combine_staged_vectors(p, staged, count, place);
  } else {
    for (long first = mine; first < vectors; first += kCombineBatch * wave) {
      combine_vectors<false, kCombineBatch>(p, first, wave, valid);
    }
  }
}

}  // namespace megamoe::kernels
