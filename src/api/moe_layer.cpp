// MoeLayer: owns the device copy of the packed weights and the workspace, validates each call and
// enqueues the kernel sequence of kernels/impls/sm90_moe_forward.
#include "megamoe/layer.hpp"

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "api/single_kernel_launch.hpp"
#include "kernels/cuda_check.hpp"
#include "kernels/impls/sm90_moe_forward.hpp"
#include "kernels/routing/routing_limits.hpp"
#include "megamoe/error.hpp"
#include "plan/planner.hpp"
#include "quant/quantize.hpp"

namespace megamoe {
namespace {

// A device copy of `count` elements at `source`, in host or device memory (null when empty).
template <class T>
T* copy_to_device(const T* source, size_t count) {
  if (count == 0) return nullptr;
  T* device = cuda_alloc<T>(count);
  try {
    MEGAMOE_CUDA_CHECK(cudaMemcpy(device, source, count * sizeof(T), cudaMemcpyDefault));
  } catch (...) {
    cudaFree(device);
    throw;
  }
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

// What the routing kernel holds beyond what validate(spec) checks.
void require_routing_supported(const Routing& routing) {
  if (const auto* grouped = std::get_if<DeepseekGrouped>(&routing); grouped && grouped->n_group > kernels::kMaxGroups) {
    throw Error(ErrorCode::unsupported, "deepseek_grouped: n_group=" + std::to_string(grouped->n_group) +
                                            " exceeds the " + std::to_string(kernels::kMaxGroups) + " the routing kernel holds");
  }
}

}  // namespace

void validate_kernel_limits(const MoeSpec& spec, int experts_on_gpu) {
  if (experts_on_gpu > kernels::kMaxRoutingExperts) {
    throw Error(ErrorCode::unsupported, "num_experts=" + std::to_string(experts_on_gpu) + " exceeds the " +
                                            std::to_string(kernels::kMaxRoutingExperts) +
                                            " the routing kernel holds (the experts on one GPU)");
  }
  if (spec.top_k > kernels::kMaxTopK) {
    throw Error(ErrorCode::unsupported, "top_k=" + std::to_string(spec.top_k) + " exceeds the " +
                                            std::to_string(kernels::kMaxTopK) + " slots per token the kernels hold");
  }
  require_routing_supported(spec.routing);
  if (spec.hidden % 8 != 0) throw Error(ErrorCode::unsupported, "hidden must be a multiple of 8");
}

namespace {

// The current device, checked to be one the kernels run on; the errors say what is missing.
cudaDeviceProp hopper_device(int* device) {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess || count == 0) {
    (void)cudaGetLastError();
    throw Error(ErrorCode::no_device, std::string("no CUDA device is visible (") +
                                          (status != cudaSuccess ? cudaGetErrorName(status) : "0 devices") +
                                          "); MoeLayer needs a Hopper GPU (sm_90) and its driver");
  }
  MEGAMOE_CUDA_CHECK(cudaGetDevice(device));
  cudaDeviceProp prop{};
  MEGAMOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, *device));
  if (prop.major != 9) {
    throw Error(ErrorCode::no_device, std::string("MoeLayer needs a Hopper GPU (sm_90); device ") +
                                          std::to_string(*device) + " is " + prop.name + " (sm_" +
                                          std::to_string(prop.major) + std::to_string(prop.minor) + ")");
  }
  return prop;
}

// The routing part of the kernels' layer parameters.
void set_routing_params(kernels::MoeLayerParams& p, const Routing& routing, const float* bias) {
  p.renormalize = false;
  p.n_group = 1;
  p.topk_group = 1;
  p.routed_scaling_factor = 1.0f;
  p.bias = nullptr;
  if (const auto* softmax = std::get_if<SoftmaxTopK>(&routing)) {
    p.routing_mode = kernels::RoutingMode::softmax_topk;
    p.renormalize = softmax->renormalize;
  } else if (const auto* grouped = std::get_if<DeepseekGrouped>(&routing)) {
    p.routing_mode = kernels::RoutingMode::deepseek_grouped;
    p.renormalize = grouped->renormalize;
    p.n_group = grouped->n_group;
    p.topk_group = grouped->topk_group;
    p.routed_scaling_factor = grouped->routed_scaling_factor;
    p.bias = bias;  // null: all zeros
  } else {
    p.routing_mode = kernels::RoutingMode::precomputed;
  }
}

