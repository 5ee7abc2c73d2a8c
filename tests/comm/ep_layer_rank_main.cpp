// One rank of the expert-parallel test, started by megamoe-run, one GPU per rank or (megamoe-run
// --one-gpu) every rank on one GPU (rank r takes visible device r mod count):
//   ep_layer_rank [--iterations N] [--tokens T] [--ue8m0] [--hang | --die] [--barrier-timeout-ms MS]
// Every iteration draws fresh routing on every rank (uniform, skewed onto few experts, with -1
// holes and some ranks empty), runs EpLayer::forward, checks that dispatch delivered exactly the
// token rows ref::plan_dispatch predicts (row by row, with each slot's local expert), that y
// matches the fp64 reference for this rank's tokens, and that the layer's FP8 token rows (the
// default for fp8_block) give the same y, bit for bit, as a second layer sending bf16 rows. --hang: rank 1 stalls (never calls forward),
// so rank 0's barrier must give up after its timeout with a diagnostic instead of hanging, and
// rank 0 then checks what a caller sees: check_peers throws a timeout error naming rank 1, y is
// NaN, the next forward throws at once, and the process still runs a single-GPU layer correctly.
// --die: the same with rank 1's process gone (it exits without cleaning up after building the
// layer) instead of stalled.
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

// Device buffers of one rank's inputs and output, y poisoned.
struct DeviceCall {
  void *x = nullptr, *y = nullptr, *ids = nullptr, *w = nullptr;
  int tokens = 0;
  DeviceCall(const MoeSpec& spec, const RankInputs& in) : tokens(static_cast<int>(in.ids.size() / spec.top_k)) {
    const size_t rows = std::max<size_t>(tokens, 1);
    MEGAMOE_CUDA_CHECK(cudaMalloc(&x, rows * spec.hidden * 2));
    MEGAMOE_CUDA_CHECK(cudaMalloc(&y, rows * spec.hidden * 2));
    MEGAMOE_CUDA_CHECK(cudaMalloc(&ids, rows * spec.top_k * 4));
    MEGAMOE_CUDA_CHECK(cudaMalloc(&w, rows * spec.top_k * 4));
    MEGAMOE_CUDA_CHECK(cudaMemcpy(x, in.x.data(), in.x.size() * 2, cudaMemcpyHostToDevice));
    MEGAMOE_CUDA_CHECK(cudaMemcpy(ids, in.ids.data(), in.ids.size() * 4, cudaMemcpyHostToDevice));
    MEGAMOE_CUDA_CHECK(cudaMemcpy(w, in.weights.data(), in.weights.size() * 4, cudaMemcpyHostToDevice));
    MEGAMOE_CUDA_CHECK(cudaMemset(y, 0xFF, rows * spec.hidden * 2));
  }
  ~DeviceCall() {
    for (void* p : {x, y, ids, w}) cudaFree(p);
  }
  DeviceCall(const DeviceCall&) = delete;
  DeviceCall& operator=(const DeviceCall&) = delete;
  MoeInputs inputs() const { return MoeInputs{tokens, x, nullptr, static_cast<int32_t*>(ids), static_cast<float*>(w)}; }
  std::vector<bf16_t> output(const MoeSpec& spec) const {
    std::vector<bf16_t> got(static_cast<size_t>(tokens) * spec.hidden);
    MEGAMOE_CUDA_CHECK(cudaMemcpy(got.data(), y, got.size() * 2, cudaMemcpyDeviceToHost));
    return got;
  }
};

// Relative L2 error of `got` (the call's y) against the fp64 reference of `spec` with `weights`.
double error_against_reference(const MoeSpec& spec, const PackedWeights& weights, const RankInputs& in,
                               const std::vector<bf16_t>& got) {
  const int tokens = static_cast<int>(in.ids.size() / spec.top_k);
  std::vector<bf16_t> want(got.size());
  const ref::ReferenceReport report = ref::reference_forward(
      spec, weights, MoeInputs{tokens, in.x.data(), nullptr, in.ids.data(), in.weights.data()}, MoeOutputs{want.data()});
  std::vector<double> device(got.size());
  for (size_t i = 0; i < got.size(); ++i) device[i] = got[i].to_float();
  return ref::relative_l2(device, report.y);
}

// Rank 0 of --hang or --die, whose peer never calls forward: what the caller sees after the
// barrier gives up.
int lost_peer_case(const MoeSpec& spec, const MoeSpec& local, const PackedWeights& mine, comm::EpLayer& layer,
                   const comm::FileRendezvous& rendezvous, cudaStream_t stream, bool peer_died) {
  const RankInputs in = make_inputs(spec, 0, 1, 16);
  const DeviceCall call(spec, in);
  layer.forward(stream, call.inputs(), MoeOutputs{call.y});
  std::string reported;
  try {
    layer.check_peers(stream);
  } catch (const Error& e) {
    if (e.code() != ErrorCode::timeout) throw;
    reported = e.what();
  }
  std::printf("rank 0: check_peers: %s\n", reported.empty() ? "(no error)" : reported.c_str());
  if (reported.find("rank 1 had arrived 0 times") == std::string::npos) return 1;
  long finite = 0;
  for (const bf16_t& v : call.output(spec)) finite += std::isfinite(v.to_float());
  if (finite != 0) {
    std::fprintf(stderr, "rank 0: %ld outputs are finite after the lost peer; all must be NaN\n", finite);
    return 1;
  }
  try {
    layer.forward(stream, call.inputs(), MoeOutputs{call.y});
    std::fprintf(stderr, "rank 0: a forward after the lost peer did not throw\n");
    return 1;
  } catch (const Error& e) {
    if (e.code() != ErrorCode::timeout) throw;
  }
  // The process and its CUDA context: a single-GPU layer of this rank's experts, against the
  // reference with the same experts.
  MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
  const RankInputs own = make_inputs(local, 0, 2, 16);  // ids among this rank's experts
  MoeLayer single(local, mine, 16);
  const DeviceCall check(local, own);
  single.forward(stream, check.inputs(), MoeOutputs{check.y});
  MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  const double err = error_against_reference(local, mine, own, check.output(local));
  if (!(err < 3e-2)) {
    std::fprintf(stderr, "rank 0: the single-GPU layer after the lost peer is off by %.3e\n", err);
    return 1;
  }
  if (!peer_died) rendezvous.barrier("hang-test-done", std::chrono::seconds(120));
  std::printf("rank 0 ok after the %s peer: error reported, y NaN, later calls refused, single-GPU layer rel. L2 %.3e\n",
              peer_died ? "dead" : "stalled", err);
  return 0;
}

