#include "quant/fp8_codec.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>

namespace megamoe::quant {
namespace {

constexpr int kExponentBias = 7;
constexpr int kMantissaBits = 3;
constexpr uint8_t kMaxFiniteCode = 0x7E;  // exponent 15, mantissa 110: 448

std::array<float, 256> make_decode_table() {
  std::array<float, 256> table{};
  for (int code = 0; code < 256; ++code) {
    const int exponent = (code >> kMantissaBits) & 0xF;
    const int mantissa = code & 0x7;
    float magnitude;
    if ((code & 0x7F) == 0x7F) {
      magnitude = NAN;
    } else if (exponent == 0) {
      magnitude = std::ldexp(static_cast<float>(mantissa), 1 - kExponentBias - kMantissaBits);
    } else {
      magnitude = std::ldexp(1.0f + mantissa / 8.0f, exponent - kExponentBias);
    }
    table[code] = (code & 0x80) ? -magnitude : magnitude;
  }
  return table;
}

const std::array<float, 256> kDecodeTable = make_decode_table();

}  // namespace

uint8_t e4m3_encode(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80);
  const uint32_t magnitude = bits & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) return kE4M3NaN;
  if (magnitude >= 0x43E00000u) return sign | kMaxFiniteCode;  // >= 448 (and inf) saturates

  // Below the smallest normal (2^-6) the grid is uniform with step 2^-9; scaling by 2^9 is exact,
  // and nearbyint rounds half to even. A result of 8 is the smallest normal, code 0x08.
  if (magnitude < 0x3C800000u) {
    float absolute;
    std::memcpy(&absolute, &magnitude, sizeof absolute);
    return sign | static_cast<uint8_t>(std::nearbyint(absolute * 512.0f));
  }
  // Normal: keep 3 of the 23 mantissa bits, rounding half to even on the 20 dropped bits; a carry
  // moves into the exponent by itself. Rebias the exponent from 127 to 7.
  constexpr int kDropped = 23 - kMantissaBits;
  const uint32_t rounded = magnitude + ((1u << (kDropped - 1)) - 1) + ((magnitude >> kDropped) & 1u);
  const int exponent = static_cast<int>(rounded >> 23) - 127 + kExponentBias;
  const uint32_t code = (static_cast<uint32_t>(exponent) << kMantissaBits) | ((rounded >> kDropped) & 0x7u);
  return sign | static_cast<uint8_t>(std::min<uint32_t>(code, kMaxFiniteCode));
}

float e4m3_decode(uint8_t code) { return kDecodeTable[code]; }

uint8_t ue8m0_encode_ceil(float ratio) {
  uint32_t bits;
  std::memcpy(&bits, &ratio, sizeof bits);
  const int biased_exponent = static_cast<int>((bits >> 23) & 0xFF);
  const bool has_fraction = (bits & 0x7FFFFF) != 0;
  return static_cast<uint8_t>(biased_exponent + (has_fraction ? 1 : 0));
}

float ue8m0_decode(uint8_t code) { return std::ldexp(1.0f, static_cast<int>(code) - 127); }

BlockScale block_scale(float amax, ScaleFormat format) {
  const float clamped = std::max(amax, kMinBlockAmax);
  if (format == ScaleFormat::ue8m0) {
    const float scale = ue8m0_decode(ue8m0_encode_ceil(clamped / kE4M3Max));
    return {scale, 1.0f / scale};
  }
  return {clamped / kE4M3Max, kE4M3Max / clamped};
}

}  // namespace megamoe::quant