// Refuses a call made while a device other than the layer's (`device`) is current: its kernels
// would run there on this layer's weights and workspace, read through peer mappings where there
// are some and faulting where there are none (an illegal address, which ends the CUDA context of
// that device). cudaGetDevice is legal during stream capture; the stream's own device is not asked
// for (cudaStreamGetDevice is refused during capture by some drivers, which invalidates the
// capture), and a kernel launch into a stream of another device than the current one fails
// before it runs. `call` names the method for the message.
void require_layer_device(int device, const char* call) {
  int current = 0;
  MEGAMOE_CUDA_CHECK(cudaGetDevice(&current));
  if (current != device) {
    throw Error(ErrorCode::invalid_argument, std::string(call) + ": the current device is " + std::to_string(current) +
                                                 ", but this layer lives on device " + std::to_string(device) +
                                                 ": call cudaSetDevice(" + std::to_string(device) + ") first");
  }
}

// Refuses a call that synchronizes `stream` while the stream is being captured into a CUDA graph:
// its copy to host memory and its synchronization would end the capture as invalidated, and the
// caller's graph with it. `call` names the method for the message.
void require_not_capturing(cudaStream_t stream, const char* call) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  MEGAMOE_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) {
    throw Error(ErrorCode::invalid_argument,
                std::string(call) + " reads the layer's device state back and synchronizes the stream, which is "
                                    "being captured into a CUDA graph: call it after the capture has ended (after "
                                    "a replay, to read what the replay did)");
  }
}

// A distinct set of launch choices, printed once under MEGAMOE_PRINT_CONFIGS=1.
using ChoiceKey = std::tuple<int, bool, bool, bool, int>;

}  // namespace

struct MoeLayer::Impl {
  int device = 0;  // the device the layer was built on, which holds its buffers
  uint8_t* w13 = nullptr;
  float* w13_scales = nullptr;
  uint8_t* w2 = nullptr;
  float* w2_scales = nullptr;
  void* workspace = nullptr;
  // Every routing bias the layer was given (by its spec or a call), each in its own device buffer
  // that is never written again: a CUDA graph captured with one bias replays with that bias
  // whatever calls came since (docs/usage.md#guarantees). Identical biases share a buffer.
  std::vector<std::pair<std::vector<float>, float*>> biases;
  plan::LayerPlan plan;
  plan::DeviceFacts facts;
  kernels::MoeLayerParams params{};  // routing fields set per call
  // One forward's launches at a time: calls from several host threads on one stream would
  // otherwise interleave their kernels, which share the workspace.
  std::mutex mutex;
  std::set<ChoiceKey> printed;  // MEGAMOE_PRINT_CONFIGS=1: each configuration printed once
  unsigned long long* timeline_stamps = nullptr;  // set_timeline's

  // The device copy of `bias` (kept for the layer's life), or null for none. A bias not seen yet
  // is copied synchronously, which a CUDA graph capture on `stream` would not survive.
  const float* bias_buffer(const std::vector<float>& bias, cudaStream_t stream) {
    if (bias.empty()) return nullptr;
    for (const auto& [values, buffer] : biases) {
      if (values == bias) return buffer;
    }
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    MEGAMOE_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    if (capture != cudaStreamCaptureStatusNone) {
      throw Error(ErrorCode::invalid_argument,
                  "this call's routing bias is new to the layer, and uploading it cannot happen during CUDA graph "
                  "capture: make one call with this routing before capturing");
    }
    if (biases.size() >= kMaxRoutingBiases) {
      throw Error(ErrorCode::unsupported, "this layer has been given " + std::to_string(kMaxRoutingBiases) +
                                              " distinct routing biases; each stays allocated for the CUDA graphs "
                                              "that may use it. Build a new layer for further biases");
    }
    float* buffer = copy_to_device(bias.data(), bias.size());
    biases.emplace_back(bias, buffer);
    return buffer;
  }

  ~Impl() {
    for (void* p : {static_cast<void*>(w13), static_cast<void*>(w13_scales), static_cast<void*>(w2),
                    static_cast<void*>(w2_scales), workspace}) {
      cudaFree(p);
    }
    for (const auto& entry : biases) cudaFree(entry.second);
  }

  static constexpr size_t kMaxRoutingBiases = 64;
};

MoeLayer::MoeLayer(const MoeSpec& spec, const PackedWeights& weights, int max_tokens, const MoeLayerOptions& options)
    : MoeLayer(spec, checked_view(spec, weights), max_tokens, options) {}

