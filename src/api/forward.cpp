// Validation of one forward call's buffers.
#include "megamoe/forward.hpp"

#include <cstdint>
#include <string>

#include "megamoe/error.hpp"

namespace megamoe {
namespace {

struct Span {
  const char* name;
  uintptr_t begin;
  size_t bytes;
};

void require_pointer(const void* ptr, const char* name, size_t alignment) {
  if (ptr == nullptr) throw Error(ErrorCode::null_pointer, std::string(name) + " is null");
  if (reinterpret_cast<uintptr_t>(ptr) % alignment != 0) {
    throw Error(ErrorCode::misaligned_pointer, std::string(name) + " must be " + std::to_string(alignment) +
                                                   "-byte aligned (got address " +
                                                   std::to_string(reinterpret_cast<uintptr_t>(ptr)) + ")");
  }
}

bool overlaps(const Span& a, const Span& b) {
  return a.bytes > 0 && b.bytes > 0 && a.begin < b.begin + b.bytes && b.begin < a.begin + a.bytes;
}

}  // namespace

void validate_forward_args(const MoeSpec& spec, int capacity_tokens, const MoeInputs& inputs,
                           const MoeOutputs& outputs) {
  validate(spec);
  const Routing& routing = inputs.routing != nullptr ? *inputs.routing : spec.routing;
  if (inputs.routing != nullptr) validate_routing(routing, spec);
  const int T = inputs.num_tokens;
  if (T < 0) throw Error(ErrorCode::invalid_argument, "num_tokens=" + std::to_string(T) + " must be >= 0");
  if (T > capacity_tokens) {
    throw Error(ErrorCode::capacity_exceeded, "num_tokens=" + std::to_string(T) + " exceeds the capacity of " +
                                                  std::to_string(capacity_tokens) +
                                                  " tokens this layer was planned for; plan a larger max_tokens");
  }
  if (inputs.expected_valid_tokens != 0) {
    if (inputs.num_valid_tokens == nullptr) {
      throw Error(ErrorCode::invalid_argument,
                  "expected_valid_tokens is a hint for a device row count: set num_valid_tokens too, or leave it 0");
    }
    if (inputs.expected_valid_tokens < 0 || inputs.expected_valid_tokens > T) {
      throw Error(ErrorCode::invalid_argument, "expected_valid_tokens=" + std::to_string(inputs.expected_valid_tokens) +
                                                   " must lie in [0, num_tokens=" + std::to_string(T) + "]");
    }
  }
  const bool quantized_x = inputs.x_scales != nullptr;
  if (quantized_x && spec.precision != Precision::fp8_block) {
    throw Error(ErrorCode::invalid_argument,
                std::string("x_scales (x already quantized per 128 channels) needs precision fp8_block, not ") +
                    to_string(spec.precision) + ": pass a bf16 x");
  }
  if (!quantized_x && inputs.x_scale_stride != 0) {
    throw Error(ErrorCode::invalid_argument, "x_scale_stride=" + std::to_string(inputs.x_scale_stride) +
                                                 " is set without x_scales: set both, or neither");
  }
  if (quantized_x && inputs.x_scale_stride != 0 && inputs.x_scale_stride < T) {
    throw Error(ErrorCode::invalid_argument, "x_scale_stride=" + std::to_string(inputs.x_scale_stride) +
                                                 " must be 0 (num_tokens) or at least num_tokens=" + std::to_string(T) +
                                                 " (x_scales holds [hidden / 128][x_scale_stride] floats)");
  }
  if (T == 0) return;  // nothing is read or written

  const size_t H = static_cast<size_t>(spec.hidden);
  const size_t E = static_cast<size_t>(spec.num_experts);
  const size_t k = static_cast<size_t>(spec.top_k);
  require_pointer(inputs.x, "x", kActivationAlignment);
  if (quantized_x) require_pointer(inputs.x_scales, "x_scales", alignof(float));
  if (inputs.num_valid_tokens != nullptr) require_pointer(inputs.num_valid_tokens, "num_valid_tokens", alignof(int32_t));
  require_pointer(outputs.y, "y", kActivationAlignment);

  // The device row count too: every combine block reads it while the others write y.
  const size_t x_element_bytes = quantized_x ? 1 : 2;
  Span inputs_read[5] = {{"x", reinterpret_cast<uintptr_t>(inputs.x), T * H * x_element_bytes}, {}, {}, {}, {}};
  if (quantized_x) {
    const size_t stride = static_cast<size_t>(x_scale_stride_of(inputs));
    inputs_read[4] = {"x_scales", reinterpret_cast<uintptr_t>(inputs.x_scales),
                      ((H / 128 - 1) * stride + T) * sizeof(float)};
  }
  if (inputs.num_valid_tokens != nullptr) {
    inputs_read[3] = {"num_valid_tokens", reinterpret_cast<uintptr_t>(inputs.num_valid_tokens), sizeof(int32_t)};
  }
  if (std::holds_alternative<Precomputed>(routing)) {
    require_pointer(inputs.topk_ids, "topk_ids (precomputed routing)", alignof(int32_t));
    require_pointer(inputs.topk_weights, "topk_weights (precomputed routing)", alignof(float));
    inputs_read[1] = {"topk_ids", reinterpret_cast<uintptr_t>(inputs.topk_ids), T * k * sizeof(int32_t)};
    inputs_read[2] = {"topk_weights", reinterpret_cast<uintptr_t>(inputs.topk_weights), T * k * sizeof(float)};
  } else {
    require_pointer(inputs.router_logits, "router_logits", alignof(float));
    inputs_read[1] = {"router_logits", reinterpret_cast<uintptr_t>(inputs.router_logits), T * E * sizeof(float)};
  }
  const Span y{"y", reinterpret_cast<uintptr_t>(outputs.y), T * H * 2};
  for (const Span& input : inputs_read) {
    if (overlaps(y, input)) {
      throw Error(ErrorCode::aliasing, std::string("y overlaps ") + input.name + "; in-place forward is not supported");
    }
  }
}

}  // namespace megamoe
