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
// trips (Nsight Compute: ~8 cycles per instruction, little of it instruction fetch), so selection
// runs on order keys with warp reductions and only the winner's lane rescans. A token's scores live
// in shared memory and the loops over experts stay rolled, which keeps the kernel a third of the
// 97 KB of SASS that holding them in unrolled registers took.
#pragma once

#include <cfloat>
#include <climits>
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
};

namespace routing_detail {

// Marks an expert as ineligible (key 0, as a taken one gets in the passes). Every legitimate
// selection value is a number: sanitized logits, or a sigmoid plus a finite bias.
__device__ __forceinline__ float excluded() { return __int_as_float(0x7fffffff); }

struct Candidate {
  uint32_t key;  // 0: none
  int index;
};

// Best of this lane's entries lane + 32 i below count by key_of(e); ties go to the lower index.
// Unrolled by 8 so that a lane's loads (E <= 256) issue together.
template <class KeyOf>
__device__ __forceinline__ Candidate lane_best(int count, int lane, KeyOf key_of) {
  Candidate c{0u, INT_MAX};
#pragma unroll 8
  for (int e = lane; e < count; e += 32) {
    const uint32_t key = key_of(e);
    if (key > c.key) c = Candidate{key, e};
  }
  return c;
}

// The warp's best candidate (highest key, then lowest index), in every lane; index INT_MAX when
// every lane's key is 0.
__device__ __forceinline__ Candidate warp_best(const Candidate& c) {
  const uint32_t top = __reduce_max_sync(0xffffffffu, c.key);
  const uint32_t index = __reduce_min_sync(0xffffffffu, c.key == top ? static_cast<uint32_t>(c.index) : UINT32_MAX);
  return Candidate{top, top == 0u ? INT_MAX : static_cast<int>(index)};
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Group score of the deepseek mode: the sum of the group's `per_group` (1 or 2) best values, in
// the reference's order (best first). One lane walks one group.
__device__ __forceinline__ float group_score(const float* values, int first, int size, int per_group) {
  float best = -INFINITY, second = -INFINITY;
#pragma unroll 8
  for (int e = first; e < first + size; ++e) {
    const float v = values[e];
    if (v > best) {
      second = best;
      best = v;
    } else if (v > second) {
      second = v;
    }
  }
  double sum = static_cast<double>(best);
  if (per_group == 2) sum += static_cast<double>(second);
  return static_cast<float>(sum);
}

}  // namespace routing_detail

// Whether lane's slot id equals the id of an earlier slot of the token (slot j in lane j < k): every
// lane of the warp calls it.
__device__ __forceinline__ bool repeats_an_earlier_slot(int id, int lane, int k) {
  bool duplicate = false;
  for (int j = 0; j < k; ++j) {
    const int other = __shfl_sync(0xffffffffu, id, j);
    duplicate |= (j < lane) && other == id;
  }
  return duplicate;
}

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
    const bool duplicate = repeats_an_earlier_slot(my_id, lane, k);
    if (lane < k && my_id != -1 && (my_id < 0 || my_id >= E || duplicate)) {
      atomicAdd(&p.error_flags[0], 1);
      my_id = -1;
    }
  } else {
    const bool softmax = p.mode == RoutingMode::softmax_topk;
    const float* logits = p.logits + static_cast<size_t>(token) * E;
    // Eight logits (and biases) per lane in flight before any arithmetic: one memory round trip
    // for E <= 256. The deepseek modes' eight sigmoids of a lane then run side by side, computed
    // for every slot (past E on a zero) so that no branch separates them: each is a long chain of
    // dependent FP64 instructions (exp, a division), and a loop over the experts issued one chain
    // after another (docs/decisions.md#router-sigmoids-side-by-side).
    constexpr int kLoadsInFlight = 8;
    const bool has_bias = !softmax && p.bias != nullptr;
    for (int first = 0; first < E; first += 32 * kLoadsInFlight) {
      float logit[kLoadsInFlight], bias[kLoadsInFlight];
#pragma unroll
      for (int b = 0; b < kLoadsInFlight; ++b) {
        const int e = first + 32 * b + lane;
        logit[b] = sanitize_logit(e < E ? logits[e] : 0.0f);
        bias[b] = e < E && has_bias ? p.bias[e] : 0.0f;
      }
      if (softmax) {
#pragma unroll
        for (int b = 0; b < kLoadsInFlight; ++b) {
          const int e = first + 32 * b + lane;
          if (e < E) value[e] = score[e] = logit[b];
        }
      } else {
        float sigmoid[kLoadsInFlight];
#pragma unroll
        for (int b = 0; b < kLoadsInFlight; ++b)
          sigmoid[b] = static_cast<float>(1.0 / (1.0 + exp(-static_cast<double>(logit[b]))));
#pragma unroll
        for (int b = 0; b < kLoadsInFlight; ++b) {
          const int e = first + 32 * b + lane;
          if (e < E) {
            value[e] = static_cast<float>(static_cast<double>(sigmoid[b]) + static_cast<double>(bias[b]));
            score[e] = sigmoid[b];
          }
        }
      }
    }
    __syncwarp();

    if (!softmax) {
      // Keep the topk_group best groups (lane g scores group g); the rest become ineligible.
      const int group_size = E / p.n_group;
      const int per_group = group_size < 2 ? group_size : 2;
      Candidate group{0u, INT_MAX};
      if (lane < p.n_group) group = Candidate{order_key(group_score(value, lane * group_size, group_size, per_group)), lane};
      uint32_t selected_groups = 0;
      for (int r = 0; r < p.topk_group; ++r) {
        const Candidate best = warp_best(group);
        selected_groups |= 1u << best.index;
        if (lane == best.index) group.key = 0u;
      }
      __syncwarp();
      for (int e = lane; e < E; e += 32)
        if (!((selected_groups >> (e / group_size)) & 1u)) value[e] = excluded();
      __syncwarp();
    }

    // k passes of argmax; lane j keeps the j-th winner and computes its own weight term after.
    // Only the winner's lane rescans, and only its own entries (e = lane mod 32), so the passes
    // need no shared-memory synchronization. The selection values become order keys in place
    // first (each lane its own entries, as it wrote them), so that a rescan, the passes' dependent
    // chain, compares integers instead of converting 8 floats each time; a taken expert gets key 0.
    uint32_t* keys = reinterpret_cast<uint32_t*>(value);
    for (int e = lane; e < E; e += 32) keys[e] = order_key(value[e]);
    const auto key_of = [keys](int e) { return keys[e]; };
    Candidate mine = lane_best(E, lane, key_of);
    float softmax_max = 0.0f, softmax_denominator = 1.0f;
    if (softmax) {
      // The passes' first scan is the softmax maximum's too (the best key of all); the weights'
      // row holds the same logits as floats.
      softmax_max = from_order_key(warp_best(mine).key);
      float partial = 0.0f;
#pragma unroll 4
      for (int e = lane; e < E; e += 32) partial += expf(score[e] - softmax_max);
      softmax_denominator = warp_sum(partial);
    }
#pragma unroll 1
    for (int j = 0; j < k; ++j) {
      const Candidate best = warp_best(mine);
      if (best.index == INT_MAX) break;  // the planner guarantees k reachable experts
      if (lane == j) my_id = best.index;
      if (mine.index == best.index) {
        keys[best.index] = 0u;
        mine = lane_best(E, lane, key_of);
      }
    }
    double my_raw_weight = 0.0;
    if (my_id >= 0) {
      my_raw_weight = softmax ? static_cast<double>(expf(score[my_id] - softmax_max) / softmax_denominator)
                              : static_cast<double>(score[my_id]);
    }
    // The sum of the picked weights in slot order, as the reference adds them (the shuffles of a
    // group of 8 are independent, so they issue together ahead of the dependent additions).
    double picked_sum = 0.0;
    for (int first = 0; first < k; first += 8) {
      double picked[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) picked[j] = __shfl_sync(0xffffffffu, my_raw_weight, first + j);
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if (first + j < k) picked_sum += picked[j];
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

  if (lane < k) {
    const size_t slot = static_cast<size_t>(token) * k + lane;
    p.routed_ids[slot] = my_id;
    p.routed_weights[slot] = my_weight;
    p.slot_rank[slot] = my_id >= 0 ? atomicAdd(&counts[my_id], 1) : -1;
  }
}

}  // namespace megamoe::kernels
