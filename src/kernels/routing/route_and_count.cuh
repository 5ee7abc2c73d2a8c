// Routing role: one warp per token turns router logits (or the caller's precomputed ids) into k
// experts and weights, counts rows per expert and gives each slot its rank inside its expert.
// Arithmetic mirrors src/ref/routing.cpp: sanitized logits, scores in double rounded to float,
// ties to the lower index, k passes of warp-wide argmax.
#pragma once

#include <cfloat>
#include <climits>
#include <cstdint>

#include "kernels/ptx/grid_dependency.cuh"
#include "kernels/routing/routing_limits.hpp"

namespace megamoe::kernels {

enum class RoutingMode : int { softmax_topk = 0, deepseek_grouped = 1, precomputed = 2 };

struct RoutingParams {
  int num_tokens;
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
  int32_t* expert_counts;     // [E], zero on entry
  int32_t* routed_ids;        // [T, k] out; -1 = unused
  float* routed_weights;      // [T, k] out
  int32_t* slot_rank;         // [T, k] out
  int32_t* error_flags;       // [0] += invalid ids
  float* y_accumulator;       // [T, hidden] zeroed here for the atomic combine, or null
  int hidden;
};

namespace routing_detail {

struct Candidate {
  float value;
  int index;
};

__device__ __forceinline__ bool better(const Candidate& a, const Candidate& b) {
  return a.value > b.value || (a.value == b.value && a.index < b.index);
}

__device__ __forceinline__ Candidate warp_best(Candidate c) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    Candidate other{__shfl_xor_sync(0xffffffffu, c.value, offset), __shfl_xor_sync(0xffffffffu, c.index, offset)};
    if (better(other, c)) c = other;
  }
  return c;
}

__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ float sanitize(float logit) {
  if (isnan(logit)) return -FLT_MAX;
  if (isinf(logit)) return logit > 0 ? FLT_MAX : -FLT_MAX;
  return logit;
}

// Best expert among this warp's values whose bit is set in `eligible` (bit i of each lane: expert
// lane + 32 i). Every lane receives the winner.
__device__ __forceinline__ Candidate best_of(const float (&values)[kMaxExpertsPerLane], uint32_t eligible, int lane) {
  Candidate c{-INFINITY, INT_MAX};
#pragma unroll
  for (int i = 0; i < kMaxExpertsPerLane; ++i) {
    if ((eligible >> i) & 1u) {
      const Candidate mine{values[i], lane + 32 * i};
      if (better(mine, c)) c = mine;
    }
  }
  return warp_best(c);
}

// Marks the winner as taken in its lane's bitmask.
__device__ __forceinline__ void take(uint32_t& eligible, int expert, int lane) {
  if (expert % 32 == lane) eligible &= ~(1u << (expert / 32));
}

}  // namespace routing_detail

