#include "ref/moe_reference.hpp"

#include <algorithm>
#include <cmath>
#include <mutex>

#include "megamoe/error.hpp"
#include "common/parallel_for.hpp"
#include "quant/quantize.hpp"
#include "kernels/layout/weight_layout.hpp"
#include "weights/packed_decode.hpp"

namespace megamoe::ref {
namespace {

// Where the activations and the FC1 output are rounded, matching one device precision mode.
enum class ActivationPath { fp8_block, fp8_tensor, bf16, unquantized };

// The path, with fp8_tensor's scales: static (PackedWeights' fc1_input_scale / fc2_input_scale),
// or dynamic, computed from the run's own x and FC1 output as the device computes them.
struct Rounding {
  ActivationPath path;
  float fc1_input_scale = 0.0f;
  float fc2_input_scale = 0.0f;
  bool dynamic = false;          // FC1's output is stored in bf16 before its encoding
  bool computes_scales = false;  // dynamic: from this run's x and FC1 output, else given
};

// The rounding the device applies to layers of the weights' precision.
Rounding rounding_of(const PackedWeights& weights) {
  switch (weights.precision) {
    case Precision::fp8_block: return Rounding{ActivationPath::fp8_block};
    case Precision::fp8_tensor:
      return Rounding{ActivationPath::fp8_tensor, weights.fc1_input_scale, weights.fc2_input_scale,
                      weights.input_scales == InputScales::dynamic, weights.input_scales == InputScales::dynamic};
    case Precision::bf16: break;
  }
  return Rounding{ActivationPath::bf16};
}

// A dynamic per-tensor scale's amax: the largest finite |value| (an inf or NaN element encodes as
// itself, saturated or NaN, and leaves the other elements' scale alone).
template <class Values>
float finite_amax(const Values& values) {
  float amax = 0.0f;
  for (const auto v : values) {
    const float f = static_cast<float>(v);
    if (std::isfinite(f)) amax = std::fmax(amax, std::fabs(f));
  }
  return amax;
}

// What a run computes: the report, and for calibration the largest |SwiGLU output| of any routed
// slot, before the FC1 output is rounded.
struct ReferenceRun {
  ReferenceReport report;
  double fc1_output_amax = 0.0;
};

// One expert's weights, a row at a time as doubles: gate/up row r in the original order
// (gate rows [0, I), up rows [I, 2I)), W2 row n. Rows are decoded on the fly so the reference
// streams 1-2 bytes per weight instead of a materialized fp64 copy of every touched expert.
struct ExpertRows {
  std::function<void(int row, double* out)> w13;
  std::function<void(int row, double* out)> w2;
};
using ExpertLoader = std::function<ExpertRows(int expert)>;

struct Slot {
  int token;
  int index;  // t * k + j
};

// values -> e4m3(v * (1 / scale)) -> decode * scale, fp8_tensor's rounding of a whole tensor.
std::vector<double> round_per_tensor(const std::vector<float>& values, float scale) {
  std::vector<uint8_t> codes(values.size());
  quant::quantize_per_tensor(values.data(), values.size(), scale, codes.data());
  return quant::dequantize_per_tensor(codes.data(), codes.size(), scale);
}

// x as the device encodes it; a dynamic fp8_tensor scale computed from it is left in `rounding`.
std::vector<double> load_activations(const MoeSpec& spec, Rounding& rounding, const MoeInputs& inputs) {
  const int T = inputs.num_tokens, H = spec.hidden;
  if (inputs.x_scales != nullptr) {
    // x already quantized (fp8_block, checked by validate_forward_args): its codes and scales as given.
    const size_t stride = static_cast<size_t>(x_scale_stride_of(inputs));
    const int blocks = H / quant::kQuantBlock;
    std::vector<float> scales(static_cast<size_t>(T) * blocks);
    for (int t = 0; t < T; ++t)
      for (int b = 0; b < blocks; ++b) scales[static_cast<size_t>(t) * blocks + b] = inputs.x_scales[b * stride + t];
    return quant::dequantize_rows_per_128(static_cast<const uint8_t*>(inputs.x), scales.data(), T, H);
  }
  const bf16_t* x = static_cast<const bf16_t*>(inputs.x);
  std::vector<float> xf(static_cast<size_t>(T) * H);
  for (size_t i = 0; i < xf.size(); ++i) xf[i] = x[i].to_float();
  if (rounding.path == ActivationPath::fp8_block) {
    const quant::QuantizedRows q = quant::quantize_rows_per_128(xf.data(), T, H, spec.scale_format);
    return quant::dequantize_rows_per_128(q.codes.data(), q.scales.data(), T, H);
  }
  if (rounding.path == ActivationPath::fp8_tensor) {
    if (rounding.computes_scales) rounding.fc1_input_scale = quant::tensor_scale(finite_amax(xf));
    return round_per_tensor(xf, rounding.fc1_input_scale);
  }
  return std::vector<double>(xf.begin(), xf.end());
}

// FC1 output row of one slot, rounded the way the device stores it for FC2.
void round_fc1_output(const MoeSpec& spec, const Rounding& rounding, std::vector<double>& h) {
  const int I = spec.intermediate;
  if (rounding.path == ActivationPath::bf16) {
    for (double& v : h) v = bf16_t::from_float(static_cast<float>(v)).to_float();
  } else if (rounding.path == ActivationPath::fp8_block) {
    std::vector<float> hf(h.begin(), h.end());
    const quant::QuantizedRows q = quant::quantize_rows_per_128(hf.data(), 1, I, spec.scale_format);
    h = quant::dequantize_rows_per_128(q.codes.data(), q.scales.data(), 1, I);
  } else if (rounding.path == ActivationPath::fp8_tensor) {
    h = round_per_tensor(std::vector<float>(h.begin(), h.end()), rounding.fc2_input_scale);
  }
}

// Four independent partial sums: a single running sum waits on the add latency for every element
// (1.5x slower on dsv3 rows once they sit in cache); the different summation order is far below
// any tolerance the reference is used with.
double dot(const double* a, const double* b, int n) {
  double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
  int i = 0;
  for (; i + 4 <= n; i += 4) {
    s0 += a[i] * b[i];
    s1 += a[i + 1] * b[i + 1];
    s2 += a[i + 2] * b[i + 2];
    s3 += a[i + 3] * b[i + 3];
  }
  for (; i < n; ++i) s0 += a[i] * b[i];
  return (s0 + s1) + (s2 + s3);
}

// Computes every routed slot's expert output (unweighted) into slot_out [T*k, H]; returns the
// largest |SwiGLU output| of any slot, before round_fc1_output. Two passes over the experts: FC1
// of every slot, then (after a dynamic scale of FC2's input has seen all of FC1's output) the
// rounding of FC1's output and FC2; a dynamic scale is left in `rounding`.
double compute_experts(const MoeSpec& spec, Rounding& rounding, const ExpertLoader& load_expert,
                       const std::vector<double>& activations, const std::vector<std::vector<Slot>>& slots_of_expert,
                       std::vector<double>& slot_out, const ReferenceProgress& progress) {
  const ActivationPath path = rounding.path;
  const int H = spec.hidden, I = spec.intermediate, E = spec.num_experts;
  std::mutex mutex;  // guards done, fc1_output_amax and the progress callback
  int done = 0;
  double fc1_output_amax = 0.0;
  std::vector<std::vector<std::vector<double>>> h_of_expert(E);  // [e][slot][channel]
  parallel_for(E, [&](int e) {
    const std::vector<Slot>& slots = slots_of_expert[e];
    if (slots.empty()) return;
    const ExpertRows w = load_expert(e);
    const size_t n_slots = slots.size();
    // Each weight row is decoded once and used for every slot routed to this expert.
    std::vector<double> gate_row(H), up_row(H);
    std::vector<std::vector<double>>& h = h_of_expert[e];
    h.assign(n_slots, std::vector<double>(I));
    for (int c = 0; c < I; ++c) {
      w.w13(c, gate_row.data());
      w.w13(I + c, up_row.data());
      for (size_t s = 0; s < n_slots; ++s) {
        const double* a = activations.data() + static_cast<size_t>(slots[s].token) * H;
        const double g = dot(gate_row.data(), a, H), u = dot(up_row.data(), a, H);
        // The device keeps SwiGLU in fp32 registers before requantizing.
        h[s][c] = path == ActivationPath::unquantized ? swiglu(g, u) : static_cast<float>(swiglu(g, u));
      }
    }
    double expert_amax = 0.0;
    for (const std::vector<double>& row : h)
      for (double v : row) expert_amax = std::max(expert_amax, std::fabs(v));
    // Dynamic scales: the device stores FC1's output in bf16, takes its amax and encodes that.
    if (rounding.dynamic)
      for (std::vector<double>& row : h)
        for (double& v : row) v = bf16_t::from_float(static_cast<float>(v)).to_float();
    std::lock_guard<std::mutex> lock(mutex);
    fc1_output_amax = std::max(fc1_output_amax, expert_amax);
  });
  if (path == ActivationPath::fp8_tensor && rounding.computes_scales) {
    float amax = 0.0f;
    for (const auto& rows : h_of_expert)
      for (const auto& row : rows) amax = std::fmax(amax, finite_amax(row));
    rounding.fc2_input_scale = quant::tensor_scale(amax);
  }
  parallel_for(E, [&](int e) {
    const std::vector<Slot>& slots = slots_of_expert[e];
    if (!slots.empty()) {
      const ExpertRows w = load_expert(e);
      std::vector<std::vector<double>>& h = h_of_expert[e];
      for (std::vector<double>& row : h) round_fc1_output(spec, rounding, row);
      std::vector<double> w2_row(I);
      for (int n = 0; n < H; ++n) {
        w.w2(n, w2_row.data());
        for (size_t s = 0; s < slots.size(); ++s) {
          slot_out[static_cast<size_t>(slots[s].index) * H + n] = dot(w2_row.data(), h[s].data(), I);
        }
      }
      std::vector<std::vector<double>>().swap(h);
    }
    std::lock_guard<std::mutex> lock(mutex);
    ++done;
    if (progress) progress(done, E);
  });
  return fc1_output_amax;
}

ReferenceRun run_reference(const MoeSpec& spec, Rounding rounding, const ExpertLoader& load_expert,
                           const MoeInputs& inputs, const MoeOutputs& outputs, const ReferenceProgress& progress) {
  validate_forward_args(spec, inputs.num_tokens, inputs, outputs);
  if (inputs.num_valid_tokens != nullptr) {
    throw Error(ErrorCode::invalid_argument,
                "the CPU reference takes no num_valid_tokens (a device-side count): pass the valid count as num_tokens");
  }
  const int T = inputs.num_tokens, H = spec.hidden, k = spec.top_k;
  ReferenceRun run;
  ReferenceReport& report = run.report;
  if (std::holds_alternative<Precomputed>(spec.routing)) {
    report.routing.num_tokens = T;
    report.routing.top_k = k;
    report.routing.ids.assign(inputs.topk_ids, inputs.topk_ids + static_cast<size_t>(T) * k);
    report.routing.weights.assign(inputs.topk_weights, inputs.topk_weights + static_cast<size_t>(T) * k);
  } else {
    report.routing = route(spec, inputs.router_logits, T);
  }
  const RoutingCheck check = check_routing(report.routing.ids.data(), T, k, spec.num_experts);
  report.invalid_ids = check.invalid_ids;

  std::vector<std::vector<Slot>> slots_of_expert(spec.num_experts);
  for (int t = 0; t < T; ++t)
    for (int j = 0; j < k; ++j) {
      const int index = t * k + j;
      if (check.used[index]) slots_of_expert[report.routing.ids[index]].push_back({t, index});
    }

  const std::vector<double> activations = load_activations(spec, rounding, inputs);
  std::vector<double> slot_out(static_cast<size_t>(T) * k * H, 0.0);
  run.fc1_output_amax = compute_experts(spec, rounding, load_expert, activations, slots_of_expert, slot_out, progress);
  report.fc1_input_scale = rounding.fc1_input_scale;
  report.fc2_input_scale = rounding.fc2_input_scale;

  // Deterministic combine: fixed slot order per token.
  report.y.assign(static_cast<size_t>(T) * H, 0.0);
  bf16_t* y = static_cast<bf16_t*>(outputs.y);
  for (int t = 0; t < T; ++t) {
    for (int j = 0; j < k; ++j) {
      const int index = t * k + j;
      if (!check.used[index]) continue;
      const double w = report.routing.weights[index];
      for (int n = 0; n < H; ++n) report.y[static_cast<size_t>(t) * H + n] += w * slot_out[static_cast<size_t>(index) * H + n];
    }
    for (int n = 0; n < H; ++n) {
      const size_t i = static_cast<size_t>(t) * H + n;
      y[i] = bf16_t::from_float(static_cast<float>(report.y[i]));
    }
  }
  return run;
}

ReferenceRun run_unquantized(const MoeSpec& spec, const WeightsView& weights, const MoeInputs& inputs,
                             const MoeOutputs& outputs, const ReferenceProgress& progress) {
  validate(spec);
  if (weights.w13 == nullptr || weights.w2 == nullptr) throw Error(ErrorCode::null_pointer, "weights.w13/w2 is null");
  if (weights.dtype != DType::bf16 && weights.dtype != DType::fp32) {
    throw Error(ErrorCode::invalid_argument, "unquantized reference takes bf16 or fp32 weights");
  }
  const int H = spec.hidden, I = spec.intermediate;
  // Row `row` of a [rows, cols] matrix of expert e in the caller's dtype.
  auto read_row = [&](const void* base, size_t expert_offset, int cols, int row, double* out) {
    const size_t first = expert_offset + static_cast<size_t>(row) * cols;
    for (int c = 0; c < cols; ++c) {
      out[c] = weights.dtype == DType::fp32 ? static_cast<const float*>(base)[first + c]
                                            : static_cast<const bf16_t*>(base)[first + c].to_float();
    }
  };
  auto load = [&](int e) {
    const size_t w13_offset = static_cast<size_t>(e) * 2 * I * H, w2_offset = static_cast<size_t>(e) * H * I;
    return ExpertRows{[&, w13_offset](int row, double* out) { read_row(weights.w13, w13_offset, H, row, out); },
                      [&, w2_offset](int row, double* out) { read_row(weights.w2, w2_offset, I, row, out); }};
  };
  return run_reference(spec, Rounding{ActivationPath::unquantized}, load, inputs, outputs, progress);
}

}  // namespace

double swiglu(double gate, double up) { return gate / (1.0 + std::exp(-gate)) * up; }

double relative_l2(const std::vector<double>& a, const std::vector<double>& b) {
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff += (a[i] - b[i]) * (a[i] - b[i]);
    norm += b[i] * b[i];
  }
  return std::sqrt(diff / std::max(norm, 1e-300));
}

