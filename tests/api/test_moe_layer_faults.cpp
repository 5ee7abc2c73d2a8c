// MoeLayer under careless or hostile use: calls from several host threads, a failed allocation,
// bad sizes, other kernels holding most of the GPU, and a long soak. None may fault the GPU,
// hang, change a result silently, or leave the process less usable than before.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <string>
#include <thread>
#include <vector>

#include "api/layer_fixture.hpp"
#include "common/gpu_test.hpp"
#include "common/sm_hog.hpp"
#include "common/test_random.hpp"
#include "megamoe/error.hpp"
#include "megamoe/layer.hpp"
#include "ref/moe_reference.hpp"

namespace megamoe {
namespace {

using test::Case;
using test::Inputs;
using test::kMaxTokens;
using test::LayerFixture;
using test::RoutingKind;
using test::Skew;

using test::DeviceCall;

// The small fp8 layer with softmax routing most of these tests run.
LayerFixture& small_layer() {
  const Case c{"small", Precision::fp8_block, 7, RoutingKind::softmax, Skew::uniform, CombineMode::deterministic};
  return test::fixture_for(c);
}

bool same_bits(const std::vector<bf16_t>& a, const std::vector<bf16_t>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(bf16_t)) == 0;
}

// `call` throws Error(invalid_argument) whose message holds each of `texts`.
template <class Call>
void expect_refused(Call&& call, std::initializer_list<std::string> texts) {
  try {
    call();
    ADD_FAILURE() << "accepted; expected a refusal saying: " << *texts.begin();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
    for (const std::string& text : texts) EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
  }
}

// Free device memory now, after the device is idle.
size_t free_device_bytes() {
  MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
  size_t free = 0, total = 0;
  MEGAMOE_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  return free;
}

// Host threads that share a layer and a stream: each call's launches stay together, so every
// call computes what it computes alone. Without that, the calls' kernels interleaved on the
// stream and shared the workspace, and the GPU faulted.
TEST(MoeLayerFaults, ThreadsSharingALayerAndAStream) {
  MEGAMOE_REQUIRE_HOPPER();
  test::SeededRng rng;
  LayerFixture& f = small_layer();
  constexpr int kThreads = 4, kCallsPerThread = 200;
  const int token_counts[kThreads] = {1, 37, 128, 300};
  std::vector<Inputs> inputs;
  std::vector<std::vector<bf16_t>> alone;
  for (int t : token_counts) {
    inputs.push_back(test::make_inputs(rng, f.spec, t, Skew::uniform));
    alone.push_back(test::run_device(*f.layer, f.spec, inputs.back(), t, CombineMode::deterministic));
  }
  cudaStream_t stream;
  MEGAMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::vector<std::unique_ptr<DeviceCall>> calls;
  for (int i = 0; i < kThreads; ++i) calls.push_back(std::make_unique<DeviceCall>(f.spec, inputs[i], token_counts[i]));
  std::vector<std::thread> threads;
  std::vector<std::string> failures(kThreads);
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      try {
        for (int call = 0; call < kCallsPerThread; ++call) {
          f.layer->forward(stream, calls[i]->inputs(), MoeOutputs{calls[i]->y.get()});
        }
      } catch (const std::exception& e) {
        failures[i] = e.what();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  for (int i = 0; i < kThreads; ++i) {
    EXPECT_EQ(failures[i], "") << "thread " << i;
    EXPECT_TRUE(same_bits(calls[i]->y.download(), alone[i])) << token_counts[i] << " tokens";
  }
  cudaStreamDestroy(stream);
}

// A layer too large for the device: an out_of_memory error naming the size, after which nothing
// of it stays allocated, no CUDA error is left for the next caller to trip over, and other
// layers still run.
TEST(MoeLayerFaults, FailedAllocationLeavesTheProcessAsItWas) {
  MEGAMOE_REQUIRE_HOPPER();
  test::SeededRng rng;
  MoeSpec spec;
  spec.num_experts = 16;
  spec.top_k = 4;
  spec.hidden = 7168;
  spec.intermediate = 256;
  spec.precision = Precision::fp8_block;
  const ref::RandomWeights weights = ref::make_random_weights(spec, rng.seed());
  const PackedWeights packed = prepare_weights(spec, weights.view());
  const size_t free_before = free_device_bytes();
  for (int attempt = 0; attempt < 3; ++attempt) {
    try {
      MoeLayer huge(spec, packed, 1 << 24);  // a workspace of ~1.9 TB
      ADD_FAILURE() << "a layer with a 1.9 TB workspace was built";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::out_of_memory) << e.what();
      EXPECT_NE(std::string(e.what()).find("bytes"), std::string::npos) << e.what();
    }
    EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "the failed allocation's error was left pending";
    EXPECT_EQ(cudaPeekAtLastError(), cudaSuccess);
  }
  EXPECT_NEAR(static_cast<double>(free_device_bytes()), static_cast<double>(free_before), 4 << 20)
      << "the failed constructions left device memory allocated";

  LayerFixture& f = small_layer();
  const Inputs in = test::make_inputs(rng, f.spec, 7, Skew::uniform);
  const std::vector<bf16_t> y = test::run_device(*f.layer, f.spec, in, 7, CombineMode::deterministic);
  for (const bf16_t v : y) ASSERT_TRUE(std::isfinite(v.to_float()));
}

// Sizes outside what the kernels index are refused with the limit in the message, never wrapped.
TEST(MoeLayerFaults, SizesOutsideTheLimitsAreRefusedByName) {
  MEGAMOE_REQUIRE_HOPPER();
  test::SeededRng rng;
  LayerFixture& f = small_layer();
  for (int max_tokens : {0, -1, (1 << 24) + 1, 2147483647}) {
    try {
      MoeLayer layer(f.spec, f.packed, max_tokens);
      ADD_FAILURE() << "built a layer for max_tokens=" << max_tokens;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
      EXPECT_NE(std::string(e.what()).find("must be in [1, 16777216]"), std::string::npos) << e.what();
    }
  }
  const Inputs in = test::make_inputs(rng, f.spec, 8, Skew::uniform);
  DeviceCall call(f.spec, in, 8);
  for (int tokens : {-1, kMaxTokens + 1}) {
    MoeInputs inputs = call.inputs();
    inputs.num_tokens = tokens;
    EXPECT_THROW(f.layer->forward(nullptr, inputs, MoeOutputs{call.y.get()}), Error) << tokens << " tokens";
  }
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

// A layer lives on the device it was built on. A call made while another device was current
// launched its kernels there on this layer's buffers: read through peer mappings where the devices
// had them, else an illegal address that ended that device's context. It is refused by name
// before anything is launched, on that device's default stream or one of its own, and the layer
// and both devices work on. Needs two GPUs (scripts/gpu/gpu2_check.sh).
TEST(MoeLayerFaults, CallsWhileAnotherDeviceIsCurrentAreRefused) {
  MEGAMOE_REQUIRE_HOPPER();
  int devices = 0;
  MEGAMOE_CUDA_CHECK(cudaGetDeviceCount(&devices));
  if (devices < 2) GTEST_SKIP() << "needs two GPUs";
  test::SeededRng rng;
  MEGAMOE_CUDA_CHECK(cudaSetDevice(0));
  LayerFixture& f = small_layer();
  const Inputs in = test::make_inputs(rng, f.spec, 8, Skew::uniform);
  const std::vector<bf16_t> expected = test::run_device(*f.layer, f.spec, in, 8, CombineMode::deterministic);
  DeviceCall call(f.spec, in, 8);
  MEGAMOE_CUDA_CHECK(cudaSetDevice(1));
  cudaStream_t other_stream;
  MEGAMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&other_stream, cudaStreamNonBlocking));
  for (cudaStream_t stream : {cudaStream_t{nullptr}, other_stream}) {
    expect_refused([&] { f.layer->forward(stream, call.inputs(), MoeOutputs{call.y.get()}); },
                   {"forward: the current device is 1, but this layer lives on device 0: call cudaSetDevice(0)"});
    expect_refused([&] { f.layer->take_invalid_routing_ids(stream); },
                   {"take_invalid_routing_ids: the current device is 1, but this layer lives on device 0"});
  }
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  MEGAMOE_CUDA_CHECK(cudaStreamDestroy(other_stream));
  MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());  // device 1 is unharmed
  // Nothing ran: y is still poisoned, and a call on the layer's own device computes what it did.
  MEGAMOE_CUDA_CHECK(cudaSetDevice(0));
  for (const bf16_t v : call.y.download()) ASSERT_TRUE(std::isnan(v.to_float()));
  f.layer->forward(nullptr, call.inputs(), MoeOutputs{call.y.get()});
  MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_TRUE(same_bits(call.y.download(), expected));
  EXPECT_EQ(f.layer->take_invalid_routing_ids(nullptr), 0);
}