__global__ void __launch_bounds__(256) route_and_count_kernel(RoutingParams p) {
  using namespace routing_detail;
  const int lane = threadIdx.x % 32;
  const int token = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  ptx::wait_for_prerequisite_grids();
  ptx::allow_dependent_launch();
  if (token >= p.num_tokens) return;
  const int E = p.num_experts, k = p.top_k;
  if (p.y_accumulator != nullptr) {
    float4* row = reinterpret_cast<float4*>(p.y_accumulator + static_cast<size_t>(token) * p.hidden);
    for (int v = lane; v < p.hidden / 4; v += 32) row[v] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }

  int my_id = -1;        // lane j < k ends up holding slot j
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
  } else {
    float value[kMaxExpertsPerLane];   // what selection ranks: logit (softmax) or choice (grouped)
    float score[kMaxExpertsPerLane];   // what weights use: logit (softmax) or sigmoid score (grouped)
    uint32_t present = 0;
#pragma unroll
    for (int i = 0; i < kMaxExpertsPerLane; ++i) {
      const int e = lane + 32 * i;
      value[i] = -INFINITY;
      score[i] = 0.0f;
      if (e < E) {
        present |= 1u << i;
        const float logit = sanitize(p.logits[static_cast<size_t>(token) * E + e]);
        if (p.mode == RoutingMode::softmax_topk) {
          value[i] = score[i] = logit;
        } else {
          score[i] = static_cast<float>(1.0 / (1.0 + exp(-static_cast<double>(logit))));
          const double bias = p.bias ? static_cast<double>(p.bias[e]) : 0.0;
          value[i] = static_cast<float>(static_cast<double>(score[i]) + bias);
        }
      }
    }
    uint32_t eligible = present;
    double softmax_denominator = 1.0;
    double exponential[kMaxExpertsPerLane] = {};  // softmax: exp(logit - max), computed once per expert
    if (p.mode == RoutingMode::softmax_topk) {
      const double softmax_max = best_of(value, present, lane).value;
      double partial = 0.0;
#pragma unroll
      for (int i = 0; i < kMaxExpertsPerLane; ++i) {
        exponential[i] = ((present >> i) & 1u) ? exp(static_cast<double>(value[i]) - softmax_max) : 0.0;
        partial += exponential[i];
      }
      softmax_denominator = warp_sum(partial);
    } else {
      // Group score = sum of the group's two best choice values; keep the best topk_group groups.
      const int group_size = E / p.n_group;
      const int per_group = group_size < 2 ? group_size : 2;
      int group_of[kMaxExpertsPerLane];  // one division per expert, not one per expert per group
#pragma unroll
      for (int i = 0; i < kMaxExpertsPerLane; ++i) group_of[i] = ((present >> i) & 1u) ? (lane + 32 * i) / group_size : -1;
      float my_group_score = -INFINITY;  // lane g holds group g
      for (int g = 0; g < p.n_group; ++g) {
        uint32_t members = 0;
#pragma unroll
        for (int i = 0; i < kMaxExpertsPerLane; ++i)
          if (group_of[i] == g) members |= 1u << i;
        double sum = 0.0;
        for (int r = 0; r < per_group; ++r) {
          const Candidate best = best_of(value, members, lane);
          sum += best.value;
          take(members, best.index, lane);
        }
        if (lane == g) my_group_score = static_cast<float>(sum);
      }
      uint32_t selected_groups = 0;
      Candidate group{lane < p.n_group ? my_group_score : -INFINITY, lane < p.n_group ? lane : INT_MAX};
      for (int r = 0; r < p.topk_group; ++r) {
        const Candidate best = warp_best(group);
        selected_groups |= 1u << best.index;
        if (lane == best.index) group = Candidate{-INFINITY, INT_MAX};
      }
      eligible = 0;
#pragma unroll
      for (int i = 0; i < kMaxExpertsPerLane; ++i)
        if (group_of[i] >= 0 && ((selected_groups >> group_of[i]) & 1u)) eligible |= 1u << i;
    }

    // k passes of argmax; lane j keeps the j-th winner. Only the selection is serial: the winner's
    // weight term was computed before the passes, and lane j divides its own after them.
    double my_term = 0.0;  // softmax: exp(logit - max); grouped: sigmoid score
    for (int j = 0; j < k; ++j) {
      const Candidate best = best_of(value, eligible, lane);
      double term = 0.0;
#pragma unroll
      for (int i = 0; i < kMaxExpertsPerLane; ++i)
        if (lane + 32 * i == best.index)
          term = p.mode == RoutingMode::softmax_topk ? exponential[i] : static_cast<double>(score[i]);
      term = __shfl_sync(0xffffffffu, term, best.index % 32);
      take(eligible, best.index, lane);
      if (lane == j) {
        my_id = best.index;
        my_term = term;
      }
    }
    const double my_raw_weight = p.mode == RoutingMode::softmax_topk ? my_term / softmax_denominator : my_term;
    // The sum of the picked weights in slot order, as the reference adds them.
    double picked_sum = 0.0;
    for (int j = 0; j < k; ++j) picked_sum += __shfl_sync(0xffffffffu, my_raw_weight, j);
    double w = my_raw_weight;
    if (p.mode == RoutingMode::softmax_topk) {
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
    p.slot_rank[slot] = my_id >= 0 ? atomicAdd(&p.expert_counts[my_id], 1) : -1;
  }
}

}  // namespace megamoe::kernels