MoeLayer::MoeLayer(const MoeSpec& spec, const PackedWeightsView& weights, int max_tokens,
                   const MoeLayerOptions& options)
    : spec_(spec), max_tokens_(max_tokens), impl_(nullptr) {
  validate(spec);
  validate(options, spec);
  // With the other arguments, so that it is named as theirs are before the device is looked for
  // (plan_layer checks it again).
  validate_max_tokens(max_tokens);
  validate_packed(spec, weights);
  validate_kernel_limits(spec, spec.num_experts);

  int device = 0;
  const cudaDeviceProp prop = hopper_device(&device);
  plan::DeviceFacts facts = plan::DeviceFacts::h200_measured();
  facts.name = prop.name;
  facts.num_sms = prop.multiProcessorCount;
  facts.smem_per_block_optin = static_cast<int>(prop.sharedMemPerBlockOptin);
  const InputScales input_scales =
      spec.precision == Precision::fp8_tensor ? weights.input_scales : InputScales::from_checkpoint;
  plan::LayerPlan layer_plan = plan::plan_layer(spec, max_tokens, options, facts, input_scales);

  auto impl = std::make_unique<Impl>();
  impl->device = device;
  impl->facts = facts;
  impl->plan = layer_plan;
  impl->w13 = copy_to_device(weights.w13, weights.w13_bytes());
  impl->w13_scales = copy_to_device(weights.w13_scales, weights.w13_scale_count());
  impl->w2 = copy_to_device(weights.w2, weights.w2_bytes());
  impl->w2_scales = copy_to_device(weights.w2_scales, weights.w2_scale_count());
  const layout::MoeWorkspaceLayout& w = impl->plan.workspace;
  impl->workspace = cuda_alloc<uint8_t>(w.total_bytes);
  // The routing counters must read zero when the first forward starts, on whatever stream it
  // runs (a non-blocking stream does not wait for the legacy stream's memset).
  MEGAMOE_CUDA_CHECK(cudaMemset(impl->workspace, 0, w.total_bytes));
  if (w.tensor_scales && !w.dynamic_scales) {
    // Static fp8_tensor scales (validate_packed checked them): the kernels read them from here.
    const layout::TensorScaleSlots slots{weights.fc1_input_scale, quant::tensor_factor(weights.fc1_input_scale),
                                         weights.fc2_input_scale, quant::tensor_factor(weights.fc2_input_scale),
                                         0, 0, 0, 0};
    MEGAMOE_CUDA_CHECK(cudaMemcpy(w.at<void>(impl->workspace, w.tensor_scale_slots), &slots, sizeof slots,
                                  cudaMemcpyHostToDevice));
  }
  MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());

  kernels::MoeLayerParams& p = impl->params;
  p.num_experts = spec.num_experts;
  p.top_k = spec.top_k;
  p.hidden = spec.hidden;
  p.intermediate = spec.intermediate;
  p.precision = spec.precision;
  p.ue8m0 = spec.scale_format == ScaleFormat::ue8m0;
  p.w13 = impl->w13;
  p.w13_scales = impl->w13_scales;
  p.w2 = impl->w2;
  p.w2_scales = impl->w2_scales;
  p.workspace = impl->workspace;
  p.workspace_layout = w;
  const auto* grouped = std::get_if<DeepseekGrouped>(&spec.routing);
  if (grouped != nullptr) impl->bias_buffer(grouped->e_score_correction_bias, nullptr);
  impl_ = impl.release();
}

MoeLayer::~MoeLayer() { delete impl_; }

size_t MoeLayer::workspace_bytes() const { return impl_->plan.workspace.total_bytes; }

const MoeLayerOptions& MoeLayer::options() const { return impl_->plan.options; }

namespace {

// The rows a forward's tiles are chosen for: the caller's expectation of the device count, or T.
int planned_tokens(const MoeInputs& inputs) {
  return std::max(inputs.expected_valid_tokens > 0 ? inputs.expected_valid_tokens : inputs.num_tokens, 1);
}

// The plan's choices as the launchers take them.
kernels::MoeLaunchChoices launch_choices(const plan::ForwardPlan& plan, CombineMode mode) {
  return kernels::MoeLaunchChoices{plan.token_tile,         plan.weight_multicast, plan.fc1_copies_token_rows,
                                   mode == CombineMode::deterministic, plan.single_kernel,   plan.grid,
                                   plan.fc1.stages,         plan.fc2.stages};
}

}  // namespace

