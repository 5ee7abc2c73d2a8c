// torch.ops.megamoe: MoeLayer, and the expert-parallel EpLayer, as PyTorch custom ops (the Python
// package in python/megamoe wraps them). A layer lives in this library's registry under an integer
// handle, as vLLM's custom all-reduce passes its state: the ops then take only tensors and scalars,
// torch.compile treats the handle as a constant, and a CUDA graph captures forward's kernels on
// the current stream.
// Arguments are checked here as well as in Python: an op called directly gets the same clear
// errors (ValueError for bad values, TypeError for bad dtypes, NotImplementedError for what the
// kernels do not support) before any kernel runs.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <ATen/ATen.h>
#include <torch/library.h>

#include <chrono>
#include <cstdio>
#include <initializer_list>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "comm/ep_layer.hpp"
#include "comm/rendezvous.hpp"
#include "megamoe/error.hpp"
#include "megamoe/layer.hpp"
#include "megamoe/options.hpp"
#include "megamoe/weights.hpp"

namespace megamoe::torch_ops {
namespace {

// megamoe::Error as the Python exception its code stands for.
template <class Fn>
auto translating_errors(Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const Error& e) {
    switch (e.code()) {
      case ErrorCode::unsupported: TORCH_CHECK_NOT_IMPLEMENTED(false, e.what());
      case ErrorCode::invalid_spec:
      case ErrorCode::invalid_argument:
      case ErrorCode::null_pointer:
      case ErrorCode::misaligned_pointer:
      case ErrorCode::aliasing:
      case ErrorCode::capacity_exceeded: TORCH_CHECK_VALUE(false, e.what());
      case ErrorCode::out_of_memory: TORCH_CHECK_WITH(OutOfMemoryError, false, e.what());
      default: TORCH_CHECK(false, e.what());
    }
  }
}

struct RegisteredLayer {
  static constexpr const char* kind = "layer";
  std::unique_ptr<MoeLayer> layer;
  c10::DeviceIndex device;
};

// An expert-parallel layer and the rendezvous it keeps using (declared first, so destroyed after
// the layer, whose symmetric memory says goodbye to its peers through it).
struct RegisteredEpLayer {
  static constexpr const char* kind = "expert-parallel layer";
  std::unique_ptr<comm::FileRendezvous> rendezvous;
  std::unique_ptr<comm::EpLayer> layer;
  c10::DeviceIndex device;
};

// Handles start at 1 and are never reused, so a stale handle is refused rather than aliased.
template <class Entry>
class Registry {
 public:
  int64_t add(Entry entry) {
    std::lock_guard<std::mutex> lock(mutex_);
    layers_.emplace(next_, std::make_shared<Entry>(std::move(entry)));
    return next_++;
  }
  std::shared_ptr<Entry> find(int64_t handle) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = layers_.find(handle);
    TORCH_CHECK_VALUE(it != layers_.end(), "megamoe: no ", Entry::kind, " with handle ", handle,
                      " (destroyed, or never created)");
    return it->second;
  }
  void remove(int64_t handle) {
    std::shared_ptr<Entry> entry;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = layers_.find(handle);
      if (it == layers_.end()) return;
      entry = std::move(it->second);
      layers_.erase(it);
    }
    c10::cuda::CUDAGuard guard(entry->device);
    entry.reset();  // frees the layer's device memory on its device
  }

 private:
  std::mutex mutex_;
  std::map<int64_t, std::shared_ptr<Entry>> layers_;
  int64_t next_ = 1;
};

Registry<RegisteredLayer>& registry() {
  static Registry<RegisteredLayer> instance;
  return instance;
}

Registry<RegisteredEpLayer>& ep_registry() {
  static Registry<RegisteredEpLayer> instance;
  return instance;
}

// An int64 argument as the int the C++ API takes: refused outside [lo, hi], never wrapped.
int checked_int(int64_t value, const char* name, int64_t lo, int64_t hi = std::numeric_limits<int>::max()) {
  TORCH_CHECK_VALUE(value >= lo && value <= hi, "megamoe: ", name, "=", value, " is out of range: it must be in [", lo,
                    ", ", hi, "]");
  return static_cast<int>(value);
}

// The CUDA device a layer goes on: `index`, or the current device for -1, refused unless this
// process sees it.
c10::DeviceIndex checked_device(int64_t index) {
  const int64_t count = c10::cuda::device_count();
  TORCH_CHECK(count > 0, "megamoe: no CUDA device is visible; the layer runs on Hopper GPUs (sm_90)");
  if (index == -1) return c10::cuda::current_device();
  TORCH_CHECK_VALUE(index >= 0 && index < count, "megamoe: device cuda:", index, " does not exist: this process sees ",
                    count, " CUDA device(s) (cuda:0 to cuda:", count - 1, ")");
  return static_cast<c10::DeviceIndex>(index);
}

Precision precision_from(const std::string& name) {
  if (name == "bf16") return Precision::bf16;
  if (name == "fp8_block") return Precision::fp8_block;
  if (name == "fp8_tensor") return Precision::fp8_tensor;
  TORCH_CHECK_VALUE(false, "megamoe: precision must be 'bf16', 'fp8_block' or 'fp8_tensor', not '", name, "'");
}

ScaleFormat scale_format_from(const std::string& name) {
  if (name == "fp32") return ScaleFormat::fp32;
  if (name == "ue8m0") return ScaleFormat::ue8m0;
  TORCH_CHECK_VALUE(false, "megamoe: scale_format must be 'fp32' or 'ue8m0', not '", name, "'");
}

