#include "plan/workloads.hpp"

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

const Workload& find_workload(const std::string& name) {
  std::string known;
  for (const Workload& w : named_workloads()) {
    if (w.name == name) return w;
    known += (known.empty() ? "" : ", ") + w.name;
  }
  throw Error(ErrorCode::invalid_argument, "unknown workload '" + name + "'; known: " + known);
}

}  // namespace megamoe::plan
