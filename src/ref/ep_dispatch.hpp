// CPU model of expert-parallel dispatch: which token rows each rank receives and which of its local
// experts each row's slots go to, in the canonical order the device dispatch reproduces (source
// rank, then token).
// In exact math the EP forward's output is the single-GPU reference's on each rank's tokens with all
// experts. Where an owner's own computation differs (fp8_tensor's dynamic activation scales: each
// owner's amax over the rows it received), owner_passes_forward models the layer as the owners run
// it.
#pragma once

#include <cstdint>
#include <vector>

#include "megamoe/forward.hpp"
#include "megamoe/weights.hpp"

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

// One token row an owner receives: from which source token, and the token's slots as this owner
// sees them.
struct ReceivedRow {
  int32_t rank;                     // source rank
  int32_t token;                    // token index at the source
  std::vector<int32_t> local_ids;   // [top_k]: local expert of each slot, -1 where it routes elsewhere or nowhere
  bool operator==(const ReceivedRow& other) const {
    return rank == other.rank && token == other.token && local_ids == other.local_ids;
  }
};

struct DispatchPlan {
  // received[dst]: the token rows rank dst receives, canonical order (source rank, then token):
  // one per source token with at least one routed slot on dst.
  std::vector<std::vector<ReceivedRow>> received;
  // sent[src][dst]: token rows rank src sends to rank dst (what the count exchange carries).
  std::vector<std::vector<int32_t>> sent;
  // Ids that route nowhere: -1 (silently) and out-of-range or duplicate ids (counted here).
  long invalid_ids = 0;
};

DispatchPlan plan_dispatch(const EpTopology& topology, int top_k, const std::vector<RankRouting>& ranks);

// One source rank's call: x [num_tokens, hidden] bf16 and topk_weights [num_tokens, top_k], host memory.
struct SourceCall {
  int num_tokens = 0;
  const bf16_t* x = nullptr;
  const float* topk_weights = nullptr;
};

// y [sources[rank].num_tokens, hidden] in fp64 (before any rounding) of `rank`'s tokens as the
// expert-parallel layer computes them: every owner's local pass (reference_forward of `local_spec`,
// its E / world experts, with owners[o]'s weights) over the rows plan.received[o] lists, each row
// the source token's x with its slots' local experts and routing weights; the owners' partial sums
// of a token added in rank order. The owners' partial sums are not rounded to bf16 as the layer's
// are: a comparison needs the bound that rounding takes.
std::vector<double> owner_passes_forward(const MoeSpec& local_spec, const std::vector<const PackedWeights*>& owners,
                                         const DispatchPlan& plan, const std::vector<SourceCall>& sources, int rank);

}  // namespace megamoe::ref
