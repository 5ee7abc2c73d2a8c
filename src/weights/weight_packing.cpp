// prepare_weights: vLLM-layout weights -> interleaved, optionally FP8-quantized packs.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>

#include "kernels/layout/weight_layout.hpp"
#include "megamoe/error.hpp"
#include "megamoe/weights.hpp"
#include "quant/fp8_codec.hpp"
#include "common/parallel_for.hpp"
#include "quant/quantize.hpp"
#include "weights/packed_decode.hpp"

namespace megamoe {
namespace {

// One expert's matrix [rows, cols] of the caller's weights: `offset` elements into `base`, and
// (fp8_e4m3) this expert's scales in `layout`.
struct SourceMatrix {
  const char* name;  // "w13" or "w2", for errors
  int expert;
  const void* base;
  DType dtype;
  const float* scales;
  ScaleLayout layout;
  size_t offset;
  int rows;
  int cols;
};

// A NaN or inf weight would spoil its whole quantization block (and the output of every token
// routed to its expert): refused, named by its place in the caller's tensor [E, rows, cols].
[[noreturn]] void refuse_weight(const SourceMatrix& m, int row, int col, float value);

// Throws for the first non-finite value of row `row` of `m`, decoded as `values`.
void require_finite_row(const SourceMatrix& m, int row, const float* values) {
  for (int c = 0; c < m.cols; ++c) {
    if (!std::isfinite(values[c])) refuse_weight(m, row, c, values[c]);
  }
}

// Layouts with one scale for many rows of an expert matrix (vLLM's fp8 checkpoints).
bool is_per_tensor(ScaleLayout layout) {
  return layout == ScaleLayout::per_tensor || layout == ScaleLayout::per_gate_up;
}

// The scale of row `row` of a [rows, cols] matrix in a layout other than block_128x128, as an
// index into the expert's scales. per_gate_up's rows are w13's: gate rows [0, rows/2), up rows after.
size_t row_scale_index(ScaleLayout layout, int row, int rows) {
  if (layout == ScaleLayout::per_row) return static_cast<size_t>(row);
  return layout == ScaleLayout::per_gate_up && row >= rows / 2 ? 1 : 0;
}

// Checkpoint scales one expert's [rows, cols] matrix holds in `layout`.
size_t matrix_scale_count(ScaleLayout layout, int rows, int cols) {
  switch (layout) {
    case ScaleLayout::block_128x128:
      return static_cast<size_t>(rows / quant::kQuantBlock) * (cols / quant::kQuantBlock);
    case ScaleLayout::per_row: return static_cast<size_t>(rows);
    case ScaleLayout::per_tensor: return 1;
    case ScaleLayout::per_gate_up: return 2;
  }
  return 0;
}

// One expert's matrix as fp32 in `out`, whatever the caller's dtype; row r lands at out row
// row_map(r).
template <class RowMap>
void load_matrix(const SourceMatrix& m, RowMap row_map, std::vector<float>& out) {
  const int cols = m.cols;
  out.resize(static_cast<size_t>(m.rows) * cols);
  for (int r = 0; r < m.rows; ++r) {
    float* dst = out.data() + static_cast<size_t>(row_map(r)) * cols;
    const size_t first = m.offset + static_cast<size_t>(r) * cols;
    if (m.dtype == DType::fp32) {
      std::memcpy(dst, static_cast<const float*>(m.base) + first, cols * sizeof(float));
    } else if (m.dtype == DType::bf16) {
      const bf16_t* src = static_cast<const bf16_t*>(m.base) + first;
      for (int c = 0; c < cols; ++c) dst[c] = src[c].to_float();
    } else if (m.layout == ScaleLayout::block_128x128) {
      const uint8_t* src = static_cast<const uint8_t*>(m.base) + first;
      const float* row_scales = m.scales + static_cast<size_t>(r / quant::kQuantBlock) * (cols / quant::kQuantBlock);
      for (int c = 0; c < cols; ++c) dst[c] = quant::e4m3_decode(src[c]) * row_scales[c / quant::kQuantBlock];
    } else {
      const uint8_t* src = static_cast<const uint8_t*>(m.base) + first;
      const float scale = m.scales[row_scale_index(m.layout, r, m.rows)];
      for (int c = 0; c < cols; ++c) dst[c] = quant::e4m3_decode(src[c]) * scale;
    }
    require_finite_row(m, r, dst);
  }
}

// Packs one row-major matrix into `codes` (bf16 bits or E4M3 bytes) and, for fp8_block, `scales`.
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

// Buffers a thread reuses across the experts it packs: fresh ones would fault in new pages each time.
struct PackScratch {
  std::vector<float> values;
  std::vector<uint8_t> codes;
};

// fp8_tensor: one expert's matrix as E4M3 `codes`, row r at row_map(r), with one scale for each of
// `parts` equal row ranges of the original order (w13: the gate rows, then the up rows; w2: all).
// Per-tensor fp8_e4m3 input keeps its codes and scales bit for bit (a per_tensor scale serves
// every part). Any other input is decoded and each part quantized as one block by quantize_block:
// scale max(amax, 1e-4) / 448 and codes e4m3(v * 448 / max(amax, 1e-4)), the factor of fp8_block's
// weight blocks (the activations, of which the device holds only the scale, use tensor_factor's 1 / scale).
template <class RowMap>
void pack_tensor_matrix(const SourceMatrix& m, int parts, RowMap row_map, PackScratch& scratch, uint8_t* codes,
                        float* scales) {
  const uint8_t* original = nullptr;
  if (m.dtype == DType::fp8_e4m3 && is_per_tensor(m.layout)) {
    original = static_cast<const uint8_t*>(m.base) + m.offset;
    for (int p = 0; p < parts; ++p) scales[p] = m.scales[row_scale_index(m.layout, p * (m.rows / parts), m.rows)];
    // The codes are kept, not decoded, so their values are checked here as load_matrix checks what it
    // decodes: a NaN code, or (where 448 x scale is past FLT_MAX) a code whose value decode(code) x
    // scale is inf, which the other precisions refuse for the same checkpoint.
    const int rows_per_part = m.rows / parts;
    for (int r = 0; r < m.rows; ++r) {
      const float scale = scales[r / rows_per_part];
      const bool may_overflow = !std::isfinite(quant::kE4M3Max * scale);
      const uint8_t* row = original + static_cast<size_t>(r) * m.cols;
      for (int c = 0; c < m.cols; ++c) {
        if ((row[c] & 0x7F) == quant::kE4M3NaN || (may_overflow && !std::isfinite(quant::e4m3_decode(row[c]) * scale))) {
          refuse_weight(m, r, c, quant::e4m3_decode(row[c]) * scale);
        }
      }
    }
  } else {
    load_matrix(m, [](int row) { return row; }, scratch.values);
    scratch.codes.resize(scratch.values.size());
    const size_t part = scratch.values.size() / parts;
    for (int p = 0; p < parts; ++p) {
      scales[p] = quant::quantize_block(scratch.values.data() + p * part, static_cast<int>(part), 1,
                                        ScaleFormat::fp32, scratch.codes.data() + p * part);
    }
    original = scratch.codes.data();
  }
  for (int r = 0; r < m.rows; ++r) {
    std::memcpy(codes + static_cast<size_t>(row_map(r)) * m.cols, original + static_cast<size_t>(r) * m.cols, m.cols);
  }
}

std::string format_float(float value) {
  std::ostringstream os;
  os << value;
  return os.str();
}

void refuse_weight(const SourceMatrix& m, int row, int col, float value) {
  throw Error(ErrorCode::invalid_argument, std::string("weights.") + m.name + "[" + std::to_string(m.expert) + ", " +
                                               std::to_string(row) + ", " + std::to_string(col) + "] = " +
                                               (std::isnan(value) ? "nan" : format_float(value)) +
                                               ": weights must be finite (a NaN or inf would spoil the output of "
                                               "every token routed to that expert)");
}

// Refuses the first of `count` weight scales that is not finite and positive, named `name`[i] with
// its value, then `rule`.
void require_finite_positive_scales(const std::string& name, const float* scales, size_t count, const char* rule) {
  for (size_t i = 0; i < count; ++i) {
    if (!std::isfinite(scales[i]) || scales[i] <= 0.0f) {
      throw Error(ErrorCode::invalid_argument,
                  name + "[" + std::to_string(i) + "] = " + format_float(scales[i]) + ": " + rule);
    }
  }
}

// fp8_tensor's activation scales: the device multiplies by 1 / scale, which a subnormal scale
// overflows to inf (and 0 * inf is NaN), so only positive normal floats are taken.
bool is_valid_input_scale(float scale) { return std::isnormal(scale) && scale > 0.0f; }

// The static activation scale of an fp8_tensor layer from the caller's `count` values of
// weights.<name>: the largest, as vLLM takes it (one scale serves every expert's tokens, and the
// largest saturates none of them sooner than its own would).
float static_input_scale(const char* name, const float* values, int count) {
  float largest = 0.0f;
  for (int i = 0; i < count; ++i) {
    if (!is_valid_input_scale(values[i])) {
      throw Error(ErrorCode::invalid_argument,
                  std::string("weights.") + name + "[" + std::to_string(i) + "] = " + format_float(values[i]) +
                      ": activation scales must be positive normal floats (finite, > 0 and not subnormal: the "
                      "activations are multiplied by 1 / scale)");
    }
    largest = std::max(largest, values[i]);
  }
  return largest;
}

}  // namespace

namespace weights {

void decode_packed_row(const PackedWeights& packed, PackedMatrix matrix, int expert, int row, double* out) {
  const bool w13 = matrix == PackedMatrix::w13;
  const int I = packed.intermediate;
  const int rows = w13 ? 2 * I : packed.hidden;
  const int cols = w13 ? packed.hidden : I;
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
  if (packed.precision == Precision::fp8_tensor) {
    const bool up = w13 && layout::original_w13_row(row, I) >= I;
    const double scale = w13 ? packed.w13_scales[2 * static_cast<size_t>(expert) + (up ? 1 : 0)]
                              : packed.w2_scales[expert];
    for (int c = 0; c < cols; ++c) out[c] = quant::e4m3_decode(codes[first + c]) * scale;
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

namespace {

// A precision or scale format as its name, or as the integer of a value that names none.
std::string name_of(Precision precision) {
  const std::string name = to_string(precision);
  return name != "?" ? name : std::to_string(static_cast<int>(precision));
}
std::string name_of(ScaleFormat format) {
  return format == ScaleFormat::fp32 || format == ScaleFormat::ue8m0 ? to_string(format)
                                                                     : std::to_string(static_cast<int>(format));
}

// Refuses a pack made for another spec, naming the first field in which they differ.
void require_prepared_for(const MoeSpec& spec, const PackedWeightsView& packed) {
  auto differ = [](const char* field, const std::string& packed_value, const std::string& spec_value) {
    throw Error(ErrorCode::invalid_argument, std::string("packed weights have ") + field + "=" + packed_value +
                                                 " where the spec has " + field + "=" + spec_value +
                                                 ": call prepare_weights with this spec");
  };
  for (auto [field, packed_value, spec_value] :
       {std::tuple{"num_experts", packed.num_experts, spec.num_experts}, std::tuple{"hidden", packed.hidden, spec.hidden},
        std::tuple{"intermediate", packed.intermediate, spec.intermediate}}) {
    if (packed_value != spec_value) differ(field, std::to_string(packed_value), std::to_string(spec_value));
  }
  if (packed.precision != spec.precision) differ("precision", name_of(packed.precision), name_of(spec.precision));
  if (spec.precision == Precision::fp8_block && packed.scale_format != spec.scale_format) {
    differ("scale_format", name_of(packed.scale_format), name_of(spec.scale_format));
  }
}

// A PackedWeights' buffers hold what its shapes need (its own fields, which may not be a valid spec's).
void require_sizes(const PackedWeights& packed) {
  const PackedWeightsView view = packed.view();
  if (packed.w13.size() != view.w13_bytes() || packed.w2.size() != view.w2_bytes() ||
      packed.w13_scales.size() != view.w13_scale_count() || packed.w2_scales.size() != view.w2_scale_count()) {
    throw Error(ErrorCode::invalid_argument, "packed weights hold " + std::to_string(packed.w13.size()) + " + " +
                                                 std::to_string(packed.w2.size()) + " bytes and " +
                                                 std::to_string(packed.w13_scales.size()) + " + " +
                                                 std::to_string(packed.w2_scales.size()) +
                                                 " scales where their shapes need " + std::to_string(view.w13_bytes()) +
                                                 " + " + std::to_string(view.w2_bytes()) + " and " +
                                                 std::to_string(view.w13_scale_count()) + " + " +
                                                 std::to_string(view.w2_scale_count()));
  }
}

// A PackedWeights' fp8 weight scales (held on the host, so they can be read here): finite and
// positive, as prepare_weights packs every one. A pack filled elsewhere with a NaN, inf, zero or
// negative scale would pass every other check and turn each output row of that expert into NaN,
// inf or zeros without an error.
void require_scale_values(const PackedWeights& packed) {
  for (auto [name, scales] : {std::pair{"w13_scales", &packed.w13_scales}, std::pair{"w2_scales", &packed.w2_scales}}) {
    require_finite_positive_scales(std::string("packed weights: ") + name, scales->data(), scales->size(),
                                   "fp8 weight scales must be finite and positive (prepare_weights packs no other)");
  }
}

// The pointers a view of `packed.precision` needs, and its fp8_tensor input scales.
void require_buffers(const PackedWeightsView& packed) {
  for (auto [name, pointer] : {std::pair{"w13", static_cast<const void*>(packed.w13)},
                               std::pair{"w2", static_cast<const void*>(packed.w2)}}) {
    if (pointer == nullptr) throw Error(ErrorCode::null_pointer, std::string("packed weights: ") + name + " is null");
  }
  if (packed.precision != Precision::bf16) {
    for (auto [name, pointer] : {std::pair{"w13_scales", packed.w13_scales}, std::pair{"w2_scales", packed.w2_scales}}) {
      if (pointer == nullptr) {
        throw Error(ErrorCode::null_pointer, std::string("packed ") + to_string(packed.precision) + " weights: " + name +
                                                 " is null; fp8 weights need their scales");
      }
    }
  }
  if (packed.precision == Precision::fp8_tensor && packed.input_scales != InputScales::from_checkpoint &&
      packed.input_scales != InputScales::dynamic) {
    throw Error(ErrorCode::invalid_argument,
                "packed fp8_tensor weights: input_scales=" + std::to_string(static_cast<int>(packed.input_scales)) +
                    " is neither InputScales::from_checkpoint nor InputScales::dynamic");
  }
  if (packed.precision == Precision::fp8_tensor && packed.input_scales == InputScales::from_checkpoint &&
      !(is_valid_input_scale(packed.fc1_input_scale) && is_valid_input_scale(packed.fc2_input_scale))) {
    throw Error(ErrorCode::invalid_argument,
                "packed fp8_tensor weights with input_scales=from_checkpoint need finite, positive, normal "
                "fc1_input_scale and fc2_input_scale (got " +
                    format_float(packed.fc1_input_scale) + " and " + format_float(packed.fc2_input_scale) +
                    "); prepare_weights takes them from weights.w13_input_scale and weights.w2_input_scale, or "
                    "packs input_scales=dynamic without them");
  }
}

}  // namespace

// The spec first: an invalid one is named as such, not as a pack that does not match it.
void validate_packed(const MoeSpec& spec, const PackedWeightsView& packed) {
  validate(spec);
  require_prepared_for(spec, packed);
  require_buffers(packed);
}

void validate_packed(const MoeSpec& spec, const PackedWeights& packed) {
  validate(spec);
  const PackedWeightsView view = packed.view();
  require_prepared_for(spec, view);
  require_sizes(packed);
  require_buffers(view);
  require_scale_values(packed);
}

PackedWeightsView PackedWeights::view() const {
  auto scales = [](const std::vector<float>& v) { return v.empty() ? nullptr : v.data(); };
  return PackedWeightsView{num_experts, hidden, intermediate, precision, scale_format,
                           w13.data(), scales(w13_scales), w2.data(), scales(w2_scales),
                           input_scales, fc1_input_scale, fc2_input_scale};
}

size_t PackedWeightsView::w13_bytes() const {
  return 2ull * num_experts * intermediate * hidden * (precision == Precision::bf16 ? 2 : 1);
}

size_t PackedWeightsView::w2_bytes() const { return w13_bytes() / 2; }

size_t PackedWeightsView::w13_scale_count() const {
  switch (precision) {
    case Precision::bf16: return 0;
    case Precision::fp8_block:
      return 2ull * num_experts * (intermediate / quant::kQuantBlock) * (hidden / quant::kQuantBlock);
    case Precision::fp8_tensor: return 2ull * num_experts;  // the gate rows' scale, then the up rows'
  }
  return 0;
}

size_t PackedWeightsView::w2_scale_count() const {
  // Half of w13's in either fp8 layout: w2 has half the blocks, and one scale per expert to w13's two.
  return w13_scale_count() / 2;
}

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
                                           "weights.w2_scales (fp32, per 128x128 block, per row or per expert matrix)");
    }
    // A layout cast from another language's integer may name none of them: none of its scales would
    // be checked, and every value of every expert would be decoded with the first.
    for (auto [name, layout] : {std::pair{"w13_scale_layout", weights.w13_scale_layout},
                                std::pair{"w2_scale_layout", weights.w2_scale_layout}}) {
      if (layout != ScaleLayout::block_128x128 && layout != ScaleLayout::per_row && !is_per_tensor(layout)) {
        throw Error(ErrorCode::invalid_argument, std::string("weights.") + name + "=" +
                                                     std::to_string(static_cast<int>(layout)) +
                                                     " is none of ScaleLayout::block_128x128, per_row, per_tensor "
                                                     "and per_gate_up");
      }
    }
    if (weights.w2_scale_layout == ScaleLayout::per_gate_up) {
      throw Error(ErrorCode::invalid_argument,
                  "weights.w2_scale_layout=per_gate_up applies to w13 only (its gate and up rows); w2 has one "
                  "matrix per expert: pass its scales as per_tensor [E]");
    }
    for (auto [name, scales, layout, rows, cols] :
         {std::tuple{"w13_scales", weights.w13_scales, weights.w13_scale_layout, 2 * I, H},
          std::tuple{"w2_scales", weights.w2_scales, weights.w2_scale_layout, H, I}}) {
      if (layout == ScaleLayout::block_128x128 && (rows % quant::kQuantBlock != 0 || cols % quant::kQuantBlock != 0)) {
        throw Error(ErrorCode::invalid_argument, std::string("weights.") + name + " come in 128x128 blocks: hidden=" +
                                                     std::to_string(H) + " and intermediate=" + std::to_string(I) +
                                                     " must be multiples of 128 (or pass scales per row)");
      }
      require_finite_positive_scales(std::string("weights.") + name, scales,
                                     static_cast<size_t>(E) * matrix_scale_count(layout, rows, cols),
                                     "scales must be finite and positive");
    }
  } else if (weights.dtype != DType::bf16 && weights.dtype != DType::fp32) {
    // Only a value cast from another language's integer gets here: it is named by that integer.
    throw Error(ErrorCode::invalid_argument, "weights.dtype=" + std::to_string(static_cast<int>(weights.dtype)) +
                                                 " is none of DType::bf16, fp32 and fp8_e4m3 (with scales)");
  } else if (weights.w13_scales != nullptr || weights.w2_scales != nullptr) {
    // bf16 and fp32 values are read as they are: scales beside them would be dropped without a word,
    // and codes upcast from an fp8 checkpoint without their scales applied would pack as wrong
    // values. The Python packer refuses them too.
    throw Error(ErrorCode::invalid_argument,
                std::string("weights.") + (weights.w13_scales != nullptr ? "w13_scales" : "w2_scales") +
                    " is set, but weights.dtype=" + to_string(weights.dtype) +
                    " takes no scales (they go with DType::fp8_e4m3 codes): apply them to the values first, or "
                    "pass the E4M3 codes");
  }
  PackedWeights packed;
  packed.num_experts = E;
  packed.hidden = H;
  packed.intermediate = I;
  packed.precision = spec.precision;
  packed.scale_format = spec.scale_format;
  // Only fp8_tensor quantizes its activations with one scale per tensor; the other precisions
  // leave the input scales unread (bf16 does not quantize them, fp8_block scales each token's 128
  // channels).
  if (spec.precision == Precision::fp8_tensor) {
    if ((weights.w13_input_scale == nullptr) != (weights.w2_input_scale == nullptr)) {
      throw Error(ErrorCode::null_pointer,
                  std::string("precision fp8_tensor takes weights.w13_input_scale and weights.w2_input_scale "
                              "together (the checkpoint's static activation scales) or neither (scales computed "
                              "on the device each forward); got only ") +
                      (weights.w13_input_scale != nullptr ? "w13_input_scale" : "w2_input_scale"));
    }
    if (weights.w13_input_scale == nullptr) {
      packed.input_scales = InputScales::dynamic;
    } else {
      if (weights.input_scale_count != 1 && weights.input_scale_count != E) {
        throw Error(ErrorCode::invalid_argument,
                    "weights.input_scale_count=" + std::to_string(weights.input_scale_count) +
                        " must be 1 (one scale per layer) or num_experts=" + std::to_string(E) + " (one per expert)");
      }
      packed.fc1_input_scale =
          static_input_scale("w13_input_scale", weights.w13_input_scale, weights.input_scale_count);
      packed.fc2_input_scale = static_input_scale("w2_input_scale", weights.w2_input_scale, weights.input_scale_count);
    }
  }
  const size_t w13_count = 2ull * I * H;
  const size_t w2_count = static_cast<size_t>(H) * I;
  const PackedWeightsView sizes = packed.view();
  packed.w13.resize(sizes.w13_bytes());
  packed.w2.resize(sizes.w2_bytes());
  packed.w13_scales.resize(sizes.w13_scale_count());
  packed.w2_scales.resize(sizes.w2_scale_count());
  const size_t w13_scales_per_expert = sizes.w13_scale_count() / E;
  const size_t w2_scales_per_expert = sizes.w2_scale_count() / E;

