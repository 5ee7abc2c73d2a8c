// The single-kernel forward (options.launch = single_kernel) on a Hopper GPU, beyond the
// reference cases every layer suite case also runs through it (test_moe_layer.cpp): run-to-run and
// graph-replay bits, grids of few CTAs and CTAs that cannot become resident, device token counts,
// bad routing ids, and a long run of fresh calls whose counters must come back to zero each time.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <memory>
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
using test::LayerFixture;
using test::RoutingKind;
using test::Skew;

constexpr MoeLayerOptions kSingle{.launch = ForwardLaunch::single_kernel};
constexpr MoeLayerOptions kPerStage{.launch = ForwardLaunch::per_stage};

bool same_bits(const std::vector<bf16_t>& a, const std::vector<bf16_t>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(bf16_t)) == 0;
}

using test::DeviceCall;


LayerFixture& qwen_layer() {
  return test::fixture_for(
      Case{"qwen35-a3b", Precision::fp8_block, 1, RoutingKind::workload, Skew::uniform, CombineMode::deterministic});
}

// The plan says what launches, and what the single kernel cannot take is refused by name.
TEST(SingleKernelForward, PlansAndRefusals) {
  MEGAMOE_REQUIRE_HOPPER();
  LayerFixture& f = qwen_layer();
  MoeLayer single(f.spec, f.packed, 4096, kSingle);
  EXPECT_NE(single.describe_plan(8).find("one kernel"), std::string::npos) << single.describe_plan(8);
  // The five kernels' tile, tokens on M included (docs/design.md#single-kernel-token-tiles).
  EXPECT_NE(single.describe_plan(4096).find("one kernel, token tile 128"), std::string::npos)
      << single.describe_plan(4096);
  MoeLayer per_stage(f.spec, f.packed, 4096, kPerStage);
  EXPECT_NE(per_stage.describe_plan(8).find("five kernels"), std::string::npos) << per_stage.describe_plan(8);
  EXPECT_NE(per_stage.describe_plan(4096).find("five kernels, token tile 128"), std::string::npos)
      << per_stage.describe_plan(4096);
  for (const MoeLayerOptions& refused :
       {MoeLayerOptions{.token_tile = 64, .launch = ForwardLaunch::single_kernel, .weight_multicast = true},
        MoeLayerOptions{.fc1_token_rows = Fc1TokenRows::row_copy, .launch = ForwardLaunch::single_kernel}}) {
    try {
      MoeLayer layer(f.spec, f.packed, 64, refused);
      ADD_FAILURE() << "built a layer with " << refused;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
      EXPECT_NE(std::string(e.what()).find("options.launch=single_kernel"), std::string::npos) << e.what();
    }
  }
}

// Run to run, eagerly and under graph replay, and against the five kernels: the same bits. Grids
// of one CTA and of a few hold every route, gather, GEMM and combine item in fewer CTAs.
TEST(SingleKernelForward, BitIdenticalAcrossRunsReplaysAndGrids) {
  MEGAMOE_REQUIRE_HOPPER();
  test::SeededRng rng;
  LayerFixture& f = qwen_layer();
  MoeLayer per_stage(f.spec, f.packed, 2048, kPerStage);
  std::vector<std::unique_ptr<MoeLayer>> singles;
  for (int sms : {0, 1, 7}) {
    MoeLayerOptions options = kSingle;
    options.num_sms = sms;
    singles.push_back(std::make_unique<MoeLayer>(f.spec, f.packed, 2048, options));
  }
  for (int tokens : {1, 12, 13, 300, 2048}) {
    SCOPED_TRACE(std::to_string(tokens) + " tokens");
    const Inputs in = test::make_inputs(rng, f.spec, tokens, Skew::uniform);
    const std::vector<bf16_t> expected = test::run_device(per_stage, f.spec, in, tokens, CombineMode::deterministic);
    for (auto& layer : singles) {
      SCOPED_TRACE(::testing::Message() << layer->options());
      for (int run = 0; run < 3; ++run) {
        EXPECT_TRUE(same_bits(test::run_device(*layer, f.spec, in, tokens, CombineMode::deterministic), expected))
            << "run " << run;
      }
    }
    // Captured once, replayed three times on a poisoned output.
    test::DeviceBuffer<bf16_t> x(in.x.size()), y(expected.size());
    test::DeviceBuffer<float> logits(in.logits.size());
    x.upload(in.x);
    logits.upload(in.logits);
    cudaStream_t stream;
    MEGAMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    MEGAMOE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    singles[0]->forward(stream, MoeInputs{tokens, x.get(), logits.get(), nullptr, nullptr}, MoeOutputs{y.get()});
    MEGAMOE_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    MEGAMOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int replay = 0; replay < 3; ++replay) {
      y.poison();
      MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
      MEGAMOE_CUDA_CHECK(cudaGraphLaunch(exec, stream));
      MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
      EXPECT_TRUE(same_bits(y.download(), expected)) << "replay " << replay;
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(stream);
  }
}

