// The GPU layer suites' shared fixture: cases, a cached layer per (workload, precision, routing),
// random inputs (uniform or skewed routing), the reference comparison and one device forward.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "common/gpu_test.hpp"
#include "common/test_random.hpp"
#include "megamoe/layer.hpp"
#include "plan/workloads.hpp"
#include "ref/random_problem.hpp"

namespace megamoe::test {

enum class RoutingKind { workload, softmax, grouped, precomputed };
enum class Skew { uniform, skewed };

struct Case {
  std::string workload;  // a named workload, "small", or one of test_shape()'s
  Precision precision;
  int tokens;
  RoutingKind routing;
  Skew skew;
  CombineMode combine;
  InputScales input_scales = InputScales::from_checkpoint;  // fp8_tensor: static or dynamic activation scales
};

inline std::string name_of(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  std::string name = c.workload + "_" + to_string(c.precision) + "_T" + std::to_string(c.tokens);
  const char* routing[] = {"", "_softmax", "_grouped", "_precomputed"};
  name += routing[static_cast<int>(c.routing)];
  if (c.skew == Skew::skewed) name += "_skewed";
  if (c.combine == CombineMode::fast) name += "_fast";
  if (c.input_scales == InputScales::dynamic) name += "_dynamic";
  for (char& ch : name)
    if (ch == '-') ch = '_';
  return name;
}

// Weights, packed copy and layer for one (workload, precision); rebuilt when the key changes so
// that only one large workload lives in memory at a time.
struct LayerFixture {
  MoeSpec spec;
  ref::RandomWeights weights;
  PackedWeights packed;
  std::unique_ptr<MoeLayer> layer;
  // The same weights, options.launch = single_kernel (not with fp8_tensor's dynamic scales).
  std::unique_ptr<MoeLayer> single_kernel_layer;
};

inline constexpr int kMaxTokens = 4096;

// Shapes of the suites besides the named workloads, {E, k, H, I}: "small" (whole 256-row channel
// tiles in both GEMMs), and the shapes users' models bring that the named ones do not: "ragged", an
// expert count no power of two and a width of 1.5 channel tiles (FC2's last tile half-filled),
// "ragged64" (bf16, whose widths are multiples of 64: FC1's 2I = 640 and FC2's H = 192 both end in
// a part-filled tile, and K blocks of 64 elements), "top2" (few experts with many rows each, a
// Mixtral-like layer scaled down) and "top1" (one expert a token). 0 where the name is none of them.
struct TestShape {
  int num_experts, top_k, hidden, intermediate;
};
inline TestShape test_shape(const std::string& name) {
  if (name == "small") return {16, 4, 256, 256};
  if (name == "ragged") return {60, 4, 384, 1408};
  if (name == "ragged64") return {60, 4, 192, 320};
  if (name == "top2") return {8, 2, 1024, 2816};
  if (name == "top1") return {32, 1, 256, 256};
  return {0, 0, 0, 0};
}

inline MoeSpec spec_for(const Case& c, uint64_t seed) {
  MoeSpec spec;
  if (const TestShape shape = test_shape(c.workload); shape.num_experts > 0) {
    spec.num_experts = shape.num_experts;
    spec.top_k = shape.top_k;
    spec.hidden = shape.hidden;
    spec.intermediate = shape.intermediate;
  } else {
    spec = plan::find_workload(c.workload).spec;
  }
  spec.precision = c.precision;
  switch (c.routing) {
    case RoutingKind::workload: break;
    case RoutingKind::softmax: spec.routing = SoftmaxTopK{.renormalize = false}; break;
    case RoutingKind::grouped: spec.routing = DeepseekGrouped{.n_group = 4, .topk_group = 2, .routed_scaling_factor = 2.5f}; break;
    case RoutingKind::precomputed: spec.routing = Precomputed{}; break;
  }
  if (auto* grouped = std::get_if<DeepseekGrouped>(&spec.routing)) {
    std::mt19937_64 engine(seed);
    std::uniform_real_distribution<float> bias(-0.05f, 0.05f);
    grouped->e_score_correction_bias.resize(spec.num_experts);
    for (float& b : grouped->e_score_correction_bias) b = bias(engine);
  }
  return spec;
}

// A fixture's weights (and a grouped routing's bias) come from the run's seed and the fixture's
// own name, not from the test that happens to build it: a replay builds the same one.
inline LayerFixture& fixture_for(const Case& c) {
  static std::unique_ptr<LayerFixture> cached;
  static std::string cached_key;
  const uint64_t seed = test::seed_for("layer fixture " + c.workload + " " + to_string(c.precision) + " routing " +
                                       std::to_string(static_cast<int>(c.routing)) +
                                       (c.input_scales == InputScales::dynamic ? " dynamic" : ""));
  const MoeSpec spec = spec_for(c, seed);
  std::ostringstream key;
  key << spec << (c.input_scales == InputScales::dynamic ? " dynamic" : "");
  if (!cached || cached_key != key.str()) {
    cached.reset();
    auto f = std::make_unique<LayerFixture>();
    f->spec = spec;
    f->weights = ref::make_random_weights(spec, seed, c.input_scales);
    f->packed = prepare_weights(spec, f->weights.view());
    f->layer = std::make_unique<MoeLayer>(spec, f->packed, kMaxTokens);
    if (!(spec.precision == Precision::fp8_tensor && f->packed.input_scales == InputScales::dynamic)) {
      f->single_kernel_layer = std::make_unique<MoeLayer>(spec, f->packed, kMaxTokens,
                                                          MoeLayerOptions{.launch = ForwardLaunch::single_kernel});
    }
    cached = std::move(f);
    cached_key = key.str();
  }
  return *cached;
}

struct Inputs {
  std::vector<bf16_t> x;
  std::vector<float> logits;
  std::vector<int32_t> ids;
  std::vector<float> weights;
  MoeInputs view(int tokens) const { return MoeInputs{tokens, x.data(), logits.data(), ids.data(), weights.data()}; }
};

inline Inputs make_inputs(test::SeededRng& rng, const MoeSpec& spec, int tokens, Skew skew) {
  Inputs in;
  const int E = spec.num_experts, k = spec.top_k;
  in.x = rng.bf16_normals(static_cast<size_t>(tokens) * spec.hidden);
  in.logits = rng.normals(static_cast<size_t>(tokens) * E);
  if (skew == Skew::skewed) {
    // Expert 0 wins every token; the rest of each top-k comes from 2k experts, so most get none.
    for (int t = 0; t < tokens; ++t) {
      in.logits[static_cast<size_t>(t) * E] += 12.0f;
      for (int e = 1; e <= 2 * k && e < E; ++e) in.logits[static_cast<size_t>(t) * E + e] += 6.0f;
    }
  }
  for (int t = 0; t < tokens; ++t) {
    // Distinct ids: a partial Fisher-Yates shuffle of the candidates. Skewed: expert 0 first,
    // the rest from experts 1..2k.
    std::vector<int32_t> candidates;
    if (skew == Skew::skewed) {
      for (int e = 1; e <= std::min(E - 1, 2 * k); ++e) candidates.push_back(e);
    } else {
      for (int e = 0; e < E; ++e) candidates.push_back(e);
    }
    for (int j = 0; j < k; ++j) {
      int32_t id;
      if (skew == Skew::skewed && j == 0) {
        id = 0;
      } else {
        const int offset = skew == Skew::skewed ? j - 1 : j;
        std::swap(candidates[offset], candidates[rng.integer(offset, static_cast<int>(candidates.size()) - 1)]);
        id = candidates[offset];
      }
      in.ids.push_back(id);
      in.weights.push_back(rng.uniform(0.05f, 1.0f));
    }
  }
  return in;
}

// Tokens compared with the CPU reference: routing is per token, so any subset of a call's rows is
// a valid call of its own. Small calls are checked whole; larger ones on a random sample (always
// with the first and last token) of as many rows as ~60 GFLOP of fp64 reference work allows, 32
// to 256: dsv3 gets 85 rows, the other workloads 256. The device still processes every token.
inline std::vector<int> reference_rows(test::SeededRng& rng, const MoeSpec& spec, int tokens) {
  constexpr double kReferenceFlopBudget = 6e10;
  const double flops_per_row = 2.0 * spec.top_k * 3.0 * spec.hidden * spec.intermediate;
  const int count = std::min(tokens, std::clamp(static_cast<int>(kReferenceFlopBudget / flops_per_row), 32, 256));
  std::vector<int> all(tokens);
  for (int t = 0; t < tokens; ++t) all[t] = t;
  if (count < tokens) {
    std::swap(all[1], all[tokens - 1]);  // the last token is always in the sample, after the first
    for (int j = 2; j < count; ++j) std::swap(all[j], all[rng.integer(j, tokens - 1)]);
    all.resize(count);
    std::sort(all.begin(), all.end());
  }
  return all;
}

// The rows of `in` (or of a device output of `width` values per token) listed in `rows`.
template <class T>
inline std::vector<T> take_rows(const std::vector<T>& values, int width, const std::vector<int>& rows) {
  std::vector<T> out;
  out.reserve(rows.size() * width);
  for (int r : rows) out.insert(out.end(), values.begin() + static_cast<size_t>(r) * width,
                                values.begin() + static_cast<size_t>(r + 1) * width);
  return out;
}

inline Inputs take_rows(const Inputs& in, const MoeSpec& spec, const std::vector<int>& rows) {
  return Inputs{take_rows(in.x, spec.hidden, rows), take_rows(in.logits, spec.num_experts, rows),
                take_rows(in.ids, spec.top_k, rows), take_rows(in.weights, spec.top_k, rows)};
}

struct Comparison {
  size_t values;  // compared
  double rel_l2;
  double max_normalized;  // max |d - r| / (|r| + rms(r))
  long non_finite;
};

inline Comparison compare(const std::vector<bf16_t>& device, const std::vector<double>& reference) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < reference.size(); ++i) norm += reference[i] * reference[i];
  const double rms = std::sqrt(norm / reference.size());
  Comparison c{reference.size(), 0, 0, 0};
  for (size_t i = 0; i < reference.size(); ++i) {
    const double d = device[i].to_float();
    if (!std::isfinite(d)) {
      ++c.non_finite;
      continue;
    }
    diff += (d - reference[i]) * (d - reference[i]);
    c.max_normalized = std::max(c.max_normalized, std::fabs(d - reference[i]) / (std::fabs(reference[i]) + rms));
  }
  c.rel_l2 = std::sqrt(diff / std::max(norm, 1e-300));
  return c;
}

