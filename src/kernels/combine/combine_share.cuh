// Combine role of the single-kernel forward (scheduler/forward_items.hpp): the math warpgroups,
// once this CTA's FC2 tiles are done, wait until every FC2 tile of the forward is stored, then
// combine their CTA's share of the output vectors: vector v belongs to CTA (v / math threads) mod
// grid, a whole grid's wave of vectors at a time. The deterministic share keeps several vectors'
// slot rows a thread in flight by cp.async into the idle stage ring (the combine kernel has up to
// eight blocks a SM for that; this CTA is the SM's only one, and registers would hold two or three).
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
#include "kernels/ptx/cp_async.cuh"
#include "kernels/ptx/memory.cuh"
#include "kernels/ptx/sync.cuh"

namespace megamoe::kernels {

// Vectors a thread combines at once where their rows come into registers (combine_vectors of the
// atomic share): each of them costs the round trips of one.
inline constexpr int kCombineBatch = 2;

// Shared memory the deterministic share stages its slot rows in (the stage ring, idle once the
// CTA's FC2 tiles are consumed): per math thread, up to kMaxStagedVectors of its vectors' rows are
// in flight at once, and none of them in registers.
struct CombineStaging {
  char* bytes;
  int size;
};

// Bytes at the end of the staging memory that a role after the GEMMs may keep for its own shared
// state while it stages rows before them (expert parallelism's back role: its claimed chunk).
inline constexpr int kCombineStagingReserve = 256;

namespace combine_detail {

// cp.async.wait_group takes its count as an immediate: one instruction per count below this.
inline constexpr int kMaxStagedVectors = 8;
// What one staged row takes: its 16 bytes and its weight.
inline constexpr int kStagedRowBytes = sizeof(uint4) + sizeof(float);

// One math thread's rows in the staging memory: row r of thread t at r * threads + t (a warp's
// rows side by side: conflict-free 16-byte accesses), vector stage s's slot j at row s * top_k + j.
// Weights in a second array of the same order.
struct StagedRows {
  uint4* rows;
  float* weights;
  int threads;
  int top_k;
  int depth;  // vectors in flight

