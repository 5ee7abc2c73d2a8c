// The deterministic combine with its slot rows copied by 16-byte cp.async into shared memory, one
// vector (8 channels) of a thread at a time and several vectors deep: the single kernel's combine
// share (combine/combine_share.cuh) and expert parallelism's combine and reduce chunks
// (comm/ep_fused_roles.cuh), both in the forward's stage ring, idle once the CTA's FC2 tiles are
// consumed. Each thread keeps its vectors' rows in flight there, not in registers, and sums them
// in slot order as combine_vectors does.
#pragma once

#include <cstdint>

#include "kernels/combine/combine_slots.cuh"
#include "kernels/ptx/cp_async.cuh"
#include "kernels/ptx/memory.cuh"

namespace megamoe::kernels {

// The shared memory a combine stages its slot rows in.
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

// One staging thread's rows in the staging memory: row r of thread t at r * threads + t (a warp's
// rows side by side: conflict-free 16-byte accesses), vector stage s's slot j at row s * top_k + j.
// Weights in a second array of the same order.
struct StagedRows {
  uint4* rows;
  float* weights;
  int threads;
  int top_k;
  int depth;  // vectors in flight

  __device__ __forceinline__ StagedRows(const CombineStaging& staging, int thread, int staging_threads, int k)
      : threads(staging_threads), top_k(k) {
    const int per_thread = staging.size / (staging_threads * kStagedRowBytes);
    depth = min(kMaxStagedVectors, per_thread / k);
    rows = reinterpret_cast<uint4*>(staging.bytes) + thread;
    weights =
        reinterpret_cast<float*>(staging.bytes + static_cast<size_t>(per_thread) * staging_threads * sizeof(uint4)) +
        thread;
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

}  // namespace megamoe::kernels
