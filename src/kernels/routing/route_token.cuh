// Routing of one token by one warp (route_token): router logits (or the caller's precomputed ids)
// become k experts and weights, each counted in its expert's row counter, which gives the slot its
// rank inside its expert. The routing kernel (route_and_count.cuh) and the single-kernel forward's
// front role (front_items.cuh) run it.
// Selection mirrors src/ref/routing.cpp exactly: sanitized logits, deepseek scores in double
// rounded to float, ties to the lower index, k passes of warp-wide argmax. Softmax weights are
// computed in float (the reference's run in double): a softmax token's experts come from its
// logits, so no choice depends on them, and the weights stay within ~1e-6 of the reference's,
// where 256 double exps per token are a long FP64 chain per warp, on pipes a block's warps share.
//
// A small batch's routing time is one warp's chain of dependent instructions and memory round
// trips (Nsight Compute: ~11 cycles per instruction), so each lane holds a contiguous share of the
// experts as order keys in registers (LaneExperts): a pass is one reduction, one ballot and the
// winner's register update, with no shared-memory rescan (docs/decisions.md#router).
#pragma once

#include <cuda_bf16.h>

#include <cfloat>
#include <cmath>
#include <cstdint>

#include "kernels/routing/selection.hpp"
#include "kernels/routing/routing_limits.hpp"
#include "kernels/routing/valid_tokens.cuh"
#include "kernels/scheduler/grouped_tile_scheduler.cuh"

namespace megamoe::kernels {

struct RoutingParams {
  int num_tokens;
  const int32_t* num_valid_tokens;  // device count, or null: all num_tokens rows are real
  int num_experts;
  int top_k;
  RoutingMode mode;
  bool renormalize;
  int n_group;
  int topk_group;
  float routed_scaling_factor;
  const float* bias;          // [E] or null (deepseek_grouped)
  const float* logits;        // [T, E]
  const int32_t* topk_ids;    // [T, k] (precomputed)
  const float* topk_weights;  // [T, k] (precomputed)
  int32_t* expert_counts;     // [E] counters, zero on entry and on exit
  uint32_t* blocks_done;      // [1], zero on entry and on exit
  int32_t* expert_rows;       // [E] out: routed rows per expert
  int token_tile_rows;        // each expert's segment is padded to this many rows
  int32_t* expert_offsets;    // [E+1] out: first pool row of each expert
  int32_t* token_tile_prefix; // [E+1] out: token tiles of the experts before each expert
  int32_t* token_tile_expert; // [T*k] out: the expert of each token tile (its first entries)
  int32_t* routed_ids;        // [T, k] out; -1 = unused
  float* routed_weights;      // [T, k] out
  int32_t* slot_rank;         // [T, k] out
  int32_t* error_flags;       // [0] += invalid ids
  float* y_accumulator;       // [T, hidden] zeroed here for the atomic combine, or null
  int hidden;
  GemmTileCounters gemm;      // zeroed by the scan
  // The single-kernel forward's combine (combine/combine_token_blocks.cuh), null elsewhere: each
  // token's used slots into each of its combine_blocks counters, and zeros into y for a token
  // with none (no FC2 tile stores a row of it, so none combines it).
  uint32_t* combine_slots_left;  // [T, combine_blocks]
  int combine_blocks;
  __nv_bfloat16* y;              // [T, hidden]
};

namespace routing_detail {

// Experts per lane: 8 up to 256 experts, 16 up to kMaxRoutingExperts.
inline constexpr int kNarrowSlots = 8;
inline constexpr int kWideSlots = kMaxRoutingExperts / 32;
static_assert(kWideSlots * 32 == kMaxRoutingExperts, "a warp's lanes hold every expert");

// One lane's share of a token's experts: the contiguous experts first, first + 1, ... as order
// keys (0: none, taken or ineligible), and the best of them. With contiguous shares the lowest
// lane holding the warp's best key holds its lowest expert, which makes ties exact with one
// reduction and one ballot per pass.
template <int kSlots>
struct LaneExperts {
  uint32_t key[kSlots];
  uint32_t best_key;
  int best_slot;

