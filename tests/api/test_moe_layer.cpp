// MoeLayer on a Hopper GPU against the CPU reference: fp8_block tightly against the
// quantization-emulating fp64 reference and loosely against unquantized math, bf16 against fp64.
// Outputs are poisoned (NaN) before every run; inputs are fresh random data.
#include "megamoe/layer.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/gpu_test.hpp"
#include "common/test_random.hpp"
#include "megamoe/error.hpp"
#include "plan/workloads.hpp"
#include "ref/moe_reference.hpp"
#include "ref/random_problem.hpp"

namespace megamoe {
namespace {

enum class RoutingKind { workload, softmax, grouped, precomputed };
enum class Skew { uniform, skewed };

struct Case {
  std::string workload;  // a named workload, or "small"
  Precision precision;
  int tokens;
  RoutingKind routing;
  Skew skew;
  CombineMode combine;
};

std::string name_of(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  std::string name = c.workload + "_" + to_string(c.precision) + "_T" + std::to_string(c.tokens);
  const char* routing[] = {"", "_softmax", "_grouped", "_precomputed"};
  name += routing[static_cast<int>(c.routing)];
  if (c.skew == Skew::skewed) name += "_skewed";
  if (c.combine == CombineMode::fast) name += "_fast";
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
};

constexpr int kMaxTokens = 4096;

MoeSpec spec_for(const Case& c, uint64_t seed) {
  MoeSpec spec;
  if (c.workload == "small") {
    spec.num_experts = 16;
    spec.top_k = 4;
    spec.hidden = 256;
    spec.intermediate = 256;
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

LayerFixture& fixture_for(const Case& c, uint64_t seed) {
  static std::unique_ptr<LayerFixture> cached;
  static std::string cached_key;
  const MoeSpec spec = spec_for(c, seed);
  std::ostringstream key;
  key << spec;
  if (!cached || cached_key != key.str()) {
    cached.reset();
    auto f = std::make_unique<LayerFixture>();
    f->spec = spec;
    f->weights = ref::make_random_weights(spec, seed);
    f->packed = prepare_weights(spec, f->weights.view());
    f->layer = std::make_unique<MoeLayer>(spec, f->packed, kMaxTokens);
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

Inputs make_inputs(test::SeededRng& rng, const MoeSpec& spec, int tokens, Skew skew) {
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
std::vector<int> reference_rows(test::SeededRng& rng, const MoeSpec& spec, int tokens) {
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
std::vector<T> take_rows(const std::vector<T>& values, int width, const std::vector<int>& rows) {
  std::vector<T> out;
  out.reserve(rows.size() * width);
  for (int r : rows) out.insert(out.end(), values.begin() + static_cast<size_t>(r) * width,
                                values.begin() + static_cast<size_t>(r + 1) * width);
  return out;
}

Inputs take_rows(const Inputs& in, const MoeSpec& spec, const std::vector<int>& rows) {
  return Inputs{take_rows(in.x, spec.hidden, rows), take_rows(in.logits, spec.num_experts, rows),
                take_rows(in.ids, spec.top_k, rows), take_rows(in.weights, spec.top_k, rows)};
}

struct Comparison {
  double rel_l2;
  double max_normalized;  // max |d - r| / (|r| + rms(r))
  long non_finite;
};

Comparison compare(const std::vector<bf16_t>& device, const std::vector<double>& reference) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < reference.size(); ++i) norm += reference[i] * reference[i];
  const double rms = std::sqrt(norm / reference.size());
  Comparison c{0, 0, 0};
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

std::vector<bf16_t> run_device(MoeLayer& layer, const MoeSpec& spec, const Inputs& in, int tokens, CombineMode mode) {
  test::DeviceBuffer<bf16_t> x(in.x.size()), y(static_cast<size_t>(tokens) * spec.hidden);
  test::DeviceBuffer<float> logits(in.logits.size()), weights(in.weights.size());
  test::DeviceBuffer<int32_t> ids(in.ids.size());
  x.upload(in.x);
  logits.upload(in.logits);
  ids.upload(in.ids);
  weights.upload(in.weights);
  y.poison();
  layer.forward(nullptr, MoeInputs{tokens, x.get(), logits.get(), ids.get(), weights.get()}, MoeOutputs{y.get()}, mode);
  MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
  return y.download();
}

// Tight bounds against the quantization-emulating reference. bf16: the device accumulates in fp32
// and rounds y to bf16 (2^-9 relative). fp8_block adds requantization noise: the FC1 output the
// device computes in fp32 differs from the fp64 one by ~1e-6 relative, which moves a few values
// (and block amaxes) across E4M3 rounding boundaries, each a 2^-4 relative step; max normalized
// error seen up to 0.08, against 6e-2 rel. L2 for the unquantized comparison. Seen on H200:
// rel. L2 2e-3 to 5e-3 on the named workloads, up to 1.4e-2 on the
// small shape (I = 256: two quantization blocks per token, so one moved amax weighs more).
// A wrong scale or a lost K block costs O(1).
void expect_tight(Precision precision, const Comparison& c) {
  const bool fp8 = precision == Precision::fp8_block;
  EXPECT_LT(c.rel_l2, fp8 ? 2e-2 : 4e-3);
  EXPECT_LT(c.max_normalized, fp8 ? 0.15 : 2e-2);
}

class MoeLayerVsReference : public ::testing::TestWithParam<Case> {};

TEST_P(MoeLayerVsReference, MatchesCpuReference) {
  MEGAMOE_REQUIRE_HOPPER();
  const Case c = GetParam();
  test::SeededRng rng;
  LayerFixture& f = fixture_for(c, rng.seed());
  const Inputs in = make_inputs(rng, f.spec, c.tokens, c.skew);
  const std::vector<bf16_t> y = run_device(*f.layer, f.spec, in, c.tokens, c.combine);

  long unwritten = 0;
  for (const bf16_t& v : y) unwritten += !std::isfinite(v.to_float());
  EXPECT_EQ(unwritten, 0) << "unwritten (still NaN-poisoned) or non-finite outputs";

  const std::vector<int> rows = reference_rows(rng, f.spec, c.tokens);
  const int checked = static_cast<int>(rows.size());
  const Inputs sample = take_rows(in, f.spec, rows);
  std::vector<bf16_t> y_ref(static_cast<size_t>(checked) * f.spec.hidden), y_exact(y_ref.size());
  const ref::ReferenceReport ref = ref::reference_forward(f.spec, f.packed, sample.view(checked), MoeOutputs{y_ref.data()});
  const ref::ReferenceReport exact =
      ref::reference_forward_unquantized(f.spec, f.weights.view(), sample.view(checked), MoeOutputs{y_exact.data()});
  // make_inputs draws valid, distinct ids: no call here may flag any.
  EXPECT_EQ(ref.invalid_ids, 0);
  EXPECT_EQ(f.layer->take_invalid_routing_ids(nullptr), 0);

  const std::vector<bf16_t> y_sample = take_rows(y, f.spec.hidden, rows);
  const Comparison tight = compare(y_sample, ref.y);
  const Comparison loose = compare(y_sample, exact.y);
  EXPECT_EQ(tight.non_finite, 0) << "unwritten or non-finite outputs";
  expect_tight(c.precision, tight);
  // Loose: quantization must not change what the layer computes.
  EXPECT_LT(loose.rel_l2, c.precision == Precision::fp8_block ? 0.1 : 1e-2);
  RecordProperty("rel_l2_vs_reference", std::to_string(tight.rel_l2));
  RecordProperty("rel_l2_vs_unquantized", std::to_string(loose.rel_l2));
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (Precision p : {Precision::bf16, Precision::fp8_block}) {
    for (RoutingKind r : {RoutingKind::softmax, RoutingKind::grouped, RoutingKind::precomputed}) {
      // 16 and 17: the most tokens one router block takes (kRouterWarps), and the fewest it does not.
      for (int t : {1, 7, 16, 17, 128, 1000}) out.push_back({"small", p, t, r, Skew::uniform, CombineMode::deterministic});
      out.push_back({"small", p, 333, r, Skew::skewed, CombineMode::deterministic});
      for (int t : {7, 128}) out.push_back({"small", p, t, r, Skew::uniform, CombineMode::fast});
    }
  }
  for (const char* w : {"qwen35-a3b", "qwen3-30b-a3b", "dsv3"}) {
    for (Precision p : {Precision::fp8_block, Precision::bf16}) {
      for (int t : {1, 7, 128, 1000, 4096}) {
        out.push_back({w, p, t, RoutingKind::workload, Skew::uniform, CombineMode::deterministic});
      }
      out.push_back({w, p, 128, RoutingKind::workload, Skew::skewed, CombineMode::deterministic});
      out.push_back({w, p, 128, RoutingKind::workload, Skew::uniform, CombineMode::fast});
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Cases, MoeLayerVsReference, ::testing::ValuesIn(cases()), name_of);

TEST(MoeLayer, DeterministicModeIsBitIdenticalAndGraphCapturable) {
  MEGAMOE_REQUIRE_HOPPER();
  test::SeededRng rng;
  const Case c{"qwen35-a3b", Precision::fp8_block, 128, RoutingKind::workload, Skew::uniform, CombineMode::deterministic};
  LayerFixture& f = fixture_for(c, rng.seed());
  const Inputs in = make_inputs(rng, f.spec, c.tokens, c.skew);
  const std::vector<bf16_t> first = run_device(*f.layer, f.spec, in, c.tokens, CombineMode::deterministic);
  for (int run = 0; run < 10; ++run) {
    const std::vector<bf16_t> again = run_device(*f.layer, f.spec, in, c.tokens, CombineMode::deterministic);
    ASSERT_EQ(std::memcmp(first.data(), again.data(), first.size() * sizeof(bf16_t)), 0) << "run " << run;
  }

  // The same forward captured in a CUDA graph and replayed gives the same bits.
  test::DeviceBuffer<bf16_t> x(in.x.size()), y(first.size());
  test::DeviceBuffer<float> logits(in.logits.size());
  x.upload(in.x);
  logits.upload(in.logits);
  y.poison();
  cudaStream_t stream;
  MEGAMOE_CUDA_CHECK(cudaStreamCreate(&stream));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  MEGAMOE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  f.layer->forward(stream, MoeInputs{c.tokens, x.get(), logits.get(), nullptr, nullptr}, MoeOutputs{y.get()});
  MEGAMOE_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  MEGAMOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 3; ++replay) MEGAMOE_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  const std::vector<bf16_t> replayed = y.download();
  EXPECT_EQ(std::memcmp(first.data(), replayed.data(), first.size() * sizeof(bf16_t)), 0);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// Layers on the fixture's packed weights for up to `max_tokens` tokens, one built under each value
// of an environment switch the layer reads when it is built, and what they give for the same
// inputs: the same y bit for bit.
void expect_same_output_under(const char* variable, std::initializer_list<const char*> values,
                              std::initializer_list<int> token_counts, int max_tokens = kMaxTokens) {
  test::SeededRng rng;
  const Case workload{"qwen35-a3b", Precision::fp8_block, 1, RoutingKind::workload, Skew::uniform,
                      CombineMode::deterministic};
  LayerFixture& f = fixture_for(workload, rng.seed());
  std::vector<std::unique_ptr<MoeLayer>> layers;
  for (const char* value : values) {
    ASSERT_EQ(setenv(variable, value, 1), 0);
    layers.push_back(std::make_unique<MoeLayer>(f.spec, f.packed, max_tokens));
  }
  unsetenv(variable);
  for (int tokens : token_counts) {
    const Inputs in = make_inputs(rng, f.spec, tokens, workload.skew);
    const std::vector<bf16_t> first = run_device(*layers[0], f.spec, in, tokens, CombineMode::deterministic);
    for (size_t v = 1; v < layers.size(); ++v) {
      SCOPED_TRACE(std::to_string(tokens) + " tokens, " + variable + "=" + *(values.begin() + v));
      const std::vector<bf16_t> other = run_device(*layers[v], f.spec, in, tokens, CombineMode::deterministic);
      EXPECT_EQ(std::memcmp(first.data(), other.data(), first.size() * sizeof(bf16_t)), 0);
    }
  }
}

// fp8 FC1 reads its token rows from the gathered pool, or copies them from one quantized row per
// token (where experts get few rows): the same bytes into the same stages, so the same output bit
// for bit. 2048 tokens forces the copy onto full 64-row tiles, which the planner never gives it.
TEST(MoeLayer, TokenRowCopyMatchesThePoolBitForBit) {
  MEGAMOE_REQUIRE_HOPPER();
  expect_same_output_under("MEGAMOE_FC1_ROW_COPY", {"0", "1"}, {7, 128, 2048});
}

// A token's output element is the same sums in the same order whatever the token tile: the tile
// only decides which tokens share a wgmma. 1000 tokens puts 16-token tiles on experts of ~32 rows,
// several tiles each, and 64-token tiles on their short last subtiles. A layer for at most 128
// tokens plans 16-token tiles, so the wider ones need the workspace padded for them.
TEST(MoeLayer, TokenTileLeavesTheOutputUnchangedBitForBit) {
  MEGAMOE_REQUIRE_HOPPER();
  expect_same_output_under("MEGAMOE_TOKEN_TILE", {"16", "32", "64"}, {7, 128, 1000});
  expect_same_output_under("MEGAMOE_TOKEN_TILE", {"16", "32", "64"}, {7, 128}, 128);
}

// A mistyped override must not quietly run the planner's own choice.
TEST(MoeLayer, UnsupportedOverridesAreRefused) {
  MEGAMOE_REQUIRE_HOPPER();
  test::SeededRng rng;
  const Case c{"small", Precision::fp8_block, 7, RoutingKind::softmax, Skew::uniform, CombineMode::deterministic};
  LayerFixture& f = fixture_for(c, rng.seed());
  const std::pair<const char*, const char*> overrides[] = {
      {"MEGAMOE_TOKEN_TILE", "48"}, {"MEGAMOE_FC1_ROW_COPY", "yes"}, {"MEGAMOE_FC1_ROW_COPY", ""}};
  for (const auto& [name, value] : overrides) {
    ASSERT_EQ(setenv(name, value, 1), 0);
    try {
      MoeLayer layer(f.spec, f.packed, kMaxTokens);
      ADD_FAILURE() << "a layer was built with " << name << "='" << value << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
    }
    unsetenv(name);
  }
}

// A layer re-routed with set_routing computes what a layer built with that routing computes, bit
// for bit, and a routing the kernels cannot hold is refused without changing the layer's.
TEST(MoeLayer, SetRoutingMatchesALayerBuiltWithThatRouting) {
  MEGAMOE_REQUIRE_HOPPER();
  test::SeededRng rng;
  const Case softmax{"small", Precision::fp8_block, 7, RoutingKind::softmax, Skew::uniform, CombineMode::deterministic};
  const Case grouped{"small", Precision::fp8_block, 7, RoutingKind::grouped, Skew::uniform, CombineMode::deterministic};
  const MoeSpec grouped_spec = spec_for(grouped, rng.seed());
  LayerFixture& f = fixture_for(softmax, rng.seed());
  MoeLayer rerouted(f.spec, f.packed, kMaxTokens);
  MoeLayer built(grouped_spec, f.packed, kMaxTokens);
  rerouted.set_routing(grouped_spec.routing);
  const Inputs in = make_inputs(rng, f.spec, 100, Skew::uniform);
  const std::vector<bf16_t> expected = run_device(built, grouped_spec, in, 100, CombineMode::deterministic);
  const std::vector<bf16_t> actual = run_device(rerouted, grouped_spec, in, 100, CombineMode::deterministic);
  EXPECT_EQ(std::memcmp(expected.data(), actual.data(), expected.size() * sizeof(bf16_t)), 0);

  DeepseekGrouped too_many_groups = std::get<DeepseekGrouped>(grouped_spec.routing);
  too_many_groups.n_group = 5;  // 16 experts do not split into 5 groups
  EXPECT_THROW(rerouted.set_routing(too_many_groups), Error);
  const std::vector<bf16_t> after = run_device(rerouted, grouped_spec, in, 100, CombineMode::deterministic);
  EXPECT_EQ(std::memcmp(expected.data(), after.data(), expected.size() * sizeof(bf16_t)), 0);

  // Back to softmax: the bias of the grouped routing must not leak into it.
  rerouted.set_routing(f.spec.routing);
  const std::vector<bf16_t> softmax_expected = run_device(*f.layer, f.spec, in, 100, CombineMode::deterministic);
  const std::vector<bf16_t> softmax_actual = run_device(rerouted, f.spec, in, 100, CombineMode::deterministic);
  EXPECT_EQ(std::memcmp(softmax_expected.data(), softmax_actual.data(), softmax_expected.size() * sizeof(bf16_t)), 0);
}

// The kernels' shared-memory limits belong to each device: a process that spreads a model's layers
// over several GPUs must find them raised on every one. Needs two GPUs (scripts/gpu2_check.sh).
TEST(MoeLayer, RunsOnEveryGpuOfOneProcess) {
  MEGAMOE_REQUIRE_HOPPER();
  int devices = 0;
  MEGAMOE_CUDA_CHECK(cudaGetDeviceCount(&devices));
  if (devices < 2) GTEST_SKIP() << "one GPU: nothing to check";
  test::SeededRng rng;
  const Case c{"small", Precision::fp8_block, 7, RoutingKind::softmax, Skew::uniform, CombineMode::deterministic};
  const MoeSpec spec = spec_for(c, rng.seed());
  const ref::RandomWeights weights = ref::make_random_weights(spec, rng.seed());
  const PackedWeights packed = prepare_weights(spec, weights.view());
  const Inputs in = make_inputs(rng, spec, c.tokens, c.skew);
  std::vector<double> want;
  {
    std::vector<bf16_t> unused(static_cast<size_t>(c.tokens) * spec.hidden);
    want = ref::reference_forward(spec, packed, in.view(c.tokens), MoeOutputs{unused.data()}).y;
  }
  int original = 0;
  MEGAMOE_CUDA_CHECK(cudaGetDevice(&original));
  for (int device = 0; device < devices; ++device) {
    SCOPED_TRACE("device " + std::to_string(device));
    MEGAMOE_CUDA_CHECK(cudaSetDevice(device));
    MoeLayer layer(spec, packed, 64);
    const Comparison got = compare(run_device(layer, spec, in, c.tokens, CombineMode::deterministic), want);
    EXPECT_EQ(got.non_finite, 0);
    expect_tight(c.precision, got);
  }
  MEGAMOE_CUDA_CHECK(cudaSetDevice(original));
}

// A device-side token count (how expert parallelism hands over the rows it received): the rows
// before it match the reference, the padding rows after it keep their poison, whatever stale
// routing they hold, and a count past num_tokens is clamped. At 16 tokens one router block routes
// them all; at 128 several blocks do.
void expect_only_valid_rows_computed(test::SeededRng& rng, const Case& c) {
  LayerFixture& f = fixture_for(c, rng.seed());
  const int H = f.spec.hidden;
  const Inputs in = make_inputs(rng, f.spec, c.tokens, c.skew);
  test::DeviceBuffer<bf16_t> x(in.x.size()), y(static_cast<size_t>(c.tokens) * H);
  test::DeviceBuffer<float> weights(in.weights.size());
  test::DeviceBuffer<int32_t> ids(in.ids.size()), valid(1);
  x.upload(in.x);
  ids.upload(in.ids);
  weights.upload(in.weights);
  for (const int count : {rng.integer(1, c.tokens - 1), 0, c.tokens + 5}) {
    valid.upload(std::vector<int32_t>{count});
    y.poison();
    MoeInputs call{c.tokens, x.get(), nullptr, ids.get(), weights.get()};
    call.num_valid_tokens = valid.get();
    f.layer->forward(nullptr, call, MoeOutputs{y.get()});
    MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<bf16_t> got = y.download();
    const int rows = std::min(count, c.tokens);
    if (rows > 0) {
      std::vector<bf16_t> want(static_cast<size_t>(rows) * H);
      const ref::ReferenceReport report = ref::reference_forward(f.spec, f.packed, in.view(rows), MoeOutputs{want.data()});
      const Comparison tight = compare(std::vector<bf16_t>(got.begin(), got.begin() + want.size()), report.y);
      EXPECT_EQ(tight.non_finite, 0) << "valid count " << count;
      expect_tight(c.precision, tight);
    }
    long written_padding = 0;
    for (size_t i = static_cast<size_t>(rows) * H; i < got.size(); ++i) written_padding += got[i].bits != 0xFFFF;
    EXPECT_EQ(written_padding, 0) << "padding values written with valid count " << count;
  }
  EXPECT_EQ(f.layer->take_invalid_routing_ids(nullptr), 0);
}

TEST(MoeLayer, DeviceTokenCountComputesOnlyTheValidRows) {
  MEGAMOE_REQUIRE_HOPPER();
  test::SeededRng rng;
  for (const int tokens : {16, 128}) {
    SCOPED_TRACE("tokens " + std::to_string(tokens));
    expect_only_valid_rows_computed(
        rng, Case{"qwen35-a3b", Precision::fp8_block, tokens, RoutingKind::precomputed, Skew::uniform,
                  CombineMode::deterministic});
  }
}

TEST(MoeLayer, BadRoutingIsFlaggedAndNaNLogitsStayValid) {
  MEGAMOE_REQUIRE_HOPPER();
  test::SeededRng rng;
  const Case c{"small", Precision::fp8_block, 64, RoutingKind::precomputed, Skew::uniform, CombineMode::deterministic};
  LayerFixture& f = fixture_for(c, rng.seed());
  Inputs in = make_inputs(rng, f.spec, c.tokens, c.skew);
  const int k = f.spec.top_k;
  in.ids[0 * k + 1] = -1;                   // not routed here
  in.ids[1 * k + 2] = f.spec.num_experts;   // out of range
  in.ids[2 * k + 3] = 1 << 30;              // far out of range
  in.ids[3 * k + 1] = in.ids[3 * k + 0];    // duplicate
  in.ids[4 * k + 0] = -5;                   // negative, invalid
  const std::vector<bf16_t> y = run_device(*f.layer, f.spec, in, c.tokens, CombineMode::deterministic);
  std::vector<bf16_t> y_ref(y.size());
  const ref::ReferenceReport ref = ref::reference_forward(f.spec, f.packed, in.view(c.tokens), MoeOutputs{y_ref.data()});
  EXPECT_EQ(ref.invalid_ids, 4);
  EXPECT_EQ(f.layer->take_invalid_routing_ids(nullptr), 4);
  EXPECT_EQ(f.layer->take_invalid_routing_ids(nullptr), 0) << "the count resets when taken";
  const Comparison tight = compare(y, ref.y);
  EXPECT_EQ(tight.non_finite, 0);
  expect_tight(f.spec.precision, tight);

  const Case softmax{"small", Precision::fp8_block, 8, RoutingKind::softmax, Skew::uniform, CombineMode::deterministic};
  LayerFixture& g = fixture_for(softmax, rng.seed());
  Inputs nan_in = make_inputs(rng, g.spec, softmax.tokens, Skew::uniform);
  for (int e = 0; e < g.spec.num_experts; ++e) nan_in.logits[e] = NAN;  // token 0: all NaN
  nan_in.logits[g.spec.num_experts + 3] = INFINITY;                    // token 1: one +inf
  nan_in.logits[2 * g.spec.num_experts + 5] = NAN;                     // token 2: one NaN
  const std::vector<bf16_t> y2 = run_device(*g.layer, g.spec, nan_in, softmax.tokens, CombineMode::deterministic);
  std::vector<bf16_t> y2_ref(y2.size());
  const ref::ReferenceReport ref2 = ref::reference_forward(g.spec, g.packed, nan_in.view(softmax.tokens), MoeOutputs{y2_ref.data()});
  EXPECT_EQ(g.layer->take_invalid_routing_ids(nullptr), 0);
  const Comparison c2 = compare(y2, ref2.y);
  EXPECT_EQ(c2.non_finite, 0);
  expect_tight(g.spec.precision, c2);
}

TEST(MoeLayer, RejectsBadCallsBeforeLaunching) {
  MEGAMOE_REQUIRE_HOPPER();
  test::SeededRng rng;
  const Case c{"small", Precision::bf16, 4, RoutingKind::softmax, Skew::uniform, CombineMode::deterministic};
  LayerFixture& f = fixture_for(c, rng.seed());
  test::DeviceBuffer<bf16_t> x(static_cast<size_t>(kMaxTokens + 1) * f.spec.hidden), y(x.bytes() / 2);
  test::DeviceBuffer<float> logits(static_cast<size_t>(kMaxTokens + 1) * f.spec.num_experts);
  y.poison();
  EXPECT_THROW(f.layer->forward(nullptr, MoeInputs{kMaxTokens + 1, x.get(), logits.get()}, MoeOutputs{y.get()}), Error);
  EXPECT_THROW(f.layer->forward(nullptr, MoeInputs{4, x.get(), nullptr}, MoeOutputs{y.get()}), Error);
  EXPECT_THROW(f.layer->forward(nullptr, MoeInputs{4, x.get(), logits.get()}, MoeOutputs{x.get()}), Error);
  MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
  for (const bf16_t& v : y.download()) ASSERT_EQ(v.bits, 0xFFFF) << "a rejected call wrote the output";
}

// Specs that are valid but beyond what the kernels hold are refused at construction, with the
// limit named, instead of routing silently wrong.
TEST(MoeLayer, RefusesSpecsBeyondTheKernelLimits) {
  MEGAMOE_REQUIRE_HOPPER();
  auto expect_unsupported = [](const MoeSpec& spec, const char* limit) {
    const ref::RandomWeights weights = ref::make_random_weights(spec, 1);
    const PackedWeights packed = prepare_weights(spec, weights.view());
    try {
      MoeLayer layer(spec, packed, 16);
      ADD_FAILURE() << "accepted a spec beyond the " << limit << " limit";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::unsupported) << e.what();
      EXPECT_NE(std::string(e.what()).find(limit), std::string::npos) << e.what();
    }
  };
  MoeSpec spec;
  spec.hidden = 128;
  spec.intermediate = 128;
  spec.precision = Precision::bf16;
  spec.num_experts = 64;
  spec.top_k = 33;
  expect_unsupported(spec, "top_k=33");
  spec.num_experts = 513;
  spec.top_k = 8;
  expect_unsupported(spec, "num_experts=513");
  spec.num_experts = 66;
  spec.routing = DeepseekGrouped{.n_group = 33, .topk_group = 4};
  expect_unsupported(spec, "n_group=33");
}

}  // namespace
}  // namespace megamoe
