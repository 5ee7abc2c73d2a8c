// The unfused baseline megamoe-bench measures in the same run: what a C++ user without megamoe
// would write. Routing is given (precomputed ids and weights, so the baseline does not pay for
// it); the host reads it back once per call (one stream synchronization) and builds the
// per-expert row lists; then a gather kernel, one grouped cuBLAS bf16 GEMM call (fp32 accumulate,
// one group per touched expert: cublasGemmGroupedBatchedEx) for FC1, a SwiGLU kernel, one grouped
// call for FC2 (bf16 out, as vLLM keeps it), and an atomic weighted combine. bf16 math in both
// precisions: cuBLAS has no 128x128 block-scaled FP8 GEMM on sm_90.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "megamoe/spec.hpp"
#include "megamoe/weights.hpp"

namespace megamoe::bench {

class UnfusedBaseline {
 public:
  // `weights` are bf16 in the vLLM layout (w13 [E, 2I, H], w2 [E, H, I]) in host memory.
  UnfusedBaseline(const MoeSpec& spec, const WeightsView& weights, int max_tokens);
  ~UnfusedBaseline();
  UnfusedBaseline(const UnfusedBaseline&) = delete;
  UnfusedBaseline& operator=(const UnfusedBaseline&) = delete;

  // Device pointers: x [T, H] bf16, ids/weights [T, k], y [T, H] bf16.
  void forward(cudaStream_t stream, int tokens, const void* x, const int32_t* ids, const float* weights, void* y);

 private:
  MoeSpec spec_;
  int max_tokens_;
  cublasHandle_t cublas_ = nullptr;
  void* w13_ = nullptr;
  void* w2_ = nullptr;
  void* pool_ = nullptr;        // bf16 [rows, H]
  void* gate_up_ = nullptr;     // bf16 [rows, 2I]
  void* hidden_ = nullptr;      // bf16 [rows, I]
  void* expert_out_ = nullptr;  // bf16 [rows, H]
  const void** gemm_pointers_ = nullptr;  // device: A, B, C pointer arrays of both grouped GEMMs
  float* y_accumulator_ = nullptr;
  int32_t* row_token_ = nullptr;
  float* row_weight_ = nullptr;
  std::vector<int32_t> host_ids_;
  std::vector<float> host_weights_;
  std::vector<int32_t> host_row_token_;
  std::vector<float> host_row_weight_;
};

}  // namespace megamoe::bench