// Other work holding all but a few SMs slows the single kernel down and never hangs it: its CTAs
// claim their work, so none waits for a CTA that is not resident (scheduler/forward_items.hpp).
TEST(SingleKernelForward, FinishesBesideKernelsHoldingMostSms) {
  MEGAMOE_REQUIRE_HOPPER();
  test::SeededRng rng;
  LayerFixture& f = qwen_layer();
  int sms = 0;
  MEGAMOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  MoeLayer single(f.spec, f.packed, 1024, kSingle);
  const std::vector<int> token_counts = {1, 100, 1024};
  std::vector<Inputs> inputs;
  std::vector<std::vector<bf16_t>> alone;
  for (int tokens : token_counts) {
    inputs.push_back(test::make_inputs(rng, f.spec, tokens, Skew::uniform));
    alone.push_back(test::run_device(single, f.spec, inputs.back(), tokens, CombineMode::deterministic));
  }
  cudaStream_t hog_stream, stream;
  MEGAMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&hog_stream, cudaStreamNonBlocking));
  MEGAMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (int free_sms : {1, 8}) {
    SCOPED_TRACE(std::to_string(free_sms) + " free SMs");
    // The calls' buffers are ready before the hog starts (a device synchronization would wait for it).
    std::vector<std::unique_ptr<DeviceCall>> calls;
    for (size_t i = 0; i < inputs.size(); ++i) calls.push_back(std::make_unique<DeviceCall>(f.spec, inputs[i], token_counts[i]));
    MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
    test::SmHog hog(sms - free_sms, hog_stream, 60.0);
    for (const auto& call : calls) single.forward(stream, call->inputs(), MoeOutputs{call->y.get()});
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    cudaError_t state = cudaErrorNotReady;
    while ((state = cudaStreamQuery(stream)) == cudaErrorNotReady && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    EXPECT_EQ(state, cudaSuccess) << "the forward did not finish within 30 s";
    EXPECT_TRUE(hog.holding()) << "the hog let go before the forward finished: the test proved nothing";
    hog.release();
    MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    for (size_t i = 0; i < calls.size(); ++i) EXPECT_TRUE(same_bits(calls[i]->y.download(), alone[i])) << "call " << i;
  }
  cudaStreamDestroy(stream);
  cudaStreamDestroy(hog_stream);
}

