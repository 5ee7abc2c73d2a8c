// The smallest complete use of megamoe: pack vLLM-layout weights, build the layer once, run the
// forward on a stream (directly and as a CUDA graph), read the output and the routing-error count.
// Build: part of the CMake build when CUDA is found (target megamoe-example-forward).
// Run:   ./build/megamoe-example-forward   (needs a Hopper GPU; elsewhere it says so and exits 0)
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "megamoe/error.hpp"
#include "megamoe/layer.hpp"
#include "megamoe/weights.hpp"

namespace {

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw megamoe::Error(megamoe::ErrorCode::cuda_error, std::string(what) + ": " +
                                                                                   cudaGetErrorString(status));
}

template <class T>
T* device_copy(const std::vector<T>& host) {
  T* device = nullptr;
  check(cudaMalloc(reinterpret_cast<void**>(&device), host.size() * sizeof(T)), "cudaMalloc");
  check(cudaMemcpy(device, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy");
  return device;
}

}  // namespace

int main() {
  cudaDeviceProp prop{};
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0 || cudaGetDeviceProperties(&prop, 0) != cudaSuccess ||
      prop.major != 9) {
    std::printf("megamoe-example-forward: no Hopper GPU here; nothing to run.\n");
    return 0;
  }
  try {
    // A Qwen3-MoE-like layer, scaled down so that packing takes a moment: 64 experts, top-8.
    megamoe::MoeSpec spec;
    spec.num_experts = 64;
    spec.top_k = 8;
    spec.hidden = 1024;
    spec.intermediate = 512;
    spec.precision = megamoe::Precision::fp8_block;
    spec.routing = megamoe::SoftmaxTopK{.renormalize = true};
    megamoe::validate(spec);  // throws megamoe::Error naming the bad field

    // Weights as vLLM stores them: w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I].
    std::mt19937 engine(1);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const int E = spec.num_experts, H = spec.hidden, I = spec.intermediate, k = spec.top_k;
    std::vector<megamoe::bf16_t> w13(static_cast<size_t>(E) * 2 * I * H), w2(static_cast<size_t>(E) * H * I);
    for (auto& w : w13) w = megamoe::bf16_t::from_float(normal(engine) / std::sqrt(static_cast<float>(H)));
    for (auto& w : w2) w = megamoe::bf16_t::from_float(normal(engine) / std::sqrt(static_cast<float>(I)));
    const megamoe::PackedWeights packed =
        megamoe::prepare_weights(spec, {w13.data(), w2.data(), megamoe::DType::bf16});

    const int max_tokens = 256;
    megamoe::MoeLayer layer(spec, packed, max_tokens);
    std::printf("layer: %d experts, top-%d, H=%d, I=%d, fp8_block; workspace %.1f MiB for %d tokens\n", E, k, H, I,
                layer.workspace_bytes() / 1048576.0, max_tokens);

    // One call of 32 tokens: x [T, H] bf16 and router logits [T, E] fp32, on the device.
    const int tokens = 32;
    std::vector<megamoe::bf16_t> x(static_cast<size_t>(tokens) * H);
    std::vector<float> logits(static_cast<size_t>(tokens) * E);
    for (auto& v : x) v = megamoe::bf16_t::from_float(normal(engine));
    for (auto& v : logits) v = normal(engine);
    megamoe::bf16_t* x_dev = device_copy(x);
    float* logits_dev = device_copy(logits);
    megamoe::bf16_t* y_dev = nullptr;
    check(cudaMalloc(reinterpret_cast<void**>(&y_dev), x.size() * sizeof(megamoe::bf16_t)), "cudaMalloc");

    cudaStream_t stream;
    check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    const megamoe::MoeInputs inputs{tokens, x_dev, logits_dev};
    layer.forward(stream, inputs, {y_dev});  // enqueues only

    // The same call captured once and replayed: what a serving engine's decode step does.
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
    layer.forward(stream, inputs, {y_dev});
    check(cudaStreamEndCapture(stream, &graph), "cudaStreamEndCapture");
    check(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
    cudaEvent_t start, stop;
    check(cudaEventCreate(&start), "cudaEventCreate");
    check(cudaEventCreate(&stop), "cudaEventCreate");
    constexpr int kReplays = 100;
    check(cudaEventRecord(start, stream), "cudaEventRecord");
    for (int i = 0; i < kReplays; ++i) check(cudaGraphLaunch(exec, stream), "cudaGraphLaunch");
    check(cudaEventRecord(stop, stream), "cudaEventRecord");
    check(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");

    std::vector<megamoe::bf16_t> y(x.size());
    check(cudaMemcpy(y.data(), y_dev, y.size() * sizeof(megamoe::bf16_t), cudaMemcpyDeviceToHost), "cudaMemcpy");
    double sum_squares = 0;
    long non_finite = 0;
    for (const auto& v : y) {
      const float f = v.to_float();
      non_finite += !std::isfinite(f);
      sum_squares += static_cast<double>(f) * f;
    }
    std::printf("forward of %d tokens: %.1f us per graph replay (mean of %d, L2 warm)\n", tokens, 1e3 * ms / kReplays,
                kReplays);
    std::printf("y rms %.4f, non-finite values %ld, invalid routing ids %ld\n", std::sqrt(sum_squares / y.size()),
                non_finite, layer.take_invalid_routing_ids(stream));

    // Bad calls throw before anything is launched, with the reason.
    try {
      layer.forward(stream, {max_tokens + 1, x_dev, logits_dev}, {y_dev});
    } catch (const megamoe::Error& e) {
      std::printf("rejected as expected: %s\n", e.what());
    }

    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    cudaStreamDestroy(stream);
    cudaFree(x_dev);
    cudaFree(logits_dev);
    cudaFree(y_dev);
    return non_finite == 0 ? 0 : 1;
  } catch (const megamoe::Error& e) {
    std::fprintf(stderr, "megamoe-example-forward: %s\n", e.what());
    return 1;
  }
}
