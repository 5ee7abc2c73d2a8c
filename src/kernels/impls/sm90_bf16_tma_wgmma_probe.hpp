// Toolchain probe: one CTA loads a 64x64 bf16 tile of A and of B with TMA (CuTe SM90_TMA_LOAD,
// 128-byte swizzle) and multiplies them with one warpgroup of CuTe wgmma atoms
// (SM90_64x64x16_F32BF16BF16_SS): C = A * B^T in fp32. It proves that nvcc, the CUTLASS headers
// and the sm_90a target work together; the real kernels build on the same primitives.
#pragma once

#include <cuda_runtime_api.h>

#include "megamoe/dtypes.hpp"

namespace megamoe::kernels {

inline constexpr int kProbeM = 64;
inline constexpr int kProbeN = 64;
inline constexpr int kProbeK = 64;

// a [M, K] and b [N, K] row-major bf16 (K contiguous), c [M, N] row-major fp32, all device memory.
void sm90_bf16_tma_wgmma_probe(const bf16_t* a, const bf16_t* b, float* c, cudaStream_t stream);

}  // namespace megamoe::kernels
