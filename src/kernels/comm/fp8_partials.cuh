// FP8 partial sums on the way back to their source (EpLayerOptions::partial_sums = fp8;
// docs/decisions.md#fp8-partial-sums): how a source adds its owners' partial sums, the same in the
// staged reduce (comm/ep_combine.cuh) and the fused one (comm/ep_fused_roles.cuh), so that both give
// the same bits.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "kernels/combine/bf16x8.cuh"
#include "kernels/comm/ep_rows.cuh"

namespace megamoe::kernels {

// An owner's bf16 partial sum of one token (`hidden` channels at `from`) quantized per 128
// channels into `codes` ([hidden] E4M3) and `scales` ([hidden / 128] fp32), by `threads` threads
// (block_quantize_row's rule on them): the staged layer's quantize kernel and the fused combine
// both call this, so that their codes are the same.
__device__ __forceinline__ void quantize_partial_sum_row(const uint4* from, uint4* codes, float* scales, int hidden,
                                                         int thread, int threads) {
  ep_detail::block_quantize_row(from, &codes, &scales, 1, hidden, 1, /*ue8m0=*/false, thread, threads);
}

// Eight E4M3 codes of one FP8 partial sum times its block scale, added to `sum` (fp32).
__device__ __forceinline__ void add_fp8x8(Bf16x8Sum& sum, uint2 codes, float scale) {
  const __nv_fp8x2_storage_t* pairs = reinterpret_cast<const __nv_fp8x2_storage_t*>(&codes);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 v = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pairs[i], __NV_E4M3)));
    sum.sum[2 * i] += scale * v.x;
    sum.sum[2 * i + 1] += scale * v.y;
  }
}

// Each owner's partial sum of one vector in rank order: `rank`'s own in bf16 (it crosses no link),
// the others' as E4M3 codes times their block scale; every owner's loads in flight before the
// first addition. locate(owner, own, codes, scale) says whether the owner holds a partial sum and
// points at it (`own` for `rank`, else `codes` and `scale`). The staged and the fused reduce both
// add this way, so that their FP8 partial sums give the same bits.
template <class Locate>
__device__ __forceinline__ void add_fp8_partials_in_rank_order(Bf16x8Sum& sum, int world, int rank, Locate&& locate) {
  constexpr int kInFlight = 8;
  for (int first = 0; first < world; first += kInFlight) {
    uint4 own{};
    uint2 codes[kInFlight];
    float scales[kInFlight];
    bool present[kInFlight];
#pragma unroll
    for (int i = 0; i < kInFlight; ++i) {
      const int owner = first + i;
      const uint4* own_row = nullptr;
      const uint2* code_row = nullptr;
      const float* scale = nullptr;
      present[i] = owner < world && locate(owner, own_row, code_row, scale);
      if (!present[i]) continue;
      if (owner == rank) {
        own = *own_row;
      } else {
        codes[i] = *code_row;
        scales[i] = *scale;
      }
    }
#pragma unroll
    for (int i = 0; i < kInFlight; ++i) {
      if (!present[i]) continue;
      if (first + i == rank) sum.add(own, 1.0f);
      else add_fp8x8(sum, codes[i], scales[i]);
    }
  }
}

}  // namespace megamoe::kernels
