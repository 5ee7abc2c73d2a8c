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
  plan.received.assign(topology.world_size, {});
  plan.sent.assign(topology.world_size, std::vector<int32_t>(topology.world_size, 0));
  // Walking sources in (rank, token) order appends in the canonical order.
  for (int src = 0; src < topology.world_size; ++src) {
    const RankRouting& routing = ranks[src];
    const RoutingCheck check = check_routing(routing.topk_ids, routing.num_tokens, top_k, topology.num_experts);
    plan.invalid_ids += check.invalid_ids;
    for (int t = 0; t < routing.num_tokens; ++t) {
      std::vector<ReceivedRow> rows(topology.world_size, ReceivedRow{src, t, std::vector<int32_t>(top_k, -1)});
      std::vector<bool> sends(topology.world_size, false);
      for (int j = 0; j < top_k; ++j) {
        const size_t slot = static_cast<size_t>(t) * top_k + j;
        if (!check.used[slot]) continue;
        const int expert = routing.topk_ids[slot];
        rows[topology.owner(expert)].local_ids[j] = topology.local_expert(expert);
        sends[topology.owner(expert)] = true;
      }
      for (int dst = 0; dst < topology.world_size; ++dst) {
        if (!sends[dst]) continue;
        plan.received[dst].push_back(std::move(rows[dst]));
        ++plan.sent[src][dst];
      }
    }
  }
  return plan;
}

}  // namespace megamoe::ref
