// MoeLayer: the single-GPU MoE layer on a Hopper GPU (built when CUDA is enabled).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <optional>
#include <string>

#include "megamoe/forward.hpp"
#include "megamoe/options.hpp"
#include "megamoe/spec.hpp"
#include "megamoe/weights.hpp"

namespace megamoe {

namespace detail {
struct SingleKernelLaunch;  // src/api/single_kernel_launch.hpp (expert parallelism's fused forward)
}  // namespace detail

// Throws megamoe::Error(unsupported) where a layer of `spec` with `experts_on_gpu` of its experts on
// one GPU needs more than the kernels hold (experts, top_k slots, deepseek groups, hidden a multiple
// of 8) beyond what validate(spec) checks. MoeLayer checks it before it looks for the device; a
// caller that packs weights first (the PyTorch ops, expert parallelism per rank) checks it before.
void validate_kernel_limits(const MoeSpec& spec, int experts_on_gpu);

class MoeLayer {
 public:
  // Uploads the packed weights to the current device and allocates the workspace for up to
  // `max_tokens` tokens per call, with the planner's choices replaced where `options` says so.
  // Throws megamoe::Error.
  MoeLayer(const MoeSpec& spec, const PackedWeights& weights, int max_tokens, const MoeLayerOptions& options = {});
  // The same from packed weights the caller holds elsewhere (host or device memory): copied.
  MoeLayer(const MoeSpec& spec, const PackedWeightsView& weights, int max_tokens,
           const MoeLayerOptions& options = {});
  ~MoeLayer();
  MoeLayer(const MoeLayer&) = delete;
  MoeLayer& operator=(const MoeLayer&) = delete;

  // y = MoE(x) on `stream`. Validates the arguments first (nothing is launched on bad input);
  // enqueues kernels only: no host synchronization, so it can be captured in a CUDA graph. The
  // current device must be the one the layer was built on, and `stream` one of its streams
  // (another current device is refused with Error(invalid_argument), as by take_invalid_routing_ids).
  // Calls share the layer's workspace: two calls may not run at the same time on the device (on
  // two streams without an event between them, or two graphs replayed concurrently). Order them,
  // or give each stream its own MoeLayer. Calls from several host threads are safe: one call's
  // launches are never interleaved with another's.
  // `combine` replaces the options' combine for this call, inputs.routing the spec's routing. A
  // DeepseekGrouped bias new to the layer is uploaded synchronously (at most 64 distinct ones per
  // layer, each kept for the CUDA graphs that may use it), so its first call cannot be captured.
  void forward(cudaStream_t stream, const MoeInputs& inputs, const MoeOutputs& outputs,
               std::optional<CombineMode> combine = std::nullopt);

  // The plan a forward of `tokens` rows launches (tiles, stages, grid, combine, workspace), with
  // the reason for each choice: what MEGAMOE_PRINT_CONFIGS=1 prints when such a forward runs.
  std::string describe_plan(int tokens, std::optional<CombineMode> combine = std::nullopt) const;

  // Synchronizes `stream`, returns how many routed ids were invalid (>= E, negative other than -1,
  // or a duplicate within a token) since the last call, and resets the count. Invalid ids
  // contribute nothing. Refused (Error(invalid_argument)) while `stream` is being captured.
  long take_invalid_routing_ids(cudaStream_t stream);

  // fp8_tensor: the activation scales (x's, and FC2's input's) the last forward on `stream` used:
  // the static ones, or the dynamic ones it computed (InputScales::dynamic; 0 before the first
  // forward, and a call of zero tokens leaves the previous ones). Synchronizes `stream`, so it is
  // refused while the stream is being captured; throws megamoe::Error(invalid_argument) then and
  // for the other precisions.
  struct ActivationScales {
    float fc1;
    float fc2;
  };
  ActivationScales activation_scales(cudaStream_t stream) const;

  // Diagnosis (megamoe-bench --breakdown): later forwards that run as one kernel fold the GPU's
  // global timer at the points of src/kernels/layout/forward_timeline.hpp into `stamps` (device,
  // [event][2] unsigned long long: the earliest and the latest ns any CTA reached the point; the
  // caller presets them to UINT64_MAX and 0). Null, the default, turns it off. Five-kernel
  // forwards mark nothing.
  void set_timeline(unsigned long long* stamps);

  const MoeSpec& spec() const { return spec_; }
  int max_tokens() const { return max_tokens_; }
  const MoeLayerOptions& options() const;
  size_t workspace_bytes() const;

 private:
  friend struct detail::SingleKernelLaunch;
  struct Impl;
  MoeSpec spec_;
  int max_tokens_;
  Impl* impl_;
};

}  // namespace megamoe
