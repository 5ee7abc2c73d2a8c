// prepare_weights: vLLM-layout weights -> interleaved, optionally FP8-block-quantized packs.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <string>
#include <tuple>

#include "kernels/layout/weight_layout.hpp"
#include "megamoe/error.hpp"
#include "megamoe/weights.hpp"
#include "quant/fp8_codec.hpp"
#include "common/parallel_for.hpp"
#include "quant/quantize.hpp"
#include "weights/packed_decode.hpp"

namespace megamoe {
namespace {

// One expert's matrix as fp32 in `out`, whatever the caller's dtype; `rows` of `cols` values,
// row r landing at out row row_map(r). `scales` is the expert's scales in `layout` (fp8_e4m3 only).
template <class RowMap>
void load_matrix(const void* base, DType dtype, const float* scales, ScaleLayout layout, size_t offset, int rows,
                 int cols, RowMap row_map, std::vector<float>& out) {
  out.resize(static_cast<size_t>(rows) * cols);
  for (int r = 0; r < rows; ++r) {
    float* dst = out.data() + static_cast<size_t>(row_map(r)) * cols;
    const size_t first = offset + static_cast<size_t>(r) * cols;
    if (dtype == DType::fp32) {
      std::memcpy(dst, static_cast<const float*>(base) + first, cols * sizeof(float));
    } else if (dtype == DType::bf16) {
      const bf16_t* src = static_cast<const bf16_t*>(base) + first;
      for (int c = 0; c < cols; ++c) dst[c] = src[c].to_float();
    } else if (layout == ScaleLayout::per_row) {
      const uint8_t* src = static_cast<const uint8_t*>(base) + first;
      for (int c = 0; c < cols; ++c) dst[c] = quant::e4m3_decode(src[c]) * scales[r];
    } else {
      const uint8_t* src = static_cast<const uint8_t*>(base) + first;
      const float* row_scales = scales + static_cast<size_t>(r / quant::kQuantBlock) * (cols / quant::kQuantBlock);
      for (int c = 0; c < cols; ++c) dst[c] = quant::e4m3_decode(src[c]) * row_scales[c / quant::kQuantBlock];
    }
  }
}

// Input scales one expert's [rows, cols] matrix holds in `layout`.
size_t matrix_scale_count(ScaleLayout layout, int rows, int cols) {
  if (layout == ScaleLayout::per_row) return static_cast<size_t>(rows);
  return static_cast<size_t>(rows / quant::kQuantBlock) * (cols / quant::kQuantBlock);
}

// Packs one row-major matrix into `codes` (bf16 bits or E4M3 bytes) and, for fp8, `scales`.
void pack_matrix(const std::vector<float>& values, int rows, int cols, const PackedWeights& packed, uint8_t* codes,
                 float* scales) {
  if (packed.precision == Precision::fp8_block) {
    quant::quantize_blocks_128x128(values.data(), rows, cols, packed.scale_format, codes, scales);
    return;
  }
  for (size_t i = 0; i < values.size(); ++i) {
    const bf16_t b = bf16_t::from_float(values[i]);
    std::memcpy(codes + i * sizeof(bf16_t), &b, sizeof b);
  }
}

}  // namespace

namespace weights {

void decode_packed_row(const PackedWeights& packed, PackedMatrix matrix, int expert, int row, double* out) {
  const bool w13 = matrix == PackedMatrix::w13;
  const int rows = w13 ? 2 * packed.intermediate : packed.hidden;
  const int cols = w13 ? packed.hidden : packed.intermediate;
  const std::vector<uint8_t>& codes = w13 ? packed.w13 : packed.w2;
  const size_t first = (static_cast<size_t>(expert) * rows + row) * cols;
  if (packed.precision == Precision::bf16) {
    for (int c = 0; c < cols; ++c) {
      bf16_t b;
      std::memcpy(&b, codes.data() + (first + c) * sizeof(bf16_t), sizeof b);
      out[c] = b.to_float();
    }
    return;
  }
  using quant::kQuantBlock;
  const int block_cols = cols / kQuantBlock;
  const float* row_scales = (w13 ? packed.w13_scales : packed.w2_scales).data() +
                            (static_cast<size_t>(expert) * (rows / kQuantBlock) + row / kQuantBlock) * block_cols;
  for (int c = 0; c < cols; ++c) {
    out[c] = quant::e4m3_decode(codes[first + c]) * static_cast<double>(row_scales[c / kQuantBlock]);
  }
}

}  // namespace weights

void validate_packed(const MoeSpec& spec, const PackedWeightsView& packed) {
  if (packed.num_experts != spec.num_experts || packed.hidden != spec.hidden ||
      packed.intermediate != spec.intermediate || packed.precision != spec.precision ||
      (spec.precision == Precision::fp8_block && packed.scale_format != spec.scale_format)) {
    throw Error(ErrorCode::invalid_argument,
                "packed weights were prepared for a different spec; call prepare_weights with this spec");
  }
  if (packed.w13 == nullptr || packed.w2 == nullptr) {
    throw Error(ErrorCode::null_pointer, "packed weights: w13 and w2 are required");
  }
  if (packed.precision == Precision::fp8_block && (packed.w13_scales == nullptr || packed.w2_scales == nullptr)) {
    throw Error(ErrorCode::null_pointer, "packed fp8_block weights need w13_scales and w2_scales");
  }
}

void validate_packed(const MoeSpec& spec, const PackedWeights& packed) {
  const PackedWeightsView view = packed.view();
  if (packed.w13.size() != view.w13_bytes() || packed.w2.size() != view.w2_bytes() ||
      packed.w13_scales.size() != view.w13_scale_count() || packed.w2_scales.size() != view.w2_scale_count()) {
    throw Error(ErrorCode::invalid_argument, "packed weights hold " + std::to_string(packed.w13.size()) + " + " +
                                                 std::to_string(packed.w2.size()) + " bytes where their shapes need " +
                                                 std::to_string(view.w13_bytes()) + " + " +
                                                 std::to_string(view.w2_bytes()));
  }
  validate_packed(spec, view);
}

PackedWeightsView PackedWeights::view() const {
  auto scales = [](const std::vector<float>& v) { return v.empty() ? nullptr : v.data(); };
  return PackedWeightsView{num_experts, hidden, intermediate, precision, scale_format,
                           w13.data(), scales(w13_scales), w2.data(), scales(w2_scales)};
}

size_t PackedWeightsView::w13_bytes() const {
  return 2ull * num_experts * intermediate * hidden * (precision == Precision::fp8_block ? 1 : 2);
}

size_t PackedWeightsView::w2_bytes() const { return w13_bytes() / 2; }

size_t PackedWeightsView::w13_scale_count() const {
  if (precision != Precision::fp8_block) return 0;
  return 2ull * num_experts * (intermediate / quant::kQuantBlock) * (hidden / quant::kQuantBlock);
}

size_t PackedWeightsView::w2_scale_count() const { return w13_scale_count() / 2; }

size_t PackedWeights::bytes_per_expert() const {
  PackedWeightsView one_expert = view();
  one_expert.num_experts = 1;
  return one_expert.w13_bytes() + one_expert.w2_bytes() +
         (one_expert.w13_scale_count() + one_expert.w2_scale_count()) * sizeof(float);
}

PackedWeights prepare_weights(const MoeSpec& spec, const WeightsView& weights, const PackProgress& progress) {
  validate(spec);
  if (weights.w13 == nullptr) throw Error(ErrorCode::null_pointer, "weights.w13 is null");
  if (weights.w2 == nullptr) throw Error(ErrorCode::null_pointer, "weights.w2 is null");
  const int E = spec.num_experts, H = spec.hidden, I = spec.intermediate;
  if (weights.dtype == DType::fp8_e4m3) {
    if (weights.w13_scales == nullptr || weights.w2_scales == nullptr) {
      throw Error(ErrorCode::null_pointer, "fp8_e4m3 weights need their scales: weights.w13_scales and "
                                           "weights.w2_scales (fp32, per 128x128 block or per row)");
    }
    for (auto [name, scales, layout, rows, cols] :
         {std::tuple{"w13_scales", weights.w13_scales, weights.w13_scale_layout, 2 * I, H},
          std::tuple{"w2_scales", weights.w2_scales, weights.w2_scale_layout, H, I}}) {
      if (layout == ScaleLayout::block_128x128 && (rows % quant::kQuantBlock != 0 || cols % quant::kQuantBlock != 0)) {
        throw Error(ErrorCode::invalid_argument, std::string("weights.") + name + " come in 128x128 blocks: hidden=" +
                                                     std::to_string(H) + " and intermediate=" + std::to_string(I) +
                                                     " must be multiples of 128 (or pass scales per row)");
      }
      const size_t count = static_cast<size_t>(E) * matrix_scale_count(layout, rows, cols);
      for (size_t i = 0; i < count; ++i) {
        if (!std::isfinite(scales[i]) || scales[i] <= 0.0f) {
          throw Error(ErrorCode::invalid_argument, std::string("weights.") + name + "[" + std::to_string(i) +
                                                       "] = " + std::to_string(scales[i]) +
                                                       ": scales must be finite and positive");
        }
      }
    }
  } else if (weights.dtype != DType::bf16 && weights.dtype != DType::fp32) {
    throw Error(ErrorCode::invalid_argument, std::string("weights.dtype=") + to_string(weights.dtype) +
                                                 " is not accepted; pass bf16, fp32 or fp8_e4m3 (with scales) weights");
  }
  PackedWeights packed;
  packed.num_experts = E;
  packed.hidden = H;
  packed.intermediate = I;
  packed.precision = spec.precision;
  packed.scale_format = spec.scale_format;
  const size_t w13_count = 2ull * I * H;
  const size_t w2_count = static_cast<size_t>(H) * I;
  const bool fp8 = packed.precision == Precision::fp8_block;
  packed.w13.resize(E * w13_count * packed.element_bytes());
  packed.w2.resize(E * w2_count * packed.element_bytes());
  const size_t w13_scale_count = fp8 ? w13_count / (quant::kQuantBlock * quant::kQuantBlock) : 0;
  const size_t w2_scale_count = fp8 ? w2_count / (quant::kQuantBlock * quant::kQuantBlock) : 0;
  packed.w13_scales.resize(E * w13_scale_count);
  packed.w2_scales.resize(E * w2_scale_count);

  std::mutex progress_mutex;
  int done = 0;
  parallel_for(E, [&](int e) {
    // Reused across the experts a thread packs: fresh buffers would fault in new pages each time.
    thread_local std::vector<float> scratch;
    // Input scales of this expert (fp8_e4m3).
    const float* w13_input_scales =
        weights.w13_scales ? weights.w13_scales + e * matrix_scale_count(weights.w13_scale_layout, 2 * I, H) : nullptr;
    const float* w2_input_scales =
        weights.w2_scales ? weights.w2_scales + e * matrix_scale_count(weights.w2_scale_layout, H, I) : nullptr;
    load_matrix(weights.w13, weights.dtype, w13_input_scales, weights.w13_scale_layout, e * w13_count, 2 * I, H,
                [I](int row) { return layout::packed_w13_row(row, I); }, scratch);
    pack_matrix(scratch, 2 * I, H, packed, packed.w13.data() + e * w13_count * packed.element_bytes(),
                packed.w13_scales.data() + e * w13_scale_count);
    load_matrix(weights.w2, weights.dtype, w2_input_scales, weights.w2_scale_layout, e * w2_count, H, I,
                [](int row) { return row; }, scratch);
    pack_matrix(scratch, H, I, packed, packed.w2.data() + e * w2_count * packed.element_bytes(),
                packed.w2_scales.data() + e * w2_scale_count);
    if (progress) {
      std::lock_guard<std::mutex> lock(progress_mutex);
      progress(++done, E);
    }
  });
  return packed;
}

namespace weights {

ExpertMatrices decode_expert(const PackedWeights& packed, int expert) {
  const int H = packed.hidden, I = packed.intermediate;
  ExpertMatrices out;
  out.w13.resize(2ull * I * H);
  out.w2.resize(static_cast<size_t>(H) * I);
  for (int row = 0; row < 2 * I; ++row) {
    decode_packed_row(packed, PackedMatrix::w13, expert, layout::packed_w13_row(row, I),
                      out.w13.data() + static_cast<size_t>(row) * H);
  }
  for (int row = 0; row < H; ++row) {
    decode_packed_row(packed, PackedMatrix::w2, expert, row, out.w2.data() + static_cast<size_t>(row) * I);
  }
  return out;
}

}  // namespace weights

DequantizedWeights unpack_weights(const PackedWeights& packed) {
  DequantizedWeights out;
  for (int e = 0; e < packed.num_experts; ++e) {
    const weights::ExpertMatrices expert = weights::decode_expert(packed, e);
    out.w13.insert(out.w13.end(), expert.w13.begin(), expert.w13.end());
    out.w2.insert(out.w2.end(), expert.w2.begin(), expert.w2.end());
  }
  return out;
}

}  // namespace megamoe
