// Row movement of the expert-parallel roles: carving a rank's symmetric buffer, and copying a whole
// row with one block.
#pragma once

#include <cstdint>

#include "kernels/quant/fp8_block_scale.cuh"

namespace megamoe::kernels {

constexpr int kEpRowThreads = 256;  // threads of the blocks that move rows

}  // namespace megamoe::kernels

namespace megamoe::kernels::ep_detail {

template <class T>
__device__ __forceinline__ T* region(void* base, size_t offset) {
  return reinterpret_cast<T*>(static_cast<char*>(base) + offset);
}

// The block copies one row of `vectors` 16-byte vectors from `from` to each of to[0..count): each
// vector is loaded once, kBatch loads per thread in flight before their stores (the destinations
// are usually peers: the stores are posted NVLink writes, the loads local).
template <int kBatch = 4>
__device__ __forceinline__ void block_copy_row(const uint4* from, uint4* const* to, int count, int vectors) {
  for (int first = threadIdx.x; first < vectors; first += kBatch * blockDim.x) {
    uint4 staged[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int v = first + i * blockDim.x;
      if (v < vectors) staged[i] = from[v];
    }
    for (int d = 0; d < count; ++d) {
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int v = first + i * blockDim.x;
        if (v < vectors) to[d][v] = staged[i];
      }
    }
  }
}

// The block quantizes one bf16 row of `hidden` channels per 128 channels (the gather's rule,
// quant/fp8_block_scale.cuh) and writes its codes to each of to[0..count) and its scales to each
// of scales_to[0..count), block b's at scales_to[d][b * scale_stride]. A thread takes 16 channels
// (two loads, one 16-byte store of codes), so that a 128-channel block is 8 aligned lanes. Every
// one of the `threads` threads calls it (full-warp shuffles; a uniform trip count): `threads` a
// multiple of 32 and `thread` congruent to the lane id mod 32, numbering them from 0.
__device__ __forceinline__ void block_quantize_row(const uint4* from, uint4* const* to, float* const* scales_to,
                                                   int count, int hidden, size_t scale_stride, bool ue8m0, int thread,
                                                   int threads) {
  constexpr int kValues = 16;
  const int vectors = hidden / kValues;  // a multiple of 8: whole blocks of lanes
  for (int first = 0; first < vectors; first += threads) {
    const int v = first + thread;
    const bool in_range = v < vectors;
    float values[kValues] = {};
    if (in_range) {
      bf16x8_to_floats(from[2 * v], values);
      bf16x8_to_floats(from[2 * v + 1], values + 8);
    }
    uint4 codes;
    const BlockScale s = encode_lane_block_values(values, ue8m0, reinterpret_cast<uint16_t*>(&codes));
    if (!in_range) continue;
    for (int d = 0; d < count; ++d) to[d][v] = codes;
    if (v % (128 / kValues) == 0) {
      const size_t block = static_cast<size_t>(v / (128 / kValues));
      for (int d = 0; d < count; ++d) scales_to[d][block * scale_stride] = s.scale;
    }
  }
}

// The same by every thread of the block.
__device__ __forceinline__ void block_quantize_row(const uint4* from, uint4* const* to, float* const* scales_to,
                                                   int count, int hidden, size_t scale_stride, bool ue8m0) {
  block_quantize_row(from, to, scales_to, count, hidden, scale_stride, ue8m0, static_cast<int>(threadIdx.x),
                     static_cast<int>(blockDim.x));
}

}  // namespace megamoe::kernels::ep_detail
