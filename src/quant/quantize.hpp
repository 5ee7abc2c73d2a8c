// Quantization to FP8 E4M3: weights in 128x128 blocks, activations per row per 128 channels
// (fp8_block), or whole tensors with one scale (fp8_tensor). Every function here defines the
// exact arithmetic the device kernels reproduce.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "megamoe/spec.hpp"

namespace megamoe::quant {

inline constexpr int kQuantBlock = 128;

// Quantizes `count` values spaced `stride` apart as one block: writes the codes to `codes`
// (same spacing) and returns the block's scale. Decoded value = e4m3_decode(code) * scale.
float quantize_block(const float* values, int count, long stride, ScaleFormat format,
                     uint8_t* codes);

// Row-major [rows, cols] matrix, cols a multiple of 128: one scale per row per 128 columns,
// scales [rows, cols/128].
struct QuantizedRows {
  std::vector<uint8_t> codes;
  std::vector<float> scales;
};
QuantizedRows quantize_rows_per_128(const float* values, int rows, int cols, ScaleFormat format);

// Row-major [rows, cols] matrix, both multiples of 128: one scale per 128x128 block.
// Writes codes [rows, cols] and scales [rows/128, cols/128].
void quantize_blocks_128x128(const float* values, int rows, int cols, ScaleFormat format, uint8_t* codes,
                             float* scales);

// Decoded value of every code, row-major [rows, cols], given per-row-per-128 scales.
std::vector<double> dequantize_rows_per_128(const uint8_t* codes, const float* scales, int rows,
                                            int cols);

// Per-tensor quantization (fp8_tensor's activations): one static fp32 scale for a whole tensor,
// of which the device holds the scale only. Its factor is therefore 1.0f / scale (one IEEE fp32
// division, round to nearest), not quantize_block's 448 / amax: the two can differ in the last bit.
float tensor_factor(float scale);
// The per-tensor scale of a tensor whose absolute maximum is `amax`: max(amax, kMinBlockAmax) / 448,
// block_scale's fp32 scale.
float tensor_scale(float amax);
// codes[i] = e4m3_encode(values[i] * tensor_factor(scale)) (saturating at +-448).
void quantize_per_tensor(const float* values, size_t count, float scale, uint8_t* codes);
// Decoded values e4m3_decode(code) * scale, exact in double.
std::vector<double> dequantize_per_tensor(const uint8_t* codes, size_t count, float scale);

}  // namespace megamoe::quant
