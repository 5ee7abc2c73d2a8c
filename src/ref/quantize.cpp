#include "ref/quantize.hpp"

#include <cmath>

#include "ref/fp8_codec.hpp"

namespace megamoe::ref {

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
  std::vector<float> block(static_cast<size_t>(kQuantBlock) * kQuantBlock);
  std::vector<uint8_t> block_codes(block.size());
  for (int rb = 0; rb < rows / kQuantBlock; ++rb) {
    for (int cb = 0; cb < block_cols; ++cb) {
      const size_t corner = static_cast<size_t>(rb) * kQuantBlock * cols + static_cast<size_t>(cb) * kQuantBlock;
      for (int r = 0; r < kQuantBlock; ++r)
        for (int c = 0; c < kQuantBlock; ++c)
          block[static_cast<size_t>(r) * kQuantBlock + c] = values[corner + static_cast<size_t>(r) * cols + c];
      scales[static_cast<size_t>(rb) * block_cols + cb] =
          quantize_block(block.data(), static_cast<int>(block.size()), 1, format, block_codes.data());
      for (int r = 0; r < kQuantBlock; ++r)
        for (int c = 0; c < kQuantBlock; ++c)
          codes[corner + static_cast<size_t>(r) * cols + c] = block_codes[static_cast<size_t>(r) * kQuantBlock + c];
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

}  // namespace megamoe::ref
