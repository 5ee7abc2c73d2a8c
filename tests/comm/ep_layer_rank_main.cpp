// One rank of the expert-parallel test, started by megamoe-run, one GPU per rank or (megamoe-run
// --one-gpu) every rank on one GPU (rank r takes visible device r mod count):
//   ep_layer_rank [--iterations N] [--tokens T] [--hidden H] [--ue8m0]
//                 [--precision bf16|fp8_block|fp8_tensor [--dynamic-scales]] [--fused]
//                 [--symmetric-memory cuda_ipc|nvshmem] [--hang | --die [--fp8-partials | --fc2-stores]]
//                 [--barrier-timeout-ms MS] [--progress]
// Every iteration draws fresh routing on every rank (uniform, skewed onto few experts, with -1
// holes and some ranks empty), runs EpLayer::forward, checks that dispatch delivered exactly the
// token rows ref::plan_dispatch predicts (row by row, with each slot's local expert), that y
// matches the fp64 reference for this rank's tokens, and that the layer's FP8 token rows (the
// default for fp8_block) give the same y, bit for bit, as a second layer sending bf16 rows, and that
// a third layer returning FP8 partial sums stays within a bound of the first's y (its error is
// printed). --hang: rank 1 stalls (never calls forward),
// so rank 0's barrier must give up after its timeout with a diagnostic instead of hanging, and
// rank 0 then checks what a caller sees: check_peers throws a timeout error naming rank 1, y is
// NaN, the next forward throws at once, and the process still runs a single-GPU layer correctly.
// --die: the same with rank 1's process gone (it exits without cleaning up after building the
// layer) instead of stalled; with --fp8-partials the layer under test returns FP8 partial sums, with
// --fc2-stores (and --fused) its FC2 stores each expert row into the token's source.
// Before any layer, every run checks the refusals a caller can meet: symmetric buffers whose sizes
// differ between ranks, and EpLayer::forward given x_scales.
// --hidden: the model width (default 256; 384 and 7168 reach the source's FP8 quantizer with a
// part-filled and a second pass over the row). --symmetric-memory: where the buffers live.
// --precision: the layer's (default fp8_block); bf16 and fp8_tensor layers send bf16 rows, which an
// fp8_tensor owner encodes with its own activation scale: static ones calibrated for the whole
// layer (every rank's the same here, so the reference quantizes alike), or with --dynamic-scales
// each owner's amax over the rows it received, so that y is checked against the owners' passes
// (ref::owner_passes_forward) instead of the single-GPU reference. --fused: the layer under test
// runs its forward as one launch (EpLayerOptions::fused), so every check above applies to it and its
// y must equal the staged bf16-rows layer's bit for bit; it refuses the staged phases; with --hang
// or --die its own waits must end in the diagnostic; the FP8 partial sums' layer is fused too,
// its y required to equal a staged FP8 partial sums layer's bit for bit; and a fourth layer, fused
// with EpCombine::fc2_stores (FC2 stores every expert row into its source, which sums them), must
// give the single-GPU layer's y (all experts on this rank) bit for bit, in every iteration and
// graph replay. Combinations of the options that are refused are refused before any collective step.
// --progress: each forward of an iteration synchronized and named on stderr as it returns (where a
// run stops).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>

#include "comm/ep_layer.hpp"
#include "comm/symmetric_memory.hpp"
#include "kernels/cuda_check.hpp"
#include "megamoe/error.hpp"
#include "megamoe/options.hpp"
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

// bf16 outputs as the doubles ref::relative_l2 compares.
std::vector<double> widened(const std::vector<bf16_t>& values) {
  std::vector<double> wide(values.size());
  for (size_t i = 0; i < values.size(); ++i) wide[i] = values[i].to_float();
  return wide;
}

