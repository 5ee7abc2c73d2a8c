// Device side of the block-scale rule of src/ref/fp8_codec.cpp (block_scale) and of the E4M3
// conversion; both must stay bit-identical with the host codec.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

namespace megamoe::kernels {

inline constexpr float kE4M3Max = 448.0f;
inline constexpr float kMinBlockAmax = 1e-4f;

struct BlockScale {
  float scale;   // decoded value = e4m3 * scale
  float factor;  // value * factor is what gets encoded
};

__device__ __forceinline__ BlockScale block_scale(float amax, bool ue8m0) {
  const float clamped = fmaxf(amax, kMinBlockAmax);
  if (ue8m0) {
    const uint32_t bits = __float_as_uint(__fdiv_rn(clamped, kE4M3Max));
    const uint32_t exponent = ((bits >> 23) & 0xFFu) + ((bits & 0x7FFFFFu) != 0 ? 1u : 0u);
    return {__uint_as_float(exponent << 23), __uint_as_float((254u - exponent) << 23)};
  }
  return {__fdiv_rn(clamped, kE4M3Max), __fdiv_rn(kE4M3Max, clamped)};
}

// Two values -> two E4M3 bytes (round to nearest even, saturate to +-448), low byte first.
__device__ __forceinline__ uint16_t encode_e4m3x2(float first, float second) {
  return static_cast<uint16_t>(__nv_cvt_float2_to_fp8x2(make_float2(first, second), __NV_SATFINITE, __NV_E4M3));
}

__device__ __forceinline__ uint8_t encode_e4m3(float value) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(value, __NV_SATFINITE, __NV_E4M3));
}

}  // namespace megamoe::kernels
