// Row movement of the expert-parallel roles: carving a rank's symmetric buffer, and copying a whole
// row with one block.
#pragma once

#include <cstdint>

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

}  // namespace megamoe::kernels::ep_detail