// Relative L2 error of `got` (the call's y) against the fp64 reference of `spec` with `weights`.
double error_against_reference(const MoeSpec& spec, const PackedWeights& weights, const RankInputs& in,
                               const std::vector<bf16_t>& got) {
  const int tokens = static_cast<int>(in.ids.size() / spec.top_k);
  std::vector<bf16_t> want(got.size());
  const ref::ReferenceReport report = ref::reference_forward(
      spec, weights, MoeInputs{tokens, in.x.data(), nullptr, in.ids.data(), in.weights.data()}, MoeOutputs{want.data()});
  return ref::relative_l2(widened(got), report.y);
}

// The same for the owners' passes (ref::owner_passes_forward): each owner's layer of `local` experts
// (shares[o]) over the rows the plan says it received, as every rank can rebuild from `everyone`.
double error_against_owner_passes(const MoeSpec& local, const std::vector<PackedWeights>& shares,
                                  const ref::DispatchPlan& plan, const std::vector<RankInputs>& everyone, int rank,
                                  const std::vector<bf16_t>& got) {
  std::vector<const PackedWeights*> owners;
  std::vector<ref::SourceCall> sources;
  for (size_t r = 0; r < everyone.size(); ++r) {
    owners.push_back(&shares[r]);
    sources.push_back({static_cast<int>(everyone[r].ids.size() / local.top_k), everyone[r].x.data(),
                       everyone[r].weights.data()});
  }
  return ref::relative_l2(widened(got), ref::owner_passes_forward(local, owners, plan, sources, rank));
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

// Whether building a symmetric buffer throws on this rank with an error `named` accepts (printing
// what went wrong where it does not).
template <class Named>
bool buffer_refused(const comm::FileRendezvous& rendezvous, const char* what, const char* name, size_t bytes,
                    comm::SymmetricBackend backend, Named named, const std::string& layout = "") {
  try {
    comm::SymmetricMemory odd(rendezvous, name, bytes, std::chrono::seconds(30), backend, layout);
    std::fprintf(stderr, "FAILED: rank %d built a symmetric buffer whose %s differs from its peers'\n",
                 rendezvous.rank(), what);
    return false;
  } catch (const Error& e) {
    if (named(e)) return true;
    std::fprintf(stderr, "FAILED: rank %d: a differing %s refused with the wrong error: %s\n", rendezvous.rank(), what,
                 e.what());
    return false;
  }
}

// The refusals, collective: each rank asks for a buffer of another size than its peers (every rank
// must refuse, naming the sizes), then for one of the same size laid out otherwise (as two fused
// layers of different combines with world == top_k: every rank must refuse, naming the layouts),
// then for a buffer on another backend than its neighbours' (every rank must refuse: the backends
// differ, or the build has no NVSHMEM for the ranks that ask for it), then gives its layer
// x_scales, which expert parallelism does not take. Buffers that differ need two ranks.
bool refusals_hold(const comm::FileRendezvous& rendezvous, comm::SymmetricBackend backend, comm::EpLayer& layer,
                   const MoeSpec& spec, cudaStream_t stream) {
  const int rank = rendezvous.rank();
  if (rendezvous.world_size() > 1) {
    const bool sizes = buffer_refused(rendezvous, "size", "sizes-differ", 4096 + 256 * static_cast<size_t>(rank),
                                      backend, [](const Error& e) {
                                        return e.code() == ErrorCode::invalid_argument &&
                                               std::string(e.what()).find("bytes where rank") != std::string::npos;
                                      });
    const bool layouts = buffer_refused(
        rendezvous, "layout", "layouts-differ", 4096, backend,
        [](const Error& e) {
          return e.code() == ErrorCode::invalid_argument &&
                 std::string(e.what()).find("lays its buffer out as") != std::string::npos;
        },
        rank % 2 == 0 ? "fused layer, combine=owner_sums" : "fused layer, combine=fc2_stores");
    const comm::SymmetricBackend mixed =
        rank % 2 == 0 ? comm::SymmetricBackend::cuda_ipc : comm::SymmetricBackend::nvshmem;
    const bool backends = buffer_refused(rendezvous, "backend", "backends-differ", 4096, mixed, [](const Error& e) {
      const std::string what = e.what();
      return (e.code() == ErrorCode::invalid_argument && what.find("uses backend") != std::string::npos) ||
             (e.code() == ErrorCode::unsupported && what.find("has no NVSHMEM") != std::string::npos);
    });
    if (!sizes || !layouts || !backends) return false;
  }
  RankInputs in = make_inputs(spec, rank, 0, 4);
  const DeviceCall call(spec, in);
  MoeInputs inputs = call.inputs();
  float* scales = nullptr;  // a valid layout for MoeLayer: [H / 128][T]
  MEGAMOE_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&scales), sizeof(float) * (spec.hidden / 128) * std::max(call.tokens, 1)));
  inputs.x_scales = scales;
  try {
    layer.forward(stream, inputs, MoeOutputs{call.y});
    cudaFree(scales);
    std::fprintf(stderr, "FAILED: rank %d: EpLayer::forward took x_scales\n", rank);
    return false;
  } catch (const Error& e) {
    cudaFree(scales);
    if (e.code() != ErrorCode::unsupported || std::string(e.what()).find("x_scales is for MoeLayer") == std::string::npos) {
      std::fprintf(stderr, "FAILED: rank %d: x_scales refused with an error that does not name them: %s\n", rank,
                   e.what());
      return false;
    }
  }
  if (layer.fused()) {  // one launch: the staged phases are not there to call
    try {
      layer.dispatch(stream, call.inputs());
      std::fprintf(stderr, "FAILED: rank %d: a fused layer took a staged dispatch\n", rank);
      return false;
    } catch (const Error& e) {
      if (e.code() != ErrorCode::unsupported || std::string(e.what()).find("staged layer's") == std::string::npos) {
        std::fprintf(stderr, "FAILED: rank %d: a staged phase refused with the wrong error: %s\n", rank, e.what());
        return false;
      }
    }
  }
  return true;
}

