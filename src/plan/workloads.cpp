#include "plan/workloads.hpp"

#include <algorithm>
#include <iterator>

#include "megamoe/error.hpp"

namespace megamoe::plan {
namespace {

MoeSpec make_spec(int experts, int top_k, int hidden, int intermediate, Routing routing) {
  MoeSpec spec;
  spec.num_experts = experts;
  spec.top_k = top_k;
  spec.hidden = hidden;
  spec.intermediate = intermediate;
  spec.routing = std::move(routing);
  return spec;
}

}  // namespace

const std::vector<Workload>& named_workloads() {
  static const std::vector<Workload> workloads = {
      {"qwen35-a3b", "Qwen3.5-A3B-like: the seeds' workload",
       make_spec(256, 8, 2048, 512, SoftmaxTopK{.renormalize = true})},
      {"qwen3-30b-a3b", "Qwen3-30B-A3B", make_spec(128, 8, 2048, 768, SoftmaxTopK{.renormalize = true})},
      {"dsv3", "DeepSeek-V3 routed experts",
       make_spec(256, 8, 7168, 2048,
                 DeepseekGrouped{.n_group = 8, .topk_group = 4, .routed_scaling_factor = 2.5f, .renormalize = true})},
  };
  return workloads;
}

namespace {

constexpr const char* kShapeExample = "experts=8,top_k=2,hidden=4096,intermediate=14336";

// "experts=E,top_k=K,hidden=H,intermediate=I" as a Workload; the caller has seen a '='.
Workload shape_workload(const std::string& text) {
  auto refuse = [&](const std::string& why) -> Workload {
    throw Error(ErrorCode::invalid_argument, "workload '" + text + "': " + why + "; a layer of your own shape is " +
                                                 "written experts=E,top_k=K,hidden=H,intermediate=I (e.g. " +
                                                 kShapeExample + ")");
  };
  const char* keys[] = {"experts", "top_k", "hidden", "intermediate"};
  long long values[4] = {-1, -1, -1, -1};
  size_t begin = 0;
  while (begin <= text.size()) {
    const size_t end = std::min(text.find(',', begin), text.size());
    const std::string item = text.substr(begin, end - begin);
    const size_t equals = item.find('=');
    if (equals == std::string::npos) return refuse("'" + item + "' is not key=value");
    const std::string key = item.substr(0, equals), value = item.substr(equals + 1);
    const auto known = std::find_if(std::begin(keys), std::end(keys), [&](const char* k) { return key == k; });
    if (known == std::end(keys)) return refuse("unknown key '" + key + "'");
    long long& slot = values[known - std::begin(keys)];
    if (slot >= 0) return refuse(key + " given twice");
    // Digits only (no sign, no blanks), at most 9 of them: an int, which the spec's checks then judge.
    if (value.empty() || value.size() > 9 || !std::all_of(value.begin(), value.end(), [](char c) {
          return c >= '0' && c <= '9';
        })) {
      return refuse(key + " needs a non-negative integer of at most 9 digits, got '" + value + "'");
    }
    slot = std::stoll(value);
    begin = end + 1;
  }
  std::string missing;
  for (int i = 0; i < 4; ++i) {
    if (values[i] < 0) missing += (missing.empty() ? "" : ", ") + std::string(keys[i]);
  }
  if (!missing.empty()) return refuse("no " + missing);
  return Workload{text, "a layer of the user's shape",
                  make_spec(static_cast<int>(values[0]), static_cast<int>(values[1]), static_cast<int>(values[2]),
                            static_cast<int>(values[3]), SoftmaxTopK{.renormalize = true})};
}

}  // namespace

Workload find_workload(const std::string& name) {
  if (name.find('=') != std::string::npos) return shape_workload(name);
  std::string known;
  for (const Workload& w : named_workloads()) {
    if (w.name == name) return w;
    known += (known.empty() ? "" : ", ") + w.name;
  }
  throw Error(ErrorCode::invalid_argument, "unknown workload '" + name + "'; known: " + known +
                                               ", or a shape such as " + kShapeExample);
}

}  // namespace megamoe::plan
