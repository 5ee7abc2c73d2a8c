// One rank of the expert-parallel test, started by megamoe-run on a machine with >= 2 GPUs:
//   ep_layer_rank [--iterations N] [--tokens T] [--hang]
// Every iteration draws fresh routing on every rank (uniform, skewed onto few experts, with -1
// holes and some ranks empty), runs EpLayer::forward, checks that dispatch delivered exactly the
// token rows ref::plan_dispatch predicts (row by row, with each slot's local expert) and that y
// matches the fp64 reference for this rank's tokens. --hang: rank 1 never calls forward, so rank 0 must time out in the cross-rank
// barrier with a diagnostic (the launcher then fails the run) instead of hanging.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>

#include "comm/ep_layer.hpp"
#include "kernels/cuda_check.hpp"
#include "megamoe/error.hpp"
#include "ref/ep_dispatch.hpp"
#include "ref/moe_reference.hpp"
#include "ref/random_problem.hpp"

namespace {

using namespace megamoe;

struct RankInputs {
  std::vector<bf16_t> x;
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

// Every rank can rebuild every rank's inputs for an iteration from the same seeds.
RankInputs make_inputs(const MoeSpec& spec, int rank, int iteration, int max_tokens) {
  std::mt19937_64 engine(1000003ull * iteration + rank);
  RankInputs in;
  const int pattern = iteration % 4;
  // Every eighth iteration fills the buffer and every eighth (offset 4) sends one token; pattern 3
  // leaves rank 1 empty.
  int tokens = static_cast<int>(engine() % max_tokens) + 1;
  if (iteration % 8 == 0) tokens = max_tokens;
  if (iteration % 8 == 4) tokens = 1;
  if (pattern == 3 && rank == 1) tokens = 0;
  std::normal_distribution<float> normal;
  for (int i = 0; i < tokens * spec.hidden; ++i) in.x.push_back(bf16_t::from_float(normal(engine)));
  const int E = spec.num_experts, k = spec.top_k;
  for (int t = 0; t < tokens; ++t) {
    std::vector<int32_t> experts(E);
    for (int e = 0; e < E; ++e) experts[e] = e;
    // pattern 1: skewed onto the first 2k experts (most experts receive nothing)
    const int span = pattern == 1 ? std::min(E, 2 * k) : E;
    for (int j = 0; j < k; ++j) {
      std::swap(experts[j], experts[j + engine() % (span - j)]);
      const bool hole = pattern == 2 && engine() % 5 == 0;
      in.ids.push_back(hole ? -1 : experts[j]);
      in.weights.push_back(0.05f + 0.95f * static_cast<float>(engine() % 1000) / 1000.0f);
    }
  }
  return in;
}

int run(int argc, char** argv) {
  int iterations = 20, max_tokens = 64;
  bool hang = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--iterations" && i + 1 < argc) iterations = std::atoi(argv[++i]);
    else if (arg == "--tokens" && i + 1 < argc) max_tokens = std::atoi(argv[++i]);
    else if (arg == "--hang") hang = true;
    else throw Error(ErrorCode::invalid_argument, "unknown argument " + arg);
  }
  const auto rendezvous = comm::FileRendezvous::from_environment();
  const int rank = rendezvous.rank(), world = rendezvous.world_size();
  const char* local_rank = std::getenv("LOCAL_RANK");
  MEGAMOE_CUDA_CHECK(cudaSetDevice(local_rank ? std::atoi(local_rank) : rank));

  MoeSpec spec;
  spec.num_experts = 16;
  spec.top_k = 4;
  spec.hidden = 256;
  spec.intermediate = 256;
  spec.precision = Precision::fp8_block;
  spec.routing = Precomputed{};
  const ref::RandomWeights weights = ref::make_random_weights(spec, 7);  // identical on every rank
  const PackedWeights all = prepare_weights(spec, weights.view());
  MoeSpec local = spec;
  local.num_experts = spec.num_experts / world;
  const size_t w13_per_expert = 2ull * spec.intermediate * spec.hidden, w2_per_expert = 1ull * spec.hidden * spec.intermediate;
  const size_t first = static_cast<size_t>(rank) * local.num_experts;
  const PackedWeights mine = prepare_weights(
      local, WeightsView{weights.w13.data() + first * w13_per_expert, weights.w2.data() + first * w2_per_expert,
                         DType::bf16});
  comm::EpLayer layer(spec, mine, max_tokens, rendezvous);
  cudaStream_t stream;
  MEGAMOE_CUDA_CHECK(cudaStreamCreate(&stream));
  if (hang && rank == 1) {
    std::printf("rank 1 skips forward on purpose\n");
    rendezvous.barrier("hang-test-done", std::chrono::seconds(120));
    return 0;
  }

