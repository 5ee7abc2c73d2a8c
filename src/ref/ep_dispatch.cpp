#include "ref/ep_dispatch.hpp"

#include <string>

#include "megamoe/error.hpp"
#include "ref/routing.hpp"

namespace megamoe::ref {

void validate(const EpTopology& t) {
  if (t.world_size < 1 || t.num_experts < 1 || t.num_experts % t.world_size != 0) {
    throw Error(ErrorCode::invalid_spec, "num_experts=" + std::to_string(t.num_experts) +
                                             " must be a positive multiple of world_size=" +
                                             std::to_string(t.world_size));
  }
}

DispatchPlan plan_dispatch(const EpTopology& topology, int top_k, const std::vector<RankRouting>& ranks) {
  validate(topology);
  if (static_cast<int>(ranks.size()) != topology.world_size) {
    throw Error(ErrorCode::invalid_argument, "plan_dispatch needs one routing per rank (" +
                                                 std::to_string(topology.world_size) + "), got " +
                                                 std::to_string(ranks.size()));
  }
  DispatchPlan plan;
  plan.received.assign(topology.world_size,
                       std::vector<std::vector<DispatchSource>>(topology.experts_per_rank()));
  plan.sent.assign(topology.world_size, std::vector<int32_t>(topology.num_experts, 0));
  // Walking sources in (rank, token, slot) order appends in the canonical order.
  for (int src = 0; src < topology.world_size; ++src) {
    const RankRouting& routing = ranks[src];
    const RoutingCheck check = check_routing(routing.topk_ids, routing.num_tokens, top_k, topology.num_experts);
    plan.invalid_ids += check.invalid_ids;
    for (int t = 0; t < routing.num_tokens; ++t) {
      for (int j = 0; j < top_k; ++j) {
        const size_t slot = static_cast<size_t>(t) * top_k + j;
        if (!check.used[slot]) continue;
        const int expert = routing.topk_ids[slot];
        plan.received[topology.owner(expert)][topology.local_expert(expert)].push_back({src, t, j});
        ++plan.sent[src][expert];
      }
    }
  }
  return plan;
}

}  // namespace megamoe::ref
