// CPU model of expert-parallel dispatch: which rows each rank receives for each of its experts,
// in the canonical order the device dispatch reproduces (source rank, then token, then slot).
// The EP forward itself needs no new reference: its output equals the single-GPU reference run on
// each rank's tokens with all experts, since the math is the same.
#pragma once

#include <cstdint>
#include <vector>

namespace megamoe::ref {

// Expert e lives on rank e / (E / world_size), as local expert e % (E / world_size).
struct EpTopology {
  int world_size = 1;
  int num_experts = 0;

  int experts_per_rank() const { return num_experts / world_size; }
  int owner(int expert) const { return expert / experts_per_rank(); }
  int local_expert(int expert) const { return expert % experts_per_rank(); }
};

// Throws megamoe::Error unless world_size >= 1 divides num_experts.
void validate(const EpTopology& topology);

// One rank's routing: topk_ids [num_tokens, top_k], host memory.
struct RankRouting {
  int num_tokens = 0;
  const int32_t* topk_ids = nullptr;
};

struct DispatchSource {
  int32_t rank;
  int32_t token;
  int32_t slot;
  bool operator==(const DispatchSource& other) const {
    return rank == other.rank && token == other.token && slot == other.slot;
  }
};

struct DispatchPlan {
  // received[dst][local_expert]: the rows rank dst receives for that expert, canonical order.
  std::vector<std::vector<std::vector<DispatchSource>>> received;
  // sent[src][expert]: rows rank src sends to expert (what the count exchange carries).
  std::vector<std::vector<int32_t>> sent;
  // Ids that route nowhere: -1 (silently) and out-of-range or duplicate ids (counted here).
  long invalid_ids = 0;
};

DispatchPlan plan_dispatch(const EpTopology& topology, int top_k, const std::vector<RankRouting>& ranks);

}  // namespace megamoe::ref
