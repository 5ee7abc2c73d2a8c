// Combine role. Deterministic: y[t] = sum over the token's used slots, in slot order, of
// weight * expert output (the FC2 epilogue's bf16 slot rows), accumulated in fp32 and rounded once
// to bf16. Fast: y = bf16(y_accumulator), which the FC2 epilogue filled with atomic adds. One
// thread per 8 output channels: 16-byte stores.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/combine/bf16x8.cuh"
#include "kernels/ptx/grid_dependency.cuh"
#include "kernels/ptx/memory.cuh"
#include "kernels/routing/valid_tokens.cuh"

namespace megamoe::kernels {

struct CombineParams {
  int num_tokens;
  const int32_t* num_valid_tokens;  // device count, or null: all num_tokens rows are real
  int top_k;
  int hidden;
  const int32_t* routed_ids;      // [T, k]
  const float* routed_weights;    // [T, k]
  const __nv_bfloat16* slot_outputs;  // [T*k, H] (deterministic)
  const float* y_accumulator;     // [T, H] (fast)
  __nv_bfloat16* y;               // [T, H]
};

// Output vector `index` (token index / (H/8), channels 8 x the rest); past the valid tokens, nothing.
template <bool kDeterministic>
__device__ __forceinline__ void combine_vector(const CombineParams& p, long index, int valid) {
  constexpr int kVector = Bf16x8Sum::kChannels;
  const int vectors_per_token = p.hidden / kVector;
  if (index >= static_cast<long>(valid) * vectors_per_token) return;
  const int token = static_cast<int>(index / vectors_per_token);
  const int column = static_cast<int>(index % vectors_per_token) * kVector;
  const size_t first_slot = static_cast<size_t>(token) * p.top_k;
  Bf16x8Sum sum;
  if constexpr (kDeterministic) {
    sum.add_rows<8>(p.top_k, [&](int j, const uint4*& row, float& weight) {
      const size_t slot = first_slot + j;
      weight = p.routed_weights[slot];
      if (p.routed_ids[slot] >= 0) row = reinterpret_cast<const uint4*>(p.slot_outputs + slot * p.hidden + column);
    });
  } else {
    const float4* acc = reinterpret_cast<const float4*>(p.y_accumulator + static_cast<size_t>(token) * p.hidden + column);
    const float4 lo = acc[0], hi = acc[1];
    float* s = sum.sum;
    s[0] = lo.x, s[1] = lo.y, s[2] = lo.z, s[3] = lo.w, s[4] = hi.x, s[5] = hi.y, s[6] = hi.z, s[7] = hi.w;
  }
  reinterpret_cast<uint4*>(p.y + static_cast<size_t>(token) * p.hidden + column)[0] = sum.rounded();
}

template <bool kDeterministic>
__global__ void __launch_bounds__(256) combine_kernel(CombineParams p) {
  const int vectors_per_token = p.hidden / Bf16x8Sum::kChannels;
  const long index = static_cast<long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int token = static_cast<int>(index / vectors_per_token);
  const size_t first_slot = static_cast<size_t>(token) * p.top_k;
  // The routing is complete before this grid can launch (the gather released its successors only
  // after waiting for the router), so the token's ids and weights come into L1 while FC2 finishes:
  // after the wait only the slot rows are a round trip away.
  if (kDeterministic && token < p.num_tokens) {
    ptx::prefetch_l1(p.routed_ids + first_slot);
    ptx::prefetch_l1(p.routed_ids + first_slot + p.top_k - 1);
    ptx::prefetch_l1(p.routed_weights + first_slot);
    ptx::prefetch_l1(p.routed_weights + first_slot + p.top_k - 1);
  }
  ptx::wait_for_prerequisite_grids();
  ptx::allow_dependent_launch();
  combine_vector<kDeterministic>(p, index, valid_tokens(p.num_tokens, p.num_valid_tokens));
}

}  // namespace megamoe::kernels