// The option combinations EpLayer refuses, each before any collective step (so every rank may try
// them alone): more tokens a rank than the ranks together may hold, an EpCombine value that names
// none, fc2_stores without fused, fc2_stores with FP8 partial sums, and an fp8_tensor layer fused
// (refused so whatever its combine, before the fused checks the other rows name).
bool combinations_refused(const MoeSpec& spec, const PackedWeights& mine, int max_tokens,
                          const comm::FileRendezvous& rendezvous) {
  struct Refusal {
    comm::EpCombine combine;
    bool fused;
    comm::EpPartialSums partial_sums;
    bool fp8_tensor_only;  // the row of an fp8_tensor layer (whose fused rows it refuses first)
    ErrorCode code;
    const char* named;  // what the message must say
  };
  const Refusal refusals[] = {
      {static_cast<comm::EpCombine>(7), false, comm::EpPartialSums::bf16, false, ErrorCode::invalid_argument,
       "names no EpCombine value"},
      {comm::EpCombine::fc2_stores, false, comm::EpPartialSums::bf16, false, ErrorCode::unsupported,
       "set fused=true"},
      {comm::EpCombine::fc2_stores, true, comm::EpPartialSums::fp8, false, ErrorCode::unsupported,
       "partial_sums=fp8 is for combine=owner_sums"},
      {comm::EpCombine::owner_sums, true, comm::EpPartialSums::bf16, true, ErrorCode::unsupported, "fp8_tensor"},
  };
  // Whether a layer of `tokens` a rank with `options` is refused with `code`, saying `named`.
  const auto refused = [&](int tokens, const comm::EpLayerOptions& options, ErrorCode code, const char* named) {
    try {
      comm::EpLayer layer(spec, mine, tokens, rendezvous, options);
      std::fprintf(stderr, "FAILED: rank %d: a layer was built that must be refused (%s)\n", rendezvous.rank(),
                   named);
      return false;
    } catch (const Error& e) {
      if (e.code() != code || std::string(e.what()).find(named) == std::string::npos) {
        std::fprintf(stderr, "FAILED: rank %d: refused without saying \"%s\": %s\n", rendezvous.rank(), named,
                     e.what());
        return false;
      }
      return true;
    }
  };
  // Every rank's tokens past the single-GPU layer's limit, which the local pass runs over.
  if (rendezvous.world_size() > 1 && !refused(static_cast<int>(kMaxLayerTokens), comm::EpLayerOptions{},
                                              ErrorCode::invalid_argument, "ranks' tokens together")) {
    return false;
  }
  const bool fp8_tensor = spec.precision == Precision::fp8_tensor;
  for (const Refusal& r : refusals) {
    if (r.fp8_tensor_only ? !fp8_tensor : r.fused && fp8_tensor) continue;
    comm::EpLayerOptions options;
    options.combine = r.combine;
    options.fused = r.fused;
    options.partial_sums = r.partial_sums;
    options.buffer_name = "ep-refused";
    if (!refused(max_tokens, options, r.code, r.named)) return false;
  }
  return true;
}