  // The best key and its slot, ties to the lower slot: a tree over adjacent ranges, so that the
  // left side of every comparison holds the lower slots.
  __device__ __forceinline__ void find_best() {
    uint32_t k[kSlots];
    int slot[kSlots];
#pragma unroll
    for (int i = 0; i < kSlots; ++i) {
      k[i] = key[i];
      slot[i] = i;
    }
#pragma unroll
    for (int width = 1; width < kSlots; width *= 2) {
#pragma unroll
      for (int i = 0; i < kSlots; i += 2 * width) {
        const bool right = k[i + width] > k[i];
        k[i] = right ? k[i + width] : k[i];
        slot[i] = right ? slot[i + width] : slot[i];
      }
    }
    best_key = k[0];
    best_slot = slot[0];
  }
};

// One argmax pass: the warp's best expert (ties to the lower index) into `expert` in every lane,
// and its key, 0 when none is left. The lane that held it drops it and finds its next best
// (every lane runs the tree, so the warp does not diverge).
template <int kSlots>
__device__ __forceinline__ uint32_t take_warp_best(LaneExperts<kSlots>& mine, int lane, int per_lane, int& expert) {
  const uint32_t top = __reduce_max_sync(0xffffffffu, mine.best_key);
  const int winner = __ffs(__ballot_sync(0xffffffffu, mine.best_key == top)) - 1;
  expert = winner * per_lane + __shfl_sync(0xffffffffu, mine.best_slot, winner);
  const bool won = lane == winner;
#pragma unroll
  for (int i = 0; i < kSlots; ++i) mine.key[i] = won && i == mine.best_slot ? 0u : mine.key[i];
  mine.find_best();
  return top;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// The two largest of a set of numbers (as a multiset: a repeated maximum is also the second).
struct TopTwo {
  float best, second;
};

__device__ __forceinline__ TopTwo merge(TopTwo a, TopTwo b) {
  return TopTwo{fmaxf(a.best, b.best), fmaxf(fminf(a.best, b.best), fmaxf(a.second, b.second))};
}

// Group score of the deepseek mode: the sum of the group's `per_group` (1 or 2) best values, in
// the reference's order (best first); its values are finite (sigmoid plus a finite bias). One lane
// walks one group, eight values in flight and merged as a tree.
__device__ __forceinline__ float group_score(const float* values, int first, int size, int per_group) {
  TopTwo top{-INFINITY, -INFINITY};
#pragma unroll 1
  for (int chunk = 0; chunk < size; chunk += 8) {
    TopTwo pair[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int e = chunk + 2 * i;
      const float a = e < size ? values[first + e] : -INFINITY;
      const float b = e + 1 < size ? values[first + e + 1] : -INFINITY;
      pair[i] = TopTwo{fmaxf(a, b), fminf(a, b)};
    }
    top = merge(top, merge(merge(pair[0], pair[1]), merge(pair[2], pair[3])));
  }
  double sum = static_cast<double>(top.best);
  if (per_group == 2) sum += static_cast<double>(top.second);
  return static_cast<float>(sum);
}

// The deepseek mode's group limit: keeps the keys of the topk_group best groups (lane g scores
// group g; ties to the lower group) and zeroes the rest. `values` holds the choice values.
template <int kSlots>
__device__ __forceinline__ void keep_best_groups(const RoutingParams& p, const float* values, int lane, int first,
                                                 LaneExperts<kSlots>& mine) {
  const int group_size = p.num_experts / p.n_group;
  const int per_group = group_size < 2 ? group_size : 2;
  uint32_t group_key = lane < p.n_group ? order_key(group_score(values, lane * group_size, group_size, per_group)) : 0u;
  uint32_t selected = 0;
  for (int r = 0; r < p.topk_group; ++r) {
    const uint32_t top = __reduce_max_sync(0xffffffffu, group_key);
    const int winner = __ffs(__ballot_sync(0xffffffffu, group_key == top)) - 1;
    selected |= 1u << winner;
    if (lane == winner) group_key = 0u;
  }
  const int per_lane = (p.num_experts + 31) / 32;
#pragma unroll
  for (int i = 0; i < kSlots; ++i) {
    const int e = first + i;
    if (i < per_lane && e < p.num_experts && !((selected >> (e / group_size)) & 1u)) mine.key[i] = 0u;
  }
}

// The logit modes (softmax, deepseek) with kSlots experts per lane: lane j < k ends with slot j's
// expert and weight. `value` and `score` are the warp's shared-memory rows (deepseek only).
template <int kSlots>
__device__ __forceinline__ void route_logits(const RoutingParams& p, int token, int lane, float* value, float* score,
                                             int& my_id, float& my_weight) {
  const int E = p.num_experts, k = p.top_k;
  const int per_lane = (E + 31) / 32;
  const int first = lane * per_lane;
  const bool softmax = p.mode == RoutingMode::softmax_topk;
  const float* logits = p.logits + static_cast<size_t>(token) * E;
  // Every load of the lane in flight before any arithmetic: one memory round trip.
  float logit[kSlots], bias[kSlots];
#pragma unroll
  for (int i = 0; i < kSlots; ++i) {
    const bool real = i < per_lane && first + i < E;
    logit[i] = real ? sanitize_logit(logits[first + i]) : 0.0f;
    bias[i] = real && !softmax && p.bias != nullptr ? p.bias[first + i] : 0.0f;
  }
  LaneExperts<kSlots> mine;
  if (softmax) {
#pragma unroll
    for (int i = 0; i < kSlots; ++i) mine.key[i] = i < per_lane && first + i < E ? order_key(logit[i]) : 0u;
  } else {
    // The weights use the sigmoid score, the selection its sum with the bias (the choice value).
    // The double sigmoid runs in a rolled loop over the lane's rows of shared memory: unrolled,
    // its FP64 exp per slot made the router's code 2.5 times as long.
#pragma unroll
    for (int i = 0; i < kSlots; ++i) {
      if (i < per_lane && first + i < E) {
        value[first + i] = logit[i];
        score[first + i] = bias[i];
      }
    }
    const int end = min(first + per_lane, E);
#pragma unroll 1
    for (int e = first; e < end; ++e) {
      const float sigmoid = static_cast<float>(1.0 / (1.0 + exp(-static_cast<double>(value[e]))));
      value[e] = static_cast<float>(static_cast<double>(sigmoid) + static_cast<double>(score[e]));
      score[e] = sigmoid;
    }
#pragma unroll
    for (int i = 0; i < kSlots; ++i) mine.key[i] = i < per_lane && first + i < E ? order_key(value[first + i]) : 0u;
    __syncwarp();
    keep_best_groups(p, value, lane, first, mine);
  }
  mine.find_best();

  // k passes of argmax; lane j keeps the j-th winner. The first pass's key is the softmax maximum.
  uint32_t my_key = 0u;
  float softmax_max = 0.0f, softmax_denominator = 1.0f;
#pragma unroll 1
  for (int j = 0; j < k; ++j) {
    int expert;
    const uint32_t top = take_warp_best(mine, lane, per_lane, expert);
    if (top == 0u) break;  // the planner guarantees k reachable experts
    if (j == 0 && softmax) {
      softmax_max = from_order_key(top);
      float partial = 0.0f;
#pragma unroll
      for (int i = 0; i < kSlots; ++i)
        if (i < per_lane && first + i < E) partial += expf(logit[i] - softmax_max);
      softmax_denominator = warp_sum(partial);
    }
    if (lane == j) {
      my_id = expert;
      my_key = top;
    }
  }
  double my_raw_weight = 0.0;
  if (my_id >= 0) {
    // A softmax key gives back its logit (-0 as +0, which exp does not tell apart).
    my_raw_weight = softmax ? static_cast<double>(expf(from_order_key(my_key) - softmax_max) / softmax_denominator)
                            : static_cast<double>(score[my_id]);
  }
  // The sum of the picked weights in slot order, as the reference adds them (the shuffles of a
  // group of 8 are independent, so they issue together ahead of the dependent additions).
  double picked_sum = 0.0;
  for (int chunk = 0; chunk < k; chunk += 8) {
    double picked[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) picked[j] = __shfl_sync(0xffffffffu, my_raw_weight, chunk + j);
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (chunk + j < k) picked_sum += picked[j];
  }
  double w = my_raw_weight;
  if (softmax) {
    if (p.renormalize) w /= picked_sum;
  } else {
    if (p.renormalize) w /= picked_sum + 1e-20;
    w *= static_cast<double>(p.routed_scaling_factor);
  }
  my_weight = static_cast<float>(w);
}

}  // namespace routing_detail

// One token, by one warp (`value` and `score` are the warp's shared-memory rows; `counts` the
// per-expert row counters, global or this block's shared memory).
__device__ __forceinline__ void route_token(const RoutingParams& p, int token, int lane, float* value, float* score,
                                            int32_t* counts) {
  using namespace routing_detail;
  const int E = p.num_experts, k = p.top_k;
  if (p.y_accumulator != nullptr) {
    float4* row = reinterpret_cast<float4*>(p.y_accumulator + static_cast<size_t>(token) * p.hidden);
    for (int v = lane; v < p.hidden / 4; v += 32) row[v] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }

  int my_id = -1;  // lane j < k ends up holding slot j
  float my_weight = 0.0f;

  if (p.mode == RoutingMode::precomputed) {
    if (lane < k) {
      my_id = p.topk_ids[static_cast<size_t>(token) * k + lane];
      my_weight = p.topk_weights[static_cast<size_t>(token) * k + lane];
    }
    // Duplicates: an id equal to the id of any earlier slot is invalid.
    bool duplicate = false;
    for (int j = 0; j < k; ++j) {
      const int other = __shfl_sync(0xffffffffu, my_id, j);
      duplicate |= (j < lane) && other == my_id;
    }
    if (lane < k && my_id != -1 && (my_id < 0 || my_id >= E || duplicate)) {
      atomicAdd(&p.error_flags[0], 1);
      my_id = -1;
    }
  } else if (E <= 32 * kNarrowSlots) {
    route_logits<kNarrowSlots>(p, token, lane, value, score, my_id, my_weight);
  } else {
    route_logits<kWideSlots>(p, token, lane, value, score, my_id, my_weight);
  }

  if (lane < k) {
    const size_t slot = static_cast<size_t>(token) * k + lane;
    p.routed_ids[slot] = my_id;
    p.routed_weights[slot] = my_weight;
    p.slot_rank[slot] = my_id >= 0 ? atomicAdd(&counts[my_id], 1) : -1;
  }
  if (p.combine_slots_left != nullptr) {
    const uint32_t used = __popc(__ballot_sync(0xffffffffu, lane < k && my_id >= 0));
    uint32_t* left = p.combine_slots_left + static_cast<size_t>(token) * p.combine_blocks;
    for (int b = lane; b < p.combine_blocks; b += 32) left[b] = used;
    if (used == 0) {
      uint4* row = reinterpret_cast<uint4*>(p.y + static_cast<size_t>(token) * p.hidden);
      for (int v = lane; v < p.hidden / 8; v += 32) row[v] = make_uint4(0u, 0u, 0u, 0u);
    }
  }
}

}  // namespace megamoe::kernels
