// Combine role. Deterministic: y[t] = sum over the token's used slots, in slot order, of
// weight * expert output (the FC2 epilogue's bf16 slot rows), accumulated in fp32 and rounded once
// to bf16. Fast: y = bf16(y_accumulator), which the FC2 epilogue filled with atomic adds. One
// thread per 8 output channels: 16-byte stores.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/ptx/grid_dependency.cuh"
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

template <bool kDeterministic>
__global__ void __launch_bounds__(256) combine_kernel(CombineParams p) {
  constexpr int kVector = 8;
  const int vectors_per_token = p.hidden / kVector;
  const long index = static_cast<long>(blockIdx.x) * blockDim.x + threadIdx.x;
  ptx::wait_for_prerequisite_grids();
  ptx::allow_dependent_launch();
  if (index >= static_cast<long>(valid_tokens(p.num_tokens, p.num_valid_tokens)) * vectors_per_token) return;
  const int token = static_cast<int>(index / vectors_per_token);
  const int column = static_cast<int>(index % vectors_per_token) * kVector;

  float sum[kVector] = {};
  if constexpr (kDeterministic) {
    for (int j = 0; j < p.top_k; ++j) {
      const size_t slot = static_cast<size_t>(token) * p.top_k + j;
      if (p.routed_ids[slot] < 0) continue;
      const float w = p.routed_weights[slot];
      const uint4 raw = *reinterpret_cast<const uint4*>(p.slot_outputs + slot * p.hidden + column);
      const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
      for (int i = 0; i < kVector / 2; ++i) {
        const float2 v = __bfloat1622float2(pairs[i]);
        sum[2 * i] += w * v.x;
        sum[2 * i + 1] += w * v.y;
      }
    }
  } else {
    const float4* acc = reinterpret_cast<const float4*>(p.y_accumulator + static_cast<size_t>(token) * p.hidden + column);
    const float4 lo = acc[0], hi = acc[1];
    sum[0] = lo.x, sum[1] = lo.y, sum[2] = lo.z, sum[3] = lo.w, sum[4] = hi.x, sum[5] = hi.y, sum[6] = hi.z, sum[7] = hi.w;
  }
  uint4 packed;
  __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&packed);
#pragma unroll
  for (int i = 0; i < kVector / 2; ++i) pairs[i] = __floats2bfloat162_rn(sum[2 * i], sum[2 * i + 1]);
  reinterpret_cast<uint4*>(p.y + static_cast<size_t>(token) * p.hidden + column)[0] = packed;
}

}  // namespace megamoe::kernels