Routing routing_from(const std::string& mode, bool renormalize, int64_t n_group, int64_t topk_group,
                     double routed_scaling_factor, const std::optional<at::Tensor>& bias) {
  if (mode == "softmax") return SoftmaxTopK{.renormalize = renormalize};
  if (mode == "precomputed") return Precomputed{};
  TORCH_CHECK_VALUE(mode == "deepseek_grouped", "megamoe: routing must be 'softmax', 'deepseek_grouped' or 'precomputed', not '",
                    mode, "'");
  DeepseekGrouped grouped{.n_group = checked_int(n_group, "n_group", 1),
                          .topk_group = checked_int(topk_group, "topk_group", 1),
                          .routed_scaling_factor = static_cast<float>(routed_scaling_factor),
                          .renormalize = renormalize};
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->dim() == 1, "megamoe: the routing bias must be 1-D [num_experts], got ", bias->sizes());
    const at::Tensor host = bias->to(at::kCPU, at::kFloat).contiguous();
    grouped.e_score_correction_bias.assign(host.data_ptr<float>(), host.data_ptr<float>() + host.numel());
  }
  return grouped;
}

MoeSpec spec_from(int64_t num_experts, int64_t hidden, int64_t intermediate, int64_t top_k,
                  const std::string& precision, const std::string& scale_format, const std::string& routing,
                  bool renormalize, int64_t n_group, int64_t topk_group, double routed_scaling_factor,
                  const std::optional<at::Tensor>& bias) {
  MoeSpec spec;
  spec.num_experts = checked_int(num_experts, "num_experts", 1);
  spec.top_k = checked_int(top_k, "top_k", 1);
  spec.hidden = checked_int(hidden, "hidden", 1);
  spec.intermediate = checked_int(intermediate, "intermediate", 1);
  spec.precision = precision_from(precision);
  spec.scale_format = scale_format_from(scale_format);
  spec.routing = routing_from(routing, renormalize, n_group, topk_group, routed_scaling_factor, bias);
  return spec;
}

// The choice `value` names among `choices` (name, choice); refused with the names it may take.
template <class T>
T choice_from(const std::string& value, const char* option, std::initializer_list<std::pair<const char*, T>> choices) {
  std::string names;
  size_t index = 0;
  for (const auto& [name, choice] : choices) {
    if (value == name) return choice;
    names += std::string(index == 0 ? "" : index + 1 == choices.size() ? " or " : ", ") + "'" + name + "'";
    ++index;
  }
  TORCH_CHECK_VALUE(false, "megamoe: ", option, " must be ", names, ", not '", value, "'");
}

MoeLayerOptions options_from(int64_t token_tile, const std::string& fc1_token_rows, int64_t num_sms,
                             const std::string& launch) {
  MoeLayerOptions options;
  options.token_tile = checked_int(token_tile, "token_tile", 0);
  options.fc1_token_rows = choice_from<Fc1TokenRows>(fc1_token_rows, "fc1_token_rows",
                                       {{"auto", Fc1TokenRows::automatic},
                                        {"pool", Fc1TokenRows::pool},
                                        {"row_copy", Fc1TokenRows::row_copy}});
  options.num_sms = checked_int(num_sms, "num_sms", 0);
  options.launch = choice_from<ForwardLaunch>(launch, "launch",
                               {{"auto", ForwardLaunch::automatic},
                                {"per_stage", ForwardLaunch::per_stage},
                                {"single_kernel", ForwardLaunch::single_kernel}});
  return options;
}

// A host copy of `t` as `dtype`, contiguous: what prepare_weights reads.
at::Tensor host_contiguous(const at::Tensor& t, at::ScalarType dtype) { return t.to(at::kCPU, dtype).contiguous(); }

// The layout of an fp8_e4m3 checkpoint's fp32 scales for its [E, rows, cols] matrices, from their
// shape: per expert matrix [E], [E, 1] or [E, 1, 1] (vLLM's per-tensor weight_scale), for w13
// (gate_up) also [E, 2] (the gate rows' scale, then the up rows', as vLLM holds them before
// merging), per 128 x 128 block [E, ceil(rows/128), ceil(cols/128)] (DeepSeek-V3's
// weight_scale_inv), or per row [E, rows] or [E, rows, 1]. Per expert comes first: [E, 1, 1] is
// also the block shape of a matrix within one block, where both name the same scale.
ScaleLayout scale_layout_of(const at::Tensor& scale, const char* name, int64_t E, int64_t rows, int64_t cols,
                            bool gate_up) {
  const bool per_tensor = (scale.dim() == 1 && scale.size(0) == E) ||
                          (scale.dim() == 2 && scale.size(0) == E && scale.size(1) == 1) ||
                          (scale.dim() == 3 && scale.size(0) == E && scale.size(1) == 1 && scale.size(2) == 1);
  if (per_tensor) return ScaleLayout::per_tensor;
  if (gate_up && scale.dim() == 2 && scale.size(0) == E && scale.size(1) == 2) return ScaleLayout::per_gate_up;
  const std::vector<int64_t> blocks{E, (rows + 127) / 128, (cols + 127) / 128};
  if (scale.sizes() == at::IntArrayRef(blocks)) return ScaleLayout::block_128x128;
  const bool per_row = (scale.dim() == 3 && scale.size(0) == E && scale.size(1) == rows && scale.size(2) == 1) ||
                       (scale.dim() == 2 && scale.size(0) == E && scale.size(1) == rows);
  TORCH_CHECK_VALUE(per_row, "megamoe: ", name, " must be ", blocks, " (per block), [", E, ", ", rows,
                    ", 1] (per row) or [", E, "] (per expert", gate_up ? "; or [E, 2], gate then up" : "",
                    "), got ", scale.sizes());
  return ScaleLayout::per_row;
}

