// Host-side storage types shared with the device: bf16 bits and FP8 E4M3 bytes.
// The device uses __nv_bfloat16 / __nv_fp8_e4m3, which have the same bit layout.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace megamoe {

enum class DType { bf16, fp32, fp8_e4m3 };

const char* to_string(DType dtype);
int size_of(DType dtype);

// bfloat16 as raw bits; conversion from float rounds to nearest even like __float2bfloat16_rn.
struct bf16_t {
  uint16_t bits = 0;

  static bf16_t from_float(float value) {
    uint32_t u;
    std::memcpy(&u, &value, sizeof u);
    if (std::isnan(value)) return bf16_t{static_cast<uint16_t>((u >> 16) | 0x0040u)};  // quiet NaN, sign kept
    const uint32_t rounding_bias = 0x7FFFu + ((u >> 16) & 1u);
    return bf16_t{static_cast<uint16_t>((u + rounding_bias) >> 16)};
  }

  float to_float() const {
    const uint32_t u = static_cast<uint32_t>(bits) << 16;
    float value;
    std::memcpy(&value, &u, sizeof value);
    return value;
  }
};
static_assert(sizeof(bf16_t) == 2);

}  // namespace megamoe
