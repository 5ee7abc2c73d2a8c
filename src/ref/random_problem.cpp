#include "ref/random_problem.hpp"

#include <cmath>
#include <random>
#include <stdexcept>

#include "common/parallel_for.hpp"
#include "ref/moe_reference.hpp"

namespace megamoe::ref {
namespace {

// xorshift64*: fast, and good enough for weights.
struct Xorshift {
  uint64_t state;
  float uniform(float half_width) {
    state ^= state >> 12, state ^= state << 25, state ^= state >> 27;
    return half_width * (static_cast<float>((state * 0x2545F4914F6CDD1Dull) >> 40) * 0x1p-23f - 1.0f);
  }
};

// make_random_weights' calibration of an fp8_tensor spec's activation scales.
void calibrate_activation_scales(const MoeSpec& spec, uint64_t seed, RandomWeights& w) {
  const int T = kCalibrationTokens;
  std::mt19937_64 engine(seed ^ 0x6A09E667F3BCC908ull);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<bf16_t> x(static_cast<size_t>(T) * spec.hidden);
  for (bf16_t& v : x) v = bf16_t::from_float(normal(engine));
  const RandomRouting routing = make_random_routing(T, spec.top_k, spec.num_experts, engine());
  MoeSpec precomputed = spec;
  precomputed.routing = Precomputed{};
  MoeInputs inputs{T, x.data(), nullptr, routing.ids.data(), routing.weights.data()};
  const CalibratedInputScales scales = calibrate_input_scales(precomputed, w.view(), inputs);
  w.fc1_input_scale = scales.fc1;
  w.fc2_input_scale = scales.fc2;
}

}  // namespace

RandomWeights make_random_weights(const MoeSpec& spec, uint64_t seed, InputScales input_scales) {
  const int E = spec.num_experts, H = spec.hidden, I = spec.intermediate;
  const size_t w13_count = 2ull * I * H, w2_count = static_cast<size_t>(H) * I;
  RandomWeights w;
  w.w13.resize(E * w13_count);
  w.w2.resize(E * w2_count);
  // Uniform on [-a, a] has standard deviation a / sqrt(3).
  const float w13_width = std::sqrt(3.0f / H), w2_width = std::sqrt(3.0f / I);
  parallel_for(E, [&](int e) {
    Xorshift rng{(seed + 1) * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(e) * 0xBF58476D1CE4E5B9ull + 1};
    for (size_t i = 0; i < w13_count; ++i) w.w13[e * w13_count + i] = bf16_t::from_float(rng.uniform(w13_width));
    for (size_t i = 0; i < w2_count; ++i) w.w2[e * w2_count + i] = bf16_t::from_float(rng.uniform(w2_width));
  });
  if (spec.precision == Precision::fp8_tensor && input_scales == InputScales::from_checkpoint) {
    calibrate_activation_scales(spec, seed, w);
  }
  return w;
}

WeightsView RandomWeights::view() const {
  WeightsView view{w13.data(), w2.data(), DType::bf16};
  if (fc1_input_scale > 0.0f) {
    view.w13_input_scale = &fc1_input_scale;
    view.w2_input_scale = &fc2_input_scale;
  }
  return view;
}

std::vector<PackedWeights> RandomWeights::pack_rank_shares(const MoeSpec& spec, int world) const {
  MoeSpec local = spec;
  local.num_experts = spec.num_experts / world;
  std::vector<PackedWeights> shares;
  for (int rank = 0; rank < world; ++rank) {
    WeightsView share = view();
    const size_t first = static_cast<size_t>(rank) * local.num_experts;
    share.w13 = w13.data() + first * 2 * spec.intermediate * spec.hidden;
    share.w2 = w2.data() + first * spec.hidden * spec.intermediate;
    shares.push_back(prepare_weights(local, share));
  }
  return shares;
}

namespace {

float random_routing_weight(std::mt19937_64& engine) {
  return 0.05f + 0.95f * static_cast<float>(engine() >> 11) * 0x1p-53f;
}

}  // namespace

RandomRouting make_random_routing(int tokens, int top_k, int num_experts, uint64_t seed) {
  std::mt19937_64 engine(seed);
  RandomRouting r;
  std::vector<int32_t> experts(num_experts);
  for (int t = 0; t < tokens; ++t) {
    for (int e = 0; e < num_experts; ++e) experts[e] = e;
    for (int j = 0; j < top_k; ++j) {  // partial Fisher-Yates: the first k are distinct
      std::swap(experts[j], experts[j + engine() % (num_experts - j)]);
      r.ids.push_back(experts[j]);
      r.weights.push_back(random_routing_weight(engine));
    }
  }
  return r;
}

RandomRouting make_balanced_routing(int tokens, int top_k, int num_experts, uint64_t seed) {
  if (top_k > num_experts) throw std::invalid_argument("balanced routing needs top_k <= num_experts");
  std::mt19937_64 engine(seed);
  RandomRouting r;
  for (int t = 0; t < tokens; ++t) {
    for (int j = 0; j < top_k; ++j) {
      r.ids.push_back(static_cast<int32_t>((static_cast<int64_t>(t) * top_k + j) % num_experts));
      r.weights.push_back(random_routing_weight(engine));
    }
  }
  return r;
}

}  // namespace megamoe::ref