// Reading a layer's state back (take_invalid_routing_ids, activation_scales) copies to the host and
// synchronizes the stream: inside a CUDA graph capture that ended the capture as invalidated, and
// the caller's graph with it. It is refused by name; the capture goes on, and the graph it makes
// replays the forward captured before the refusal.
TEST(MoeLayerFaults, ReadBacksDuringCaptureAreRefused) {
  MEGAMOE_REQUIRE_HOPPER();
  test::SeededRng rng;
  for (const Precision precision : {Precision::fp8_block, Precision::fp8_tensor}) {
    SCOPED_TRACE(to_string(precision));
    LayerFixture& f =
        test::fixture_for(Case{"small", precision, 8, RoutingKind::softmax, Skew::uniform, CombineMode::deterministic});
    const Inputs in = test::make_inputs(rng, f.spec, 8, Skew::uniform);
    const std::vector<bf16_t> expected = test::run_device(*f.layer, f.spec, in, 8, CombineMode::deterministic);
    DeviceCall call(f.spec, in, 8);
    cudaStream_t stream;
    MEGAMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    MEGAMOE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    f.layer->forward(stream, call.inputs(), MoeOutputs{call.y.get()});
    expect_refused([&] { f.layer->take_invalid_routing_ids(stream); },
                   {"take_invalid_routing_ids reads the layer's device state back", "being captured"});
    if (precision == Precision::fp8_tensor) {
      expect_refused([&] { f.layer->activation_scales(stream); },
                     {"activation_scales reads the layer's device state back", "being captured"});
    }
    cudaGraph_t graph;
    MEGAMOE_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));  // the capture was not invalidated
    cudaGraphExec_t exec;
    MEGAMOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    MEGAMOE_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    EXPECT_TRUE(same_bits(call.y.download(), expected));
    EXPECT_EQ(f.layer->take_invalid_routing_ids(stream), 0);  // after the capture: read as usual
    MEGAMOE_CUDA_CHECK(cudaGraphExecDestroy(exec));
    MEGAMOE_CUDA_CHECK(cudaGraphDestroy(graph));
    MEGAMOE_CUDA_CHECK(cudaStreamDestroy(stream));
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  }
}

