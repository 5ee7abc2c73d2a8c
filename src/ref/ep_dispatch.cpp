#include "ref/ep_dispatch.hpp"

#include <string>

#include "megamoe/error.hpp"
#include "ref/moe_reference.hpp"
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

std::vector<double> owner_passes_forward(const MoeSpec& local_spec, const std::vector<const PackedWeights*>& owners,
                                         const DispatchPlan& plan, const std::vector<SourceCall>& sources, int rank) {
  const int world = static_cast<int>(owners.size()), H = local_spec.hidden, k = local_spec.top_k;
  if (static_cast<int>(plan.received.size()) != world || static_cast<int>(sources.size()) != world || rank < 0 ||
      rank >= world) {
    throw Error(ErrorCode::invalid_argument, "owner_passes_forward needs one owner, one plan entry and one source per "
                                             "rank, and a rank among them");
  }
  std::vector<double> y(static_cast<size_t>(sources[rank].num_tokens) * H, 0.0);
  for (int owner = 0; owner < world; ++owner) {
    const std::vector<ReceivedRow>& rows = plan.received[owner];
    if (rows.empty()) continue;
    std::vector<bf16_t> x;
    std::vector<int32_t> ids;
    std::vector<float> weights;
    for (const ReceivedRow& row : rows) {
      const SourceCall& source = sources[row.rank];
      x.insert(x.end(), source.x + static_cast<size_t>(row.token) * H, source.x + static_cast<size_t>(row.token + 1) * H);
      ids.insert(ids.end(), row.local_ids.begin(), row.local_ids.end());
      weights.insert(weights.end(), source.topk_weights + static_cast<size_t>(row.token) * k,
                     source.topk_weights + static_cast<size_t>(row.token + 1) * k);
    }
    const int n = static_cast<int>(rows.size());
    std::vector<bf16_t> rounded(static_cast<size_t>(n) * H);
    const ReferenceReport pass = reference_forward(local_spec, *owners[owner], MoeInputs{n, x.data(), nullptr, ids.data(),
                                                                                          weights.data()},
                                                   MoeOutputs{rounded.data()});
    for (int r = 0; r < n; ++r) {
      if (rows[r].rank != rank) continue;
      for (int c = 0; c < H; ++c) y[static_cast<size_t>(rows[r].token) * H + c] += pass.y[static_cast<size_t>(r) * H + c];
    }
  }
  return y;
}

}  // namespace megamoe::ref