void MoeLayer::forward(cudaStream_t stream, const MoeInputs& inputs, const MoeOutputs& outputs,
                       std::optional<CombineMode> combine) {
  validate_forward_args(spec_, max_tokens_, inputs, outputs);
  if (combine) validate_combine(*combine, "combine");
  // Before the empty batch returns: a routing the kernels cannot take is refused whatever the
  // token count, so that the ranks of an expert-parallel call, some with no tokens, agree.
  const Routing& routing = inputs.routing != nullptr ? *inputs.routing : spec_.routing;
  require_routing_supported(routing);
  require_layer_device(impl_->device, "forward");
  if (inputs.num_tokens == 0) return;
  std::lock_guard<std::mutex> lock(impl_->mutex);
  const CombineMode mode = combine.value_or(impl_->plan.options.combine);
  const plan::ForwardPlan plan = plan::plan_forward(spec_, impl_->plan, planned_tokens(inputs), mode, impl_->facts,
                                                    plan::PlanDetail::decisions);
  const kernels::MoeLaunchChoices choices = launch_choices(plan, mode);
  if (print_configs() && impl_->printed
                             .insert({choices.token_tile, choices.fc1_copies_token_rows, choices.deterministic,
                                      choices.single_kernel, choices.grid})
                             .second) {
    std::cerr << "megamoe: " << spec_ << "\n  " << impl_->plan << "\n  "
              << plan::plan_forward(spec_, impl_->plan, plan.tokens, mode, impl_->facts) << "\n";
  }
  if (inputs.x_scales != nullptr && plan.single_kernel) {
    throw Error(ErrorCode::unsupported,
                "x_scales (x already quantized) with launch=single_kernel: the single kernel quantizes a bf16 x "
                "itself; pass a bf16 x or launch=per_stage");
  }
  // Only a call that launches uploads a bias new to the layer (synchronously, one of its 64).
  kernels::MoeLayerParams params = impl_->params;
  const auto* grouped = std::get_if<DeepseekGrouped>(&routing);
  set_routing_params(params, routing, grouped ? impl_->bias_buffer(grouped->e_score_correction_bias, stream) : nullptr);
  kernels::MoeCall call{};
  call.num_tokens = inputs.num_tokens;
  call.num_valid_tokens = inputs.num_valid_tokens;
  call.x = inputs.x;
  call.router_logits = inputs.router_logits;
  call.topk_ids = inputs.topk_ids;
  call.topk_weights = inputs.topk_weights;
  call.y = outputs.y;
  call.x_scales = inputs.x_scales;
  call.x_scale_stride = x_scale_stride_of(inputs);
  call.timeline_stamps = impl_->timeline_stamps;
  kernels::launch_moe_forward(params, choices, call, stream);
}

detail::SingleKernelLaunch detail::SingleKernelLaunch::of(const MoeLayer& layer, int tokens) {
  std::lock_guard<std::mutex> lock(layer.impl_->mutex);
  kernels::MoeLayerParams params = layer.impl_->params;
  set_routing_params(params, layer.spec_.routing, nullptr);
  const plan::ForwardPlan plan = plan::plan_forward(layer.spec_, layer.impl_->plan, std::max(tokens, 1),
                                                    CombineMode::deterministic, layer.impl_->facts,
                                                    plan::PlanDetail::decisions);
  if (!plan.single_kernel) {
    throw Error(ErrorCode::unsupported, "internal: the fused expert-parallel forward needs a single-kernel plan");
  }
  return SingleKernelLaunch{params, launch_choices(plan, CombineMode::deterministic)};
}

void MoeLayer::set_timeline(unsigned long long* stamps) {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->timeline_stamps = stamps;
}

std::string MoeLayer::describe_plan(int tokens, std::optional<CombineMode> combine) const {
  if (combine) validate_combine(*combine, "combine");
  std::ostringstream os;
  os << spec_ << "\n" << impl_->plan << "\n"
     << plan::plan_forward(spec_, impl_->plan, tokens, combine.value_or(impl_->plan.options.combine), impl_->facts);
  return os.str();
}

long MoeLayer::take_invalid_routing_ids(cudaStream_t stream) {
  // Its reset is a memset of this layer's workspace, which must not run on another device.
  require_layer_device(impl_->device, "take_invalid_routing_ids");
  require_not_capturing(stream, "take_invalid_routing_ids");
  std::lock_guard<std::mutex> lock(impl_->mutex);
  const layout::MoeWorkspaceLayout& w = impl_->plan.workspace;
  int32_t* flags = w.at<int32_t>(impl_->workspace, w.error_flags);
  int32_t count = 0;
  MEGAMOE_CUDA_CHECK(cudaMemcpyAsync(&count, flags, sizeof count, cudaMemcpyDeviceToHost, stream));
  MEGAMOE_CUDA_CHECK(cudaMemsetAsync(flags, 0, sizeof count, stream));
  MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  return count;
}

MoeLayer::ActivationScales MoeLayer::activation_scales(cudaStream_t stream) const {
  const layout::MoeWorkspaceLayout& w = impl_->plan.workspace;
  if (!w.tensor_scales) {
    throw Error(ErrorCode::invalid_argument, std::string("activation_scales: a precision ") +
                                                 to_string(spec_.precision) +
                                                 " layer has no per-tensor activation scales (fp8_tensor only)");
  }
  require_not_capturing(stream, "activation_scales");
  layout::TensorScaleSlots slots{};
  {
    // Ordered after the forwards already enqueued on `stream`; other threads' forwards need not
    // wait for the synchronization.
    std::lock_guard<std::mutex> lock(impl_->mutex);
    MEGAMOE_CUDA_CHECK(cudaMemcpyAsync(&slots, w.at<void>(impl_->workspace, w.tensor_scale_slots), sizeof slots,
                                       cudaMemcpyDeviceToHost, stream));
  }
  MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  return ActivationScales{slots.fc1_scale, slots.fc2_scale};
}

}  // namespace megamoe