// A checkpoint's static activation scale (w13_input_scale or w2_input_scale, vLLM's names): one
// per layer ([] or [1]) or one per expert ([E] or [E, 1]), of any float dtype; as float32 values
// on the host.
at::Tensor input_scale_values(const at::Tensor& scale, const char* name, int64_t E) {
  TORCH_CHECK_TYPE(at::isFloatingType(scale.scalar_type()), "megamoe: ", name,
                   " must be a floating-point tensor, not ", scale.scalar_type());
  const bool per_layer = scale.numel() == 1 && scale.dim() <= 1;
  const bool per_expert = (scale.dim() == 1 && scale.size(0) == E) ||
                          (scale.dim() == 2 && scale.size(0) == E && scale.size(1) == 1);
  TORCH_CHECK_VALUE(per_layer || per_expert, "megamoe: ", name,
                    " must hold one activation scale per layer ([] or [1]) or one per expert ([", E, "] or [", E,
                    ", 1]), got ", scale.sizes());
  return host_contiguous(scale, at::kFloat).reshape({-1});
}

// Packs vLLM-layout weights on the host (w13 [E, 2I, H], gate rows then up rows; w2 [E, H, I];
// bf16, fp32, or float8_e4m3fn with fp32 scales per expert matrix, per 128 x 128 block or per row)
// into PackedWeights as CPU tensors: [w13 bytes [E, 2I, H * element bytes], w13 scales, w2 bytes
// [E, H, I * element bytes], w2 scales, input scales]. The scales are [E, 2I/128, H/128] and
// [E, H/128, I/128] for fp8_block, [E, 2] (gate, up) and [E] for fp8_tensor, empty [0] for bf16;
// the input scales (fc1_input_scale, fc2_input_scale) [2] for fp8_tensor with a checkpoint's
// static activation scales (w13_input_scale and w2_input_scale, one per layer or per expert: the
// largest is taken), empty [0] for dynamic ones (neither given) and other precisions.
// python/megamoe/packing.py packs the same bytes on any device.
std::vector<at::Tensor> pack_weights(const at::Tensor& w13, const at::Tensor& w2, const std::optional<at::Tensor>& w13_scale,
                                     const std::optional<at::Tensor>& w2_scale,
                                     const std::optional<at::Tensor>& w13_input_scale,
                                     const std::optional<at::Tensor>& w2_input_scale, const std::string& precision,
                                     const std::string& scale_format) {
  TORCH_CHECK_VALUE(w13.dim() == 3 && w2.dim() == 3, "megamoe: w13 must be [E, 2I, H] and w2 [E, H, I]; got ",
                    w13.sizes(), " and ", w2.sizes());
  const int64_t E = w13.size(0), two_i = w13.size(1), H = w13.size(2);
  TORCH_CHECK_VALUE(two_i % 2 == 0, "megamoe: w13's second dimension (2I, gate rows then up rows) must be even, got ",
                    two_i);
  TORCH_CHECK_VALUE(w2.size(0) == E && w2.size(1) == H && w2.size(2) == two_i / 2, "megamoe: w2 must be [E, H, I] = [",
                    E, ", ", H, ", ", two_i / 2, "] to match w13 ", w13.sizes(), "; got ", w2.sizes());
  TORCH_CHECK_TYPE(w13.scalar_type() == w2.scalar_type(), "megamoe: w13 and w2 must share a dtype; got ",
                   w13.scalar_type(), " and ", w2.scalar_type());

  // Packing reads a spec's shapes and precision only.
  const MoeSpec spec = spec_from(E, H, two_i / 2, 1, precision, scale_format, "softmax", false, 1, 1, 1.0, std::nullopt);

  WeightsView view;
  switch (w13.scalar_type()) {
    case at::kBFloat16: view.dtype = DType::bf16; break;
    case at::kFloat: view.dtype = DType::fp32; break;
    case at::kFloat8_e4m3fn: view.dtype = DType::fp8_e4m3; break;
    default:
      TORCH_CHECK_TYPE(false, "megamoe: weights must be bfloat16, float32 or float8_e4m3fn; got ", w13.scalar_type());
  }
  const at::Tensor w13_host = host_contiguous(w13, w13.scalar_type());
  const at::Tensor w2_host = host_contiguous(w2, w2.scalar_type());
  view.w13 = w13_host.data_ptr();
  view.w2 = w2_host.data_ptr();
  at::Tensor w13_scale_host, w2_scale_host;
  if (view.dtype == DType::fp8_e4m3) {
    TORCH_CHECK_VALUE(w13_scale.has_value() && w2_scale.has_value(),
                      "megamoe: float8_e4m3fn weights need w13_scale and w2_scale: [E] (per expert; w13's also [E, 2], "
                      "gate then up), [E, 2I/128, H/128] and [E, H/128, I/128] (per block), or [E, 2I, 1] and "
                      "[E, H, 1] (per row)");
    // Integer scales (a checkpoint's exponent bytes, say) would be converted as numbers.
    for (const auto& [name, scale] : {std::pair{"w13_scale", &*w13_scale}, std::pair{"w2_scale", &*w2_scale}}) {
      TORCH_CHECK_TYPE(at::isFloatingType(scale->scalar_type()), "megamoe: ", name,
                       " must be a floating-point tensor (float32 scales), not ", scale->scalar_type());
    }
    view.w13_scale_layout = scale_layout_of(*w13_scale, "w13_scale", E, two_i, H, true);
    view.w2_scale_layout = scale_layout_of(*w2_scale, "w2_scale", E, H, two_i / 2, false);
    w13_scale_host = host_contiguous(*w13_scale, at::kFloat);
    w2_scale_host = host_contiguous(*w2_scale, at::kFloat);
    view.w13_scales = w13_scale_host.data_ptr<float>();
    view.w2_scales = w2_scale_host.data_ptr<float>();
  } else {
    TORCH_CHECK_VALUE(!w13_scale.has_value() && !w2_scale.has_value(),
                      "megamoe: weight scales go with float8_e4m3fn weights only; these are ", w13.scalar_type());
  }
  at::Tensor w13_input_host, w2_input_host;
  if (w13_input_scale.has_value() || w2_input_scale.has_value()) {
    TORCH_CHECK_VALUE(spec.precision == Precision::fp8_tensor,
                      "megamoe: input scales go with precision fp8_tensor (a per-tensor checkpoint's static activation "
                      "scales); precision ", to_string(spec.precision),
                      " takes none (it computes its own activation scales: drop them, or use precision fp8_tensor)");
    TORCH_CHECK_VALUE(w13_input_scale.has_value() && w2_input_scale.has_value(),
                      "megamoe: w13_input_scale and w2_input_scale go together (static activation scales) or neither "
                      "(dynamic ones, computed on the device each forward); ",
                      w13_input_scale.has_value() ? "w2_input_scale" : "w13_input_scale", " is missing");
    w13_input_host = input_scale_values(*w13_input_scale, "w13_input_scale", E);
    w2_input_host = input_scale_values(*w2_input_scale, "w2_input_scale", E);
    // One count serves both: a per-layer scale beside per-expert ones is repeated (the largest is taken).
    const int64_t count = std::max(w13_input_host.numel(), w2_input_host.numel());
    if (w13_input_host.numel() != count) w13_input_host = w13_input_host.expand({count}).contiguous();
    if (w2_input_host.numel() != count) w2_input_host = w2_input_host.expand({count}).contiguous();
    view.w13_input_scale = w13_input_host.data_ptr<float>();
    view.w2_input_scale = w2_input_host.data_ptr<float>();
    view.input_scale_count = static_cast<int>(count);
  }

  return translating_errors([&] {
    // Packing a large layer takes a while on the host: say how far it got, every ~10%, past 2 s.
    const auto start = std::chrono::steady_clock::now();
    int reported = 0;
    const PackProgress progress = [&](int done, int total) {
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (seconds < 2.0 || (done * 10 / total <= reported && done != total)) return;
      reported = done * 10 / total;
      std::fprintf(stderr, "megamoe: packed %d of %d experts (%.1f s)\n", done, total, seconds);
    };
    // The tensors share the packer's buffers rather than copying them: a second copy of a large
    // layer's packed weights would double the host memory the pack peaks at.
    const auto packed = std::make_shared<PackedWeights>(prepare_weights(spec, view, progress));
    const int64_t element_bytes = packed->element_bytes();
    auto tensor_of = [&packed]<class T>(std::vector<T>& v, std::vector<int64_t> shape, at::ScalarType dtype) {
      if (v.empty()) return at::empty({0}, dtype);
      return at::from_blob(v.data(), shape, [packed](void*) {}, at::TensorOptions().dtype(dtype));
    };
    const bool tensor = packed->precision == Precision::fp8_tensor;
    const std::vector<int64_t> w13_scales_shape = tensor ? std::vector<int64_t>{E, 2}
                                                         : std::vector<int64_t>{E, two_i / 128, H / 128};
    const std::vector<int64_t> w2_scales_shape = tensor ? std::vector<int64_t>{E}
                                                        : std::vector<int64_t>{E, H / 128, two_i / 2 / 128};
    at::Tensor input_scales = at::empty({0}, at::kFloat);
    if (tensor && packed->input_scales == InputScales::from_checkpoint) {
      input_scales = at::tensor({packed->fc1_input_scale, packed->fc2_input_scale}, at::kFloat);
    }
    return std::vector<at::Tensor>{tensor_of(packed->w13, {E, two_i, H * element_bytes}, at::kByte),
                                   tensor_of(packed->w13_scales, w13_scales_shape, at::kFloat),
                                   tensor_of(packed->w2, {E, H, two_i / 2 * element_bytes}, at::kByte),
                                   tensor_of(packed->w2_scales, w2_scales_shape, at::kFloat), input_scales};
  });
}

