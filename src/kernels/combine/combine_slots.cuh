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

// Starts bringing `token`'s routed ids and weights into this SM's L1 (the deterministic combine's
// first round trip), where they are final before the slot rows are.
__device__ __forceinline__ void prefetch_token_routing(const CombineParams& p, int token) {
  const size_t first_slot = static_cast<size_t>(token) * p.top_k;
  ptx::prefetch_l1(p.routed_ids + first_slot);
  ptx::prefetch_l1(p.routed_ids + first_slot + p.top_k - 1);
  ptx::prefetch_l1(p.routed_weights + first_slot);
  ptx::prefetch_l1(p.routed_weights + first_slot + p.top_k - 1);
}

// Where combine_vectors stores a token's output: its row of y, for every valid token (zero where it
// uses no slot). Another Output (expert parallelism's partial sums, stored into their source's
// buffer) gives each token's row, and with kRoutedOnly stores only tokens with a used slot and a
// row (null: nowhere to store).
struct CombineIntoY {
  static constexpr bool kRoutedOnly = false;
  __device__ __forceinline__ __nv_bfloat16* row(const CombineParams& p, int token) const {
    return p.y + static_cast<size_t>(token) * p.hidden;
  }
};

// Output vectors first + b * stride for b < kBatch (a vector's index is token index * (H/8) + its
// 8-channel group); those past the valid tokens are skipped. Every vector's rows are located and
// loaded together (add_rows_batched): a batch costs the memory round trips of one vector.
template <bool kDeterministic, int kBatch, class Output = CombineIntoY>
__device__ __forceinline__ void combine_vectors(const CombineParams& p, long first, long stride, int valid,
                                                const Output& output = {}) {
  static_assert(kDeterministic || !Output::kRoutedOnly, "the atomic combine's sums do not say which slots were used");
  constexpr int kVector = Bf16x8Sum::kChannels;
  const int vectors_per_token = p.hidden / kVector;
  const long end = static_cast<long>(valid) * vectors_per_token;
  int token[kBatch], column[kBatch];
#pragma unroll
  for (int b = 0; b < kBatch; ++b) {
    const long index = first + b * stride;
    token[b] = index < end ? static_cast<int>(index / vectors_per_token) : -1;
    column[b] = static_cast<int>(index % vectors_per_token) * kVector;
  }
  Bf16x8Sum sum[kBatch];
  bool used[kBatch] = {};  // whether the token has a used slot (read with kRoutedOnly only)
  if constexpr (kDeterministic) {
    add_rows_batched<kBatch, 8>(sum, p.top_k, [&](int b, int j, const uint4*& row, float& weight) {
      if (token[b] < 0) return;
      const size_t slot = static_cast<size_t>(token[b]) * p.top_k + j;
      weight = p.routed_weights[slot];
      if (p.routed_ids[slot] >= 0) {
        row = reinterpret_cast<const uint4*>(p.slot_outputs + slot * p.hidden + column[b]);
        used[b] = true;
      }
    });
  } else {
    float4 lo[kBatch] = {}, hi[kBatch] = {};
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (token[b] < 0) continue;
      const float4* acc =
          reinterpret_cast<const float4*>(p.y_accumulator + static_cast<size_t>(token[b]) * p.hidden + column[b]);
      lo[b] = acc[0], hi[b] = acc[1];
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      float* s = sum[b].sum;
      s[0] = lo[b].x, s[1] = lo[b].y, s[2] = lo[b].z, s[3] = lo[b].w, s[4] = hi[b].x, s[5] = hi[b].y, s[6] = hi[b].z,
      s[7] = hi[b].w;
    }
  }
#pragma unroll
  for (int b = 0; b < kBatch; ++b) {
    if (token[b] < 0) continue;
    __nv_bfloat16* row = output.row(p, token[b]);
    if constexpr (Output::kRoutedOnly) {
      if (!used[b] || row == nullptr) continue;
    }
    reinterpret_cast<uint4*>(row + column[b])[0] = sum[b].rounded();
  }
}

template <bool kDeterministic>
__global__ void __launch_bounds__(256) combine_kernel(CombineParams p) {
  const int vectors_per_token = p.hidden / Bf16x8Sum::kChannels;
  const long index = static_cast<long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int token = static_cast<int>(index / vectors_per_token);
  // The routing is complete before this grid can launch (the gather released its successors only
  // after waiting for the router), so the token's ids and weights come into L1 while FC2 finishes:
  // after the wait only the slot rows are a round trip away.
  if (kDeterministic && token < p.num_tokens) prefetch_token_routing(p, token);
  ptx::wait_for_prerequisite_grids();
  ptx::allow_dependent_launch();
  combine_vectors<kDeterministic, 1>(p, index, 0, valid_tokens(p.num_tokens, p.num_valid_tokens));
}

}  // namespace megamoe::kernels
