// MoeSpec validation and printing.
#include "megamoe/spec.hpp"

#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <ostream>
#include <sstream>

#include "megamoe/dtypes.hpp"
#include "megamoe/error.hpp"

namespace megamoe {
namespace {

[[noreturn]] void reject(const std::string& message) { throw Error(ErrorCode::invalid_spec, message); }

// Why channel_granularity(precision) is what it is, for the error that enforces it.
const char* granularity_reason(Precision precision) {
  switch (precision) {
    case Precision::bf16: return "one 128-byte K slice of bf16";
    case Precision::fp8_block: return "one scale per 128 channels";
    case Precision::fp8_tensor: return "one 128-byte K slice of E4M3 per pipeline stage";
  }
  return "?";
}

void validate_grouped(const DeepseekGrouped& mode, const MoeSpec& spec) {
  const int E = spec.num_experts;
  if (mode.n_group < 1 || E % mode.n_group != 0) {
    reject("deepseek_grouped: n_group=" + std::to_string(mode.n_group) + " must be >= 1 and divide num_experts=" +
           std::to_string(E));
  }
  if (mode.topk_group < 1 || mode.topk_group > mode.n_group) {
    reject("deepseek_grouped: topk_group=" + std::to_string(mode.topk_group) + " must be in [1, n_group=" +
           std::to_string(mode.n_group) + "]");
  }
  const int reachable = mode.topk_group * (E / mode.n_group);
  if (spec.top_k > reachable) {
    reject("deepseek_grouped: top_k=" + std::to_string(spec.top_k) + " exceeds the " + std::to_string(reachable) +
           " experts in topk_group=" + std::to_string(mode.topk_group) + " groups of " + std::to_string(E / mode.n_group));
  }
  if (!std::isfinite(mode.routed_scaling_factor) || mode.routed_scaling_factor <= 0.0f) {
    std::ostringstream message;
    message << "deepseek_grouped: routed_scaling_factor=" << mode.routed_scaling_factor << " must be finite and > 0";
    reject(message.str());
  }
  const std::vector<float>& bias = mode.e_score_correction_bias;
  if (!bias.empty() && static_cast<int>(bias.size()) != E) {
    reject("deepseek_grouped: e_score_correction_bias has " + std::to_string(bias.size()) +
           " entries; it needs num_experts=" + std::to_string(E) + " (or none)");
  }
  for (size_t i = 0; i < bias.size(); ++i) {
    if (!std::isfinite(bias[i])) {
      std::ostringstream message;
      message << "deepseek_grouped: e_score_correction_bias[" << i << "] = " << bias[i] << ": the bias must be finite";
      reject(message.str());
    }
  }
}

}  // namespace

const char* to_string(ErrorCode code) {
  switch (code) {
    case ErrorCode::invalid_spec: return "invalid spec";
    case ErrorCode::invalid_argument: return "invalid argument";
    case ErrorCode::null_pointer: return "null pointer";
    case ErrorCode::misaligned_pointer: return "misaligned pointer";
    case ErrorCode::aliasing: return "aliasing buffers";
    case ErrorCode::capacity_exceeded: return "capacity exceeded";
    case ErrorCode::unsupported: return "unsupported";
    case ErrorCode::cuda_error: return "CUDA error";
    case ErrorCode::out_of_memory: return "out of memory";
    case ErrorCode::no_device: return "no usable GPU";
    case ErrorCode::timeout: return "timeout";
  }
  return "unknown error";
}

const char* to_string(DType dtype) {
  switch (dtype) {
    case DType::bf16: return "bf16";
    case DType::fp32: return "fp32";
    case DType::fp8_e4m3: return "fp8_e4m3";
  }
  return "?";
}

int size_of(DType dtype) {
  switch (dtype) {
    case DType::bf16: return 2;
    case DType::fp32: return 4;
    case DType::fp8_e4m3: return 1;
  }
  return 0;
}

const char* to_string(Precision precision) {
  switch (precision) {
    case Precision::bf16: return "bf16";
    case Precision::fp8_block: return "fp8_block";
    case Precision::fp8_tensor: return "fp8_tensor";
  }
  return "?";
}
const char* to_string(ScaleFormat format) { return format == ScaleFormat::ue8m0 ? "ue8m0" : "fp32"; }

std::string to_string(const Routing& routing) {
  std::ostringstream os;
  if (const auto* softmax = std::get_if<SoftmaxTopK>(&routing)) {
    os << "softmax_topk(renormalize=" << (softmax->renormalize ? "true" : "false") << ")";
  } else if (const auto* grouped = std::get_if<DeepseekGrouped>(&routing)) {
    os << "deepseek_grouped(n_group=" << grouped->n_group << ", topk_group=" << grouped->topk_group
       << ", routed_scaling_factor=" << grouped->routed_scaling_factor
       << ", renormalize=" << (grouped->renormalize ? "true" : "false")
       << ", bias=" << (grouped->e_score_correction_bias.empty() ? "none" : "per-expert") << ")";
  } else if (std::holds_alternative<Precomputed>(routing)) {
    os << "precomputed";
  } else {
    os << "none (valueless)";
  }
  return os.str();
}

int channel_granularity(Precision precision) { return precision == Precision::bf16 ? 64 : 128; }

void validate(const MoeSpec& spec) {
  // An enum cast from another language's integer may name none of its values: such a precision
  // would pack one byte per element and write bf16's two (prepare_weights), so it is refused here.
  if (spec.precision != Precision::bf16 && spec.precision != Precision::fp8_block &&
      spec.precision != Precision::fp8_tensor) {
    reject("precision=" + std::to_string(static_cast<int>(spec.precision)) +
           " is none of Precision::bf16, fp8_block and fp8_tensor");
  }
  if (spec.scale_format != ScaleFormat::fp32 && spec.scale_format != ScaleFormat::ue8m0) {
    reject("scale_format=" + std::to_string(static_cast<int>(spec.scale_format)) +
           " is neither ScaleFormat::fp32 nor ScaleFormat::ue8m0");
  }
  if (spec.num_experts < 1) reject("num_experts=" + std::to_string(spec.num_experts) + " must be >= 1");
  if (spec.top_k < 1 || spec.top_k > spec.num_experts) {
    reject("top_k=" + std::to_string(spec.top_k) + " must be in [1, num_experts=" + std::to_string(spec.num_experts) + "]");
  }
  const int granularity = channel_granularity(spec.precision);
  for (auto [name, value] : {std::pair{"hidden", spec.hidden}, std::pair{"intermediate", spec.intermediate}}) {
    if (value < granularity || value % granularity != 0) {
      reject(std::string(name) + "=" + std::to_string(value) + " must be a positive multiple of " +
             std::to_string(granularity) + " for precision " + to_string(spec.precision) + " (" +
             granularity_reason(spec.precision) + ")");
    }
  }
  // W13 has 2 x intermediate rows, counted in int by the packer, the planner and the kernels.
  if (spec.intermediate > INT_MAX / 2) {
    reject("intermediate=" + std::to_string(spec.intermediate) + " must be at most " + std::to_string(INT_MAX / 2) +
           " (W13's 2 x intermediate rows are counted in a 32-bit int)");
  }
  // Every byte count of the packed weights is a product of E, H and I: past what one allocation can
  // hold (std::vector's limit) the size_t products would wrap, and a pack sized by them would be
  // short of its shapes.
  const unsigned long long element_bytes = spec.precision == Precision::bf16 ? 2 : 1;
  unsigned long long bytes = 3 * element_bytes;
  for (const int factor : {spec.num_experts, spec.hidden, spec.intermediate}) {
    if (bytes > static_cast<unsigned long long>(PTRDIFF_MAX) / static_cast<unsigned long long>(factor)) {
      std::ostringstream message;
      message << "num_experts=" << spec.num_experts << ", hidden=" << spec.hidden
              << " and intermediate=" << spec.intermediate << " make packed weights of 3 x E x H x I x "
              << element_bytes << " = " << 3.0 * element_bytes * spec.num_experts * spec.hidden * spec.intermediate
              << " bytes; one allocation holds at most " << PTRDIFF_MAX;
      reject(message.str());
    }
    bytes *= static_cast<unsigned long long>(factor);
  }
  if (spec.precision != Precision::fp8_block && spec.scale_format != ScaleFormat::fp32) {
    reject(std::string("scale_format=ue8m0 only applies to precision fp8_block; precision ") +
           to_string(spec.precision) + " takes scale_format=fp32");
  }
  validate_routing(spec.routing, spec);
}

void validate_routing(const Routing& routing, const MoeSpec& spec) {
  // A variant whose assignment threw holds none of the three: every reader would take it for
  // another (a forward would ask for router logits and route as precomputed).
  if (routing.valueless_by_exception()) {
    reject("routing holds no value (an exception interrupted its last assignment); it takes SoftmaxTopK, "
           "DeepseekGrouped or Precomputed");
  }
  if (const auto* grouped = std::get_if<DeepseekGrouped>(&routing)) validate_grouped(*grouped, spec);
}

std::ostream& operator<<(std::ostream& os, const MoeSpec& spec) {
  return os << "MoeSpec{E=" << spec.num_experts << ", k=" << spec.top_k << ", H=" << spec.hidden
            << ", I=" << spec.intermediate << ", precision=" << to_string(spec.precision)
            << (spec.precision == Precision::fp8_block ? std::string(", scales=") + to_string(spec.scale_format) : "")
            << ", routing=" << to_string(spec.routing) << "}";
}

}  // namespace megamoe