// A layer's description as the C++ API takes it, checked.
struct CheckedLayer {
  MoeSpec spec;
  MoeLayerOptions options;
};

// Every check of a layer's description (the spec's shapes and routing, max_tokens and the
// options, and the kernels' limits for a GPU holding experts_per_gpu of its experts), before
// weights are packed anywhere: the one place they are made for both kinds of layer. The device
// has its own check (checked_device, the op check_device).
CheckedLayer checked_layer(int64_t num_experts, int64_t hidden, int64_t intermediate, int64_t top_k,
                           const std::string& precision, const std::string& scale_format, const std::string& routing,
                           bool renormalize, int64_t n_group, int64_t topk_group, double routed_scaling_factor,
                           const std::optional<at::Tensor>& bias, int64_t max_tokens, int64_t token_tile,
                           const std::string& fc1_token_rows, int64_t num_sms, const std::string& launch,
                           int64_t experts_per_gpu) {
  CheckedLayer layer{spec_from(num_experts, hidden, intermediate, top_k, precision, scale_format, routing,
                               renormalize, n_group, topk_group, routed_scaling_factor, bias),
                     options_from(token_tile, fc1_token_rows, num_sms, launch)};
  translating_errors([&] {
    validate(layer.spec);
    validate_max_tokens(max_tokens);
    validate(layer.options, layer.spec);
  });
  // MoeLayer checks the kernels' limits too, but only after the weights were packed here.
  translating_errors([&] { validate_kernel_limits(layer.spec, static_cast<int>(experts_per_gpu)); });
  return layer;
}

