// Weight preparation: from the vLLM/SGLang layout to the layout the kernels stream.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "megamoe/dtypes.hpp"
#include "megamoe/spec.hpp"

namespace megamoe {

// How an fp8_e4m3 checkpoint's fp32 scales cover one matrix [rows, cols] of an expert.
enum class ScaleLayout {
  block_128x128,  // one per 128 x 128 block, [rows/128, cols/128] (DeepSeek-V3's weight_scale_inv)
  per_row,        // one per row, i.e. output channel, [rows] (FP8-dynamic checkpoints)
  per_tensor,     // one per expert matrix, [E] (vLLM's fp8 w13_weight_scale / w2_weight_scale)
  per_gate_up,    // w13 only: one for the gate rows and one for the up rows of each expert, [E, 2]
};

// Caller weights in the layout vLLM and SGLang store: w13 [E, 2I, H] (gate rows, then up rows)
// and w2 [E, H, I], row-major, in host memory, as bf16 or fp32 values, or (fp8_e4m3) as E4M3
// bytes with fp32 scales: value = decode(byte) * scale, per 128 x 128 block of that layout the
// way DeepSeek-V3 checkpoints store weight and weight_scale_inv (w13_scales [E, 2I/128, H/128],
// w2_scales [E, H/128, I/128]), per row (w13_scales [E, 2I], w2_scales [E, H]), or per expert
// matrix (w13_scales [E] or [E, 2], w2_scales [E]).
// A precision fp8_tensor spec takes the static activation scales a per-tensor checkpoint carries
// (vLLM's w13_input_scale and w2_input_scale): input_scale_count values each, one per layer (1) or
// one per expert (E), of which the largest is used, as vLLM does; with neither of the two (vLLM's
// activation_scheme "dynamic") the layer computes them on the device each forward (InputScales).
struct WeightsView {
  const void* w13 = nullptr;
  const void* w2 = nullptr;
  DType dtype = DType::bf16;
  const float* w13_scales = nullptr;  // fp8_e4m3 only (refused beside bf16 or fp32 values)
  const float* w2_scales = nullptr;   // fp8_e4m3 only (refused beside bf16 or fp32 values)
  ScaleLayout w13_scale_layout = ScaleLayout::block_128x128;
  ScaleLayout w2_scale_layout = ScaleLayout::block_128x128;
  const float* w13_input_scale = nullptr;  // fp8_tensor: the scale of the layer input x
  const float* w2_input_scale = nullptr;   // fp8_tensor: the scale of FC2's input (SwiGLU's output)
  int input_scale_count = 1;               // 1 or E
};

// Packed weights, row-major with K contiguous (what TMA and wgmma read):
//  - w13: [E, 2I, H]; rows interleaved by 8 (gate[0:8], up[0:8], gate[8:16], ...) so that the
//    wgmma fragment of one thread holds both halves of a SwiGLU pair.
//  - w2:  [E, H, I], rows in the original order.
//  - bf16: 2-byte elements, no scales. fp8_block: E4M3 bytes and one fp32 scale per 128x128
//    block of the packed matrix (w13_scales [E, 2I/128, H/128], w2_scales [E, H/128, I/128]);
//    the value of an element is decode(byte) * scale. fp8_tensor: E4M3 bytes, w13_scales [E, 2]
//    (the gate rows' scale, then the up rows'), w2_scales [E], and the two activation scales:
//    x is encoded as e4m3(x * (1 / fc1_input_scale)), FC2's input h as e4m3(h * (1 / fc2_input_scale)).
struct PackedWeightsView;

// Where an fp8_tensor layer's two activation scales come from.
enum class InputScales {
  from_checkpoint,  // static: fc1_input_scale and fc2_input_scale, fixed when the weights are packed
  dynamic,          // per forward, on the device: amax / 448 of x, and of FC2's input over every routed
                    // row (FC1 then stores bf16 and a pass encodes it: docs/decisions.md#dynamic-input-scales)
};

struct PackedWeights {
  int num_experts = 0;
  int hidden = 0;
  int intermediate = 0;
  Precision precision = Precision::bf16;
  ScaleFormat scale_format = ScaleFormat::fp32;
  std::vector<uint8_t> w13;
  std::vector<float> w13_scales;
  std::vector<uint8_t> w2;
  std::vector<float> w2_scales;
  InputScales input_scales = InputScales::from_checkpoint;  // fp8_tensor only
  float fc1_input_scale = 0.0f;  // fp8_tensor from_checkpoint only
  float fc2_input_scale = 0.0f;  // fp8_tensor from_checkpoint only

