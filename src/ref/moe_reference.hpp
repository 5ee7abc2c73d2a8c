// The MoE layer forward on the CPU in fp64: the oracle every device kernel is checked against.
#pragma once

#include <functional>
#include <optional>
#include <vector>

#include "megamoe/forward.hpp"
#include "megamoe/weights.hpp"
#include "ref/routing.hpp"

namespace megamoe::ref {

struct ReferenceReport {
  RoutingResult routing;     // ids and weights used (the caller's own when precomputed)
  long invalid_ids = 0;      // out-of-range or duplicate ids, which contributed nothing
  std::vector<double> y;     // [T, H] before the final rounding to bf16
  float fc1_input_scale = 0.0f;  // fp8_tensor: the activation scales applied (static, dynamic or given)
  float fc2_input_scale = 0.0f;
};

// fp8_tensor's two activation scales, for reference_forward to apply instead of its own: a dynamic
// layer's scales come from all of a call's tokens, where a test runs the reference on a sample.
struct ActivationScaleOverride {
  float fc1;
  float fc2;
};

// Called after each expert is computed (done experts, total).
using ReferenceProgress = std::function<void(int done, int total)>;

// Emulates the device pipeline at every quantization point, so it can be compared tightly:
//  fp8_block: x -> E4M3 per token per 128 channels; FC1 on decoded values (exact products, fp64
//  sums); SwiGLU in fp64 rounded to fp32; FC1 output -> E4M3 per token per 128; FC2; weighted
//  sum over the top-k in fixed slot order; bf16 out.
//  fp8_tensor: x -> E4M3 as e4m3(x * (1 / fc1_input_scale)); FC1 on decoded values; SwiGLU in
//  fp64 rounded to fp32; FC1 output -> e4m3(h * (1 / fc2_input_scale)); FC2 as above. With
//  InputScales::dynamic, fc1_input_scale is tensor_scale of x's largest finite |value| and
//  fc2_input_scale that of FC1's output rounded to bf16 over every routed row, which is then
//  encoded from its bf16 values.
//  bf16: the same with no quantization, the FC1 output rounded to bf16.
// Host buffers; validates like forward and writes outputs.y only after validation.
ReferenceReport reference_forward(const MoeSpec& spec, const PackedWeights& weights, const MoeInputs& inputs,
                                  const MoeOutputs& outputs, const ReferenceProgress& progress = {},
                                  std::optional<ActivationScaleOverride> scales = std::nullopt);

// Unquantized math on the caller's original weights (no activation or FC1-output quantization):
// the loose check that quantization did not change what the layer computes.
ReferenceReport reference_forward_unquantized(const MoeSpec& spec, const WeightsView& weights,
                                              const MoeInputs& inputs, const MoeOutputs& outputs,
                                              const ReferenceProgress& progress = {});

// Static activation scales for an fp8_tensor layer whose weights come without them (what a
// calibration pass over sample inputs measures): amax / 448 of the layer input x over `inputs`'
// tokens (fc1) and of SwiGLU's output over their routed slots (fc2), from unquantized math on
// bf16 or fp32 weights; an amax below 1e-4 counts as 1e-4, as for block scales.
struct CalibratedInputScales {
  float fc1 = 0.0f;
  float fc2 = 0.0f;
};
CalibratedInputScales calibrate_input_scales(const MoeSpec& spec, const WeightsView& weights, const MoeInputs& inputs);

// SiLU(g) * u in fp64.
double swiglu(double gate, double up);

// ||a - b|| / ||b|| over all elements: how far an output is from a reference.
double relative_l2(const std::vector<double>& a, const std::vector<double>& b);

}  // namespace megamoe::ref
