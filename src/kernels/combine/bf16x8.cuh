// Eight bf16 channels in one 16-byte vector, summed in fp32 and rounded once: the unit of work of
// the combines (single-GPU deterministic combine, expert-parallel reduce), one thread per vector.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace megamoe::kernels {

struct Bf16x8Sum {
  static constexpr int kChannels = 8;
  float sum[kChannels] = {};

  __device__ __forceinline__ void add(const uint4& raw, float weight) {
    const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < kChannels / 2; ++i) {
      const float2 v = __bfloat1622float2(pairs[i]);
      sum[2 * i] += weight * v.x;
      sum[2 * i + 1] += weight * v.y;
    }
  }

  __device__ __forceinline__ void add(const uint4& raw) {
    const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < kChannels / 2; ++i) {
      const float2 v = __bfloat1622float2(pairs[i]);
      sum[2 * i] += v.x;
      sum[2 * i + 1] += v.y;
    }
  }

  __device__ __forceinline__ uint4 rounded() const {
    uint4 packed;
    __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&packed);
#pragma unroll
    for (int i = 0; i < kChannels / 2; ++i) pairs[i] = __floats2bfloat162_rn(sum[2 * i], sum[2 * i + 1]);
    return packed;
  }
};

}  // namespace megamoe::kernels