void check_layer(int64_t num_experts, int64_t hidden, int64_t intermediate, int64_t top_k,
                 const std::string& precision, const std::string& scale_format, const std::string& routing,
                 bool renormalize, int64_t n_group, int64_t topk_group, double routed_scaling_factor,
                 const std::optional<at::Tensor>& bias, int64_t max_tokens, int64_t token_tile,
                 const std::string& fc1_token_rows, int64_t num_sms, const std::string& launch) {
  checked_layer(num_experts, hidden, intermediate, top_k, precision, scale_format, routing, renormalize, n_group,
                topk_group, routed_scaling_factor, bias, max_tokens, token_tile, fc1_token_rows, num_sms, launch,
                num_experts);
}

int64_t check_device(int64_t device_index) { return checked_device(device_index); }

// Packed tensors of `experts` experts of `spec`'s shapes (pack_weights' tensors, or the same bytes
// packed on the GPU) as the view a layer copies from, their sizes checked. fp8_tensor's
// input_scales are (fc1_input_scale, fc2_input_scale) [2], static, or empty [0], dynamic (the layer
// computes them each forward); other precisions take an empty tensor.
PackedWeightsView packed_view(const MoeSpec& spec, int experts, const at::Tensor& w13, const at::Tensor& w13_scales,
                              const at::Tensor& w2, const at::Tensor& w2_scales,
                              const at::Tensor& input_scales) {
  PackedWeightsView view{experts, spec.hidden, spec.intermediate, spec.precision, spec.scale_format};
  const bool fp8 = spec.precision != Precision::bf16;
  auto check_packed = [](const at::Tensor& t, const char* name, at::ScalarType dtype, size_t count) {
    TORCH_CHECK_TYPE(t.scalar_type() == dtype, "megamoe: packed ", name, " must be ", dtype, ", not ", t.scalar_type());
    TORCH_CHECK_VALUE(t.is_contiguous() && static_cast<size_t>(t.numel()) == count, "megamoe: packed ", name,
                      " must be contiguous with ", count, " elements, got ", t.sizes());
  };
  check_packed(w13, "w13", at::kByte, view.w13_bytes());
  check_packed(w2, "w2", at::kByte, view.w2_bytes());
  check_packed(w13_scales, "w13_scales", at::kFloat, view.w13_scale_count());
  check_packed(w2_scales, "w2_scales", at::kFloat, view.w2_scale_count());
  view.w13 = w13.data_ptr<uint8_t>();
  view.w2 = w2.data_ptr<uint8_t>();
  view.w13_scales = fp8 ? w13_scales.data_ptr<float>() : nullptr;
  view.w2_scales = fp8 ? w2_scales.data_ptr<float>() : nullptr;
  const int64_t input_scale_count = input_scales.numel();
  if (spec.precision == Precision::fp8_tensor) {
    TORCH_CHECK_TYPE(input_scales.scalar_type() == at::kFloat, "megamoe: packed input_scales must be ", at::kFloat,
                     ", not ", input_scales.scalar_type());
    TORCH_CHECK_VALUE(input_scale_count == 2 || input_scale_count == 0,
                      "megamoe: packed input_scales must hold (fc1_input_scale, fc2_input_scale) [2] for static "
                      "activation scales, or nothing [0] for dynamic ones; got ", input_scales.sizes());
    if (input_scale_count == 0) {
      view.input_scales = InputScales::dynamic;
    } else {
      const at::Tensor host = input_scales.to(at::kCPU).contiguous();
      view.input_scales = InputScales::from_checkpoint;
      view.fc1_input_scale = host.data_ptr<float>()[0];
      view.fc2_input_scale = host.data_ptr<float>()[1];
    }
  } else {
    TORCH_CHECK_VALUE(input_scale_count == 0, "megamoe: packed input_scales go with precision fp8_tensor; precision ",
                      to_string(spec.precision), " takes an empty tensor [0], got ", input_scales.sizes());
  }
  return view;
}

// Weights packed on the GPU were written on the current stream: done before a layer copies them.
void wait_for_packing(const at::Tensor& packed) {
  if (packed.is_cuda()) c10::cuda::getCurrentCUDAStream(packed.get_device()).synchronize();
}

// A layer for up to max_tokens tokens on device `device_index`, from packed weights (pack_weights'
// tensors, input_scales included, or the same bytes packed on the GPU) on the host or on a device:
// copied.
int64_t create_layer(const at::Tensor& w13, const at::Tensor& w13_scales, const at::Tensor& w2,
                     const at::Tensor& w2_scales, const at::Tensor& input_scales, int64_t num_experts, int64_t hidden,
                     int64_t intermediate, int64_t top_k, const std::string& precision, const std::string& scale_format,
                     const std::string& routing, bool renormalize, int64_t n_group, int64_t topk_group,
                     double routed_scaling_factor, const std::optional<at::Tensor>& bias, int64_t max_tokens,
                     int64_t token_tile, const std::string& fc1_token_rows, int64_t num_sms,
                     const std::string& launch, int64_t device_index) {
  const CheckedLayer layer =
      checked_layer(num_experts, hidden, intermediate, top_k, precision, scale_format, routing, renormalize, n_group,
                    topk_group, routed_scaling_factor, bias, max_tokens, token_tile, fc1_token_rows, num_sms, launch,
                    num_experts);
  const PackedWeightsView view =
      packed_view(layer.spec, layer.spec.num_experts, w13, w13_scales, w2, w2_scales, input_scales);
  const c10::DeviceIndex device = checked_device(device_index);
  return translating_errors([&] {
    c10::cuda::CUDAGuard guard(device);
    wait_for_packing(w13);
    RegisteredLayer entry{std::make_unique<MoeLayer>(layer.spec, view, static_cast<int>(max_tokens), layer.options),
                          device};
    return registry().add(std::move(entry));
  });
}

