// A 4 x 4 transpose of 32-bit values across a quad of lanes (lanes 4i .. 4i + 3), for the
// tokens-on-M epilogues: a wgmma accumulator fragment gives lane q of a quad two adjacent columns
// of each 8-column group; after the transpose of four consecutive groups, lane q holds all of group
// q's columns, and stores them with one wide store instead of four narrow ones.
#pragma once

#include <cstdint>

namespace megamoe::kernels {

// On entry v[i] is this lane's part i (of group i); on return v[i] is lane i's part q, where q is
// this lane's index in its quad. Every lane of the warp calls it (full-mask shuffles). Two steps of
// two shuffles: swap the off-diagonal 2 x 2 blocks (lanes q and q ^ 2), then the off-diagonal
// elements inside each block (lanes q and q ^ 1). Indices stay compile-time (selects, no
// dynamically indexed registers).
__device__ __forceinline__ void quad_transpose(uint32_t (&v)[4]) {
  const int q = threadIdx.x % 4;
  const bool high_pair = (q & 2) != 0, odd = (q & 1) != 0;
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const uint32_t sent = __shfl_xor_sync(0xffffffffu, high_pair ? v[k] : v[k + 2], 2);
    if (high_pair) v[k] = sent; else v[k + 2] = sent;
  }
#pragma unroll
  for (int k = 0; k < 4; k += 2) {
    const uint32_t sent = __shfl_xor_sync(0xffffffffu, odd ? v[k] : v[k + 1], 1);
    if (odd) v[k] = sent; else v[k + 1] = sent;
  }
}

}  // namespace megamoe::kernels
