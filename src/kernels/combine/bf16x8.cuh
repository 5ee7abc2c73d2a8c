// Eight bf16 channels in one 16-byte vector, summed in fp32 and rounded once: the unit of work of
// the combines (single-GPU deterministic combine, expert-parallel reduce), one thread per vector.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/ptx/memory.cuh"

namespace megamoe::kernels {

struct Bf16x8Sum {
  static constexpr int kChannels = 8;
  float sum[kChannels] = {};

  __device__ __forceinline__ void add(const uint4& raw, float weight) {
    const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < kChannels / 2; ++i) {
      const float2 v = __bfloat1622float2(pairs[i]);
      sum[2 * i] += weight * v.x;
      sum[2 * i + 1] += weight * v.y;
    }
  }

  // Adds `count` weighted rows in index order (add_rows_batched of one sum).
  template <int kInFlight, class Locate>
  __device__ __forceinline__ void add_rows(int count, Locate locate);

  __device__ __forceinline__ uint4 rounded() const {
    uint4 packed;
    __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&packed);
#pragma unroll
    for (int i = 0; i < kChannels / 2; ++i) pairs[i] = __floats2bfloat162_rn(sum[2 * i], sum[2 * i + 1]);
    return packed;
  }
};

// Adds `count` weighted rows in index order to each of `kBatch` sums. `locate(b, i, row, weight)`
// sets row i of sum b's address (null: nothing to add) and weight; each group of kInFlight rows
// of every sum is located, then loaded, then added, so that a group costs two memory round trips
// (where the rows are found, the rows) for all kBatch sums instead of one chain per row. The rows
// are read once: their lines go first when L2 evicts.
template <int kBatch, int kInFlight, class Locate>
__device__ __forceinline__ void add_rows_batched(Bf16x8Sum (&sums)[kBatch], int count, Locate locate) {
  const uint64_t read_once = ptx::l2_policy_evict_first();
  for (int first = 0; first < count; first += kInFlight) {
    const uint4* row[kBatch][kInFlight];
    float weight[kBatch][kInFlight];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
#pragma unroll
      for (int i = 0; i < kInFlight; ++i) {
        row[b][i] = nullptr;
        weight[b][i] = 0.0f;
        if (first + i < count) locate(b, first + i, row[b][i], weight[b][i]);
      }
    }
    uint4 value[kBatch][kInFlight];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
#pragma unroll
      for (int i = 0; i < kInFlight; ++i)
        if (row[b][i] != nullptr) value[b][i] = ptx::ld_global_v4(row[b][i], read_once);
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
#pragma unroll
      for (int i = 0; i < kInFlight; ++i)
        if (row[b][i] != nullptr) sums[b].add(value[b][i], weight[b][i]);
    }
  }
}

template <int kInFlight, class Locate>
__device__ __forceinline__ void Bf16x8Sum::add_rows(int count, Locate locate) {
  Bf16x8Sum batch[1] = {*this};  // registers either way once inlined
  add_rows_batched<1, kInFlight>(batch, count, [&](int, int i, const uint4*& row, float& weight) { locate(i, row, weight); });
  *this = batch[0];
}

}  // namespace megamoe::kernels