int run(int argc, char** argv) {
  int iterations = 20, max_tokens = 64;
  bool hang = false, die = false, ue8m0 = false;
  std::chrono::milliseconds barrier_timeout = comm::kDefaultBarrierTimeout;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--iterations" && i + 1 < argc) iterations = std::atoi(argv[++i]);
    else if (arg == "--tokens" && i + 1 < argc) max_tokens = std::atoi(argv[++i]);
    else if (arg == "--hang") hang = true;
    else if (arg == "--ue8m0") ue8m0 = true;  // power-of-two activation scales, on the wire too
    else if (arg == "--die") hang = die = true;
    else if (arg == "--barrier-timeout-ms" && i + 1 < argc) barrier_timeout = std::chrono::milliseconds(std::atoi(argv[++i]));
    else throw Error(ErrorCode::invalid_argument, "unknown argument " + arg);
  }
  const auto rendezvous = comm::FileRendezvous::from_environment();
  const int rank = rendezvous.rank(), world = rendezvous.world_size();
  const char* local_rank = std::getenv("LOCAL_RANK");
  int devices = 0;
  MEGAMOE_CUDA_CHECK(cudaGetDeviceCount(&devices));
  MEGAMOE_CUDA_CHECK(cudaSetDevice((local_rank ? std::atoi(local_rank) : rank) % devices));

  MoeSpec spec;
  spec.num_experts = 16;
  spec.top_k = 4;
  spec.hidden = 256;
  spec.intermediate = 256;
  spec.precision = Precision::fp8_block;
  spec.scale_format = ue8m0 ? ScaleFormat::ue8m0 : ScaleFormat::fp32;
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
  comm::EpLayerOptions options;
  options.barrier_timeout = barrier_timeout;
  comm::EpLayer layer(spec, mine, max_tokens, rendezvous, options);
  if (layer.token_rows() != comm::EpTokenRows::fp8) {
    std::fprintf(stderr, "rank %d: an fp8_block layer sends %s token rows; automatic must mean fp8\n", rank,
                 comm::to_string(layer.token_rows()));
    return 1;
  }
  cudaStream_t stream;
  MEGAMOE_CUDA_CHECK(cudaStreamCreate(&stream));
  if (hang && rank == 1) {
    std::printf("rank 1 skips forward on purpose%s\n", die ? " and exits without cleaning up" : "");
    std::fflush(stdout);
    if (die) std::_Exit(0);
    rendezvous.barrier("hang-test-done", std::chrono::seconds(120));
    return 0;
  }
  if (hang) return lost_peer_case(spec, local, mine, layer, rendezvous, stream, die);
  // The same layer sending bf16 rows (built after the lost-peer cases, whose dead peer would never
  // close a second buffer).
  options.token_rows = comm::EpTokenRows::bf16;
  options.buffer_name = "ep-bf16-rows";
  comm::EpLayer bf16_rows(spec, mine, max_tokens, rendezvous, options);

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
    const DeviceCall call(spec, in);
    const DeviceCall call_bf16_rows(spec, in);
    bf16_rows.forward(stream, call_bf16_rows.inputs(), MoeOutputs{call_bf16_rows.y});
    layer.forward(stream, call.inputs(), MoeOutputs{call.y});

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
    // Combine: this rank's outputs against the single-GPU fp64 reference with all experts, and the
    // bf16 rows' bit for bit.
    const std::vector<bf16_t> y_fp8_rows = call.output(spec), y_bf16_rows = call_bf16_rows.output(spec);
    if (std::memcmp(y_fp8_rows.data(), y_bf16_rows.data(), y_fp8_rows.size() * sizeof(bf16_t)) != 0) {
      std::fprintf(stderr, "iteration %d: rank %d y with FP8 token rows differs from y with bf16 rows\n", it, rank);
      return 1;
    }
    if (T > 0) {
      const double err = error_against_reference(spec, all, in, call.output(spec));
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
      const std::vector<bf16_t> eager = call.output(spec);
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      MEGAMOE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
      layer.forward(stream, call.inputs(), MoeOutputs{call.y});
      MEGAMOE_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
      MEGAMOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
      for (int replay = 0; replay < 2; ++replay) {
        MEGAMOE_CUDA_CHECK(cudaMemsetAsync(call.y, 0xFF, eager.size() * 2, stream));
        MEGAMOE_CUDA_CHECK(cudaGraphLaunch(exec, stream));
        MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
        const std::vector<bf16_t> replayed = call.output(spec);
        if (std::memcmp(eager.data(), replayed.data(), eager.size() * 2) != 0) {
          std::fprintf(stderr, "iteration %d: rank %d graph replay %d differs from the eager forward\n", it, rank, replay);
          return 1;
        }
      }
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
    }
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
