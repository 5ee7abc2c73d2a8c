#include "ref/moe_reference.hpp"

#include <algorithm>
#include <cmath>
#include <mutex>

#include "megamoe/error.hpp"
#include "ref/parallel.hpp"
#include "ref/quantize.hpp"
#include "ref/weight_packing.hpp"

namespace megamoe::ref {
namespace {

// Where the activations and the FC1 output are rounded, matching one device precision mode.
enum class ActivationPath { fp8_block, bf16, unquantized };

using ExpertLoader = std::function<ExpertMatrices(int expert)>;

struct Slot {
  int token;
  int index;  // t * k + j
};

std::vector<double> load_activations(const MoeSpec& spec, ActivationPath path, const MoeInputs& inputs) {
  const int T = inputs.num_tokens, H = spec.hidden;
  const bf16_t* x = static_cast<const bf16_t*>(inputs.x);
  std::vector<float> xf(static_cast<size_t>(T) * H);
  for (size_t i = 0; i < xf.size(); ++i) xf[i] = x[i].to_float();
  if (path == ActivationPath::fp8_block) {
    const QuantizedRows q = quantize_rows_per_128(xf.data(), T, H, spec.scale_format);
    return dequantize_rows_per_128(q.codes.data(), q.scales.data(), T, H);
  }
  return std::vector<double>(xf.begin(), xf.end());
}

// FC1 output row of one slot, rounded the way the device stores it for FC2.
void round_fc1_output(const MoeSpec& spec, ActivationPath path, std::vector<double>& h) {
  const int I = spec.intermediate;
  if (path == ActivationPath::bf16) {
    for (double& v : h) v = bf16_t::from_float(static_cast<float>(v)).to_float();
  } else if (path == ActivationPath::fp8_block) {
    std::vector<float> hf(h.begin(), h.end());
    const QuantizedRows q = quantize_rows_per_128(hf.data(), 1, I, spec.scale_format);
    h = dequantize_rows_per_128(q.codes.data(), q.scales.data(), 1, I);
  }
}

double dot(const double* a, const double* b, int n) {
  double sum = 0.0;
  for (int i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// Computes every routed slot's expert output (unweighted) into slot_out [T*k, H].
void compute_experts(const MoeSpec& spec, ActivationPath path, const ExpertLoader& load_expert,
                     const std::vector<double>& activations, const std::vector<std::vector<Slot>>& slots_of_expert,
                     std::vector<double>& slot_out, const ReferenceProgress& progress) {
  const int H = spec.hidden, I = spec.intermediate, E = spec.num_experts;
  std::mutex progress_mutex;
  int done = 0;
  parallel_for(E, [&](int e) {
    std::vector<double> h(I);
    const std::vector<Slot>& slots = slots_of_expert[e];
    if (!slots.empty()) {
      const ExpertMatrices w = load_expert(e);
      for (const Slot& slot : slots) {
        const double* a = activations.data() + static_cast<size_t>(slot.token) * H;
        for (int c = 0; c < I; ++c) {
          const double gate = dot(w.w13.data() + static_cast<size_t>(c) * H, a, H);
          const double up = dot(w.w13.data() + static_cast<size_t>(I + c) * H, a, H);
          // The device keeps SwiGLU in fp32 registers before requantizing.
          h[c] = path == ActivationPath::unquantized ? swiglu(gate, up) : static_cast<float>(swiglu(gate, up));
        }
        round_fc1_output(spec, path, h);
        double* out = slot_out.data() + static_cast<size_t>(slot.index) * H;
        for (int n = 0; n < H; ++n) out[n] = dot(w.w2.data() + static_cast<size_t>(n) * I, h.data(), I);
      }
    }
    if (progress) {
      std::lock_guard<std::mutex> lock(progress_mutex);
      progress(++done, E);
    }
  });
}

ReferenceReport run_reference(const MoeSpec& spec, ActivationPath path, const ExpertLoader& load_expert,
                              const MoeInputs& inputs, const MoeOutputs& outputs, const ReferenceProgress& progress) {
  validate_forward_args(spec, inputs.num_tokens, inputs, outputs);
  const int T = inputs.num_tokens, H = spec.hidden, k = spec.top_k;
  ReferenceReport report;
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

  const std::vector<double> activations = load_activations(spec, path, inputs);
  std::vector<double> slot_out(static_cast<size_t>(T) * k * H, 0.0);
  compute_experts(spec, path, load_expert, activations, slots_of_expert, slot_out, progress);

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
  return report;
}

void check_packed_matches(const MoeSpec& spec, const PackedWeights& weights) {
  if (weights.num_experts != spec.num_experts || weights.hidden != spec.hidden ||
      weights.intermediate != spec.intermediate || weights.precision != spec.precision ||
      (spec.precision == Precision::fp8_block && weights.scale_format != spec.scale_format)) {
    throw Error(ErrorCode::invalid_argument,
                "packed weights were prepared for a different spec; call prepare_weights with this spec");
  }
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
                                  const MoeOutputs& outputs, const ReferenceProgress& progress) {
  validate(spec);
  check_packed_matches(spec, weights);
  const ActivationPath path = spec.precision == Precision::fp8_block ? ActivationPath::fp8_block : ActivationPath::bf16;
  return run_reference(spec, path, [&](int e) { return decode_expert(weights, e); }, inputs, outputs, progress);
}

ReferenceReport reference_forward_unquantized(const MoeSpec& spec, const WeightsView& weights,
                                              const MoeInputs& inputs, const MoeOutputs& outputs,
                                              const ReferenceProgress& progress) {
  validate(spec);
  if (weights.w13 == nullptr || weights.w2 == nullptr) throw Error(ErrorCode::null_pointer, "weights.w13/w2 is null");
  if (weights.dtype != DType::bf16 && weights.dtype != DType::fp32) {
    throw Error(ErrorCode::invalid_argument, "unquantized reference takes bf16 or fp32 weights");
  }
  const size_t w13_count = 2ull * spec.intermediate * spec.hidden;
  const size_t w2_count = static_cast<size_t>(spec.hidden) * spec.intermediate;
  auto load = [&](int e) {
    auto read = [&](const void* base, size_t offset, size_t count) {
      std::vector<double> out(count);
      for (size_t i = 0; i < count; ++i) {
        out[i] = weights.dtype == DType::fp32 ? static_cast<const float*>(base)[offset + i]
                                              : static_cast<const bf16_t*>(base)[offset + i].to_float();
      }
      return out;
    };
    return ExpertMatrices{read(weights.w13, e * w13_count, w13_count), read(weights.w2, e * w2_count, w2_count)};
  };
  return run_reference(spec, ActivationPath::unquantized, load, inputs, outputs, progress);
}

}  // namespace megamoe::ref
