// FP8 E4M3 (the "fn" variant: no infinities, 0x7F/0xFF are NaN) and UE8M0 codecs, bit-exact with
// what the device's cvt.rn.satfinite.e4m3x2.f32 and our quantization kernels produce.
#pragma once

#include <cstdint>

#include "megamoe/spec.hpp"

namespace megamoe::quant {

inline constexpr float kE4M3Max = 448.0f;
// Blocks whose absolute maximum is below this are scaled as if it were this value, so a block of
// zeros gets a finite, nonzero scale (the DeepSeek-V3 / DeepGEMM convention).
inline constexpr float kMinBlockAmax = 1e-4f;
inline constexpr uint8_t kE4M3NaN = 0x7F;

// Round to nearest even; values beyond +-448 (and +-inf) saturate to +-448; NaN -> 0x7F.
uint8_t e4m3_encode(float value);
float e4m3_decode(uint8_t code);

// Power-of-two scale 2^ceil(log2(ratio)) for a positive normal ratio, as the UE8M0 byte
// (exponent + 127) and as its float value.
uint8_t ue8m0_encode_ceil(float ratio);
float ue8m0_decode(uint8_t code);

// The scale of a block whose absolute maximum is `amax`, and the factor values are multiplied by
// before encoding. fp32: scale = amax / 448 and factor = 448 / amax (both IEEE round-to-nearest);
// ue8m0: scale = 2^ceil(log2(amax / 448)) and factor = 1 / scale (exact).
struct BlockScale {
  float scale;
  float factor;
};
BlockScale block_scale(float amax, ScaleFormat format);

}  // namespace megamoe::quant
