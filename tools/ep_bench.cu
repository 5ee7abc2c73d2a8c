// megamoe-ep-bench: expert parallelism across the GPUs of one node, one process per rank:
//   megamoe-run -n 2 [--one-gpu] -- megamoe-ep-bench [--workload dsv3] [--tokens 128,4096]
//                                        [--precision fp8_block|bf16|fp8_tensor]
//                                        [--token-rows automatic|bf16|fp8]
//                                        [--partial-sums bf16|fp8] [--symmetric-memory cuda_ipc|nvshmem]
//                                        [--fused] [--json PATH] [--timeline]
// Measures, per token count per rank: dispatch and combine time and their NVLink GB/s (rows that
// cross to another rank: token rows of H x 2 bytes, or H + H / 32 as FP8 with their scales, and
// partial sums back the same way, by --partial-sums), the whole staged EP forward, and the staged NCCL
// baseline (all-gather tokens -> local experts over all tokens -> reduce-scatter), each the
// slowest rank's median; and, in the same run, the one-way peer copy bandwidth and the cost of one
// cross-rank barrier. Each timed phase starts after a device barrier, so that no rank's timing
// includes a late peer. The EP output is checked against the baseline's (where it runs). --fused
// also times both fused layers (EpLayerOptions::fused, one launch a rank), each after checking its
// y against the staged layer's as its combine promises: combine=owner_sums bit for bit,
// combine=fc2_stores (the single-GPU layer's sums, not the staged layer's) within a relative L2
// of 1e-2 (not with --partial-sums fp8: FP8 partial sums are owner_sums' only). --timeline also
// prints, per rank, when the first and the last block reached each point of a call
// (layout/ep_timeline.hpp; with --fused the fused layers' too, layout/forward_timeline.hpp), from
// the global timer, median of the timed calls. Where ranks share a GPU (megamoe-run --one-gpu)
// everything but the NCCL baseline runs (NCCL takes one GPU a rank): the figures are of
// time-sliced ranks, not of NVLink, and the header line and the JSON (ranks_share_one_gpu) say so.
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_json.hpp"
#include "bench_stats.hpp"
#include "cli_args.hpp"
#include "comm/ep_layer.hpp"
#include "comm/nvshmem_heap.hpp"
#include "device_timing.hpp"
#include "kernels/cuda_check.hpp"
#include "kernels/layout/ep_timeline.hpp"
#include "kernels/layout/forward_timeline.hpp"
#include "megamoe/error.hpp"
#include "megamoe/options.hpp"
#include "plan/workloads.hpp"
#include "ref/moe_reference.hpp"
#include "ref/random_problem.hpp"
#include "stamp_timeline.hpp"

