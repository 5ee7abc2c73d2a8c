// Device side of the block-scale rule of src/ref/fp8_codec.cpp (block_scale) and of the E4M3
// conversion; both must stay bit-identical with the host codec.
#pragma once

#include <cuda_bf16.h>
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

// Eight bf16 values of one 16-byte vector as floats (exact).
__device__ __forceinline__ void bf16x8_to_floats(const uint4& raw, float* out) {
  const __nv_bfloat16* v = reinterpret_cast<const __nv_bfloat16*>(&raw);
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = __bfloat162float(v[i]);
}

// values * factor as E4M3 pairs, low byte first: codes[kValues / 2].
template <int kValues>
__device__ __forceinline__ void encode_with_factor(const float (&values)[kValues], float factor, uint16_t* codes) {
#pragma unroll
  for (int i = 0; i < kValues / 2; ++i) codes[i] = encode_e4m3x2(values[2 * i] * factor, values[2 * i + 1] * factor);
}

// One lane's kValues consecutive channels of a 128-channel block that 128 / kValues consecutive,
// aligned lanes of the warp hold together: the block's scale (its amax gathered by shuffles) and
// this lane's codes under it. Every lane of the warp calls it; a lane without channels passes
// zeros, which change no block's amax.
template <int kValues>
__device__ __forceinline__ BlockScale encode_lane_block_values(const float (&values)[kValues], bool ue8m0,
                                                               uint16_t* codes) {
  constexpr int kLanesPerBlock = 128 / kValues;
  static_assert(128 % kValues == 0 && kLanesPerBlock <= 32, "a block's lanes lie within one warp");
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kValues; ++i) amax = fmaxf(amax, fabsf(values[i]));
#pragma unroll
  for (int offset = kLanesPerBlock / 2; offset > 0; offset /= 2) {
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  }
  const BlockScale s = block_scale(amax, ue8m0);
  encode_with_factor(values, s.factor, codes);
  return s;
}

}  // namespace megamoe::kernels