  std::mutex progress_mutex;
  int done = 0;
  parallel_for(E, [&](int e) {
    thread_local PackScratch scratch;
    // This expert's matrices, with their checkpoint scales (fp8_e4m3).
    auto expert_scales = [&](const float* scales, ScaleLayout layout, int rows, int cols) {
      return scales ? scales + e * matrix_scale_count(layout, rows, cols) : nullptr;
    };
    const SourceMatrix w13{"w13", e, weights.w13, weights.dtype,
                           expert_scales(weights.w13_scales, weights.w13_scale_layout, 2 * I, H),
                           weights.w13_scale_layout, e * w13_count, 2 * I, H};
    const SourceMatrix w2{"w2", e, weights.w2, weights.dtype,
                          expert_scales(weights.w2_scales, weights.w2_scale_layout, H, I),
                          weights.w2_scale_layout, e * w2_count, H, I};
    const auto w13_packed_row = [I](int row) { return layout::packed_w13_row(row, I); };
    const auto w2_packed_row = [](int row) { return row; };
    uint8_t* w13_codes = packed.w13.data() + e * w13_count * packed.element_bytes();
    uint8_t* w2_codes = packed.w2.data() + e * w2_count * packed.element_bytes();
    float* w13_scales = packed.w13_scales.data() + e * w13_scales_per_expert;
    float* w2_scales = packed.w2_scales.data() + e * w2_scales_per_expert;
    if (packed.precision == Precision::fp8_tensor) {
      pack_tensor_matrix(w13, 2, w13_packed_row, scratch, w13_codes, w13_scales);
      pack_tensor_matrix(w2, 1, w2_packed_row, scratch, w2_codes, w2_scales);
    } else {
      load_matrix(w13, w13_packed_row, scratch.values);
      pack_matrix(scratch.values, 2 * I, H, packed, w13_codes, w13_scales);
      load_matrix(w2, w2_packed_row, scratch.values);
      pack_matrix(scratch.values, H, I, packed, w2_codes, w2_scales);
    }
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
  // Its own shapes must be a layer's, and its buffers hold them: it is read by those shapes.
  MoeSpec shapes;
  shapes.num_experts = packed.num_experts;
  shapes.top_k = 1;
  shapes.hidden = packed.hidden;
  shapes.intermediate = packed.intermediate;
  shapes.precision = packed.precision;
  shapes.scale_format = packed.precision == Precision::fp8_block ? packed.scale_format : ScaleFormat::fp32;
  validate(shapes);
  require_sizes(packed);
  DequantizedWeights out;
  for (int e = 0; e < packed.num_experts; ++e) {
    const weights::ExpertMatrices expert = weights::decode_expert(packed, e);
    out.w13.insert(out.w13.end(), expert.w13.begin(), expert.w13.end());
    out.w2.insert(out.w2.end(), expert.w2.begin(), expert.w2.end());
  }
  return out;
}

}  // namespace megamoe