// Other work holding all but a few SMs slows the forward down and never hangs it: no role waits
// for CTAs that cannot become resident. The results are those of the GPU to itself.
TEST(MoeLayerFaults, ForwardBesideKernelsHoldingMostSms) {
  MEGAMOE_REQUIRE_HOPPER();
  test::SeededRng rng;
  int sms = 0;
  MEGAMOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  for (const char* workload : {"small", "qwen35-a3b"}) {
    SCOPED_TRACE(workload);
    const Case c{workload, Precision::fp8_block, 128, RoutingKind::workload, Skew::uniform, CombineMode::deterministic};
    LayerFixture& f = test::fixture_for(c);
    const std::vector<int> token_counts = {1, 128, 1000};
    std::vector<Inputs> inputs;
    std::vector<std::vector<bf16_t>> alone;
    for (int tokens : token_counts) {
      inputs.push_back(test::make_inputs(rng, f.spec, tokens, Skew::uniform));
      alone.push_back(test::run_device(*f.layer, f.spec, inputs.back(), tokens, CombineMode::deterministic));
    }
    cudaStream_t hog_stream, stream;
    MEGAMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&hog_stream, cudaStreamNonBlocking));
    MEGAMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    for (int free_sms : {1, 8}) {
      test::SmHog hog(sms - free_sms, hog_stream, 60.0);
      std::vector<std::unique_ptr<DeviceCall>> calls;
      for (size_t i = 0; i < inputs.size(); ++i) {
        calls.push_back(std::make_unique<DeviceCall>(f.spec, inputs[i], token_counts[i]));
        f.layer->forward(stream, calls.back()->inputs(), MoeOutputs{calls.back()->y.get()});
      }
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
      cudaError_t state = cudaErrorNotReady;
      while ((state = cudaStreamQuery(stream)) == cudaErrorNotReady && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      EXPECT_EQ(state, cudaSuccess) << "the forward did not finish within 30 s on " << free_sms << " free SMs";
      EXPECT_TRUE(hog.holding()) << "the hog let go before the forward finished: the test proved nothing";
      hog.release();
      MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
      for (size_t i = 0; i < calls.size(); ++i) {
        EXPECT_TRUE(same_bits(calls[i]->y.download(), alone[i])) << free_sms << " free SMs, call " << i;
      }
    }
    cudaStreamDestroy(stream);
    cudaStreamDestroy(hog_stream);
  }
}

