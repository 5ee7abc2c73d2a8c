// Dynamic activation scales of fp8_tensor (InputScales::dynamic, docs/decisions.md#dynamic-input-scales):
// one scale per tensor and forward, amax / 448 of its largest finite |value|, computed on the device
// without a host synchronization. Two roles around the per-stage chain:
//   x_amax_kernel, before the router: x's amax over the valid tokens -> TensorScaleSlots::fc1_scale
//     and fc1_factor, which the gather encodes with and FC1's epilogue multiplies by;
//   FC1's epilogue stores its output in bf16 and folds its largest finite magnitude into
//     fc2_amax_bits (quant/tensor_amax.cuh);
//   encode_fc1_output_kernel, between FC1 and FC2: fc2_scale and fc2_factor from that amax, and every
//     pool row FC1 wrote encoded from bf16 into the E4M3 rows FC2 reads.
// Non-finite values are left out of the amax (an inf or NaN element encodes as itself, saturated or
// NaN, and does not zero every other element's code); the reference (src/ref/moe_reference.cpp)
// takes the same amaxes. The kernels are defined here: only the per-stage launcher includes it.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/layout/moe_workspace.hpp"
#include "kernels/pipeline/last_block.cuh"
#include "kernels/ptx/grid_dependency.cuh"
#include "kernels/quant/fp8_block_scale.cuh"
#include "kernels/quant/tensor_amax.cuh"
#include "kernels/routing/valid_tokens.cuh"

namespace megamoe::kernels {

inline constexpr int kDynamicScaleThreads = 256;
inline constexpr int kDynamicScaleChunk = 8;  // bf16 values per 16-byte load
// Blocks per SM of both kernels: enough loads in flight to stream x or FC1's output at HBM rate.
inline constexpr int kDynamicScaleBlocksPerSm = 4;

struct DynamicScaleParams {
  int num_tokens;
  const int32_t* num_valid_tokens;      // device count, or null
  int hidden;
  int intermediate;
  int num_experts;
  const __nv_bfloat16* x;               // [T, H]
  const int32_t* expert_offsets;        // [E+1]: the pool rows in use end at [E]
  const __nv_bfloat16* fc1_output_bf16; // [pool_rows, I]
  uint8_t* fc1_output;                  // [pool_rows, I] E4M3, FC2's token operand
  layout::TensorScaleSlots* slots;
};

// x's amax, in a grid-stride loop of 16-byte loads; the last block to finish turns it into x's
// scale and clears the amaxes for this forward's FC1 and the next forward.
__global__ void __launch_bounds__(kDynamicScaleThreads) x_amax_kernel(DynamicScaleParams p) {
  // The slots are read by the previous forward's kernels until they finish, and x may be the
  // output of the caller's kernel before this one.
  ptx::wait_for_prerequisite_grids();
  ptx::allow_dependent_launch();
  const size_t chunks =
      static_cast<size_t>(valid_tokens(p.num_tokens, p.num_valid_tokens)) * p.hidden / kDynamicScaleChunk;
  uint32_t magnitude = 0;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < chunks;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const uint4 raw = reinterpret_cast<const uint4*>(p.x)[i];
    magnitude = max(magnitude, max(max(finite_bf16x2_magnitude(raw.x), finite_bf16x2_magnitude(raw.y)),
                                   max(finite_bf16x2_magnitude(raw.z), finite_bf16x2_magnitude(raw.w))));
  }
  publish_amax(&p.slots->x_amax_bits, magnitude);
  if (!last_block_to_finish(&p.slots->x_blocks_done)) return;
  if (threadIdx.x == 0) {
    const TensorScale s = tensor_scale_of(atomicOr(&p.slots->x_amax_bits, 0u));
    p.slots->fc1_scale = s.scale;
    p.slots->fc1_factor = s.factor;
    p.slots->x_amax_bits = 0;
    p.slots->fc2_amax_bits = 0;  // FC1 of this forward starts after this grid completes
  }
}

// FC2's input scale from FC1's amax, then FC1's bf16 output rows [0, expert_offsets[E]) encoded
// with it (the padding rows between experts' segments too: FC2 multiplies them and stores nothing).
__global__ void __launch_bounds__(kDynamicScaleThreads) encode_fc1_output_kernel(DynamicScaleParams p) {
  ptx::wait_for_prerequisite_grids();  // FC1's stores and amax, and the router's offsets
  ptx::allow_dependent_launch();
  const TensorScale s = tensor_scale_of(*reinterpret_cast<volatile uint32_t*>(&p.slots->fc2_amax_bits));
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    p.slots->fc2_scale = s.scale;
    p.slots->fc2_factor = s.factor;
  }
  const size_t chunks = static_cast<size_t>(p.expert_offsets[p.num_experts]) * p.intermediate / kDynamicScaleChunk;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < chunks;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const uint4 raw = reinterpret_cast<const uint4*>(p.fc1_output_bf16)[i];
    const __nv_bfloat16* v = reinterpret_cast<const __nv_bfloat16*>(&raw);
    uint2 codes;
    uint16_t* pairs = reinterpret_cast<uint16_t*>(&codes);
#pragma unroll
    for (int j = 0; j < kDynamicScaleChunk / 2; ++j) {
      pairs[j] = encode_e4m3x2(__bfloat162float(v[2 * j]) * s.factor, __bfloat162float(v[2 * j + 1]) * s.factor);
    }
    reinterpret_cast<uint2*>(p.fc1_output)[i] = codes;
  }
}

}  // namespace megamoe::kernels
