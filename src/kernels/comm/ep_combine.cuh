// Expert-parallel combine roles.
//   push (owner): each received row's expert output goes back to its source rank's
//   combine_rows[token * k + slot] (NVLink writes, 16 bytes per lane).
//   reduce (source): after a barrier, y[t] = sum over the token's used slots, in slot order, of
//   weight * row, accumulated in fp32 and rounded once to bf16 (deterministic).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/comm/ep_rows.cuh"
#include "kernels/layout/ep_buffers.hpp"

namespace megamoe::kernels {

struct EpCombineParams {
  void* const* peer_bases;
  layout::EpBufferLayout layout;
  int rank;
  int num_tokens;
  const uint4* expert_rows;     // owner: [received rows, H] bf16 outputs of the local experts
  const int32_t* slot_rank;     // source: [T, k], -1 for unused slots
  const float* topk_weights;    // source: [T, k]
  __nv_bfloat16* y;             // source: [T, H]
};

__global__ void __launch_bounds__(256) ep_push_kernel(EpCombineParams p) {
  const int total = ep_detail::received_rows(
      ep_detail::region<const int32_t>(p.peer_bases[p.rank], p.layout.recv_counts),
      p.layout.world_size * p.layout.experts_per_rank);
  const int4* sources = ep_detail::region<const int4>(p.peer_bases[p.rank], p.layout.recv_sources);
  const int vectors_per_row = p.layout.hidden / 8;
  const int lane = threadIdx.x % 32;
  const long warps = static_cast<long>(gridDim.x) * blockDim.x / 32;
  for (long row = (blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x) / 32; row < total; row += warps) {
    const int4 source = sources[row];  // (src, token, slot, local expert)
    uint4* to = ep_detail::region<uint4>(p.peer_bases[source.x], p.layout.combine_rows) +
                (static_cast<long>(source.y) * p.layout.top_k + source.z) * vectors_per_row;
    ep_detail::warp_copy_row(to, p.expert_rows + row * vectors_per_row, vectors_per_row, lane);
  }
}

__global__ void __launch_bounds__(256) ep_reduce_kernel(EpCombineParams p) {
  const int k = p.layout.top_k, H = p.layout.hidden;
  const long index = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x;
  if (index >= static_cast<long>(p.num_tokens) * (H / 8)) return;
  const int token = static_cast<int>(index / (H / 8));
  const int column = static_cast<int>(index % (H / 8)) * 8;
  const __nv_bfloat16* rows = reinterpret_cast<const __nv_bfloat16*>(
      static_cast<const char*>(p.peer_bases[p.rank]) + p.layout.combine_rows);
  float sum[8] = {};
  for (int j = 0; j < k; ++j) {
    const long slot = static_cast<long>(token) * k + j;
    if (p.slot_rank[slot] < 0) continue;
    const float w = p.topk_weights[slot];
    const uint4 raw = *reinterpret_cast<const uint4*>(rows + slot * H + column);
    const __nv_bfloat16* v = reinterpret_cast<const __nv_bfloat16*>(&raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) sum[i] += w * __bfloat162float(v[i]);
  }
  uint4 packed;
  __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&packed);
#pragma unroll
  for (int i = 0; i < 4; ++i) pairs[i] = __floats2bfloat162_rn(sum[2 * i], sum[2 * i + 1]);
  *reinterpret_cast<uint4*>(p.y + static_cast<long>(token) * H + column) = packed;
}

}  // namespace megamoe::kernels
