// Permute role: one warp per token copies its activation row into the pool row of each of its
// routed slots (expert-contiguous order), quantizing to E4M3 per 128 channels on the way in
// fp8_block mode. The token is read and quantized once, whatever k is.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/ptx/grid_dependency.cuh"
#include "kernels/quant/fp8_block_scale.cuh"

namespace megamoe::kernels {

struct GatherParams {
  int num_tokens;
  int top_k;
  int hidden;
  int pool_rows;
  bool ue8m0;
  const __nv_bfloat16* x;        // [T, H]
  const int32_t* routed_ids;     // [T, k]
  const int32_t* slot_rank;      // [T, k]
  const int32_t* expert_offsets; // [E+1]
  int32_t* pool_slot;            // [pool_rows]
  void* activations;             // [pool_rows, H] bf16 or e4m3
  float* activation_scales;      // [H/128, pool_rows] (fp8)
};

// One 8-channel chunk of a token into the pool rows of its slots (row < 0: unused slot).
// Called by the whole warp; out-of-range lanes (in_range false) take part in the shuffles only.
template <bool kFp8>
__device__ __forceinline__ void write_chunk(const GatherParams& p, uint4 raw, int chunk, bool in_range, int my_row) {
  constexpr int kElementsPerLane = 8;
  constexpr int kLanesPerBlock = 128 / kElementsPerLane;
  if constexpr (kFp8) {
    const __nv_bfloat16* v = reinterpret_cast<const __nv_bfloat16*>(&raw);
    float f[kElementsPerLane];
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < kElementsPerLane; ++i) {
      f[i] = __bfloat162float(v[i]);
      amax = fmaxf(amax, fabsf(f[i]));
    }
    // The 16 lanes of one 128-channel block are a contiguous half-warp.
#pragma unroll
    for (int offset = kLanesPerBlock / 2; offset > 0; offset /= 2)
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    const BlockScale s = block_scale(amax, p.ue8m0);
    uint2 packed;
    uint16_t* pairs = reinterpret_cast<uint16_t*>(&packed);
#pragma unroll
    for (int i = 0; i < kElementsPerLane / 2; ++i) pairs[i] = encode_e4m3x2(f[2 * i] * s.factor, f[2 * i + 1] * s.factor);
    const int block = chunk / kLanesPerBlock;
    for (int j = 0; j < p.top_k; ++j) {
      const int row = __shfl_sync(0xffffffffu, my_row, j);
      if (row < 0 || !in_range) continue;
      reinterpret_cast<uint2*>(static_cast<uint8_t*>(p.activations) + static_cast<size_t>(row) * p.hidden)[chunk] = packed;
      if (chunk % kLanesPerBlock == 0) p.activation_scales[static_cast<size_t>(block) * p.pool_rows + row] = s.scale;
    }
  } else {
    for (int j = 0; j < p.top_k; ++j) {
      const int row = __shfl_sync(0xffffffffu, my_row, j);
      if (row < 0 || !in_range) continue;
      reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(p.activations) + static_cast<size_t>(row) * p.hidden)[chunk] = raw;
    }
  }
}

template <bool kFp8>
__global__ void __launch_bounds__(256) gather_quantize_kernel(GatherParams p) {
  constexpr int kElementsPerLane = 8;  // one 16-byte load of bf16
  const int lane = threadIdx.x % 32;
  const int token = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  ptx::wait_for_prerequisite_grids();
  ptx::allow_dependent_launch();
  if (token >= p.num_tokens) return;

  // Lane j < k learns slot j's pool row; -1 when the slot is unused.
  int my_row = -1;
  if (lane < p.top_k) {
    const size_t slot = static_cast<size_t>(token) * p.top_k + lane;
    const int expert = p.routed_ids[slot];
    if (expert >= 0) {
      my_row = p.expert_offsets[expert] + p.slot_rank[slot];
      p.pool_slot[my_row] = static_cast<int32_t>(slot);
    }
  }

  // Loads go out kLoadsInFlight per lane at a time: one memory round trip per batch, not one per
  // chunk (the stores between them keep the compiler from hoisting the next load by itself).
  // Every lane runs every batch, so the shuffles below always see the whole warp.
  constexpr int kLoadsInFlight = 4;
  const int chunks = p.hidden / kElementsPerLane;
  const uint4* source = reinterpret_cast<const uint4*>(p.x + static_cast<size_t>(token) * p.hidden);
  for (int first = 0; first < chunks; first += 32 * kLoadsInFlight) {
    uint4 batch[kLoadsInFlight];
#pragma unroll
    for (int b = 0; b < kLoadsInFlight; ++b) {
      const int chunk = first + 32 * b + lane;
      batch[b] = chunk < chunks ? source[chunk] : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int b = 0; b < kLoadsInFlight; ++b) {
      if (first + 32 * b >= chunks) break;  // warp-uniform
      const int chunk = first + 32 * b + lane;
      const bool in_range = chunk < chunks;
      write_chunk<kFp8>(p, batch[b], chunk, in_range, my_row);
    }
  }
}

}  // namespace megamoe::kernels