// Ten thousand calls with fresh routing and token counts: a fixed call replayed among them gives
// the same bits every time, sampled calls match the CPU reference, and the device memory in use
// does not grow.
TEST(MoeLayerFaults, SoakOfTenThousandCalls) {
  MEGAMOE_REQUIRE_HOPPER();
  test::SeededRng rng;
  LayerFixture& f = small_layer();
  constexpr int kCalls = 10000, kMaxSoakTokens = 256;
  const Inputs fixed = test::make_inputs(rng, f.spec, 64, Skew::uniform);
  const std::vector<bf16_t> fixed_y = test::run_device(*f.layer, f.spec, fixed, 64, CombineMode::deterministic);
  DeviceCall fixed_call(f.spec, fixed, 64);
  test::DeviceBuffer<bf16_t> x(static_cast<size_t>(kMaxSoakTokens) * f.spec.hidden);
  test::DeviceBuffer<bf16_t> y(static_cast<size_t>(kMaxSoakTokens) * f.spec.hidden);
  test::DeviceBuffer<float> logits(static_cast<size_t>(kMaxSoakTokens) * f.spec.num_experts);
  std::vector<bf16_t> host_x;
  const size_t free_before = free_device_bytes();
  int replays = 0, checked = 0;
  for (int call = 0; call < kCalls; ++call) {
    const int tokens = rng.integer(1, kMaxSoakTokens);
    // Fresh logits every call; x is redrawn now and then (the routing is what varies).
    if (call % 250 == 0) {
      host_x = rng.bf16_normals(static_cast<size_t>(kMaxSoakTokens) * f.spec.hidden);
      MEGAMOE_CUDA_CHECK(cudaMemcpy(x.get(), host_x.data(), x.bytes(), cudaMemcpyHostToDevice));
    }
    const std::vector<float> host_logits = rng.normals(static_cast<size_t>(tokens) * f.spec.num_experts);
    MEGAMOE_CUDA_CHECK(cudaMemcpy(logits.get(), host_logits.data(), host_logits.size() * sizeof(float),
                                  cudaMemcpyHostToDevice));
    const bool check = call % 1000 == 999;
    f.layer->forward(nullptr, MoeInputs{tokens, x.get(), logits.get(), nullptr, nullptr}, MoeOutputs{y.get()});
    if (check) {
      MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
      std::vector<bf16_t> device(static_cast<size_t>(tokens) * f.spec.hidden);
      MEGAMOE_CUDA_CHECK(cudaMemcpy(device.data(), y.get(), device.size() * sizeof(bf16_t), cudaMemcpyDeviceToHost));
      Inputs in;
      in.x.assign(host_x.begin(), host_x.begin() + device.size());
      in.logits = host_logits;
      std::vector<bf16_t> reference(device.size());
      const ref::ReferenceReport report =
          ref::reference_forward(f.spec, f.packed, in.view(tokens), MoeOutputs{reference.data()});
      const test::Comparison cmp = test::compare(device, report.y);
      EXPECT_EQ(cmp.non_finite, 0) << "call " << call;
      EXPECT_LT(cmp.rel_l2, 2e-2) << "call " << call << ", " << tokens << " tokens";
      ++checked;
    }
    if (call % 500 == 0) {
      fixed_call.y.poison();
      f.layer->forward(nullptr, fixed_call.inputs(), MoeOutputs{fixed_call.y.get()});
      ASSERT_TRUE(same_bits(fixed_call.y.download(), fixed_y)) << "the fixed call changed after " << call << " calls";
      ++replays;
    }
  }
  EXPECT_EQ(free_device_bytes(), free_before) << "device memory in use grew over the soak";
  EXPECT_EQ(replays, kCalls / 500);
  EXPECT_EQ(checked, kCalls / 1000);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

}  // namespace
}  // namespace megamoe
