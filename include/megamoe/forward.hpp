// The buffers of one forward call and their validation.
#pragma once

#include <cstdint>

#include "megamoe/spec.hpp"

namespace megamoe {

// One call's inputs; all pointers address memory of the device that runs the call (host memory
// for the CPU reference).
struct MoeInputs {
  int num_tokens = 0;                     // T, 0 <= T <= planned capacity (0: nothing is read or written)
  const void* x = nullptr;                // [T, H] bf16, 16-byte aligned
  const float* router_logits = nullptr;   // [T, E] fp32 (softmax_topk, deepseek_grouped)
  const int32_t* topk_ids = nullptr;      // [T, k] int32 (precomputed); -1 = not routed here
  const float* topk_weights = nullptr;    // [T, k] fp32 (precomputed)
  // Optional device int32: only the first *num_valid_tokens rows (clamped to [0, T]) are real;
  // the rest are padding that routes nowhere and whose y rows are left as they were. For callers
  // whose token count is known on the device only (a CUDA graph captured at a padded size, or the
  // rows an expert-parallel dispatch received): T is then the upper bound that sizes the launch.
  // The GPU forward reads it after the previous kernel on the stream finished; the CPU reference
  // does not take it.
  const int32_t* num_valid_tokens = nullptr;
  // Optional, with num_valid_tokens: how many rows the caller expects to be real, 1 <= n <= T (0:
  // T). Only the choice of tile shapes reads it, so a wrong guess costs speed, never correctness:
  // a launch sized for 8192 rows that usually carries a few hundred then runs the small-batch tiles.
  int expected_valid_tokens = 0;
  // Optional: this call's routing instead of the spec's (experts, top_k and shapes stay), for a
  // framework whose routing is a call argument. It decides, as the spec's would, whether the call
  // reads router_logits or topk_ids/topk_weights. Nothing of it outlives the call: a CUDA graph
  // replays the routing it captured.
  const Routing* routing = nullptr;
  // Optional, precision fp8_block: x already quantized, as E4M3 codes [T, H] (one byte each, the
  // same 16-byte alignment) with one fp32 scale per token and 128 channels: token t's scale of
  // channels [128 b, 128 b + 128) at x_scales[b * x_scale_stride + t] (0: a stride of T), decoded
  // value = e4m3(code) * scale. The layer then uses these codes and scales as they are instead of
  // quantizing x itself (a bf16 x quantized by the layer's own rule, ScaleFormat included, gives
  // the same bits as passing the bf16 x). For callers whose activations arrive quantized (an
  // expert-parallel dispatch carrying FP8 rows, a fused quantizing norm). Not with
  // MoeLayerOptions::launch = single_kernel.
  const float* x_scales = nullptr;
  int x_scale_stride = 0;
};

// The stride of a call's x_scales: x_scale_stride, or num_tokens where that is 0.
inline int x_scale_stride_of(const MoeInputs& inputs) {
  return inputs.x_scale_stride != 0 ? inputs.x_scale_stride : inputs.num_tokens;
}

struct MoeOutputs {
  void* y = nullptr;  // [T, H] bf16, 16-byte aligned, must not overlap any input
};

// Alignment the kernels rely on: TMA rows and 16-byte vector stores.
inline constexpr int kActivationAlignment = 16;

// Throws megamoe::Error (null_pointer, misaligned_pointer, aliasing, capacity_exceeded,
// invalid_argument, invalid_spec for a bad inputs.routing) before anything is read or written.
void validate_forward_args(const MoeSpec& spec, int capacity_tokens, const MoeInputs& inputs,
                           const MoeOutputs& outputs);

}  // namespace megamoe