int run(int argc, char** argv) {
  int iterations = 20, max_tokens = 64, hidden = 256;
  comm::SymmetricBackend backend = comm::SymmetricBackend::cuda_ipc;
  bool hang = false, die = false, ue8m0 = false, fused = false, fp8_partials_under_test = false,
       fc2_stores_under_test = false, progress = false;
  Precision precision = Precision::fp8_block;
  InputScales input_scales = InputScales::from_checkpoint;
  std::chrono::milliseconds barrier_timeout = comm::kDefaultBarrierTimeout;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--iterations" && i + 1 < argc) iterations = std::atoi(argv[++i]);
    else if (arg == "--tokens" && i + 1 < argc) max_tokens = std::atoi(argv[++i]);
    else if (arg == "--hidden" && i + 1 < argc) hidden = std::atoi(argv[++i]);
    else if (arg == "--symmetric-memory" && i + 1 < argc) {
      const std::string name = argv[++i];
      if (name == "cuda_ipc") backend = comm::SymmetricBackend::cuda_ipc;
      else if (name == "nvshmem") backend = comm::SymmetricBackend::nvshmem;
      else throw Error(ErrorCode::invalid_argument, "--symmetric-memory takes cuda_ipc or nvshmem, not " + name);
    }
    else if (arg == "--hang") hang = true;
    else if (arg == "--ue8m0") ue8m0 = true;  // power-of-two activation scales, on the wire too
    else if (arg == "--precision" && i + 1 < argc) {
      const std::string name = argv[++i];
      if (name == "bf16") precision = Precision::bf16;
      else if (name == "fp8_block") precision = Precision::fp8_block;
      else if (name == "fp8_tensor") precision = Precision::fp8_tensor;
      else throw Error(ErrorCode::invalid_argument, "--precision takes bf16, fp8_block or fp8_tensor, not " + name);
    }
    else if (arg == "--dynamic-scales") input_scales = InputScales::dynamic;
    else if (arg == "--fused") fused = true;
    else if (arg == "--fp8-partials") fp8_partials_under_test = true;
    else if (arg == "--fc2-stores") fc2_stores_under_test = true;
    else if (arg == "--progress") progress = true;
    else if (arg == "--die") hang = die = true;
    else if (arg == "--barrier-timeout-ms" && i + 1 < argc) barrier_timeout = std::chrono::milliseconds(std::atoi(argv[++i]));
    else throw Error(ErrorCode::invalid_argument, "unknown argument " + arg);
  }
  if (input_scales == InputScales::dynamic && precision != Precision::fp8_tensor) {
    throw Error(ErrorCode::invalid_argument, "--dynamic-scales is for --precision fp8_tensor");
  }
  if (fp8_partials_under_test && !hang) {
    throw Error(ErrorCode::invalid_argument, "--fp8-partials is for the lost-peer cases (--hang or --die): the "
                                             "other runs compare FP8 partial sums with bf16 ones themselves");
  }
  if (fc2_stores_under_test && !(hang && fused)) {
    throw Error(ErrorCode::invalid_argument, "--fc2-stores is for the fused lost-peer cases (--fused with --hang or "
                                             "--die): the other fused runs compare it with the single-GPU layer");
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
  spec.hidden = hidden;
  spec.intermediate = 256;
  spec.precision = precision;
  spec.scale_format = ue8m0 ? ScaleFormat::ue8m0 : ScaleFormat::fp32;
  spec.routing = Precomputed{};
  // Identical on every rank, fp8_tensor's static activation scales too.
  const ref::RandomWeights weights = ref::make_random_weights(spec, 7, input_scales);
  const PackedWeights all = prepare_weights(spec, weights.view());
  MoeSpec local = spec;
  local.num_experts = spec.num_experts / world;
  // Every rank's share, packed as its owner packs it (with the layer's activation scales, if static).
  const std::vector<PackedWeights> shares = weights.pack_rank_shares(spec, world);
  const PackedWeights& mine = shares[rank];
  comm::EpLayerOptions options;
  options.barrier_timeout = barrier_timeout;
  options.symmetric_memory = backend;
  options.fused = fused;
  if (fp8_partials_under_test) options.partial_sums = comm::EpPartialSums::fp8;
  if (fc2_stores_under_test) options.combine = comm::EpCombine::fc2_stores;
  if (!combinations_refused(spec, mine, max_tokens, rendezvous)) return 1;
  comm::EpLayer layer(spec, mine, max_tokens, rendezvous, options);
  if (layer.combine() != options.combine) {
    std::fprintf(stderr, "FAILED: rank %d: a layer asked to combine by %s combines by %s\n", rank,
                 comm::to_string(options.combine), comm::to_string(layer.combine()));
    return 1;
  }
  options.combine = comm::EpCombine::owner_sums;
  options.fused = false;  // the layers it is compared with are staged
  options.partial_sums = comm::EpPartialSums::bf16;
  if (layer.symmetric_memory() != backend) {
    std::fprintf(stderr, "FAILED: rank %d: the layer's buffer is on %s, not the %s asked for\n", rank,
                 comm::to_string(layer.symmetric_memory()), comm::to_string(backend));
    return 1;
  }
  const comm::EpTokenRows automatic_rows =
      precision == Precision::fp8_block ? comm::EpTokenRows::fp8 : comm::EpTokenRows::bf16;
  if (layer.token_rows() != automatic_rows || layer.fused() != fused) {
    std::fprintf(stderr, "FAILED: rank %d: a %s layer sends %s token rows (automatic must mean %s), fused %d\n", rank,
                 to_string(spec.precision), comm::to_string(layer.token_rows()), comm::to_string(automatic_rows),
                 layer.fused());
    return 1;
  }
  cudaStream_t stream;
  MEGAMOE_CUDA_CHECK(cudaStreamCreate(&stream));
  if (!hang && !refusals_hold(rendezvous, backend, layer, spec, stream)) return 1;
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
  options.token_rows = comm::EpTokenRows::automatic;
  options.partial_sums = comm::EpPartialSums::fp8;
  options.buffer_name = "ep-fp8-partials";
  options.fused = fused;
  comm::EpLayer fp8_partials(spec, mine, max_tokens, rendezvous, options);
  std::unique_ptr<comm::EpLayer> fp8_partials_staged;  // with --fused: what fp8_partials must equal
  // With --fused: FC2 storing into the sources, and what it must equal, the single-GPU layer.
  std::unique_ptr<comm::EpLayer> fc2_stores;
  std::unique_ptr<MoeLayer> single_gpu;
  if (fused) {
    options.fused = false;
    options.buffer_name = "ep-fp8-partials-staged";
    fp8_partials_staged = std::make_unique<comm::EpLayer>(spec, mine, max_tokens, rendezvous, options);
    options.fused = true;
    options.partial_sums = comm::EpPartialSums::bf16;
    options.combine = comm::EpCombine::fc2_stores;
    options.buffer_name = "ep-fc2-stores";
    fc2_stores = std::make_unique<comm::EpLayer>(spec, mine, max_tokens, rendezvous, options);
    single_gpu = std::make_unique<MoeLayer>(spec, all, max_tokens);
  }
  if (fp8_partials.partial_sums() != comm::EpPartialSums::fp8) {
    std::fprintf(stderr, "FAILED: rank %d: a layer asked for FP8 partial sums sends %s ones\n", rank,
                 comm::to_string(fp8_partials.partial_sums()));
    return 1;
  }
  if (progress) std::fprintf(stderr, "rank %d: every layer built\n", rank);
  double worst_fp8_partials = 0.0;  // rel. L2 of y with FP8 partial sums against y with bf16 ones
  bool fp8_partials_differ = false;

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
    const DeviceCall call_fp8_partials(spec, in);
    const DeviceCall call_fp8_partials_staged(spec, in);
    const DeviceCall call_fc2_stores(spec, in);
    const DeviceCall call_single_gpu(spec, in);
    // The staged layer's delivery is read right after its forward: once this rank has run a later
    // layer's forward, a peer may start its next iteration, whose first forward (bf16_rows)
    // rewrites the counts here before its first barrier (compute-sanitizer's slowdown showed it
    // with --fused, where bf16_rows is the staged layer read).
    comm::EpLayer::Delivered delivered;
    const auto returned = [&](const char* what) {
      if (!progress) return;
      MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
      std::fprintf(stderr, "rank %d iteration %d (%d tokens): %s returned\n", rank, it, T, what);
    };
    bf16_rows.forward(stream, call_bf16_rows.inputs(), MoeOutputs{call_bf16_rows.y});
    returned("the staged layer with bf16 rows");
    if (fused) delivered = bf16_rows.last_delivered(stream);
    fp8_partials.forward(stream, call_fp8_partials.inputs(), MoeOutputs{call_fp8_partials.y});
    returned("the layer with FP8 partial sums");
    if (fp8_partials_staged) {
      fp8_partials_staged->forward(stream, call_fp8_partials_staged.inputs(), MoeOutputs{call_fp8_partials_staged.y});
      returned("the staged layer with FP8 partial sums");
    }
    layer.forward(stream, call.inputs(), MoeOutputs{call.y});
    returned("the layer under test");
    if (!fused) delivered = layer.last_delivered(stream);
    if (fc2_stores) {
      fc2_stores->forward(stream, call_fc2_stores.inputs(), MoeOutputs{call_fc2_stores.y});
      returned("the layer whose FC2 stores into the sources");
      if (T > 0) single_gpu->forward(stream, call_single_gpu.inputs(), MoeOutputs{call_single_gpu.y});
    }

    // Dispatch: exactly the rows the CPU model predicts, in canonical order, with each slot's
    // local expert (the staged layer's; a fused one's delivery is checked by its y below).
    const ref::DispatchPlan plan = ref::plan_dispatch(ref::EpTopology{world, spec.num_experts}, spec.top_k, routing);
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
    // bf16 rows' (staged) bit for bit.
    const std::vector<bf16_t> y_under_test = call.output(spec), y_bf16_rows = call_bf16_rows.output(spec);
    if (std::memcmp(y_under_test.data(), y_bf16_rows.data(), y_under_test.size() * sizeof(bf16_t)) != 0) {
      std::fprintf(stderr,
                   "FAILED: iteration %d: rank %d y of the layer under test (%s rows%s) differs from the staged "
                   "layer's with bf16 rows\n",
                   it, rank, comm::to_string(layer.token_rows()), fused ? ", fused" : "");
      return 1;
    }
    if (fc2_stores && T > 0) {
      const std::vector<bf16_t> y_fc2_stores = call_fc2_stores.output(spec), y_single = call_single_gpu.output(spec);
      if (std::memcmp(y_fc2_stores.data(), y_single.data(), y_single.size() * sizeof(bf16_t)) != 0) {
        std::fprintf(stderr, "FAILED: iteration %d: rank %d y of the fused layer whose FC2 stores into the sources "
                             "differs from the single-GPU layer's\n", it, rank);
        return 1;
      }
    }
    if (T > 0) {
      // FP8 partial sums: each remote owner's partial sum re-rounded to E4M3 (3 mantissa bits) per
      // 128 channels, about 3.6% RMS of that share; the source's own share stays bf16.
      const std::vector<bf16_t> y_fp8_partials = call_fp8_partials.output(spec);
      if (fp8_partials_staged) {
        const std::vector<bf16_t> y_staged = call_fp8_partials_staged.output(spec);
        if (std::memcmp(y_fp8_partials.data(), y_staged.data(), y_staged.size() * sizeof(bf16_t)) != 0) {
          std::fprintf(stderr, "FAILED: iteration %d: rank %d y of the fused layer with FP8 partial sums differs from "
                               "the staged one's\n", it, rank);
          return 1;
        }
      }
      const double partials_err = ref::relative_l2(widened(y_fp8_partials), widened(y_under_test));
      worst_fp8_partials = std::max(worst_fp8_partials, partials_err);
      fp8_partials_differ = fp8_partials_differ || partials_err > 0.0;
      if (!(partials_err < 5e-2)) {
        std::fprintf(stderr, "iteration %d: rank %d y with FP8 partial sums is %.3e (rel. L2) from y with bf16 ones\n",
                     it, rank, partials_err);
        return 1;
      }
      // With dynamic scales each owner encodes with its own amax: the reference is the owners' passes.
      const double err = input_scales == InputScales::dynamic
                             ? error_against_owner_passes(local, shares, plan, everyone, rank, call.output(spec))
                             : error_against_reference(spec, all, in, call.output(spec));
      worst = std::max(worst, err);
      // fp8 requantization noise (see tests/api/test_moe_layer.cpp) plus the bf16 rounding of
      // each rank's partial sum before the sum over ranks; fp8_tensor's longer tail
      // (docs/decisions.md#fp8-tensor-error-bound).
      const double bound = precision == Precision::fp8_tensor ? 4e-2 : 3e-2;
      if (!(err < bound)) {
        std::fprintf(stderr, "iteration %d: rank %d rel. L2 error %.3e against the reference (bound %.0e)\n", it, rank,
                     err, bound);
        return 1;
      }
    }
    // Now and then the same forwards captured in CUDA graphs and replayed twice each: the barrier
    // counts live on the device, so replays synchronize like fresh calls and give the same bits.
    auto replays_match = [&](comm::EpLayer& ep, const DeviceCall& c, const char* what) {
      const std::vector<bf16_t> eager = c.output(spec);
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      MEGAMOE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
      ep.forward(stream, c.inputs(), MoeOutputs{c.y});
      MEGAMOE_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
      MEGAMOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
      bool same = true;
      for (int replay = 0; replay < 2 && same; ++replay) {
        MEGAMOE_CUDA_CHECK(cudaMemsetAsync(c.y, 0xFF, eager.size() * 2, stream));
        MEGAMOE_CUDA_CHECK(cudaGraphLaunch(exec, stream));
        MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
        const std::vector<bf16_t> replayed = c.output(spec);
        same = std::memcmp(eager.data(), replayed.data(), eager.size() * 2) == 0;
        if (!same) {
          std::fprintf(stderr, "iteration %d: rank %d %s: graph replay %d differs from the eager forward\n", it, rank,
                       what, replay);
        }
      }
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
      return same;
    };
    if (it % 100 == 6) {  // on every rank alike, or the barriers would not pair up
      if (!replays_match(layer, call, "the layer") || !replays_match(fp8_partials, call_fp8_partials, "FP8 partial sums")) {
        return 1;
      }
      if (fc2_stores && !replays_match(*fc2_stores, call_fc2_stores, "FC2 storing into the sources")) return 1;
    }
  }
  // With one rank every partial sum is the source's own (bf16): nothing to tell apart.
  if (world > 1 && iterations >= 4 && !fp8_partials_differ) {
    std::fprintf(stderr, "FAILED: rank %d: FP8 partial sums gave bf16's bits in every iteration (not taken?)\n", rank);
    return 1;
  }
  std::printf("rank %d ok (%s): %d iterations, worst rel. L2 error %.3e; FP8 partial sums within %.3e of bf16 ones%s\n",
              rank, comm::to_string(backend), iterations, worst, worst_fp8_partials,
              fc2_stores ? "; FC2 storing into the sources gave the single-GPU layer's y" : "");
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
