#include "unfused_baseline.hpp"

#include <cuda_bf16.h>

#include <string>

#include "kernels/cuda_check.hpp"
#include "megamoe/error.hpp"
#include "ref/routing.hpp"

namespace megamoe::bench {
namespace {

void cublas_check(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw Error(ErrorCode::cuda_error, std::string(what) + " failed: cuBLAS status " + std::to_string(status));
  }
}

__global__ void gather_rows_kernel(const __nv_bfloat16* x, const int32_t* row_token, int rows, int hidden,
                                   __nv_bfloat16* pool) {
  const long vectors = static_cast<long>(rows) * (hidden / 8);
  for (long i = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x; i < vectors;
       i += static_cast<long>(gridDim.x) * blockDim.x) {
    const long row = i / (hidden / 8), column = i % (hidden / 8);
    reinterpret_cast<uint4*>(pool)[row * (hidden / 8) + column] =
        reinterpret_cast<const uint4*>(x)[static_cast<long>(row_token[row]) * (hidden / 8) + column];
  }
}

// gate_up rows hold gate [0, I) then up [I, 2I), as vLLM stores W13.
__global__ void swiglu_kernel(const __nv_bfloat16* gate_up, int rows, int intermediate, __nv_bfloat16* hidden) {
  const long count = static_cast<long>(rows) * intermediate;
  for (long i = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<long>(gridDim.x) * blockDim.x) {
    const long row = i / intermediate, c = i % intermediate;
    const float g = __bfloat162float(gate_up[row * 2 * intermediate + c]);
    const float u = __bfloat162float(gate_up[row * 2 * intermediate + intermediate + c]);
    hidden[i] = __float2bfloat16_rn(g / (1.0f + expf(-g)) * u);
  }
}

__global__ void combine_kernel(const float* expert_out, const int32_t* row_token, const float* row_weight, int rows,
                               int hidden, float* y_accumulator) {
  const long count = static_cast<long>(rows) * hidden;
  for (long i = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<long>(gridDim.x) * blockDim.x) {
    const long row = i / hidden, n = i % hidden;
    atomicAdd(y_accumulator + static_cast<long>(row_token[row]) * hidden + n, row_weight[row] * expert_out[i]);
  }
}

__global__ void to_bf16_kernel(const float* in, long count, __nv_bfloat16* out) {
  for (long i = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<long>(gridDim.x) * blockDim.x) {
    out[i] = __float2bfloat16_rn(in[i]);
  }
}

constexpr int kBlocks = 1024, kThreads = 256;

}  // namespace

UnfusedBaseline::UnfusedBaseline(const MoeSpec& spec, const WeightsView& weights, int max_tokens)
    : spec_(spec), max_tokens_(max_tokens) {
  if (weights.dtype != DType::bf16) throw Error(ErrorCode::invalid_argument, "the baseline takes bf16 weights");
  const size_t E = spec.num_experts, H = spec.hidden, I = spec.intermediate;
  const size_t rows = static_cast<size_t>(max_tokens) * spec.top_k;
  w13_ = cuda_alloc<__nv_bfloat16>(E * 2 * I * H);
  w2_ = cuda_alloc<__nv_bfloat16>(E * H * I);
  MEGAMOE_CUDA_CHECK(cudaMemcpy(w13_, weights.w13, E * 2 * I * H * 2, cudaMemcpyHostToDevice));
  MEGAMOE_CUDA_CHECK(cudaMemcpy(w2_, weights.w2, E * H * I * 2, cudaMemcpyHostToDevice));
  pool_ = cuda_alloc<__nv_bfloat16>(rows * H);
  gate_up_ = cuda_alloc<__nv_bfloat16>(rows * 2 * I);
  hidden_ = cuda_alloc<__nv_bfloat16>(rows * I);
  expert_out_ = cuda_alloc<float>(rows * H);
  y_accumulator_ = cuda_alloc<float>(static_cast<size_t>(max_tokens) * H);
  row_token_ = cuda_alloc<int32_t>(rows);
  row_weight_ = cuda_alloc<float>(rows);
  cublas_check(cublasCreate(&cublas_), "cublasCreate");
}

UnfusedBaseline::~UnfusedBaseline() {
  if (cublas_) cublasDestroy(cublas_);
  for (void* p : {w13_, w2_, pool_, gate_up_, hidden_, static_cast<void*>(expert_out_), static_cast<void*>(y_accumulator_),
                  static_cast<void*>(row_token_), static_cast<void*>(row_weight_)}) {
    cudaFree(p);
  }
}

