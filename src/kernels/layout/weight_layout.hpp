// Row order of packed W13, shared by host packing and device epilogues.
//
// W13 rows are interleaved by 8: packed rows [16g, 16g+8) hold gate rows [8g, 8g+8) and packed
// rows [16g+8, 16g+16) hold up rows [8g, 8g+8). A wgmma m64nNk* accumulator fragment gives each
// thread rows r and r+8 (and columns c and c+8), so after this interleave every thread owns both
// halves of each SwiGLU pair it computes, with no shuffle (docs/decisions.md#swiglu-row-pairs).
#pragma once

#if defined(__CUDACC__)
#define MEGAMOE_HOST_DEVICE __host__ __device__
#define MEGAMOE_FORCEINLINE __forceinline__
#else
#define MEGAMOE_HOST_DEVICE
#define MEGAMOE_FORCEINLINE inline
#endif

namespace megamoe::layout {

inline constexpr int kGateUpInterleave = 8;

// Packed row index of original W13 row `row` (gate rows [0, I), up rows [I, 2I)).
MEGAMOE_HOST_DEVICE constexpr int packed_w13_row(int row, int intermediate) {
  const bool is_up = row >= intermediate;
  const int channel = is_up ? row - intermediate : row;
  const int group = channel / kGateUpInterleave;
  return group * 2 * kGateUpInterleave + (is_up ? kGateUpInterleave : 0) + channel % kGateUpInterleave;
}

// Original W13 row of packed row `packed_row`.
MEGAMOE_HOST_DEVICE constexpr int original_w13_row(int packed_row, int intermediate) {
  const int group = packed_row / (2 * kGateUpInterleave);
  const int within = packed_row % (2 * kGateUpInterleave);
  const int channel = group * kGateUpInterleave + within % kGateUpInterleave;
  return within < kGateUpInterleave ? channel : intermediate + channel;
}

}  // namespace megamoe::layout
