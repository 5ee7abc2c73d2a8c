#include "dense_gemm_rate.hpp"

#include <cublasLt.h>

#include <cstdint>
#include <string>

#include "device_timing.hpp"
#include "kernels/cuda_check.hpp"
#include "megamoe/error.hpp"

namespace megamoe::bench {
namespace {

constexpr Replays kCalls{3, 20};
constexpr size_t kWorkspaceBytes = 64ull << 20;

void lt_check(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw Error(ErrorCode::cuda_error, std::string(what) + " failed: cublasStatus " + std::to_string(status));
  }
}

// Inputs of a realistic magnitude (all-zero operands would let the tensor cores idle at lower
// power and overstate the rate): a hash of the index, as E4M3 bytes below the NaN pattern or as
// bf16 values in [-1, 1).
__global__ void fill_kernel(uint8_t* bytes, size_t count, bool fp8) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 0x9E3779B1u;
    h ^= h >> 15;
    h *= 0x85EBCA77u;
    h ^= h >> 13;
    if (fp8) {
      bytes[i] = static_cast<uint8_t>(h & 0xB7u);  // sign, exponent <= 6, any mantissa: |v| <= 0.94
    } else if (i % 2 == 0) {
      // One bf16 per even byte pair: sign, exponent 2^-1..2^-2, 7 mantissa bits.
      const uint16_t value = static_cast<uint16_t>((h & 0x8000u) | (0x3E80u + (h & 0x00FFu)));
      bytes[i] = static_cast<uint8_t>(value & 0xFFu);
      if (i + 1 < count) bytes[i + 1] = static_cast<uint8_t>(value >> 8);
    }
  }
}

struct LtMatrix {
  cublasLtMatrixLayout_t layout = nullptr;
  LtMatrix(cudaDataType type, int rows, int cols) {
    lt_check(cublasLtMatrixLayoutCreate(&layout, type, rows, cols, rows), "cublasLtMatrixLayoutCreate");
  }
  ~LtMatrix() { cublasLtMatrixLayoutDestroy(layout); }
  LtMatrix(const LtMatrix&) = delete;
  LtMatrix& operator=(const LtMatrix&) = delete;
};

// The cuBLASLt objects of one measurement, released on every path out.
struct LtObjects {
  cublasLtHandle_t handle = nullptr;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatmulPreference_t preference = nullptr;
  LtObjects() = default;
  LtObjects(const LtObjects&) = delete;
  LtObjects& operator=(const LtObjects&) = delete;
  ~LtObjects() {
    if (preference) cublasLtMatmulPreferenceDestroy(preference);
    if (desc) cublasLtMatmulDescDestroy(desc);
    if (handle) cublasLtDestroy(handle);
  }
};

}  // namespace

DenseRate measure_dense_rate(Precision precision, cudaStream_t stream, int n) {
  const bool fp8 = precision != Precision::bf16;
  const cudaDataType input_type = fp8 ? CUDA_R_8F_E4M3 : CUDA_R_16BF;
  const size_t input_bytes = static_cast<size_t>(n) * n * (fp8 ? 1 : 2);
  const size_t output_bytes = static_cast<size_t>(n) * n * 2;

  DeviceBuffer a(input_bytes), b(input_bytes), d(output_bytes), workspace(kWorkspaceBytes);
  fill_kernel<<<1024, 256, 0, stream>>>(a.as<uint8_t>(), input_bytes, fp8);
  MEGAMOE_CHECK_LAUNCH("fill_kernel");
  fill_kernel<<<1024, 256, 0, stream>>>(b.as<uint8_t>(), input_bytes, fp8);
  MEGAMOE_CHECK_LAUNCH("fill_kernel");

  LtObjects lt;
  lt_check(cublasLtCreate(&lt.handle), "cublasLtCreate");
  // Column-major D[n, n] = A^T B with A and B stored K-major, the layout FP8 requires on sm_90.
  lt_check(cublasLtMatmulDescCreate(&lt.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  const cublasOperation_t transpose = CUBLAS_OP_T, keep = CUBLAS_OP_N;
  lt_check(cublasLtMatmulDescSetAttribute(lt.desc, CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof transpose),
           "set TRANSA");
  lt_check(cublasLtMatmulDescSetAttribute(lt.desc, CUBLASLT_MATMUL_DESC_TRANSB, &keep, sizeof keep), "set TRANSB");
  const LtMatrix a_layout(input_type, n, n), b_layout(input_type, n, n), d_layout(CUDA_R_16BF, n, n);

  lt_check(cublasLtMatmulPreferenceCreate(&lt.preference), "cublasLtMatmulPreferenceCreate");
  lt_check(cublasLtMatmulPreferenceSetAttribute(lt.preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                &kWorkspaceBytes, sizeof kWorkspaceBytes),
           "set MAX_WORKSPACE_BYTES");
  cublasLtMatmulHeuristicResult_t heuristic{};
  int found = 0;
  lt_check(cublasLtMatmulAlgoGetHeuristic(lt.handle, lt.desc, a_layout.layout, b_layout.layout, d_layout.layout,
                                          d_layout.layout, lt.preference, 1, &heuristic, &found),
           "cublasLtMatmulAlgoGetHeuristic");
  if (found == 0) throw Error(ErrorCode::unsupported, "cuBLASLt offers no algorithm for this GEMM");

  const float alpha = 1.0f, beta = 0.0f;
  const double median_s = 1e-3 * median_ms(stream, kCalls, [&] {
    lt_check(cublasLtMatmul(lt.handle, lt.desc, &alpha, a.as<void>(), a_layout.layout, b.as<void>(), b_layout.layout,
                            &beta, d.as<void>(), d_layout.layout, d.as<void>(), d_layout.layout, &heuristic.algo,
                            workspace.as<void>(), kWorkspaceBytes, stream),
             "cublasLtMatmul");
  });
  return DenseRate{2.0 * n * static_cast<double>(n) * n / median_s,
                   std::string("cuBLASLt ") + (fp8 ? "E4M3 x E4M3 -> bf16" : "bf16 x bf16 -> bf16") +
                       ", fp32 accumulation, " + std::to_string(n) + "^3, median of " + std::to_string(kCalls.timed) +
                       " calls in this run"};
}

}  // namespace megamoe::bench
