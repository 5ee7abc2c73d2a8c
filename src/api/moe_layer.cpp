// MoeLayer: owns the device copy of the packed weights and the workspace, validates each call and
// enqueues the kernel sequence of kernels/impls/sm90_moe_forward.
#include "megamoe/layer.hpp"

#include <algorithm>
#include <cstdlib>
#include <initializer_list>
#include <iostream>
#include <optional>
#include <set>
#include <string>

#include "kernels/cuda_check.hpp"
#include "kernels/impls/sm90_moe_forward.hpp"
#include "kernels/layout/gemm_smem.hpp"
#include "kernels/routing/routing_limits.hpp"
#include "megamoe/error.hpp"
#include "plan/planner.hpp"

namespace megamoe {
namespace {

// A device copy of `count` elements at `source`, in host or device memory (null when empty).
template <class T>
T* copy_to_device(const T* source, size_t count) {
  if (count == 0) return nullptr;
  T* device = cuda_alloc<T>(count);
  MEGAMOE_CUDA_CHECK(cudaMemcpy(device, source, count * sizeof(T), cudaMemcpyDefault));
  return device;
}

// A PackedWeights' view, once its sizes are checked against its shapes.
PackedWeightsView checked_view(const MoeSpec& spec, const PackedWeights& weights) {
  validate_packed(spec, weights);
  return weights.view();
}

bool print_configs() {
  static const bool enabled = [] {
    const char* value = std::getenv("MEGAMOE_PRINT_CONFIGS");
    return value != nullptr && std::string(value) == "1";
  }();
  return enabled;
}

// A planner override from the environment, read when a layer is built (a process compares two
// settings with two layers), not at every forward: unset, or one of `allowed`. Anything else is
// refused, so that a mistyped measurement does not quietly run the planner's own choice.
std::optional<std::string> environment_override(const char* name, std::initializer_list<const char*> allowed,
                                                const char* allowed_in_words) {
  const char* value = std::getenv(name);
  if (value == nullptr) return std::nullopt;
  for (const char* candidate : allowed) {
    if (std::string(value) == candidate) return std::string(value);
  }
  throw Error(ErrorCode::invalid_argument,
              std::string(name) + " must be " + allowed_in_words + ", not '" + value + "'");
}

// MEGAMOE_FC1_ROW_COPY=0 or 1 overrides the planner's choice of how fp8 FC1 reads its token rows
// (plan::fc1_copies_token_rows), for A/B runs and for the test that both ways agree bit for bit.
std::optional<bool> fc1_row_copy_override() {
  const std::optional<std::string> value = environment_override("MEGAMOE_FC1_ROW_COPY", {"0", "1"}, "0 or 1");
  if (!value) return std::nullopt;
  return *value == "1";
}

// MEGAMOE_TOKEN_TILE=16, 32 or 64 overrides the planner's token tile (plan::choose_token_tile) of
// every call, for measurements; the output does not depend on it.
std::optional<int> token_tile_override() {
  const std::optional<std::string> value =
      environment_override("MEGAMOE_TOKEN_TILE", {"16", "32", "64"}, "16, 32 or 64");
  if (!value) return std::nullopt;
  return std::stoi(*value);
}

// What the routing kernel holds beyond what validate(spec) checks.
void require_routing_supported(const Routing& routing) {
  if (const auto* grouped = std::get_if<DeepseekGrouped>(&routing); grouped && grouped->n_group > kernels::kMaxGroups) {
    throw Error(ErrorCode::unsupported, "deepseek_grouped: n_group=" + std::to_string(grouped->n_group) +
                                            " exceeds the " + std::to_string(kernels::kMaxGroups) + " the routing kernel holds");
  }
}

}  // namespace

struct MoeLayer::Impl {
  uint8_t* w13 = nullptr;
  float* w13_scales = nullptr;
  uint8_t* w2 = nullptr;
  float* w2_scales = nullptr;
  float* bias = nullptr;
  void* workspace = nullptr;
  layout::MoeWorkspaceLayout workspace_layout;
  int num_sms = 0;
  plan::DeviceFacts facts;
  std::set<int> printed_token_tiles;  // MEGAMOE_PRINT_CONFIGS=1: each configuration printed once
  std::optional<bool> fc1_row_copy;   // MEGAMOE_FC1_ROW_COPY, else the planner's per call
  std::optional<int> token_tile;      // MEGAMOE_TOKEN_TILE, else the planner's per call