void UnfusedBaseline::forward(cudaStream_t stream, int tokens, const void* x, const int32_t* ids, const float* weights,
                              void* y) {
  const int E = spec_.num_experts, H = spec_.hidden, I = spec_.intermediate, k = spec_.top_k;
  if (tokens < 1 || tokens > max_tokens_) throw Error(ErrorCode::capacity_exceeded, "baseline token count out of range");
  // The routing comes back to the host: the synchronization an unfused pipeline pays every call.
  host_ids_.resize(static_cast<size_t>(tokens) * k);
  host_weights_.resize(host_ids_.size());
  MEGAMOE_CUDA_CHECK(cudaMemcpyAsync(host_ids_.data(), ids, host_ids_.size() * 4, cudaMemcpyDeviceToHost, stream));
  MEGAMOE_CUDA_CHECK(
      cudaMemcpyAsync(host_weights_.data(), weights, host_weights_.size() * 4, cudaMemcpyDeviceToHost, stream));
  MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  const ref::RoutingCheck check = ref::check_routing(host_ids_.data(), tokens, k, E);
  std::vector<int> offsets(E + 1, 0);
  for (size_t s = 0; s < host_ids_.size(); ++s)
    if (check.used[s]) ++offsets[host_ids_[s] + 1];
  for (int e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
  const int rows = offsets[E];
  host_row_token_.resize(rows);
  host_row_weight_.resize(rows);
  std::vector<int> cursor(offsets.begin(), offsets.end() - 1);
  for (size_t s = 0; s < host_ids_.size(); ++s) {
    if (!check.used[s]) continue;
    const int row = cursor[host_ids_[s]]++;
    host_row_token_[row] = static_cast<int32_t>(s / k);
    host_row_weight_[row] = host_weights_[s];
  }
  MEGAMOE_CUDA_CHECK(cudaMemcpyAsync(row_token_, host_row_token_.data(), rows * 4, cudaMemcpyHostToDevice, stream));
  MEGAMOE_CUDA_CHECK(cudaMemcpyAsync(row_weight_, host_row_weight_.data(), rows * 4, cudaMemcpyHostToDevice, stream));
  MEGAMOE_CUDA_CHECK(cudaMemsetAsync(y_accumulator_, 0, sizeof(float) * tokens * H, stream));
  if (rows > 0) {
    gather_rows_kernel<<<kBlocks, kThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(x), row_token_, rows, H,
                                                          static_cast<__nv_bfloat16*>(pool_));
    MEGAMOE_CHECK_LAUNCH("gather_rows_kernel");
    cublas_check(cublasSetStream(cublas_, stream), "cublasSetStream");
    const float one = 1.0f, zero = 0.0f;
    // Row-major [rows, K] x [N, K]^T = [rows, N] is column-major C[N, rows] = W[K, N]^T * X[K, rows].
    for (int e = 0; e < E; ++e) {
      const int n = offsets[e + 1] - offsets[e];
      if (n == 0) continue;
      const auto* w13 = static_cast<const __nv_bfloat16*>(w13_) + static_cast<size_t>(e) * 2 * I * H;
      const auto* pool = static_cast<const __nv_bfloat16*>(pool_) + static_cast<size_t>(offsets[e]) * H;
      auto* gate_up = static_cast<__nv_bfloat16*>(gate_up_) + static_cast<size_t>(offsets[e]) * 2 * I;
      cublas_check(cublasGemmEx(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, 2 * I, n, H, &one, w13, CUDA_R_16BF, H, pool,
                                CUDA_R_16BF, H, &zero, gate_up, CUDA_R_16BF, 2 * I, CUBLAS_COMPUTE_32F,
                                CUBLAS_GEMM_DEFAULT),
                   "cublasGemmEx (FC1)");
    }
    swiglu_kernel<<<kBlocks, kThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(gate_up_), rows, I,
                                                     static_cast<__nv_bfloat16*>(hidden_));
    MEGAMOE_CHECK_LAUNCH("swiglu_kernel");
    for (int e = 0; e < E; ++e) {
      const int n = offsets[e + 1] - offsets[e];
      if (n == 0) continue;
      const auto* w2 = static_cast<const __nv_bfloat16*>(w2_) + static_cast<size_t>(e) * H * I;
      const auto* hidden = static_cast<const __nv_bfloat16*>(hidden_) + static_cast<size_t>(offsets[e]) * I;
      float* out = expert_out_ + static_cast<size_t>(offsets[e]) * H;
      cublas_check(cublasGemmEx(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, H, n, I, &one, w2, CUDA_R_16BF, I, hidden,
                                CUDA_R_16BF, I, &zero, out, CUDA_R_32F, H, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                   "cublasGemmEx (FC2)");
    }
    combine_kernel<<<kBlocks, kThreads, 0, stream>>>(expert_out_, row_token_, row_weight_, rows, H, y_accumulator_);
    MEGAMOE_CHECK_LAUNCH("combine_kernel");
  }
  to_bf16_kernel<<<kBlocks, kThreads, 0, stream>>>(y_accumulator_, static_cast<long>(tokens) * H,
                                                    static_cast<__nv_bfloat16*>(y));
  MEGAMOE_CHECK_LAUNCH("to_bf16_kernel");
}

}  // namespace megamoe::bench
