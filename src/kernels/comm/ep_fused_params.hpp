// The parameters of the fused expert-parallel forward's roles (comm/ep_fused_roles.cuh), which the
// host fills per call (comm::EpLayer): host and device code alike.
#pragma once

#include <cuda_bf16.h>
#include <vector_types.h>

#include <cstdint>

#include "kernels/comm/rank_fault.hpp"
#include "kernels/layout/ep_fused_buffers.hpp"

namespace megamoe::kernels {

struct EpFusedParams {
  void* const* peer_bases;  // [world] every rank's symmetric buffer
  layout::EpFusedLayout layout;
  int rank;
  int num_experts;          // the whole layer's
  int num_tokens;           // this rank's tokens in this call
  const int32_t* topk_ids;  // [T, k] this rank's routing, global expert ids
  const float* topk_weights;
  const uint4* x;           // [T, H] bf16
  bool ue8m0;               // FP8 rows: power-of-two scales (the layer's ScaleFormat)
  __nv_bfloat16* y;         // [T, H]
  int32_t* error_flags;     // [0] += invalid ids among this rank's tokens
  uint64_t* calls;          // this rank only: forwards run so far (the next one's arrivals count to it + 1)
  RankFault* fault;         // this rank only
  long long timeout_ns;     // each cross-rank wait's
  int publish_items;
  int publish_tokens;       // tokens per publish item
};

}  // namespace megamoe::kernels