  double worst = 0.0;
  for (int it = 0; it < iterations; ++it) {
    std::vector<RankInputs> everyone;
    std::vector<ref::RankRouting> routing;
    for (int r = 0; r < world; ++r) everyone.push_back(make_inputs(spec, r, it, max_tokens));
    for (int r = 0; r < world; ++r) {
      routing.push_back({static_cast<int>(everyone[r].ids.size() / spec.top_k), everyone[r].ids.data()});
    }
    const RankInputs& in = everyone[rank];
    const int T = routing[rank].num_tokens;
    void *x = nullptr, *y = nullptr, *ids = nullptr, *w = nullptr;
    const size_t rows = std::max<size_t>(T, 1);
    MEGAMOE_CUDA_CHECK(cudaMalloc(&x, rows * spec.hidden * 2));
    MEGAMOE_CUDA_CHECK(cudaMalloc(&y, rows * spec.hidden * 2));
    MEGAMOE_CUDA_CHECK(cudaMalloc(&ids, rows * spec.top_k * 4));
    MEGAMOE_CUDA_CHECK(cudaMalloc(&w, rows * spec.top_k * 4));
    MEGAMOE_CUDA_CHECK(cudaMemcpy(x, in.x.data(), in.x.size() * 2, cudaMemcpyHostToDevice));
    MEGAMOE_CUDA_CHECK(cudaMemcpy(ids, in.ids.data(), in.ids.size() * 4, cudaMemcpyHostToDevice));
    MEGAMOE_CUDA_CHECK(cudaMemcpy(w, in.weights.data(), in.weights.size() * 4, cudaMemcpyHostToDevice));
    MEGAMOE_CUDA_CHECK(cudaMemset(y, 0xFF, rows * spec.hidden * 2));
    layer.forward(stream, MoeInputs{T, x, nullptr, static_cast<int32_t*>(ids), static_cast<float*>(w)},
                  MoeOutputs{y});

    // Dispatch: exactly the rows the CPU model predicts, in canonical order, with each slot's
    // local expert.
    const ref::DispatchPlan plan = ref::plan_dispatch(ref::EpTopology{world, spec.num_experts}, spec.top_k, routing);
    const comm::EpLayer::Delivered delivered = layer.last_delivered(stream);
    for (int src = 0; src < world; ++src) {
      if (delivered.counts[src] != plan.sent[src][rank]) {
        std::fprintf(stderr, "iteration %d: rank %d counts %d rows from rank %d, expected %d\n", it, rank,
                     delivered.counts[src], src, plan.sent[src][rank]);
        return 1;
      }
    }
    const std::vector<ref::ReceivedRow>& expected = plan.received[rank];
    if (delivered.origins.size() != 2 * expected.size()) {
      std::fprintf(stderr, "iteration %d: rank %d received %zu rows, expected %zu\n", it, rank,
                   delivered.origins.size() / 2, expected.size());
      return 1;
    }
    for (size_t row = 0; row < expected.size(); ++row) {
      const ref::ReceivedRow& want = expected[row];
      const int32_t* ids_got = delivered.local_ids.data() + row * spec.top_k;
      if (delivered.origins[2 * row] != want.rank || delivered.origins[2 * row + 1] != want.token ||
          !std::equal(want.local_ids.begin(), want.local_ids.end(), ids_got)) {
        std::fprintf(stderr, "iteration %d: rank %d row %zu is not (rank %d, token %d) with its slots' local experts\n",
                     it, rank, row, want.rank, want.token);
        return 1;
      }
    }
    // Combine: this rank's outputs against the single-GPU fp64 reference with all experts.
    if (T > 0) {
      std::vector<bf16_t> got(static_cast<size_t>(T) * spec.hidden), want(got.size());
      MEGAMOE_CUDA_CHECK(cudaMemcpy(got.data(), y, got.size() * 2, cudaMemcpyDeviceToHost));
      const ref::ReferenceReport report = ref::reference_forward(
          spec, all, MoeInputs{T, in.x.data(), nullptr, in.ids.data(), in.weights.data()}, MoeOutputs{want.data()});
      std::vector<double> device(got.size());
      for (size_t i = 0; i < got.size(); ++i) device[i] = got[i].to_float();
      const double err = ref::relative_l2(device, report.y);
      worst = std::max(worst, err);
      // fp8 requantization noise (see tests/api/test_moe_layer.cpp) plus the bf16 rounding of
      // each rank's partial sum before the sum over ranks.
      if (!(err < 3e-2)) {
        std::fprintf(stderr, "iteration %d: rank %d rel. L2 error %.3e against the reference\n", it, rank, err);
        return 1;
      }
    }
    // Now and then the same forward captured in a CUDA graph and replayed twice:
    // the barrier counts live on the device, so replays synchronize like fresh calls and give the
    // same bits.
    if (it % 100 == 6) {  // on every rank alike, or the barriers would not pair up
      std::vector<bf16_t> eager(static_cast<size_t>(T) * spec.hidden), replayed(eager.size());
      MEGAMOE_CUDA_CHECK(cudaMemcpy(eager.data(), y, eager.size() * 2, cudaMemcpyDeviceToHost));
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      MEGAMOE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
      layer.forward(stream, MoeInputs{T, x, nullptr, static_cast<int32_t*>(ids), static_cast<float*>(w)}, MoeOutputs{y});
      MEGAMOE_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
      MEGAMOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
      for (int replay = 0; replay < 2; ++replay) {
        MEGAMOE_CUDA_CHECK(cudaMemsetAsync(y, 0xFF, eager.size() * 2, stream));
        MEGAMOE_CUDA_CHECK(cudaGraphLaunch(exec, stream));
        MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
        MEGAMOE_CUDA_CHECK(cudaMemcpy(replayed.data(), y, replayed.size() * 2, cudaMemcpyDeviceToHost));
        if (std::memcmp(eager.data(), replayed.data(), eager.size() * 2) != 0) {
          std::fprintf(stderr, "iteration %d: rank %d graph replay %d differs from the eager forward\n", it, rank, replay);
          return 1;
        }
      }
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
    }
    for (void* p : {x, y, ids, w}) cudaFree(p);
  }
  if (hang) {
    rendezvous.barrier("hang-test-done", std::chrono::seconds(120));
    std::printf("rank %d: forward returned although rank 1 never joined\n", rank);
    return 1;
  }
  std::printf("rank %d ok: %d iterations, worst rel. L2 error %.3e\n", rank, iterations, worst);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