namespace {

using namespace megamoe;
using namespace std::chrono_literals;
using bench::median;
using bench::StampTimeline;

constexpr int kWarmup = 3;
constexpr int kTimed = 20;
constexpr size_t kPeerCopyBytes = size_t{1} << 30;
// How far (relative L2) a fused layer with combine=fc2_stores may be from the staged layer: the two
// differ by the staged layer's bf16 rounding of each owner's partial sum (~1e-3); a row lost or
// summed twice is far more.
constexpr double kFc2StoresBound = 1e-2;
// Why --fused --partial-sums fp8 times no combine=fc2_stores layer (EpLayer refuses one).
constexpr const char* kFc2StoresNotWithFp8Sums =
    "--partial-sums fp8 is for combine=owner_sums: FC2 stores each expert's bf16 row into its source";

void nccl_check(ncclResult_t result, const char* what) {
  if (result != ncclSuccess) {
    throw Error(ErrorCode::cuda_error, std::string(what) + " failed: " + ncclGetErrorString(result));
  }
}

__global__ void to_local_ids_kernel(const int32_t* global_ids, long count, int first_expert, int local_experts,
                                    int32_t* local_ids) {
  for (long i = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<long>(gridDim.x) * blockDim.x) {
    const int local = global_ids[i] - first_expert;
    local_ids[i] = (global_ids[i] >= 0 && local >= 0 && local < local_experts) ? local : -1;
  }
}

struct Events {
  std::vector<cudaEvent_t> e;
  explicit Events(int n) : e(n) {
    for (cudaEvent_t& x : e) MEGAMOE_CUDA_CHECK(cudaEventCreate(&x));
  }
  ~Events() {
    for (cudaEvent_t& x : e) cudaEventDestroy(x);
  }
  float ms(int a, int b) const {
    float t = 0;
    MEGAMOE_CUDA_CHECK(cudaEventElapsedTime(&t, e[a], e[b]));
    return t;
  }
};

// What the printed lines call a fused layer.
const char* fused_label(comm::EpCombine combine) {
  return combine == comm::EpCombine::fc2_stores ? "fused, FC2 stores" : "fused";
}

// Runs `call` kTimed times with the EP timeline on and prints, for each point, the median time
// from the first block's start (the count launch's; a fused layer's one launch) to the first and
// the last block reaching it.
template <class Call>
void print_timeline(comm::EpLayer& ep, cudaStream_t stream, int rank, int tokens, Call&& call) {
  const bool fused = ep.fused();
  const int events =
      fused ? static_cast<int>(layout::kForwardTimelineEvents) : static_cast<int>(layout::kEpTimelineEvents);
  StampTimeline timeline(events, fused ? layout::kForwardTimelineEventNames : layout::kEpTimelineEventNames);
  ep.set_timeline(timeline.stamps());
  for (int i = 0; i < kTimed; ++i) {
    timeline.preset(stream);
    call();
    timeline.collect(stream, fused ? static_cast<int>(layout::kForwardStart) : static_cast<int>(layout::kCountStart));
  }
  ep.set_timeline(nullptr);
  std::fputs(timeline
                 .lines("timeline rank " + std::to_string(rank) + ", " + std::to_string(tokens) + " tokens" +
                        (fused ? std::string(", ") + fused_label(ep.combine()) + ": " : std::string(": ")))
                 .c_str(),
             stdout);
  std::fflush(stdout);
}

// The largest of every rank's value (the slowest rank decides).
double max_over_ranks(const comm::FileRendezvous& rendezvous, const std::string& key, double value) {
  std::ostringstream text;
  text.precision(17);
  text << value;
  const std::string mine = text.str();
  rendezvous.publish(key + "-rank" + std::to_string(rendezvous.rank()), std::vector<uint8_t>(mine.begin(), mine.end()));
  double worst = value;
  for (int r = 0; r < rendezvous.world_size(); ++r) {
    const std::vector<uint8_t> theirs = rendezvous.wait(key + "-rank" + std::to_string(r), 60000ms);
    worst = std::max(worst, std::stod(std::string(theirs.begin(), theirs.end())));
  }
  return worst;
}

std::vector<bf16_t> download(const bf16_t* device, size_t count) {
  std::vector<bf16_t> host(count);
  MEGAMOE_CUDA_CHECK(cudaMemcpy(host.data(), device, count * sizeof(bf16_t), cudaMemcpyDeviceToHost));
  return host;
}

// ||y - reference|| / ||reference|| in fp64.
double relative_l2(const std::vector<bf16_t>& y, const std::vector<bf16_t>& reference) {
  std::vector<double> a(y.size()), b(reference.size());
  for (size_t i = 0; i < y.size(); ++i) a[i] = y[i].to_float(), b[i] = reference[i].to_float();
  return ref::relative_l2(a, b);
}

struct FusedFigures {
  double forward_ms = 0.0;        // this rank's median forward
  double rel_l2_vs_staged = 0.0;  // of y from the staged layer's (0: bit for bit)
};

// One fused layer at one batch: a forward whose y is checked against the staged layer's as the
// layer's combine promises (owner_sums: bit for bit; fc2_stores: within kFc2StoresBound), then
// timed as the staged forward is (each call after a device barrier), then, with `timeline`, its
// timeline. A failed check throws, on every rank together (each checks its own tokens; a rank
// that threw alone would leave its peers waiting in the next collective step): the figure would not
// be of the same layer. Collective: every rank calls it for the same layers in the same order.
FusedFigures time_fused_layer(comm::EpLayer& fused, cudaStream_t stream, const MoeInputs& inputs,
                              const std::vector<bf16_t>& staged_y, bool timeline,
                              const comm::FileRendezvous& rendezvous) {
  const int tokens = inputs.num_tokens, rank = rendezvous.rank();
  const bench::DeviceBuffer y(staged_y.size() * sizeof(bf16_t));
  const MoeOutputs outputs{y.as<bf16_t>()};
  fused.forward(stream, inputs, outputs);
  fused.check_peers(stream);
  const std::vector<bf16_t> fused_y = download(y.as<bf16_t>(), staged_y.size());
  const std::string where = "rank " + std::to_string(rank) + ", " + std::to_string(tokens) + " tokens: ";
  FusedFigures figures;
  std::string failure;  // this rank's check, empty where it held
  if (fused.combine() == comm::EpCombine::owner_sums) {
    if (std::memcmp(staged_y.data(), fused_y.data(), staged_y.size() * sizeof(bf16_t)) != 0) {
      failure = where + "the fused layer's y differs from the staged layer's";
    }
  } else {
    figures.rel_l2_vs_staged = relative_l2(fused_y, staged_y);
    if (!(figures.rel_l2_vs_staged <= kFc2StoresBound)) {  // NaN fails too
      char message[320];
      std::snprintf(message, sizeof message,
                    "the fused layer with combine=fc2_stores: its y differs from the staged layer's by a "
                    "relative L2 of %.2e, over the %.0e bound (the staged layer's bf16 rounding of each "
                    "owner's partial sum accounts for ~1e-3)",
                    figures.rel_l2_vs_staged, kFc2StoresBound);
      failure = where + message;
    }
  }
  const std::string check_key =
      "T" + std::to_string(tokens) + "-check-" + comm::to_string(fused.combine());
  if (max_over_ranks(rendezvous, check_key, failure.empty() ? 0.0 : 1.0) > 0.0) {
    throw std::runtime_error(failure.empty() ? where + "a peer's " + fused_label(fused.combine()) +
                                                   " layer failed its check of y (its message says how)"
                                             : failure);
  }
  figures.forward_ms = bench::median_ms(
      stream, bench::Replays{kWarmup, kTimed}, [&] { fused.forward(stream, inputs, outputs); },
      [&] { fused.synchronize_ranks(stream); });
  if (timeline) {
    // Each call after a device barrier, as the staged timeline's: a rank's host lag after the
    // previous call's collection is not the peers' wait.
    print_timeline(fused, stream, rank, tokens, [&] {
      fused.synchronize_ranks(stream);
      fused.forward(stream, inputs, outputs);
    });
  }
  return figures;
}

// Whether any two ranks run on the same GPU (megamoe-run --one-gpu), by the devices' PCI bus ids.
bool ranks_share_a_gpu(const comm::FileRendezvous& rendezvous, int device) {
  char bus_id[32] = {};
  MEGAMOE_CUDA_CHECK(cudaDeviceGetPCIBusId(bus_id, sizeof bus_id, device));
  const std::vector<std::vector<uint8_t>> ids =
      rendezvous.exchange("pci-bus-id", std::vector<uint8_t>(bus_id, bus_id + std::strlen(bus_id)), 60000ms);
  std::vector<std::vector<uint8_t>> sorted = ids;
  std::sort(sorted.begin(), sorted.end());
  return std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end();
}

// The staged NCCL baseline, kWarmup + kTimed calls (ms of the timed ones): all-gather x, ids and
// weights of `inputs` -> the local experts (MoeLayer, this rank's share of `spec`'s) over every
// rank's tokens -> reduce-scatter into y_base.
std::vector<float> time_nccl_baseline(ncclComm_t nccl, MoeLayer& experts, const MoeSpec& spec,
                                      const comm::FileRendezvous& ranks, cudaStream_t stream, Events& ev,
                                      const MoeInputs& inputs, bf16_t* y_base) {
  const int tokens = inputs.num_tokens, H = spec.hidden, k = spec.top_k, world = ranks.world_size();
  const int local_experts = spec.num_experts / world;
  bf16_t* x_all = cuda_alloc<bf16_t>(static_cast<size_t>(world) * tokens * H);
  int32_t* ids_all = cuda_alloc<int32_t>(static_cast<size_t>(world) * tokens * k);
  int32_t* local_ids = cuda_alloc<int32_t>(static_cast<size_t>(world) * tokens * k);
  float* w_all = cuda_alloc<float>(static_cast<size_t>(world) * tokens * k);
  bf16_t* y_partial = cuda_alloc<bf16_t>(static_cast<size_t>(world) * tokens * H);
  std::vector<float> times;
  for (int i = 0; i < kWarmup + kTimed; ++i) {
    MEGAMOE_CUDA_CHECK(cudaEventRecord(ev.e[0], stream));
    nccl_check(ncclAllGather(inputs.x, x_all, static_cast<size_t>(tokens) * H, ncclBfloat16, nccl, stream),
               "all-gather x");
    nccl_check(ncclAllGather(inputs.topk_ids, ids_all, static_cast<size_t>(tokens) * k, ncclInt32, nccl, stream),
               "all-gather ids");
    nccl_check(ncclAllGather(inputs.topk_weights, w_all, static_cast<size_t>(tokens) * k, ncclFloat32, nccl, stream),
               "all-gather w");
    to_local_ids_kernel<<<256, 256, 0, stream>>>(ids_all, static_cast<long>(world) * tokens * k,
                                                 ranks.rank() * local_experts, local_experts, local_ids);
    MEGAMOE_CHECK_LAUNCH("to_local_ids_kernel");
    experts.forward(stream, MoeInputs{world * tokens, x_all, nullptr, local_ids, w_all}, MoeOutputs{y_partial});
    nccl_check(
        ncclReduceScatter(y_partial, y_base, static_cast<size_t>(tokens) * H, ncclBfloat16, ncclSum, nccl, stream),
        "reduce-scatter y");
    MEGAMOE_CUDA_CHECK(cudaEventRecord(ev.e[1], stream));
    MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    if (i >= kWarmup) times.push_back(ev.ms(0, 1));
  }
  for (void* p : {static_cast<void*>(x_all), static_cast<void*>(ids_all), static_cast<void*>(local_ids),
                  static_cast<void*>(w_all), static_cast<void*>(y_partial)}) {
    cudaFree(p);
  }
  return times;
}

void print_usage() {
  std::printf(
      "usage: megamoe-run -n RANKS -- megamoe-ep-bench [--workload qwen35-a3b|qwen3-30b-a3b|dsv3|SHAPE]\n"
      "                                                [--tokens N[,N...]]\n"
      "                                                [--precision bf16|fp8_block|fp8_tensor]\n"
      "                                                [--token-rows automatic|bf16|fp8] [--partial-sums bf16|fp8]\n"
      "                                                [--symmetric-memory cuda_ipc|nvshmem] [--fused] [--json PATH]\n"
      "                                                [--timeline]\n"
      "Options take their value as --flag value or --flag=value.\n"
      "  --workload   named workload (default dsv3), or a layer of your own shape, written as\n"
      "               megamoe-bench takes it: experts=E,top_k=K,hidden=H,intermediate=I\n"
      "  --tokens     tokens per rank, comma-separated (default 128,4096)\n"
      "  --precision  bf16, fp8_block (default) or fp8_tensor (static activation scales calibrated per rank;\n"
      "               bf16 rows on the wire; not with --fused)\n"
      "  --token-rows how token rows travel: automatic (fp8 for fp8_block), bf16, or fp8 (quantized once at\n"
      "               their source, the layer's own rule: the same y, half the bytes)\n"
      "  --partial-sums how partial sums travel back: bf16 (default) or fp8 (quantized once by their owner\n"
      "               per 128 channels: half the bytes, not bf16's bits; the table's last column says how far from the baseline)\n"
      "  --symmetric-memory where the expert-parallel buffer lives: cuda_ipc (default) or nvshmem (NVSHMEM's\n"
      "               symmetric heap; a build with MEGAMOE_NVSHMEM)\n"
      "  --fused      also time the fused layers (EpLayerOptions::fused: the forward as one launch) in the same\n"
      "               run: combine=owner_sums after checking its y against the staged layer's bit for bit, and\n"
      "               combine=fc2_stores (FC2 stores each expert's row into its source, the single-GPU layer's\n"
      "               sums) after checking its y within a relative L2 of 1e-2 of the staged layer's (not with\n"
      "               --partial-sums fp8)\n"
      "  --json PATH  rank 0 also writes the measured figures as JSON (one record per token count)\n"
      "  --timeline   also print when each rank's blocks reached each point of a call\n"
      "Ranks sharing one GPU (megamoe-run --one-gpu) skip the NCCL baseline (NCCL takes one GPU a rank).\n");
}

struct Options {
  std::string workload = "dsv3";
  std::vector<int> token_counts = {128, 4096};
  Precision precision = Precision::fp8_block;
  comm::EpTokenRows token_rows = comm::EpTokenRows::automatic;
  comm::EpPartialSums partial_sums = comm::EpPartialSums::bf16;
  comm::SymmetricBackend symmetric_memory = comm::SymmetricBackend::cuda_ipc;
  std::string json_path;
  bool timeline = false;
  bool fused = false;
  bench::Provenance provenance;
};

const std::vector<std::pair<std::string, Precision>> kEpPrecisions = {
    {"bf16", Precision::bf16}, {"fp8_block", Precision::fp8_block}, {"fp8_tensor", Precision::fp8_tensor}};
const std::vector<std::pair<std::string, comm::EpTokenRows>> kTokenRows = {
    {"automatic", comm::EpTokenRows::automatic}, {"bf16", comm::EpTokenRows::bf16}, {"fp8", comm::EpTokenRows::fp8}};
const std::vector<std::pair<std::string, comm::EpPartialSums>> kPartialSums = {{"bf16", comm::EpPartialSums::bf16},
                                                                              {"fp8", comm::EpPartialSums::fp8}};
const std::vector<std::pair<std::string, comm::SymmetricBackend>> kSymmetricBackends = {
    {"cuda_ipc", comm::SymmetricBackend::cuda_ipc}, {"nvshmem", comm::SymmetricBackend::nvshmem}};

Options parse(int argc, char** argv) {
  namespace cli = bench::cli;
  using Value = const std::string&;
  Options o;
  o.provenance = bench::provenance_of_run(argc, argv);
  cli::parse(argc, argv, {
      cli::switch_option("--help", [] {
        print_usage();
        std::exit(0);
      }),
      cli::switch_option("--timeline", [&] { o.timeline = true; }),
      cli::switch_option("--fused", [&] { o.fused = true; }),
      cli::value_option("--workload", [&](Value v) { o.workload = v; }),
      cli::value_option("--tokens",
                        [&](Value v) { o.token_counts = cli::parse_count_list("--tokens", v, kMaxLayerTokens); }),
      cli::value_option("--precision",
                        [&](Value v) { o.precision = cli::parse_choice("--precision", v, kEpPrecisions); }),
      cli::value_option("--token-rows", [&](Value v) { o.token_rows = cli::parse_choice("--token-rows", v, kTokenRows); }),
      cli::value_option("--partial-sums",
                        [&](Value v) { o.partial_sums = cli::parse_choice("--partial-sums", v, kPartialSums); }),
      cli::value_option("--symmetric-memory", [&](Value v) {
        o.symmetric_memory = cli::parse_choice("--symmetric-memory", v, kSymmetricBackends);
      }),
      cli::value_option("--json", [&](Value v) { o.json_path = cli::writable_file("--json", v); }),
  });
  if (o.symmetric_memory == comm::SymmetricBackend::nvshmem && !comm::nvshmem_heap::built()) {
    throw cli::UsageError("--symmetric-memory nvshmem needs a build with NVSHMEM (configure with -DMEGAMOE_NVSHMEM=ON)");
  }
  if (o.token_rows == comm::EpTokenRows::fp8 && o.precision != Precision::fp8_block) {
    throw cli::UsageError("--token-rows fp8 needs --precision fp8_block");
  }
  // Refused here, not after the ranks met.
  if (o.fused && o.precision == Precision::fp8_tensor) {
    throw cli::UsageError("--fused takes --precision bf16 or fp8_block: an fp8_tensor layer runs staged");
  }
  if (o.fused && o.token_rows != comm::EpTokenRows::automatic) {
    throw cli::UsageError("--fused compares with the staged layer of the same rows: it takes --token-rows automatic");
  }
  cli::check_usage([&] { plan::find_workload(o.workload); });
  return o;
}

int run(const Options& o) {
  const std::string& workload_name = o.workload;
  const std::vector<int>& token_counts = o.token_counts;
  const Precision precision = o.precision;
  const bool timeline = o.timeline;
  const std::string& json_path = o.json_path;
  const auto rendezvous = comm::FileRendezvous::from_environment();
  const int rank = rendezvous.rank(), world = rendezvous.world_size();
  // Rank r takes visible device r mod their count: one each, or (megamoe-run --one-gpu) all one.
  const char* local_rank = std::getenv("LOCAL_RANK");
  int devices = 0;
  MEGAMOE_CUDA_CHECK(cudaGetDeviceCount(&devices));
  MEGAMOE_CUDA_CHECK(cudaSetDevice((local_rank ? std::atoi(local_rank) : rank) % devices));
  int device = 0;
  MEGAMOE_CUDA_CHECK(cudaGetDevice(&device));
  cudaDeviceProp prop{};
  MEGAMOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  const std::string gpu_name = prop.name;
  cudaStream_t stream;
  MEGAMOE_CUDA_CHECK(cudaStreamCreate(&stream));

  MoeSpec spec = plan::find_workload(workload_name).spec;
  spec.precision = precision;
  spec.routing = Precomputed{};
  const int max_tokens = *std::max_element(token_counts.begin(), token_counts.end());
  MoeSpec local = spec;
  local.num_experts = spec.num_experts / world;
  const PackedWeights weights = prepare_weights(local, ref::make_random_weights(local, 100 + rank).view());
  comm::EpLayerOptions ep_options;
  ep_options.token_rows = o.token_rows;
  ep_options.symmetric_memory = o.symmetric_memory;
  ep_options.partial_sums = o.partial_sums;
  comm::EpLayer ep(spec, weights, max_tokens, rendezvous, ep_options);
  const bool fp8_rows = ep.token_rows() == comm::EpTokenRows::fp8;
  // The fused layers, each with a symmetric buffer of its own; every rank builds them in this order.
  std::unique_ptr<comm::EpLayer> fused, fused_fc2_stores;
  if (o.fused) {
    ep_options.fused = true;
    ep_options.buffer_name = "ep-fused";
    fused = std::make_unique<comm::EpLayer>(spec, weights, max_tokens, rendezvous, ep_options);
    if (ep_options.partial_sums == comm::EpPartialSums::bf16) {
      ep_options.combine = comm::EpCombine::fc2_stores;
      ep_options.buffer_name = "ep-fused-fc2-stores";
      fused_fc2_stores = std::make_unique<comm::EpLayer>(spec, weights, max_tokens, rendezvous, ep_options);
    }
  }
  // Ranks sharing a GPU (megamoe-run --one-gpu) time-slice it: no NCCL baseline (NCCL refuses two
  // ranks on one device), and the header line and the JSON say that the figures are not NVLink's.
  const bool shared_gpu = ranks_share_a_gpu(rendezvous, device);
  std::unique_ptr<MoeLayer> baseline_experts;
  ncclComm_t nccl = nullptr;
  if (!shared_gpu) {
    baseline_experts = std::make_unique<MoeLayer>(local, weights, world * max_tokens);
    ncclUniqueId id;
    if (rank == 0) {
      nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId");
      rendezvous.publish("nccl-id", std::vector<uint8_t>(reinterpret_cast<uint8_t*>(&id),
                                                         reinterpret_cast<uint8_t*>(&id) + sizeof id));
    }
    const std::vector<uint8_t> id_bytes = rendezvous.wait("nccl-id", 60000ms);
    std::memcpy(&id, id_bytes.data(), sizeof id);
    nccl_check(ncclCommInitRank(&nccl, world, id, rank), "ncclCommInitRank");
  }

  // One-way peer copy bandwidth, every rank writing to the next at the same time.
  double peer_gbps = 0;
  {
    comm::SymmetricMemory copy_buffer(rendezvous, "peercopy", kPeerCopyBytes, 60000ms);
    void* source = cuda_alloc<char>(kPeerCopyBytes);
    Events ev(2);
    std::vector<float> times;
    for (int i = 0; i < kWarmup + kTimed; ++i) {
      rendezvous.barrier("peercopy-" + std::to_string(i), 60000ms);
      MEGAMOE_CUDA_CHECK(cudaEventRecord(ev.e[0], stream));
      MEGAMOE_CUDA_CHECK(cudaMemcpyAsync(copy_buffer.peer((rank + 1) % world), source, kPeerCopyBytes,
                                         cudaMemcpyDeviceToDevice, stream));
      MEGAMOE_CUDA_CHECK(cudaEventRecord(ev.e[1], stream));
      MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
      if (i >= kWarmup) times.push_back(ev.ms(0, 1));
    }
    cudaFree(source);
    const double ms = max_over_ranks(rendezvous, "peercopy-ms", median(times));
    peer_gbps = kPeerCopyBytes / (ms * 1e-3) / 1e9;
  }
  // What one cross-rank barrier costs on its own (a one-block launch, back to back): dispatch runs
  // two and combine one, so this is the floor under their latency at small batches.
  constexpr int kBarriers = 100;
  const double barrier_ms = bench::median_ms(
      stream, bench::Replays{kWarmup, kTimed},
      [&] {
        for (int b = 0; b < kBarriers; ++b) ep.synchronize_ranks(stream);
      },
      [&] { ep.synchronize_ranks(stream); });
  const double barrier_us = 1e3 * max_over_ranks(rendezvous, "barrier-ms", barrier_ms / kBarriers);
  if (rank == 0) {
    std::printf("megamoe-ep-bench: %s %s on %d ranks%s; peer copy %.0f GB/s one way, cross-rank barrier %.1f us "
                "(measured now)\n",
                workload_name.c_str(), to_string(precision), world,
                shared_gpu ? " sharing a GPU (time-sliced, not NVLink's figures; no NCCL baseline)" : "", peer_gbps,
                barrier_us);
    std::printf("  %6s | %11s | %10s | %11s | %10s | %9s | %13s | %11s | %11s | %10s | %9s\n", "tokens", "dispatch us",
                "disp GB/s", "combine us", "comb GB/s", "% of peer", "round trip us", "EP total us", "baseline us",
                "EP/base", "EP vs base");
  }

  bench::Json records = bench::Json::array();
  const int H = spec.hidden, k = spec.top_k, E = spec.num_experts;
  for (int tokens : token_counts) {
    std::mt19937_64 engine(977 * tokens + rank);
    std::normal_distribution<float> normal;
    std::vector<bf16_t> x(static_cast<size_t>(tokens) * H);
    for (bf16_t& v : x) v = bf16_t::from_float(normal(engine));
    const ref::RandomRouting routing = ref::make_random_routing(tokens, k, E, 977 * tokens + rank);
    const std::vector<int32_t>& ids = routing.ids;
    const std::vector<float>& topk_weights = routing.weights;
    bf16_t* x_dev = cuda_alloc<bf16_t>(x.size());
    int32_t* ids_dev = cuda_alloc<int32_t>(ids.size());
    float* w_dev = cuda_alloc<float>(topk_weights.size());
    bf16_t* y_ep = cuda_alloc<bf16_t>(x.size());
    bf16_t* y_base = cuda_alloc<bf16_t>(x.size());
    MEGAMOE_CUDA_CHECK(cudaMemcpy(x_dev, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
    MEGAMOE_CUDA_CHECK(cudaMemcpy(ids_dev, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
    MEGAMOE_CUDA_CHECK(cudaMemcpy(w_dev, topk_weights.data(), topk_weights.size() * 4, cudaMemcpyHostToDevice));
    const MoeInputs inputs{tokens, x_dev, nullptr, ids_dev, w_dev};

    // EP, phase by phase: every rank starts each timed phase together (a device barrier just
    // before), so that a phase's first cross-rank barrier does not also time a late peer (its host,
    // or its local experts finishing later than ours).
    Events ev(4);
    auto staged_call = [&](bool record) {
      ep.synchronize_ranks(stream);
      if (record) MEGAMOE_CUDA_CHECK(cudaEventRecord(ev.e[0], stream));
      ep.dispatch(stream, inputs);
      if (record) MEGAMOE_CUDA_CHECK(cudaEventRecord(ev.e[1], stream));
      ep.compute(stream);
      ep.synchronize_ranks(stream);
      if (record) MEGAMOE_CUDA_CHECK(cudaEventRecord(ev.e[2], stream));
      ep.combine(stream, inputs, MoeOutputs{y_ep});
      if (record) MEGAMOE_CUDA_CHECK(cudaEventRecord(ev.e[3], stream));
      MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    };
    std::vector<float> dispatch_ms, combine_ms;
    for (int i = 0; i < kWarmup + kTimed; ++i) {
      staged_call(true);
      if (i < kWarmup) continue;
      dispatch_ms.push_back(ev.ms(0, 1));
      combine_ms.push_back(ev.ms(2, 3));
    }
    if (timeline) print_timeline(ep, stream, rank, tokens, [&] { staged_call(false); });
    // The round trip as a serving engine replays it: dispatch and combine captured in one CUDA
    // graph (no expert compute between them: the combine reduces whatever partial sums the owners
    // hold), kRoundTrips replays back to back between two events. Unlike the phases above, no
    // event, device barrier or host gap sits between the kernels; each replay still waits for the
    // previous one to complete and pays its first kernel's launch.
    constexpr int kRoundTrips = 50;
    cudaGraph_t round_trip_graph = bench::capture_graph(stream, [&] {
      ep.dispatch(stream, inputs);
      ep.combine(stream, inputs, MoeOutputs{y_ep});
    });
    cudaGraphExec_t round_trip;
    MEGAMOE_CUDA_CHECK(cudaGraphInstantiate(&round_trip, round_trip_graph, 0));
    const double round_trips_ms = bench::median_ms(
        stream, bench::Replays{kWarmup, kTimed},
        [&] {
          for (int i = 0; i < kRoundTrips; ++i) MEGAMOE_CUDA_CHECK(cudaGraphLaunch(round_trip, stream));
        },
        [&] { ep.synchronize_ranks(stream); });
    MEGAMOE_CUDA_CHECK(cudaGraphExecDestroy(round_trip));
    MEGAMOE_CUDA_CHECK(cudaGraphDestroy(round_trip_graph));
    // The whole forward as a user calls it.
    const double total_ms = bench::median_ms(
        stream, bench::Replays{kWarmup, kTimed}, [&] { ep.forward(stream, inputs, MoeOutputs{y_ep}); },
        [&] { ep.synchronize_ranks(stream); });
    // The fused layers, timed alike, each after its y is checked against the staged layer's.
    FusedFigures owner_sums_figures, fc2_stores_figures;
    if (fused) {
      const std::vector<bf16_t> staged_y = download(y_ep, x.size());
      owner_sums_figures = time_fused_layer(*fused, stream, inputs, staged_y, timeline, rendezvous);
      if (fused_fc2_stores) {
        fc2_stores_figures = time_fused_layer(*fused_fc2_stores, stream, inputs, staged_y, timeline, rendezvous);
      }
    }
    // Bytes that crossed NVLink: token rows other ranks pushed here (codes and a scale per 128
    // channels, or bf16); as many partial sums go back (likewise FP8 or bf16).
    const comm::EpLayer::Delivered delivered = ep.last_delivered(stream);
    long remote_rows = 0;
    for (int src = 0; src < world; ++src) remote_rows += src != rank ? delivered.counts[src] : 0;
    const bool fp8_partials = ep.partial_sums() == comm::EpPartialSums::fp8;
    const double remote_bytes = static_cast<double>(remote_rows) * (fp8_partials ? H + H / 128 * 4 : H * 2);
    const double remote_row_bytes = static_cast<double>(remote_rows) * (fp8_rows ? H + H / 128 * 4 : H * 2);

    // Baseline: all-gather -> local experts over every rank's tokens -> reduce-scatter.
    std::vector<float> baseline_ms;
    double rel_diff = 0.0;
    if (!shared_gpu) {
      baseline_ms = time_nccl_baseline(nccl, *baseline_experts, spec, rendezvous, stream, ev, inputs, y_base);
      rel_diff = relative_l2(download(y_ep, x.size()), download(y_base, x.size()));
    }
    const std::string key = "T" + std::to_string(tokens);
    const double agreement = max_over_ranks(rendezvous, key + "-agree", rel_diff);
    const double d_us = 1e3 * max_over_ranks(rendezvous, key + "-dispatch", median(dispatch_ms));
    const double c_us = 1e3 * max_over_ranks(rendezvous, key + "-combine", median(combine_ms));
    const double t_us = 1e3 * max_over_ranks(rendezvous, key + "-total", total_ms);
    const double f_us = 1e3 * max_over_ranks(rendezvous, key + "-fused", owner_sums_figures.forward_ms);
    const double fc2_stores_us =
        1e3 * max_over_ranks(rendezvous, key + "-fused-fc2-stores", fc2_stores_figures.forward_ms);
    const double fc2_stores_rel_l2 =
        max_over_ranks(rendezvous, key + "-fused-fc2-stores-rel-l2", fc2_stores_figures.rel_l2_vs_staged);
    const double b_us = shared_gpu ? 0.0 : 1e3 * max_over_ranks(rendezvous, key + "-baseline", median(baseline_ms));
    const double rt_us = 1e3 * max_over_ranks(rendezvous, key + "-round-trip", round_trips_ms / kRoundTrips);
    const double bytes = max_over_ranks(rendezvous, key + "-bytes", remote_bytes);
    const double row_bytes = max_over_ranks(rendezvous, key + "-row-bytes", remote_row_bytes);
    const double d_gbps = row_bytes / (d_us * 1e-6) / 1e9, c_gbps = bytes / (c_us * 1e-6) / 1e9;
    if (rank == 0) {
      std::printf("  %6d | %11.1f | %10.1f | %11.1f | %10.1f | %8.0f%% | %13.1f | %11.1f | ", tokens, d_us, d_gbps,
                  c_us, c_gbps, 100.0 * (row_bytes + bytes) / ((d_us + c_us) * 1e-6) / 1e9 / peer_gbps, rt_us, t_us);
      if (shared_gpu) {
        std::printf("%11s | %10s | %9s\n", "-", "-", "-");
      } else {
        std::printf("%11.1f | %10.2f | %9.2e\n", b_us, t_us / b_us, agreement);
      }
      bench::Json record = bench::Json::object();
      record.set("workload", workload_name)
          .set("precision", to_string(precision))
          .set("token_rows", comm::to_string(ep.token_rows()))
          .set("partial_sums", comm::to_string(ep.partial_sums()))
          .set("symmetric_memory", comm::to_string(ep.symmetric_memory()))
          .set("ranks", world)
          .set("tokens_per_rank", tokens)
          .set("dispatch_us", d_us)
          .set("combine_us", c_us)
          .set("round_trip_graph_us", rt_us)
          .set("round_trip_graph", "dispatch + combine in one CUDA graph, " + std::to_string(kRoundTrips) +
                                       " replays back to back between two events, per replay")
          .set("ep_forward_us", t_us)
          .set("dispatch_bytes", row_bytes)
          .set("combine_bytes", bytes)
          .set("dispatch_gbps", d_gbps)
          .set("combine_gbps", c_gbps)
          .set("peer_copy_gbps", peer_gbps)
          .set("barrier_us", barrier_us)
          .set("ranks_share_one_gpu", shared_gpu)
          .set("gpu", gpu_name);
      if (shared_gpu) {
        record.set("baseline", "not run: the ranks share one GPU (NCCL takes one GPU a rank)");
      } else {
        record.set("baseline_us", b_us)
            .set("baseline", "NCCL all-gather -> local experts (MoeLayer) -> reduce-scatter")
            .set("rel_diff_ep_vs_baseline", agreement);
      }
      if (fused) {
        record.set("fused_forward_us", f_us);
        std::printf("  %6s   fused: %.1f us a forward (one launch a rank; staged %.1f), y the staged layer's "
                    "bit for bit\n", "", f_us, t_us);
        if (fused_fc2_stores) {
          record.set("fused_fc2_stores_forward_us", fc2_stores_us)
              .set("fused_fc2_stores_rel_l2_vs_staged", fc2_stores_rel_l2);
          std::printf("  %6s   %s: %.1f us a forward (one launch a rank; y within %.1e of the staged layer's)\n",
                      "", fused_label(comm::EpCombine::fc2_stores), fc2_stores_us, fc2_stores_rel_l2);
        } else {
          record.set("fused_fc2_stores", std::string("not run: ") + kFc2StoresNotWithFp8Sums);
          std::printf("  %6s   %s: not run (%s)\n", "", fused_label(comm::EpCombine::fc2_stores),
                      kFc2StoresNotWithFp8Sums);
        }
      }
      records.push(std::move(bench::set_provenance(record, o.provenance)));
    }
    for (void* p : {static_cast<void*>(x_dev), static_cast<void*>(ids_dev), static_cast<void*>(w_dev),
                    static_cast<void*>(y_ep), static_cast<void*>(y_base)}) {
      cudaFree(p);
    }
  }
  if (nccl != nullptr) ncclCommDestroy(nccl);
  if (rank == 0 && !json_path.empty()) {
    bench::write_json_file(json_path, records);
    std::printf("wrote %s\n", json_path.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return megamoe::bench::cli::run_main("megamoe-ep-bench", [&] { return run(parse(argc, argv)); });
}