// One call's device buffers, uploaded once (the output poisoned).
struct DeviceCall {
  test::DeviceBuffer<bf16_t> x, y;
  test::DeviceBuffer<float> logits;
  int tokens;
  DeviceCall(const MoeSpec& spec, const Inputs& in, int t)
      : x(in.x.size()), y(static_cast<size_t>(t) * spec.hidden), logits(in.logits.size()), tokens(t) {
    x.upload(in.x);
    logits.upload(in.logits);
    y.poison();
  }
  MoeInputs inputs() const { return MoeInputs{tokens, x.get(), logits.get(), nullptr, nullptr}; }
};

// One call's device buffers with precomputed routing and a device token count (`valid`), uploaded
// once; the caller poisons y before each forward.
struct PrecomputedCall {
  test::DeviceBuffer<bf16_t> x, y;
  test::DeviceBuffer<float> weights;
  test::DeviceBuffer<int32_t> ids, valid;
  int tokens;
  PrecomputedCall(const MoeSpec& spec, const Inputs& in, int t)
      : x(in.x.size()), y(static_cast<size_t>(t) * spec.hidden), weights(in.weights.size()), ids(in.ids.size()),
        valid(1), tokens(t) {
    x.upload(in.x);
    ids.upload(in.ids);
    weights.upload(in.weights);
  }
  // The call with `count` real rows on the device.
  MoeInputs inputs(int count) {
    valid.upload(std::vector<int32_t>{count});
    MoeInputs call{tokens, x.get(), nullptr, ids.get(), weights.get()};
    call.num_valid_tokens = valid.get();
    return call;
  }
};

// y of one forward of `tokens` rows of `in` on `layer` (the layer's routing, or `routing`).
inline std::vector<bf16_t> run_device(MoeLayer& layer, const MoeSpec& spec, const Inputs& in, int tokens,
                                      CombineMode mode, const Routing* routing = nullptr) {
  test::DeviceBuffer<bf16_t> x(in.x.size()), y(static_cast<size_t>(tokens) * spec.hidden);
  test::DeviceBuffer<float> logits(in.logits.size()), weights(in.weights.size());
  test::DeviceBuffer<int32_t> ids(in.ids.size());
  x.upload(in.x);
  logits.upload(in.logits);
  ids.upload(in.ids);
  weights.upload(in.weights);
  y.poison();
  MoeInputs inputs{tokens, x.get(), logits.get(), ids.get(), weights.get()};
  inputs.routing = routing;
  layer.forward(nullptr, inputs, MoeOutputs{y.get()}, mode);
  MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
  return y.download();
}

}  // namespace megamoe::test