ReferenceReport reference_forward(const MoeSpec& spec, const PackedWeights& weights, const MoeInputs& inputs,
                                  const MoeOutputs& outputs, const ReferenceProgress& progress,
                                  std::optional<ActivationScaleOverride> scales) {
  validate(spec);
  validate_packed(spec, weights);
  const int I = spec.intermediate;
  auto rows_of = [&](int e) {
    return ExpertRows{[&, e](int row, double* out) {
                        weights::decode_packed_row(weights, weights::PackedMatrix::w13, e, layout::packed_w13_row(row, I), out);
                      },
                      [&, e](int row, double* out) { weights::decode_packed_row(weights, weights::PackedMatrix::w2, e, row, out); }};
  };
  Rounding rounding = rounding_of(weights);
  if (scales.has_value()) {
    if (rounding.path != ActivationPath::fp8_tensor) {
      throw Error(ErrorCode::invalid_argument, "reference_forward: activation scales apply to fp8_tensor weights only");
    }
    rounding.fc1_input_scale = scales->fc1;
    rounding.fc2_input_scale = scales->fc2;
    rounding.computes_scales = false;
  }
  return run_reference(spec, rounding, rows_of, inputs, outputs, progress).report;
}

ReferenceReport reference_forward_unquantized(const MoeSpec& spec, const WeightsView& weights,
                                              const MoeInputs& inputs, const MoeOutputs& outputs,
                                              const ReferenceProgress& progress) {
  return run_unquantized(spec, weights, inputs, outputs, progress).report;
}

CalibratedInputScales calibrate_input_scales(const MoeSpec& spec, const WeightsView& weights, const MoeInputs& inputs) {
  validate(spec);
  if (inputs.x_scales != nullptr) {
    throw Error(ErrorCode::invalid_argument, "calibrate_input_scales takes a bf16 x, not quantized codes (x_scales)");
  }
  const size_t elements = static_cast<size_t>(std::max(inputs.num_tokens, 0)) * spec.hidden;
  // Calibration reads the run's amaxes, not its output, but the run writes one.
  std::vector<bf16_t> y(elements);
  const ReferenceRun run = run_unquantized(spec, weights, inputs, MoeOutputs{y.data()}, {});
  const bf16_t* x = static_cast<const bf16_t*>(inputs.x);  // validated by the run
  float input_amax = 0.0f;
  for (size_t i = 0; i < elements; ++i) input_amax = std::fmax(input_amax, std::fabs(x[i].to_float()));
  return CalibratedInputScales{quant::tensor_scale(input_amax), quant::tensor_scale(static_cast<float>(run.fc1_output_amax))};
}

}  // namespace megamoe::ref
