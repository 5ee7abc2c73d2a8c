// Row movement shared by the expert-parallel dispatch and combine roles: carving a rank's
// symmetric buffer, copying whole rows with one warp, and the number of rows an owner received.
#pragma once

#include <cstdint>

namespace megamoe::kernels::ep_detail {

template <class T>
__device__ __forceinline__ T* region(void* base, size_t offset) {
  return reinterpret_cast<T*>(static_cast<char*>(base) + offset);
}

// One warp copies one row, kInFlight 16-byte loads per lane issued before their stores, so a
// remote row costs about one NVLink round trip per 32 * kInFlight vectors, not per 32.
template <int kInFlight = 8>
__device__ __forceinline__ void warp_copy_row(uint4* to, const uint4* from, int vectors, int lane) {
  int v = lane;
  for (; v + 32 * (kInFlight - 1) < vectors; v += 32 * kInFlight) {
    uint4 staged[kInFlight];
#pragma unroll
    for (int i = 0; i < kInFlight; ++i) staged[i] = from[v + 32 * i];
#pragma unroll
    for (int i = 0; i < kInFlight; ++i) to[v + 32 * i] = staged[i];
  }
  for (; v < vectors; v += 32) to[v] = from[v];
}

// Rows this owner receives in this call (sum of recv_counts), the same in every thread.
__device__ __forceinline__ int received_rows(const int32_t* counts, int entries) {
  __shared__ int total;
  if (threadIdx.x == 0) total = 0;
  __syncthreads();
  int mine = 0;
  for (int i = threadIdx.x; i < entries; i += blockDim.x) mine += counts[i];
  atomicAdd(&total, mine);
  __syncthreads();
  return total;
}

}  // namespace megamoe::kernels::ep_detail
