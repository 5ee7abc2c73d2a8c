#include "quant/quantize.hpp"

#include <algorithm>
#include <cmath>

#include "quant/fp8_codec.hpp"

namespace megamoe::quant {

float quantize_block(const float* values, int count, long stride, ScaleFormat format,
                     uint8_t* codes) {
  float amax = 0.0f;
  for (int i = 0; i < count; ++i) amax = std::fmax(amax, std::fabs(values[i * stride]));
  const BlockScale block = block_scale(amax, format);
  for (int i = 0; i < count; ++i) codes[i * stride] = e4m3_encode(values[i * stride] * block.factor);
  return block.scale;
}

QuantizedRows quantize_rows_per_128(const float* values, int rows, int cols, ScaleFormat format) {
  const int blocks = cols / kQuantBlock;
  QuantizedRows out;
  out.codes.resize(static_cast<size_t>(rows) * cols);
  out.scales.resize(static_cast<size_t>(rows) * blocks);
  for (int r = 0; r < rows; ++r) {
    for (int b = 0; b < blocks; ++b) {
      const size_t offset = static_cast<size_t>(r) * cols + static_cast<size_t>(b) * kQuantBlock;
      out.scales[static_cast<size_t>(r) * blocks + b] =
          quantize_block(values + offset, kQuantBlock, 1, format, out.codes.data() + offset);
    }
  }
  return out;
}

void quantize_blocks_128x128(const float* values, int rows, int cols, ScaleFormat format, uint8_t* codes,
                             float* scales) {
  const int block_cols = cols / kQuantBlock;
  std::vector<float> amax(block_cols), factor(block_cols);
  // One strip of 128 rows at a time, row by row (the order memory is in): the amax of each block
  // first, then the codes. The max does not depend on the order, so this equals quantize_block.
  for (int rb = 0; rb < rows / kQuantBlock; ++rb) {
    std::fill(amax.begin(), amax.end(), 0.0f);
    for (int r = rb * kQuantBlock; r < (rb + 1) * kQuantBlock; ++r) {
      const float* row = values + static_cast<size_t>(r) * cols;
      for (int c = 0; c < cols; ++c) amax[c / kQuantBlock] = std::fmax(amax[c / kQuantBlock], std::fabs(row[c]));
    }
    for (int cb = 0; cb < block_cols; ++cb) {
      const BlockScale block = block_scale(amax[cb], format);
      scales[static_cast<size_t>(rb) * block_cols + cb] = block.scale;
      factor[cb] = block.factor;
    }
    for (int r = rb * kQuantBlock; r < (rb + 1) * kQuantBlock; ++r) {
      const float* row = values + static_cast<size_t>(r) * cols;
      uint8_t* out = codes + static_cast<size_t>(r) * cols;
      for (int c = 0; c < cols; ++c) out[c] = e4m3_encode(row[c] * factor[c / kQuantBlock]);
    }
  }
}

std::vector<double> dequantize_rows_per_128(const uint8_t* codes, const float* scales, int rows,
                                            int cols) {
  const int blocks = cols / kQuantBlock;
  std::vector<double> out(static_cast<size_t>(rows) * cols);
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) {
      const size_t i = static_cast<size_t>(r) * cols + c;
      out[i] = static_cast<double>(e4m3_decode(codes[i])) * scales[static_cast<size_t>(r) * blocks + c / kQuantBlock];
    }
  return out;
}

float tensor_factor(float scale) { return 1.0f / scale; }

float tensor_scale(float amax) { return block_scale(amax, ScaleFormat::fp32).scale; }

void quantize_per_tensor(const float* values, size_t count, float scale, uint8_t* codes) {
  const float factor = tensor_factor(scale);
  for (size_t i = 0; i < count; ++i) codes[i] = e4m3_encode(values[i] * factor);
}

std::vector<double> dequantize_per_tensor(const uint8_t* codes, size_t count, float scale) {
  std::vector<double> out(count);
  for (size_t i = 0; i < count; ++i) out[i] = static_cast<double>(e4m3_decode(codes[i])) * scale;
  return out;
}

}  // namespace megamoe::quant