  ~Impl() {
    for (void* p : {static_cast<void*>(w13), static_cast<void*>(w13_scales), static_cast<void*>(w2),
                    static_cast<void*>(w2_scales), static_cast<void*>(bias), workspace}) {
      cudaFree(p);
    }
  }
};

MoeLayer::MoeLayer(const MoeSpec& spec, const PackedWeights& weights, int max_tokens)
    : MoeLayer(spec, checked_view(spec, weights), max_tokens) {}

MoeLayer::MoeLayer(const MoeSpec& spec, const PackedWeightsView& weights, int max_tokens)
    : spec_(spec), max_tokens_(max_tokens), impl_(nullptr) {
  validate(spec);
  validate_packed(spec, weights);
  if (spec.num_experts > kernels::kMaxRoutingExperts) {
    throw Error(ErrorCode::unsupported, "num_experts=" + std::to_string(spec.num_experts) + " exceeds the " +
                                            std::to_string(kernels::kMaxRoutingExperts) + " the routing kernel holds");
  }
  if (spec.top_k > kernels::kMaxTopK) {
    throw Error(ErrorCode::unsupported, "top_k=" + std::to_string(spec.top_k) + " exceeds the " +
                                            std::to_string(kernels::kMaxTopK) + " slots per token the kernels hold");
  }
  require_routing_supported(spec.routing);
  if (spec.hidden % 8 != 0) throw Error(ErrorCode::unsupported, "hidden must be a multiple of 8");

  int device = 0;
  MEGAMOE_CUDA_CHECK(cudaGetDevice(&device));
  cudaDeviceProp prop{};
  MEGAMOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  if (prop.major != 9) {
    throw Error(ErrorCode::unsupported, std::string("MoeLayer needs a Hopper GPU (sm_90); device ") +
                                            std::to_string(device) + " is " + prop.name);
  }
  if (max_tokens < 1) throw Error(ErrorCode::invalid_argument, "max_tokens must be >= 1");
  if (static_cast<int>(prop.sharedMemPerBlockOptin) < layout::kSm90SmemPerBlockOptin) {
    throw Error(ErrorCode::unsupported, "the GEMM kernels need 227 KiB of shared memory per block");
  }

  impl_ = new Impl();
  try {
    impl_->num_sms = prop.multiProcessorCount;
    impl_->facts = plan::DeviceFacts::h200_measured();
    impl_->fc1_row_copy = fc1_row_copy_override();
    impl_->token_tile = token_tile_override();
    impl_->facts.name = prop.name;
    impl_->facts.num_sms = prop.multiProcessorCount;
    impl_->facts.smem_per_block_optin = static_cast<int>(prop.sharedMemPerBlockOptin);
    // The planner sizes the workspace (one source of truth with what it reports): its padding
    // covers the token tile of every call up to max_tokens.
    impl_->workspace_layout = plan::plan_moe(spec, max_tokens, max_tokens, impl_->facts).workspace;
    if (impl_->token_tile.value_or(0) > impl_->workspace_layout.row_padding) {
      impl_->workspace_layout = plan::workspace_layout(spec, max_tokens, *impl_->token_tile);
    }
    impl_->w13 = copy_to_device(weights.w13, weights.w13_bytes());
    impl_->w13_scales = copy_to_device(weights.w13_scales, weights.w13_scale_count());
    impl_->w2 = copy_to_device(weights.w2, weights.w2_bytes());
    impl_->w2_scales = copy_to_device(weights.w2_scales, weights.w2_scale_count());
    if (const auto* grouped = std::get_if<DeepseekGrouped>(&spec.routing)) {
      impl_->bias = copy_to_device(grouped->e_score_correction_bias.data(), grouped->e_score_correction_bias.size());
    }
    MEGAMOE_CUDA_CHECK(cudaMalloc(&impl_->workspace, impl_->workspace_layout.total_bytes));
    // The routing counters must read zero when the first forward starts, on whatever stream it
    // runs (a non-blocking stream does not wait for the legacy stream's memset).
    MEGAMOE_CUDA_CHECK(cudaMemset(impl_->workspace, 0, impl_->workspace_layout.total_bytes));
    MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
  } catch (...) {
    delete impl_;
    throw;
  }
}

MoeLayer::~MoeLayer() { delete impl_; }

size_t MoeLayer::workspace_bytes() const { return impl_->workspace_layout.total_bytes; }

void MoeLayer::forward(cudaStream_t stream, const MoeInputs& inputs, const MoeOutputs& outputs, CombineMode mode) {
  validate_forward_args(spec_, max_tokens_, inputs, outputs);
  kernels::MoeForwardLaunch f{};
  f.num_tokens = inputs.num_tokens;
  f.num_valid_tokens = inputs.num_valid_tokens;
  f.num_experts = spec_.num_experts;
  f.top_k = spec_.top_k;
  f.hidden = spec_.hidden;
  f.intermediate = spec_.intermediate;
  f.fp8 = spec_.precision == Precision::fp8_block;
  f.ue8m0 = spec_.scale_format == ScaleFormat::ue8m0;
  const int planned_tokens =
      std::max(inputs.expected_valid_tokens > 0 ? inputs.expected_valid_tokens : inputs.num_tokens, 1);
  f.token_tile = impl_->token_tile.value_or(plan::choose_token_tile(spec_, planned_tokens));
  f.fc1_copies_token_rows = f.fp8 && impl_->fc1_row_copy.value_or(plan::fc1_copies_token_rows(spec_, planned_tokens));
  if (f.token_tile > impl_->workspace_layout.row_padding) {
    throw Error(ErrorCode::unsupported, "internal: token tile " + std::to_string(f.token_tile) +
                                            " exceeds the workspace padding " +
                                            std::to_string(impl_->workspace_layout.row_padding) + " (planner bug)");
  }
  if (inputs.num_tokens > 0 && print_configs() && impl_->printed_token_tiles.insert(f.token_tile).second) {
    std::cerr << "megamoe: " << spec_ << "\n" << plan::plan_moe(spec_, inputs.num_tokens, max_tokens_, impl_->facts)
              << "\n";
  }
  f.deterministic = mode == CombineMode::deterministic;
  f.grid = impl_->num_sms;
  if (const auto* softmax = std::get_if<SoftmaxTopK>(&spec_.routing)) {
    f.routing_mode = 0;
    f.renormalize = softmax->renormalize;
  } else if (const auto* grouped = std::get_if<DeepseekGrouped>(&spec_.routing)) {
    f.routing_mode = 1;
    f.renormalize = grouped->renormalize;
    f.n_group = grouped->n_group;
    f.topk_group = grouped->topk_group;
    f.routed_scaling_factor = grouped->routed_scaling_factor;
    f.bias = grouped->e_score_correction_bias.empty() ? nullptr : impl_->bias;  // empty: all zeros
  } else {
    f.routing_mode = 2;
  }
  f.x = inputs.x;
  f.router_logits = inputs.router_logits;
  f.topk_ids = inputs.topk_ids;
  f.topk_weights = inputs.topk_weights;
  f.y = outputs.y;
  f.w13 = impl_->w13;
  f.w13_scales = impl_->w13_scales;
  f.w2 = impl_->w2;
  f.w2_scales = impl_->w2_scales;
  f.workspace = impl_->workspace;
  f.workspace_layout = impl_->workspace_layout;
  kernels::launch_moe_forward(f, stream);
}

void MoeLayer::set_routing(const Routing& routing) {
  MoeSpec candidate = spec_;
  candidate.routing = routing;
  validate(candidate);
  require_routing_supported(routing);
  const auto* grouped = std::get_if<DeepseekGrouped>(&routing);
  if (grouped != nullptr && !grouped->e_score_correction_bias.empty()) {
    // A forward in flight may still read the old bias.
    MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
    if (impl_->bias == nullptr) impl_->bias = cuda_alloc<float>(grouped->e_score_correction_bias.size());
    MEGAMOE_CUDA_CHECK(cudaMemcpy(impl_->bias, grouped->e_score_correction_bias.data(),
                                  grouped->e_score_correction_bias.size() * sizeof(float), cudaMemcpyHostToDevice));
  }
  spec_ = std::move(candidate);
}

long MoeLayer::take_invalid_routing_ids(cudaStream_t stream) {
  int32_t* flags = impl_->workspace_layout.at<int32_t>(impl_->workspace, impl_->workspace_layout.error_flags);
  int32_t count = 0;
  MEGAMOE_CUDA_CHECK(cudaMemcpyAsync(&count, flags, sizeof count, cudaMemcpyDeviceToHost, stream));
  MEGAMOE_CUDA_CHECK(cudaMemsetAsync(flags, 0, sizeof count, stream));
  MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  return count;
}

}  // namespace megamoe