  int element_bytes() const { return precision == Precision::bf16 ? 2 : 1; }
  // Bytes one expert's weights and scales occupy (what a touched expert costs to stream).
  size_t bytes_per_expert() const;
  PackedWeightsView view() const;
};

// Packed weights in memory the caller owns, on the host or on a device: PackedWeights' layout,
// as pointers (what prepare_weights produces, or the same bytes packed elsewhere, e.g. by the
// Python package on the GPU). Sizes follow from the shapes: w13 2*I*H and w2 H*I elements per
// expert, and for fp8_block one scale per 128 x 128 block of each (fp8_tensor: 2 and 1 per expert).
struct PackedWeightsView {
  int num_experts = 0;
  int hidden = 0;
  int intermediate = 0;
  Precision precision = Precision::bf16;
  ScaleFormat scale_format = ScaleFormat::fp32;
  const uint8_t* w13 = nullptr;
  const float* w13_scales = nullptr;  // fp8 only
  const uint8_t* w2 = nullptr;
  const float* w2_scales = nullptr;   // fp8 only
  InputScales input_scales = InputScales::from_checkpoint;  // fp8_tensor only
  float fc1_input_scale = 0.0f;       // fp8_tensor from_checkpoint only (host values)
  float fc2_input_scale = 0.0f;

  size_t w13_bytes() const;
  size_t w2_bytes() const;
  size_t w13_scale_count() const;
  size_t w2_scale_count() const;
};

// Called after each expert is packed (done experts, total); long packs report progress with it.
using PackProgress = std::function<void(int done, int total)>;

// Throws megamoe::Error(invalid_spec) for an invalid spec (as validate(spec)), and
// (invalid_argument) unless `packed` was prepared for `spec` (same shapes, precision and, for
// fp8_block, scale format; the message names the first field that differs) and holds the bytes
// and scales its shapes need, its fp8 scales finite and positive (as prepare_weights packs them).
void validate_packed(const MoeSpec& spec, const PackedWeights& packed);
// The same for a view, whose pointers must also be set (scales for fp8 only), and whose
// from_checkpoint fp8_tensor input scales must be positive normal floats (1 / scale must be finite).
void validate_packed(const MoeSpec& spec, const PackedWeightsView& packed);

// Validates the spec and the view, then packs. Throws megamoe::Error on bad input.
// From fp8_e4m3 input the values are decoded, and every packed block re-quantized from them.
// With block scales, w2's packed blocks are the checkpoint's blocks, so an fp8_block spec with
// fp32 scales keeps w2's values exactly when the checkpoint's scales are block amax / 448 (the
// usual rule). A packed w13 block holds 64 gate and 64 up rows, which come from two checkpoint
// blocks: its values are re-rounded to the E4M3 grid of the larger of the two scales. A bf16 spec
// converts the decoded values to bf16. An fp8_tensor spec keeps per-tensor fp8_e4m3 input as it is
// (codes and scales; a per_tensor w13 scale serves gate and up); from any other input each
// expert's gate rows, up rows and w2 are quantized with scale amax / 448 each. It takes the
// activation scales from weights.w13_input_scale / w2_input_scale (positive normal floats), or,
// where both are null, packs InputScales::dynamic. Other precisions never read them, so a bf16 or
// fp8_block layer loads the same checkpoint.
PackedWeights prepare_weights(const MoeSpec& spec, const WeightsView& weights,
                              const PackProgress& progress = {});

// Inverse of prepare_weights for tests and references: the dequantized values in the original
// vLLM layout, fp32 (w13 [E, 2I, H], w2 [E, H, I]). Throws megamoe::Error where the pack's shapes
// are no valid spec's (invalid_spec) or its buffers do not hold them (invalid_argument).
struct DequantizedWeights {
  std::vector<float> w13;
  std::vector<float> w2;
};
DequantizedWeights unpack_weights(const PackedWeights& packed);

}  // namespace megamoe
