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

__global__ void combine_kernel(const __nv_bfloat16* expert_out, const int32_t* row_token, const float* row_weight, int rows,
                               int hidden, float* y_accumulator) {
  const long count = static_cast<long>(rows) * hidden;
  for (long i = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<long>(gridDim.x) * blockDim.x) {
    const long row = i / hidden, n = i % hidden;
    atomicAdd(y_accumulator + static_cast<long>(row_token[row]) * hidden + n,
              row_weight[row] * __bfloat162float(expert_out[i]));
  }
}

__global__ void to_bf16_kernel(const float* in, long count, __nv_bfloat16* out) {
  for (long i = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<long>(gridDim.x) * blockDim.x) {
    out[i] = __float2bfloat16_rn(in[i]);
  }
}

constexpr int kBlocks = 1024, kThreads = 256;
constexpr int kPointerArrays = 6;  // A, B, C of FC1 and of FC2

// Row-major out[rows, N] = in[rows, K] x W[N, K]^T is column-major C[N, rows] = W^T[N, K] x in^T,
// one group of one GEMM per touched expert.
struct GroupedGemm {
  std::vector<cublasOperation_t> trans_a, trans_b;
  std::vector<int> m, n, k, lda, ldb, ldc, group_size;
  std::vector<float> alpha, beta;
  std::vector<const void*> a, b, c;

  void add(int out_features, int rows, int in_features, const void* weights, const void* in, void* out) {
    trans_a.push_back(CUBLAS_OP_T);
    trans_b.push_back(CUBLAS_OP_N);
    m.push_back(out_features);
    n.push_back(rows);
    k.push_back(in_features);
    lda.push_back(in_features);
    ldb.push_back(in_features);
    ldc.push_back(out_features);
    group_size.push_back(1);
    alpha.push_back(1.0f);
    beta.push_back(0.0f);
    a.push_back(weights);
    b.push_back(in);
    c.push_back(out);
  }

  // pointers: device room for 3 * groups pointers.
  void run(cublasHandle_t handle, cudaStream_t stream, const void** pointers, const char* what) const {
    const size_t groups = m.size();
    std::vector<const void*> all(a);
    all.insert(all.end(), b.begin(), b.end());
    all.insert(all.end(), c.begin(), c.end());
    MEGAMOE_CUDA_CHECK(cudaMemcpyAsync(pointers, all.data(), all.size() * sizeof(void*), cudaMemcpyHostToDevice, stream));
    cublas_check(cublasGemmGroupedBatchedEx(handle, trans_a.data(), trans_b.data(), m.data(), n.data(), k.data(),
                                            alpha.data(), pointers, CUDA_R_16BF, lda.data(), pointers + groups,
                                            CUDA_R_16BF, ldb.data(), beta.data(),
                                            const_cast<void* const*>(pointers + 2 * groups), CUDA_R_16BF, ldc.data(),
                                            static_cast<int>(groups), group_size.data(), CUBLAS_COMPUTE_32F),
                 what);
  }
};

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
  expert_out_ = cuda_alloc<__nv_bfloat16>(rows * H);
  gemm_pointers_ = const_cast<const void**>(cuda_alloc<void*>(kPointerArrays * E));
  y_accumulator_ = cuda_alloc<float>(static_cast<size_t>(max_tokens) * H);
  row_token_ = cuda_alloc<int32_t>(rows);
  row_weight_ = cuda_alloc<float>(rows);
  cublas_check(cublasCreate(&cublas_), "cublasCreate");
}

UnfusedBaseline::~UnfusedBaseline() {
  if (cublas_) cublasDestroy(cublas_);
  for (void* p : {w13_, w2_, pool_, gate_up_, hidden_, expert_out_, const_cast<void*>(static_cast<const void*>(gemm_pointers_)),
                  static_cast<void*>(y_accumulator_),
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
    GroupedGemm fc1, fc2;
    for (int e = 0; e < E; ++e) {
      const int n = offsets[e + 1] - offsets[e];
      if (n == 0) continue;
      fc1.add(2 * I, n, H, static_cast<const __nv_bfloat16*>(w13_) + static_cast<size_t>(e) * 2 * I * H,
              static_cast<const __nv_bfloat16*>(pool_) + static_cast<size_t>(offsets[e]) * H,
              static_cast<__nv_bfloat16*>(gate_up_) + static_cast<size_t>(offsets[e]) * 2 * I);
      fc2.add(H, n, I, static_cast<const __nv_bfloat16*>(w2_) + static_cast<size_t>(e) * H * I,
              static_cast<const __nv_bfloat16*>(hidden_) + static_cast<size_t>(offsets[e]) * I,
              static_cast<__nv_bfloat16*>(expert_out_) + static_cast<size_t>(offsets[e]) * H);
    }
    fc1.run(cublas_, stream, gemm_pointers_, "cublasGemmGroupedBatchedEx (FC1)");
    swiglu_kernel<<<kBlocks, kThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(gate_up_), rows, I,
                                                     static_cast<__nv_bfloat16*>(hidden_));
    MEGAMOE_CHECK_LAUNCH("swiglu_kernel");
    fc2.run(cublas_, stream, gemm_pointers_ + kPointerArrays / 2 * E, "cublasGemmGroupedBatchedEx (FC2)");
    combine_kernel<<<kBlocks, kThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(expert_out_), row_token_, row_weight_, rows, H, y_accumulator_);
    MEGAMOE_CHECK_LAUNCH("combine_kernel");
  }
  to_bf16_kernel<<<kBlocks, kThreads, 0, stream>>>(y_accumulator_, static_cast<long>(tokens) * H,
                                                    static_cast<__nv_bfloat16*>(y));
  MEGAMOE_CHECK_LAUNCH("to_bf16_kernel");
}

}  // namespace megamoe::bench
