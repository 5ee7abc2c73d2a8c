// The device side of a per-tensor amax (fp8_tensor's dynamic activation scales,
// quant/dynamic_tensor_scales.cuh): magnitudes of bf16 values as bits, one atomic max per warp,
// and the scale that an amax gives.
#pragma once

#include <cstdint>

#include "kernels/quant/fp8_block_scale.cuh"

namespace megamoe::kernels {

// The magnitude bits of a bf16 value (sign cleared), or 0 for inf and NaN: non-negative bf16 values
// order as their bits, and as the upper half of the float with the same value.
__device__ __forceinline__ uint32_t finite_bf16_magnitude(uint16_t bits) {
  const uint32_t magnitude = bits & 0x7FFFu;
  return magnitude < 0x7F80u ? magnitude : 0u;
}

// The larger finite magnitude of a bf16 pair (one 32-bit word, as stored).
__device__ __forceinline__ uint32_t finite_bf16x2_magnitude(uint32_t pair) {
  return max(finite_bf16_magnitude(static_cast<uint16_t>(pair)), finite_bf16_magnitude(static_cast<uint16_t>(pair >> 16)));
}

// Folds each lane's bf16 magnitude into the forward's amax (the float bits of the largest): one
// atomic per warp. Every lane of the warp calls it.
__device__ __forceinline__ void publish_amax(uint32_t* amax_bits, uint32_t bf16_magnitude) {
  const uint32_t warp_max = __reduce_max_sync(0xFFFFFFFFu, bf16_magnitude);
  if (threadIdx.x % 32 == 0 && warp_max != 0) atomicMax(amax_bits, warp_max << 16);
}

// The scale and encoding factor of a tensor whose amax has these float bits: quant::tensor_scale
// (block_scale's fp32 scale) and quant::tensor_factor (1 / scale, not block_scale's 448 / amax).
struct TensorScale {
  float scale;
  float factor;
};
__device__ __forceinline__ TensorScale tensor_scale_of(uint32_t amax_bits) {
  const float scale = block_scale(__uint_as_float(amax_bits), false).scale;
  return {scale, __fdiv_rn(1.0f, scale)};
}

}  // namespace megamoe::kernels