// A device token count: the valid rows as the five kernels give them, the padding rows untouched;
// bad routing ids are counted once each and ignored. Tokens 5 and 6 have no used slot (every id -1,
// every id out of range): no FC2 tile stores a row of theirs, and their outputs must still be zeros.
TEST(SingleKernelForward, DeviceTokenCountAndBadIds) {
  MEGAMOE_REQUIRE_HOPPER();
  test::SeededRng rng;
  const Case c{"small", Precision::fp8_block, 200, RoutingKind::precomputed, Skew::uniform, CombineMode::deterministic};
  LayerFixture& f = test::fixture_for(c);
  MoeLayer per_stage(f.spec, f.packed, 256, kPerStage);
  MoeLayer single(f.spec, f.packed, 256, kSingle);
  Inputs in = test::make_inputs(rng, f.spec, c.tokens, c.skew);
  const int k = f.spec.top_k, H = f.spec.hidden;
  in.ids[0 * k + 1] = -1;                  // not routed here
  in.ids[1 * k + 2] = f.spec.num_experts;  // out of range
  in.ids[150 * k + 3] = -7;                // negative
  in.ids[151 * k + 1] = in.ids[151 * k];   // duplicate
  for (int j = 0; j < k; ++j) {
    in.ids[5 * k + j] = -1;
    in.ids[6 * k + j] = f.spec.num_experts + j;
  }
  test::PrecomputedCall device_call(f.spec, in, c.tokens);
  for (const int count : {0, 1, 2, 3, 12, 13, 151, 152, c.tokens + 3}) {
    SCOPED_TRACE("valid count " + std::to_string(count));
    const MoeInputs call = device_call.inputs(count);
    std::vector<std::vector<bf16_t>> outs;
    std::vector<long> flagged;
    for (MoeLayer* layer : {&per_stage, &single}) {
      device_call.y.poison();
      layer->forward(nullptr, call, MoeOutputs{device_call.y.get()});
      MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
      outs.push_back(device_call.y.download());
      flagged.push_back(layer->take_invalid_routing_ids(nullptr));
    }
    EXPECT_TRUE(same_bits(outs[0], outs[1]));
    EXPECT_EQ(flagged[0], flagged[1]);
    const int rows = std::min(count, c.tokens);
    EXPECT_EQ(flagged[1], (rows > 1 ? 1 : 0) + (rows > 6 ? k : 0) + (rows > 150 ? 1 : 0) + (rows > 151 ? 1 : 0))
        << "ids -1 are not flagged; the out-of-range, negative and duplicate ones are";
    for (int t : {5, 6}) {
      if (t >= rows) continue;
      long nonzero = 0;
      for (int h = 0; h < H; ++h) nonzero += outs[1][static_cast<size_t>(t) * H + h].bits != 0;
      EXPECT_EQ(nonzero, 0) << "token " << t << " has no used slot";
    }
    long written_padding = 0;
    for (size_t i = static_cast<size_t>(rows) * H; i < outs[1].size(); ++i) written_padding += outs[1][i].bits != 0xFFFF;
    EXPECT_EQ(written_padding, 0);
  }
}

// A thousand calls of fresh sizes and routing: each forward must leave every counter at zero for
// the next, whatever its size. Every tenth call is checked against the five kernels.
TEST(SingleKernelForward, ThousandCallsOfFreshSizes) {
  MEGAMOE_REQUIRE_HOPPER();
  test::SeededRng rng;
  const Case c{"small", Precision::fp8_block, 7, RoutingKind::softmax, Skew::uniform, CombineMode::deterministic};
  LayerFixture& f = test::fixture_for(c);
  constexpr int kMax = 512;
  MoeLayer per_stage(f.spec, f.packed, kMax, kPerStage);
  MoeLayer single(f.spec, f.packed, kMax, kSingle);
  int checked = 0;
  for (int call = 0; call < 1000; ++call) {
    const int tokens = rng.integer(1, call % 3 == 0 ? kMax : 24);
    const Inputs in = test::make_inputs(rng, f.spec, tokens, call % 7 == 0 ? Skew::skewed : Skew::uniform);
    const std::vector<bf16_t> got = test::run_device(single, f.spec, in, tokens, CombineMode::deterministic);
    if (call % 10 != 0) continue;
    ++checked;
    ASSERT_TRUE(same_bits(got, test::run_device(per_stage, f.spec, in, tokens, CombineMode::deterministic)))
        << "call " << call << ", " << tokens << " tokens";
  }
  EXPECT_EQ(checked, 100);
}

}  // namespace
}  // namespace megamoe
