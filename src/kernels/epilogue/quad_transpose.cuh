// The tokens-on-M epilogues' store widening (docs/decisions.md#tokens-on-m-tile). In the sm90 GMMA
// accumulator layout the four lanes of a quad hold one row's adjacent column pairs: lane q the
// pair q of every 8-column group. A 4 x 4 transpose of one 32-bit word per (group, lane) across the
// quad leaves lane q the four pairs of one group, i.e. 8 contiguous columns, so that it stores
// them at once (16 bytes of bf16, 8 of E4M3) instead of four lanes storing a quarter each.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <cstring>

namespace megamoe::kernels::gemm_detail {

// Before: x[j] is this lane's pair of group j (of 4). After: x[p] is pair p of group quad_lane.
// Two butterfly steps (lanes q and q ^ 2, then q ^ 1) each swap the words whose group and lane
// differ in that bit; selects rather than indexing by lane keep x in registers. Every lane of the
// warp must call it.
__device__ __forceinline__ void transpose_quad(uint32_t (&x)[4], int quad_lane) {
#pragma unroll
  for (int bit = 2; bit >= 1; bit /= 2) {
    const bool upper = (quad_lane & bit) != 0;
#pragma unroll
    for (int low = 0; low < 4; ++low) {
      if ((low & bit) != 0) continue;
      const int high = low | bit;
      // The lane keeps the word of its own half and trades the other for its partner's.
      const uint32_t received = __shfl_xor_sync(0xffffffffu, upper ? x[low] : x[high], bit);
      if (upper) {
        x[low] = received;
      } else {
        x[high] = received;
      }
    }
  }
}

// Two channels as the 32-bit word the transpose moves (bf16, the first in the low half).
__device__ __forceinline__ uint32_t bf16x2_bits(float first, float second) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(first, second);
  uint32_t bits;
  memcpy(&bits, &pair, sizeof bits);
  return bits;
}

}  // namespace megamoe::kernels::gemm_detail