void destroy_layer(int64_t handle) { registry().remove(handle); }

void check_input(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t rows, int64_t columns,
                 c10::DeviceIndex device) {
  TORCH_CHECK_VALUE(t.is_cuda() && t.get_device() == device, "megamoe: ", name, " must be on cuda:",
                    static_cast<int>(device), " (the layer's device), not ", t.device());
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, "megamoe: ", name, " must be ", dtype, ", not ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 2 && t.size(0) == rows && t.size(1) == columns, "megamoe: ", name, " must be [", rows,
                    ", ", columns, "], got ", t.sizes());
  TORCH_CHECK_VALUE(t.is_contiguous(), "megamoe: ", name, " must be contiguous (call .contiguous())");
}

// y [T, H] bf16 for x [T, H] bf16, routed from router_logits [T, E] fp32 or, with precomputed
// routing, from topk_ids [T, k] int32 (-1: not routed here) and topk_weights [T, k] fp32.
at::Tensor forward(int64_t handle, const at::Tensor& x, const std::optional<at::Tensor>& router_logits,
                   const std::optional<at::Tensor>& topk_ids, const std::optional<at::Tensor>& topk_weights,
                   bool deterministic, const std::string& routing_mode, bool renormalize, int64_t n_group,
                   int64_t topk_group, double routed_scaling_factor, const std::optional<at::Tensor>& bias) {
  const auto entry = registry().find(handle);
  MoeLayer& layer = *entry->layer;
  const MoeSpec& spec = layer.spec();
  // The call's routing travels with the call: the layer keeps none of it (a graph replays the
  // routing it captured, and calls from several threads cannot switch each other's).
  const Routing routing = routing_from(routing_mode, renormalize, n_group, topk_group, routed_scaling_factor, bias);
  TORCH_CHECK_VALUE(x.dim() == 2, "megamoe: x must be [tokens, hidden], got ", x.sizes());
  const int64_t T = x.size(0);
  check_input(x, "x", at::kBFloat16, T, spec.hidden, entry->device);
  TORCH_CHECK_VALUE(T <= layer.max_tokens(), "megamoe: ", T, " tokens exceed the ", layer.max_tokens(),
                    " this layer was prepared for (max_tokens)");
  const bool precomputed = std::holds_alternative<Precomputed>(routing);
  if (precomputed) {
    TORCH_CHECK_VALUE(topk_ids.has_value() && topk_weights.has_value() && !router_logits.has_value(),
                      "megamoe: precomputed routing takes topk_ids and topk_weights, not router_logits");
    check_input(*topk_ids, "topk_ids", at::kInt, T, spec.top_k, entry->device);
    check_input(*topk_weights, "topk_weights", at::kFloat, T, spec.top_k, entry->device);
  } else {
    TORCH_CHECK_VALUE(router_logits.has_value() && !topk_ids.has_value() && !topk_weights.has_value(),
                      "megamoe: ", to_string(routing), " routing takes router_logits, not topk_ids/topk_weights");
    check_input(*router_logits, "router_logits", at::kFloat, T, spec.num_experts, entry->device);
  }
  at::Tensor y = at::empty({T, spec.hidden}, x.options());
  // An empty batch goes through MoeLayer::forward too (it launches nothing): a routing the layer
  // cannot take is refused whatever the batch, by the layer's own checks (the kernels' limits too).
  c10::cuda::CUDAGuard guard(entry->device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(entry->device).stream();
  MoeInputs inputs;
  inputs.num_tokens = static_cast<int>(T);
  inputs.routing = &routing;
  inputs.x = x.data_ptr();
  if (precomputed) {
    inputs.topk_ids = topk_ids->data_ptr<int32_t>();
    inputs.topk_weights = topk_weights->data_ptr<float>();
  } else {
    inputs.router_logits = router_logits->data_ptr<float>();
  }
  translating_errors([&] {
    layer.forward(stream, inputs, MoeOutputs{y.data_ptr()}, deterministic ? CombineMode::deterministic : CombineMode::fast);
  });
  return y;
}

// Ids >= E or repeated within a token that a layer's calls routed since the last ask (either
// kind of layer; synchronizes the current stream).
template <class Entry>
int64_t take_invalid_routing_ids(Registry<Entry>& layers, int64_t handle) {
  const auto entry = layers.find(handle);
  c10::cuda::CUDAGuard guard(entry->device);
  return translating_errors(
      [&] { return entry->layer->take_invalid_routing_ids(c10::cuda::getCurrentCUDAStream(entry->device).stream()); });
}

int64_t invalid_routing_ids(int64_t handle) { return take_invalid_routing_ids(registry(), handle); }

int64_t workspace_bytes(int64_t handle) { return static_cast<int64_t>(registry().find(handle)->layer->workspace_bytes()); }

// Collective over the world_size processes of one node (one GPU each): this rank's experts
// [rank * E / world, (rank + 1) * E / world) of a layer of num_experts experts with precomputed
// routing, packed as for a layer of E / world experts, for up to max_tokens tokens per rank and
// call. The ranks meet in rendezvous_dir, a folder they share that no other layer uses.
// input_scales: an fp8_tensor rank's static activation scales as pack_weights gives them (each
// owner encodes the rows it receives with its own), or [0]. partial_sums: "bf16" or "fp8"
// (comm::EpPartialSums); symmetric_memory: "cuda_ipc" or "nvshmem" (comm::SymmetricBackend);
// launch: "staged" or "fused" (EpLayerOptions::fused); combine: "owner_sums" or "fc2_stores"
// (comm::EpCombine; the schema defaults it to owner_sums, as prepare_ep_weights does).
int64_t create_ep_layer(const at::Tensor& w13, const at::Tensor& w13_scales, const at::Tensor& w2,
                        const at::Tensor& w2_scales, const at::Tensor& input_scales, int64_t num_experts,
                        int64_t hidden, int64_t intermediate, int64_t top_k, const std::string& precision,
                        const std::string& scale_format, int64_t max_tokens, const std::string& rendezvous_dir,
                        int64_t rank, int64_t world_size, int64_t device_index, const std::string& token_rows,
                        const std::string& partial_sums, const std::string& symmetric_memory,
                        const std::string& launch, const std::string& combine) {
  // The kernels' limits apply to the experts of one rank (num_experts / world_size, checked below).
  const MoeSpec spec = checked_layer(num_experts, hidden, intermediate, top_k, precision, scale_format, "precomputed",
                                     false, 1, 1, 1.0, std::nullopt, max_tokens, 0, "auto", 0, "auto", 0)
                           .spec;
  comm::EpLayerOptions options;
  options.token_rows = choice_from<comm::EpTokenRows>(
      token_rows, "token_rows",
      {{"automatic", comm::EpTokenRows::automatic}, {"bf16", comm::EpTokenRows::bf16}, {"fp8", comm::EpTokenRows::fp8}});
  TORCH_CHECK_VALUE(options.token_rows != comm::EpTokenRows::fp8 || spec.precision == Precision::fp8_block,
                    "megamoe: token_rows='fp8' needs precision fp8_block (the layer's own quantization of x), not ",
                    to_string(spec.precision));
  options.partial_sums = choice_from<comm::EpPartialSums>(
      partial_sums, "partial_sums", {{"bf16", comm::EpPartialSums::bf16}, {"fp8", comm::EpPartialSums::fp8}});
  TORCH_CHECK_NOT_IMPLEMENTED(options.partial_sums != comm::EpPartialSums::fp8 || hidden % 128 == 0,
                              "megamoe: partial_sums='fp8' quantizes per 128 channels: hidden=", hidden,
                              " is not a multiple of 128");
  options.symmetric_memory = choice_from<comm::SymmetricBackend>(
      symmetric_memory, "symmetric_memory",
      {{"cuda_ipc", comm::SymmetricBackend::cuda_ipc}, {"nvshmem", comm::SymmetricBackend::nvshmem}});
  options.fused = choice_from<bool>(launch, "launch", {{"staged", false}, {"fused", true}});
  TORCH_CHECK_NOT_IMPLEMENTED(!options.fused || options.token_rows == comm::EpTokenRows::automatic,
                              "megamoe: launch='fused' takes token_rows='automatic' (the rows its layer computes on)");
  // The C++ EpLayer refuses it too, later: refused here before anything is checked against the ranks.
  TORCH_CHECK_NOT_IMPLEMENTED(!options.fused || spec.precision != Precision::fp8_tensor,
                              "megamoe: launch='fused' takes precision bf16 or fp8_block (the single-kernel forward "
                              "has no fp8_tensor path); an fp8_tensor layer runs staged (launch='staged')");
  options.combine = choice_from<comm::EpCombine>(
      combine, "combine", {{"owner_sums", comm::EpCombine::owner_sums}, {"fc2_stores", comm::EpCombine::fc2_stores}});
  // The C++ EpLayer refuses these too, later: refused here before anything is checked against the ranks.
  TORCH_CHECK_NOT_IMPLEMENTED(options.combine != comm::EpCombine::fc2_stores || options.fused,
                              "megamoe: combine='fc2_stores' is the fused forward's (FC2's epilogue stores into the "
                              "sources): set launch='fused', or keep combine='owner_sums' for the staged layer");
  TORCH_CHECK_NOT_IMPLEMENTED(
      options.combine != comm::EpCombine::fc2_stores || options.partial_sums != comm::EpPartialSums::fp8,
      "megamoe: combine='fc2_stores' returns each expert's bf16 row as FC2 stores it: partial_sums='fp8' is for "
      "combine='owner_sums'");
  checked_int(world_size, "world_size", 1);
  TORCH_CHECK_VALUE(rank >= 0 && rank < world_size, "megamoe: rank ", rank, " must be in [0, world_size=", world_size,
                    ")");
  TORCH_CHECK_VALUE(num_experts % world_size == 0, "megamoe: num_experts=", num_experts,
                    " must be a multiple of the world size ", world_size, " (each rank holds E / world experts)");
  translating_errors([&] { validate_kernel_limits(spec, static_cast<int>(num_experts / world_size)); });
  const PackedWeightsView view =
      packed_view(spec, static_cast<int>(num_experts / world_size), w13, w13_scales, w2, w2_scales, input_scales);
  const c10::DeviceIndex device = checked_device(device_index);
  return translating_errors([&] {
    c10::cuda::CUDAGuard guard(device);
    wait_for_packing(w13);
    RegisteredEpLayer entry;
    entry.rendezvous =
        std::make_unique<comm::FileRendezvous>(rendezvous_dir, static_cast<int>(rank), static_cast<int>(world_size));
    entry.layer =
        std::make_unique<comm::EpLayer>(spec, view, static_cast<int>(max_tokens), *entry.rendezvous, options);
    entry.device = device;
    return ep_registry().add(std::move(entry));
  });
}

// Collective: every rank destroys its layer (the symmetric memory waits, up to a minute, for the
// peers to unmap it).
void destroy_ep_layer(int64_t handle) { ep_registry().remove(handle); }

// Collective: y [T, H] bf16 for this rank's x [T, H] bf16 routed to global experts by topk_ids
// [T, k] int32 (-1: not routed) and topk_weights [T, k] fp32. Every rank calls it, with T = 0 too.
at::Tensor ep_forward(int64_t handle, const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights) {
  const auto entry = ep_registry().find(handle);
  const MoeSpec& spec = entry->layer->spec();
  TORCH_CHECK_VALUE(x.dim() == 2, "megamoe: x must be [tokens, hidden], got ", x.sizes());
  const int64_t T = x.size(0);
  check_input(x, "x", at::kBFloat16, T, spec.hidden, entry->device);
  check_input(topk_ids, "topk_ids", at::kInt, T, spec.top_k, entry->device);
  check_input(topk_weights, "topk_weights", at::kFloat, T, spec.top_k, entry->device);
  const int max_tokens = entry->layer->buffer_layout().max_tokens_per_rank;
  TORCH_CHECK_VALUE(T <= max_tokens, "megamoe: ", T, " tokens exceed the ", max_tokens,
                    " per rank this layer was prepared for (max_tokens)");
  c10::cuda::CUDAGuard guard(entry->device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(entry->device).stream();
  // A rank without tokens still takes part (the other ranks wait for it), on one-row stand-ins
  // for its empty tensors.
  const at::Tensor rows_x = T > 0 ? x : at::zeros({1, spec.hidden}, x.options());
  const at::Tensor rows_ids = T > 0 ? topk_ids : at::full({1, spec.top_k}, -1, topk_ids.options());
  const at::Tensor rows_weights = T > 0 ? topk_weights : at::zeros({1, spec.top_k}, topk_weights.options());
  at::Tensor y = at::empty({std::max<int64_t>(T, 1), spec.hidden}, x.options());
  translating_errors([&] {
    entry->layer->forward(stream,
                          MoeInputs{static_cast<int>(T), rows_x.data_ptr(), nullptr, rows_ids.data_ptr<int32_t>(),
                                    rows_weights.data_ptr<float>()},
                          MoeOutputs{y.data_ptr()});
  });
  return y.narrow(0, 0, T);
}

int64_t ep_invalid_routing_ids(int64_t handle) { return take_invalid_routing_ids(ep_registry(), handle); }

// How the layer's token rows travel ("bf16" or "fp8"): its token_rows choice, "automatic" resolved.
std::string ep_token_rows(int64_t handle) { return comm::to_string(ep_registry().find(handle)->layer->token_rows()); }

// Synchronizes the current stream; raises RuntimeError naming the barrier and the peer when a
// cross-rank barrier of an earlier call gave up (comm::EpLayer::check_peers).
void ep_check_peers(int64_t handle) {
  const auto entry = ep_registry().find(handle);
  c10::cuda::CUDAGuard guard(entry->device);
  translating_errors([&] { entry->layer->check_peers(c10::cuda::getCurrentCUDAStream(entry->device).stream()); });
}

}  // namespace

TORCH_LIBRARY(megamoe, m) {
  m.def("pack_weights(Tensor w13, Tensor w2, Tensor? w13_scale, Tensor? w2_scale, Tensor? w13_input_scale, "
        "Tensor? w2_input_scale, str precision, str scale_format) -> Tensor[]",
        &pack_weights);
  m.def("check_layer(int num_experts, int hidden, int intermediate, int top_k, str precision, str scale_format, "
        "str routing, bool renormalize, int n_group, int topk_group, float routed_scaling_factor, Tensor? bias, "
        "int max_tokens, int token_tile, str fc1_token_rows, int num_sms, str launch) -> ()",
        &check_layer);
  m.def("check_device(int device_index) -> int", &check_device);
  m.def("create_layer(Tensor w13, Tensor w13_scales, Tensor w2, Tensor w2_scales, Tensor input_scales, "
        "int num_experts, int hidden, int intermediate, int top_k, str precision, str scale_format, str routing, "
        "bool renormalize, int n_group, int topk_group, float routed_scaling_factor, Tensor? bias, int max_tokens, "
        "int token_tile, str fc1_token_rows, int num_sms, str launch, int device_index) -> int",
        &create_layer);
  m.def("destroy_layer(int layer) -> ()", &destroy_layer);
  m.def("forward(int layer, Tensor x, Tensor? router_logits, Tensor? topk_ids, Tensor? topk_weights, "
        "bool deterministic, str routing, bool renormalize, int n_group, int topk_group, float routed_scaling_factor, "
        "Tensor? bias) -> Tensor");
  m.def("invalid_routing_ids(int layer) -> int", &invalid_routing_ids);
  m.def("workspace_bytes(int layer) -> int", &workspace_bytes);
  m.def("create_ep_layer(Tensor w13, Tensor w13_scales, Tensor w2, Tensor w2_scales, Tensor input_scales, "
        "int num_experts, int hidden, int intermediate, int top_k, str precision, str scale_format, int max_tokens, "
        "str rendezvous_dir, int rank, int world_size, int device_index, str token_rows, str partial_sums, "
        "str symmetric_memory, str launch, str combine='owner_sums') -> int",
        &create_ep_layer);
  m.def("destroy_ep_layer(int layer) -> ()", &destroy_ep_layer);
  m.def("ep_forward(int layer, Tensor x, Tensor topk_ids, Tensor topk_weights) -> Tensor");
  m.def("ep_invalid_routing_ids(int layer) -> int", &ep_invalid_routing_ids);
  m.def("ep_token_rows(int layer) -> str", &ep_token_rows);
  m.def("ep_check_peers(int layer) -> ()", &ep_check_peers);
}

TORCH_LIBRARY_IMPL(megamoe, CUDA, m) {
  m.impl("forward", &forward);
  m.impl("ep_forward", &ep_forward);
}

}  // namespace megamoe::torch_ops
