#include "ref/routing.hpp"

#include <algorithm>
#include <cfloat>
#include <cmath>

#include "megamoe/error.hpp"

namespace megamoe::ref {
namespace {

// Index of the largest value among candidates not yet taken; lower index wins ties.
int argmax_untaken(const std::vector<float>& values, const std::vector<uint8_t>& allowed,
                   const std::vector<uint8_t>& taken) {
  int best = -1;
  for (int i = 0; i < static_cast<int>(values.size()); ++i) {
    if (!allowed[i] || taken[i]) continue;
    if (best < 0 || values[i] > values[best]) best = i;
  }
  return best;
}

// Picks k indices by repeated argmax: the way a device warp selects, one winner per pass.
std::vector<int> select_top(const std::vector<float>& values, const std::vector<uint8_t>& allowed, int k) {
  std::vector<uint8_t> taken(values.size(), 0);
  std::vector<int> picked;
  for (int j = 0; j < k; ++j) {
    const int best = argmax_untaken(values, allowed, taken);
    taken[best] = 1;
    picked.push_back(best);
  }
  return picked;
}

void route_softmax(const SoftmaxTopK& mode, const MoeSpec& spec, const float* logits, int t,
                   RoutingResult& out) {
  const int E = spec.num_experts;
  const int k = spec.top_k;
  std::vector<float> row(E);
  double max_logit = -DBL_MAX;
  for (int e = 0; e < E; ++e) {
    row[e] = sanitize_logit(logits[static_cast<size_t>(t) * E + e]);
    max_logit = std::fmax(max_logit, row[e]);
  }
  double denominator = 0.0;
  for (int e = 0; e < E; ++e) denominator += std::exp(static_cast<double>(row[e]) - max_logit);
  // softmax is monotonic in the logit, so selecting on logits is exact.
  const std::vector<int> picked = select_top(row, std::vector<uint8_t>(E, 1), k);
  std::vector<double> probs(k);
  double picked_sum = 0.0;
  for (int j = 0; j < k; ++j) {
    probs[j] = std::exp(static_cast<double>(row[picked[j]]) - max_logit) / denominator;
    picked_sum += probs[j];
  }
  for (int j = 0; j < k; ++j) {
    out.ids[static_cast<size_t>(t) * k + j] = picked[j];
    out.weights[static_cast<size_t>(t) * k + j] =
        static_cast<float>(mode.renormalize ? probs[j] / picked_sum : probs[j]);
  }
}

void route_grouped(const DeepseekGrouped& mode, const MoeSpec& spec, const float* logits, int t,
                   RoutingResult& out) {
  const int E = spec.num_experts;
  const int k = spec.top_k;
  const int group_size = E / mode.n_group;
  std::vector<float> score(E), choice(E);
  for (int e = 0; e < E; ++e) {
    const double logit = sanitize_logit(logits[static_cast<size_t>(t) * E + e]);
    score[e] = static_cast<float>(1.0 / (1.0 + std::exp(-logit)));
    const double bias = mode.e_score_correction_bias.empty() ? 0.0 : mode.e_score_correction_bias[e];
    choice[e] = static_cast<float>(static_cast<double>(score[e]) + bias);
  }
  // Group score: sum of the group's two best choice values (one if the group has one expert).
  const int per_group = group_size < 2 ? group_size : 2;
  std::vector<float> group_score(mode.n_group);
  for (int g = 0; g < mode.n_group; ++g) {
    std::vector<float> members(choice.begin() + g * group_size, choice.begin() + (g + 1) * group_size);
    double sum = 0.0;
    for (int best : select_top(members, std::vector<uint8_t>(group_size, 1), per_group)) sum += members[best];
    group_score[g] = static_cast<float>(sum);
  }
  std::vector<uint8_t> allowed(E, 0);
  for (int g : select_top(group_score, std::vector<uint8_t>(mode.n_group, 1), mode.topk_group))
    for (int e = g * group_size; e < (g + 1) * group_size; ++e) allowed[e] = 1;
  const std::vector<int> picked = select_top(choice, allowed, k);
  double picked_sum = 0.0;
  for (int e : picked) picked_sum += score[e];
  for (int j = 0; j < k; ++j) {
    double w = score[picked[j]];
    if (mode.renormalize) w /= picked_sum + 1e-20;
    out.ids[static_cast<size_t>(t) * k + j] = picked[j];
    out.weights[static_cast<size_t>(t) * k + j] = static_cast<float>(w * mode.routed_scaling_factor);
  }
}

}  // namespace

RoutingResult route(const MoeSpec& spec, const float* logits, int num_tokens) {
  RoutingResult out;
  out.num_tokens = num_tokens;
  out.top_k = spec.top_k;
  out.ids.resize(static_cast<size_t>(num_tokens) * spec.top_k);
  out.weights.resize(out.ids.size());
  if (const auto* softmax = std::get_if<SoftmaxTopK>(&spec.routing)) {
    for (int t = 0; t < num_tokens; ++t) route_softmax(*softmax, spec, logits, t, out);
  } else if (const auto* grouped = std::get_if<DeepseekGrouped>(&spec.routing)) {
    for (int t = 0; t < num_tokens; ++t) route_grouped(*grouped, spec, logits, t, out);
  } else {
    throw Error(ErrorCode::invalid_argument, "route() needs router logits; precomputed routing passes topk_ids instead");
  }
  return out;
}

RoutingCheck check_routing(const int32_t* ids, int num_tokens, int top_k, int num_experts) {
  RoutingCheck check;
  check.used.assign(static_cast<size_t>(num_tokens) * top_k, 0);
  for (int t = 0; t < num_tokens; ++t) {
    for (int j = 0; j < top_k; ++j) {
      const int32_t id = ids[static_cast<size_t>(t) * top_k + j];
      if (id == -1) continue;
      bool duplicate = false;
      for (int i = 0; i < j; ++i) duplicate |= ids[static_cast<size_t>(t) * top_k + i] == id;
      if (id < 0 || id >= num_experts || duplicate) {
        ++check.invalid_ids;
        continue;
      }
      check.used[static_cast<size_t>(t) * top_k + j] = 1;
    }
  }
  return check;
}

plan::Floors routed_floors(const MoeSpec& spec, const int32_t* ids, int num_tokens, const plan::DeviceFacts& facts) {
  validate(spec);
  const RoutingCheck check = check_routing(ids, num_tokens, spec.top_k, spec.num_experts);
  std::vector<uint8_t> touched(spec.num_experts, 0);
  double rows = 0;
  for (size_t i = 0; i < check.used.size(); ++i) {
    if (!check.used[i]) continue;
    touched[ids[i]] = 1;
    rows += 1;
  }
  return plan::floors_of(spec, num_tokens, rows, std::count(touched.begin(), touched.end(), 1), facts);
}

}  // namespace megamoe::ref