  __device__ __forceinline__ StagedRows(const CombineStaging& staging, int math_thread, int math_threads, int k)
      : threads(math_threads), top_k(k) {
    const int per_thread = staging.size / (math_threads * kStagedRowBytes);
    depth = min(kMaxStagedVectors, per_thread / k);
    rows = reinterpret_cast<uint4*>(staging.bytes) + math_thread;
    weights = reinterpret_cast<float*>(staging.bytes + static_cast<size_t>(per_thread) * math_threads * sizeof(uint4)) +
              math_thread;
  }
  __device__ __forceinline__ int row(int stage, int slot) const { return (stage * top_k + slot) * threads; }
};

// Where an output vector lies: its token and its first channel.
struct VectorPlace {
  int token;
  int column;
};

// Output vector `index` (token index * (H/8) + its 8-channel group)'s place.
__device__ __forceinline__ VectorPlace vector_place(const CombineParams& p, long index) {
  const int vectors_per_token = p.hidden / Bf16x8Sum::kChannels;
  return {static_cast<int>(index / vectors_per_token),
          static_cast<int>(index % vectors_per_token) * Bf16x8Sum::kChannels};
}

// Starts copying the slot rows and weights of the output vector at `place` into `stage` (a used
// slot's row and weight; zeros for an unused one, which then adds nothing) and commits them as one
// group. The token's routed ids are read first, up to eight at once. Returns whether any slot of
// the token is used.
__device__ __forceinline__ bool stage_vector(const CombineParams& p, const StagedRows& staged, VectorPlace place,
                                             int stage, uint64_t read_once) {
  constexpr int kIds = 8;
  const size_t first_slot = static_cast<size_t>(place.token) * p.top_k;
  bool any_used = false;
  for (int first = 0; first < p.top_k; first += kIds) {
    int32_t id[kIds];
#pragma unroll
    for (int i = 0; i < kIds; ++i) id[i] = first + i < p.top_k ? p.routed_ids[first_slot + first + i] : -1;
#pragma unroll
    for (int i = 0; i < kIds; ++i) {
      if (first + i >= p.top_k) break;
      const size_t slot = first_slot + first + i;
      const int row = staged.row(stage, first + i);
      const bool used = id[i] >= 0;
      any_used |= used;
      ptx::cp_async_16_or_zero(staged.rows + row, p.slot_outputs + (used ? slot * p.hidden + place.column : 0), used,
                               read_once);
      ptx::cp_async_4_or_zero(staged.weights + row, p.routed_weights + slot, used);
    }
  }
  ptx::cp_async_commit_group();
  return any_used;
}

// The output vector at `place` from its rows staged in `stage`, summed in slot order as
// add_rows_batched sums them, into `output`'s row of its token (with Output::kRoutedOnly only where
// a slot is `used` and the row is not null).
template <class Output>
__device__ __forceinline__ void combine_staged_vector(const CombineParams& p, const StagedRows& staged,
                                                      VectorPlace place, int stage, bool used, const Output& output) {
  Bf16x8Sum sum;
  for (int j = 0; j < p.top_k; ++j) {
    const int row = staged.row(stage, j);
    sum.add(staged.rows[row], staged.weights[row]);
  }
  __nv_bfloat16* out = output.row(p, place.token);
  if constexpr (Output::kRoutedOnly) {
    if (!used || out == nullptr) return;
  }
  reinterpret_cast<uint4*>(out + place.column)[0] = sum.rounded();
}

}  // namespace combine_detail

// `count` output vectors of this thread, the i-th at place(i), summed from their slot rows staged
// by cp.async `staged.depth` vectors deep: vector i in stage i % depth, and once it is summed the
// stage takes vector i + depth. The first `depth` vectors' routing may already be in L1
// (prefetch_token_routing); each later one's is prefetched a vector ahead of its staging.
template <class Place, class Output = CombineIntoY>
__device__ __forceinline__ void combine_staged_vectors(const CombineParams& p, const combine_detail::StagedRows& staged,
                                                       int count, Place place, const Output& output = {}) {
  using namespace combine_detail;
  static_assert(kMaxStagedVectors <= 32, "a bit a stage says whether its vector's token uses a slot");
  const uint64_t read_once = ptx::l2_policy_evict_first();
  uint32_t used = 0;
  for (int i = 0; i < min(count, staged.depth); ++i) {
    if (stage_vector(p, staged, place(i), i, read_once)) used |= 1u << i;
  }
  for (int i = 0; i < count; ++i) {
    const int stage = i % staged.depth;
    ptx::cp_async_wait_pending<kMaxStagedVectors - 1>(min(count, i + staged.depth) - 1 - i);
    combine_staged_vector(p, staged, place(i), stage, (used >> stage) & 1u, output);
    if (i + staged.depth < count) {
      used &= ~(1u << stage);
      if (stage_vector(p, staged, place(i + staged.depth), stage, read_once)) used |= 1u << stage;
      if (i + staged.depth + 1 < count) prefetch_token_routing(p, place(i + staged.depth + 1).token);
    }
  }
}

// By each of the `math_threads` math threads; `fc2_tiles_stored` reaches `fc2_tiles` when every
// FC2 tile is stored. `waited()` runs in every math thread once all of them are past that wait, the
// share's last access to a forward counter. The deterministic share stages its rows in `staging`,
// which must hold kMaxTopK rows a math thread (combine_detail::kStagedRowBytes each).
template <bool kDeterministic, class Waited>
__device__ __forceinline__ void combine_share(const CombineParams& p, const uint32_t* fc2_tiles_stored,
                                              uint32_t fc2_tiles, int math_thread, int math_threads,
                                              const Timeline& timeline, const CombineStaging& staging, Waited waited) {
  using namespace combine_detail;
  constexpr uint32_t kBarrier = static_cast<uint32_t>(NamedBarrier::kCombineShare);
  const int valid = valid_tokens(p.num_tokens, p.num_valid_tokens);
  const long vectors = static_cast<long>(valid) * (p.hidden / Bf16x8Sum::kChannels);
  const long wave = static_cast<long>(gridDim.x) * math_threads;
  const long mine = static_cast<long>(blockIdx.x) * math_threads + math_thread;
  const StagedRows staged(staging, math_thread, math_threads, p.top_k);
  // Vectors mine + i * wave for i < count.
  const int count = mine < vectors ? static_cast<int>((vectors - mine + wave - 1) / wave) : 0;
  const auto place = [&](int i) { return vector_place(p, mine + i * wave); };
  // The routing is final since the front role: the first vectors' ids and weights come into L1
  // while the last FC2 tiles finish, so that after the wait only the slot rows are a round trip
  // away (as in combine_kernel).
  if constexpr (kDeterministic) {
    for (int i = 0; i < min(count, staged.depth); ++i) prefetch_token_routing(p, place(i).token);
  }
  if (math_thread == 0) {
    ptx::wait_until([&] { return ptx::ld_acquire_gpu(fc2_tiles_stored) >= fc2_tiles; }, 64);
  }
  // Also: every math thread is done with the stage ring the deterministic share stages rows in.
  ptx::named_barrier_sync(kBarrier, static_cast<uint32_t>(math_threads));
  waited();
  timeline.mark(layout::kCombineStarted, static_cast<int>(threadIdx.x) - math_thread);
  if constexpr (kDeterministic) {
    combine_staged_vectors(p, staged, count, place);
  } else {
    for (long first = mine; first < vectors; first += kCombineBatch * wave) {
      combine_vectors<false, kCombineBatch>(p, first, wave, valid);
    }
  }
}

}  // namespace megamoe::kernels
