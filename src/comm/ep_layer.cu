#include "comm/ep_layer.hpp"

#include <algorithm>
#include <string>

#include "api/single_kernel_launch.hpp"
#include "kernels/comm/ep_combine.cuh"
#include "kernels/comm/ep_dispatch.cuh"
#include "kernels/comm/ep_fused_params.hpp"
#include "kernels/comm/rank_barrier.cuh"
#include "kernels/cuda_check.hpp"
#include "kernels/launch.hpp"
#include "kernels/layout/ep_timeline.hpp"
#include "megamoe/error.hpp"
#include "megamoe/options.hpp"

namespace megamoe::comm {
namespace {

constexpr auto kBootstrapTimeout = std::chrono::seconds(60);

}  // namespace

const char* to_string(EpTokenRows rows) {
  switch (rows) {
    case EpTokenRows::automatic: return "automatic";
    case EpTokenRows::bf16: return "bf16";
    case EpTokenRows::fp8: return "fp8";
  }
  return "(not an EpTokenRows value)";
}

const char* to_string(EpPartialSums sums) {
  switch (sums) {
    case EpPartialSums::bf16: return "bf16";
    case EpPartialSums::fp8: return "fp8";
  }
  return "(not an EpPartialSums value)";
}

const char* to_string(EpCombine combine) {
  switch (combine) {
    case EpCombine::owner_sums: return "owner_sums";
    case EpCombine::fc2_stores: return "fc2_stores";
  }
  return "(not an EpCombine value)";
}

EpLayer::EpLayer(const MoeSpec& spec, const PackedWeights& local_weights, int max_tokens_per_rank,
                 const FileRendezvous& rendezvous, const EpLayerOptions& options)
    : EpLayer(spec, local_weights.view(), max_tokens_per_rank, rendezvous, options) {}

EpLayer::EpLayer(const MoeSpec& spec, const PackedWeightsView& local_weights, int max_tokens_per_rank,
                 const FileRendezvous& rendezvous, const EpLayerOptions& options)
    : spec_(spec), rendezvous_(rendezvous) {
  const std::chrono::milliseconds barrier_timeout = options.barrier_timeout;
  validate(spec);
  if (spec.precision == Precision::fp8_tensor && options.fused) {
    throw Error(ErrorCode::unsupported, "fused=true takes precision bf16 or fp8_block (the single-kernel forward has "
                                        "no fp8_tensor path); an fp8_tensor layer runs staged (fused=false)");
  }
  if (barrier_timeout.count() < 1 || barrier_timeout > std::chrono::hours(1)) {
    throw Error(ErrorCode::invalid_argument, "barrier_timeout=" + std::to_string(barrier_timeout.count()) +
                                                 " ms must be between 1 ms and one hour");
  }
  barrier_timeout_ns_ = std::chrono::duration_cast<std::chrono::nanoseconds>(barrier_timeout).count();
  const int world = rendezvous.world_size();
  // The local pass runs over every rank's tokens (world x max_tokens_per_rank rows), whose limit is
  // the single-GPU layer's.
  if (max_tokens_per_rank < 1 || static_cast<long long>(world) * max_tokens_per_rank > kMaxLayerTokens) {
    throw Error(ErrorCode::invalid_argument,
                "max_tokens_per_rank=" + std::to_string(max_tokens_per_rank) + " must be in [1, " +
                    std::to_string(kMaxLayerTokens / world) + "]: the " + std::to_string(world) +
                    " ranks' tokens together at most " + std::to_string(kMaxLayerTokens) + " (kMaxLayerTokens)");
  }
  if (!std::holds_alternative<Precomputed>(spec.routing)) {
    throw Error(ErrorCode::unsupported, "EpLayer takes precomputed routing (topk_ids, topk_weights)");
  }
  if (spec.num_experts % world != 0) {
    throw Error(ErrorCode::invalid_spec, "num_experts=" + std::to_string(spec.num_experts) +
                                             " must be a multiple of the world size " + std::to_string(world));
  }
  if (world > layout::EpBufferLayout::kSignalSlots) throw Error(ErrorCode::unsupported, "too many ranks for one node");
  if (spec.top_k > spec.num_experts / world) {
    // The local pass sees a token's k slots, so it needs at least k experts per rank.
    throw Error(ErrorCode::unsupported, "top_k=" + std::to_string(spec.top_k) + " exceeds the " +
                                            std::to_string(spec.num_experts / world) + " experts per rank");
  }
  bool fp8_rows = spec.precision == Precision::fp8_block;
  switch (options.token_rows) {
    case EpTokenRows::automatic: break;
    case EpTokenRows::bf16: fp8_rows = false; break;
    case EpTokenRows::fp8:
      if (!fp8_rows) {
        throw Error(ErrorCode::unsupported, std::string("token_rows=fp8 needs precision fp8_block (the layer's own "
                                                        "quantization of x), not ") + to_string(spec.precision));
      }
      break;
    default:
      throw Error(ErrorCode::invalid_argument, "token_rows=" + std::to_string(static_cast<int>(options.token_rows)) +
                                                   " names no EpTokenRows value (automatic, bf16, fp8)");
  }
  if (options.partial_sums != EpPartialSums::bf16 && options.partial_sums != EpPartialSums::fp8) {
    throw Error(ErrorCode::invalid_argument, "partial_sums=" + std::to_string(static_cast<int>(options.partial_sums)) +
                                                 " names no EpPartialSums value (bf16, fp8)");
  }
  const bool fp8_partials = options.partial_sums == EpPartialSums::fp8;
  if (fp8_partials && spec.hidden % 128 != 0) {
    throw Error(ErrorCode::unsupported, "partial_sums=fp8 quantizes per 128 channels: hidden=" +
                                            std::to_string(spec.hidden) + " is not a multiple of 128");
  }
  if (options.buffer_name.empty()) throw Error(ErrorCode::invalid_argument, "buffer_name must not be empty");
  if (options.combine != EpCombine::owner_sums && options.combine != EpCombine::fc2_stores) {
    throw Error(ErrorCode::invalid_argument, "combine=" + std::to_string(static_cast<int>(options.combine)) +
                                                 " names no EpCombine value (owner_sums, fc2_stores)");
  }
  const bool fc2_stores = options.combine == EpCombine::fc2_stores;
  if (fc2_stores && !options.fused) {
    throw Error(ErrorCode::unsupported, "combine=fc2_stores is the fused forward's (FC2's epilogue stores into the "
                                        "sources): set fused=true, or keep combine=owner_sums for the staged layer");
  }
  if (fc2_stores && fp8_partials) {
    throw Error(ErrorCode::unsupported, "combine=fc2_stores returns each expert's bf16 row as FC2 stores it: "
                                        "partial_sums=fp8 is for combine=owner_sums");
  }
  fused_ = options.fused;
  if (fused_) {
    if (fp8_rows != (spec.precision == Precision::fp8_block)) {
      throw Error(ErrorCode::unsupported, "fused=true sends the rows its layer computes on: FP8 rows for fp8_block, "
                                          "bf16 rows for bf16 (token_rows=automatic), not " +
                                              std::string(to_string(options.token_rows)) + " rows for " +
                                              to_string(spec.precision));
    }
    if (barrier_timeout > kMaxFusedBarrierTimeout) {
      throw Error(ErrorCode::invalid_argument,
                  "barrier_timeout=" + std::to_string(barrier_timeout.count()) + " ms: with fused=true at most " +
                      std::to_string(kMaxFusedBarrierTimeout.count()) +
                      " ms (the kernel that waits for the peers traps its own waits after ~17 s)");
    }
  }
  layout_ = layout::EpBufferLayout::make(world, spec.num_experts, spec.top_k, spec.hidden, max_tokens_per_rank,
                                         fp8_rows, fp8_partials);
  fused_layout_ = layout::EpFusedLayout::make(world, spec.num_experts, spec.top_k, spec.hidden, max_tokens_per_rank,
                                              fp8_rows, fp8_partials, fc2_stores);
  signals_offset_ = fused_ ? fused_layout_.signals : layout_.signals;

  // The local pass: every local expert of each received token (each virtual token, where fused),
  // summed with the routing weights.
  MoeSpec local = spec;
  local.num_experts = layout_.experts_per_rank;
  MoeLayerOptions local_options;
  if (fused_) local_options.launch = ForwardLaunch::single_kernel;
  local_experts_ =
      std::make_unique<MoeLayer>(local, local_weights, static_cast<int>(layout_.max_recv_rows), local_options);

  cudaDeviceProp prop{};
  int device = 0;
  MEGAMOE_CUDA_CHECK(cudaGetDevice(&device));
  MEGAMOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  num_sms_ = prop.multiProcessorCount;
  // The modes that carve the buffer differently, which its size alone may not tell apart (with
  // world == top_k, owner_sums' partial sums take as many bytes as fc2_stores' expert rows).
  const std::string buffer_layout = std::string(fused_ ? "fused" : "staged") + " layer, token_rows=" +
                                    to_string(token_rows()) + ", partial_sums=" + to_string(partial_sums()) +
                                    ", combine=" + to_string(combine());
  buffer_ = std::make_unique<SymmetricMemory>(rendezvous, options.buffer_name,
                                             fused_ ? fused_layout_.total_bytes : layout_.total_bytes,
                                             kBootstrapTimeout, options.symmetric_memory, buffer_layout);
  token_dest_ = cuda_alloc<int32_t>(static_cast<size_t>(max_tokens_per_rank) * world);
  tile_counts_ = cuda_alloc<int32_t>(static_cast<size_t>(kernels::ep_dispatch_tiles(max_tokens_per_rank)) * world);
  dest_base_ = cuda_alloc<int32_t>(world);
  recv_total_ = cuda_alloc<int32_t>(1);
  barriers_passed_ = cuda_alloc<uint64_t>(1);
  MEGAMOE_CUDA_CHECK(cudaMemset(barriers_passed_, 0, sizeof(uint64_t)));
  fused_calls_ = cuda_alloc<uint64_t>(1);
  MEGAMOE_CUDA_CHECK(cudaMemset(fused_calls_, 0, sizeof(uint64_t)));
  tickets_ = cuda_alloc<uint32_t>(2);
  MEGAMOE_CUDA_CHECK(cudaMemset(tickets_, 0, 2 * sizeof(uint32_t)));
  error_flags_ = cuda_alloc<int32_t>(4);
  MEGAMOE_CUDA_CHECK(cudaMemset(error_flags_, 0, 4 * sizeof(int32_t)));
  fault_ = cuda_alloc<kernels::RankFault>(1);
  MEGAMOE_CUDA_CHECK(cudaMemset(fault_, 0, sizeof(kernels::RankFault)));
}

EpLayer::~EpLayer() {
  // A lost peer never reaches the buffer's closing barrier: do not wait for it.
  kernels::RankFault fault{};
  const bool readable = cudaMemcpy(&fault, fault_, sizeof fault, cudaMemcpyDeviceToHost) == cudaSuccess;
  if (!readable) cudaGetLastError();
  if (!readable || fault.failed != 0) buffer_->abandon_peers();
  for (void* p : {static_cast<void*>(token_dest_), static_cast<void*>(tile_counts_), static_cast<void*>(dest_base_),
                  static_cast<void*>(recv_total_), static_cast<void*>(tickets_), static_cast<void*>(barriers_passed_),
                  static_cast<void*>(fused_calls_),
                  static_cast<void*>(error_flags_), static_cast<void*>(fault_)}) {
    cudaFree(p);
  }
}

kernels::RankBarrierParams EpLayer::barrier_params() const {
  return kernels::RankBarrierParams{buffer_->device_peer_table(), signals_offset_, rendezvous_.rank(),
                                    rendezvous_.world_size(), barrier_timeout_ns_, barriers_passed_, fault_};
}

namespace {

// A cross-rank barrier as a launch of its own (one block, a warp per 32 ranks).
void launch_barrier(cudaStream_t stream, const kernels::RankBarrierParams& barrier, const kernels::Timeline& timeline,
                    int started_event) {
  kernels::launch_overlapping_previous(kernels::rank_barrier_kernel, 1, 32 * ((barrier.world_size + 31) / 32), 0,
                                       stream, "rank_barrier_kernel", barrier, timeline, started_event);
}

// Blocks of the row-moving launches: enough to keep every SM's NVLink writes in flight.
int row_blocks(int num_sms, long rows) { return static_cast<int>(std::clamp<long>(rows, 1, 8L * num_sms)); }

}  // namespace

long EpLayer::expected_recv_rows() const {
  return std::min<long>(layout_.max_recv_rows, static_cast<long>(rendezvous_.world_size()) * dispatched_tokens_);
}

void EpLayer::synchronize_ranks(cudaStream_t stream) {
  launch_barrier(stream, barrier_params(), kernels::Timeline{}, 0);
}

void EpLayer::forward(cudaStream_t stream, const MoeInputs& inputs, const MoeOutputs& outputs) {
  // Before the general checks, which would refuse x_scales for a bf16 layer with MoeLayer's reason.
  if (inputs.x_scales != nullptr) {
    throw Error(ErrorCode::unsupported, "EpLayer takes a bf16 x (its dispatch quantizes the rows it sends itself: "
                                        "EpLayerOptions::token_rows); x_scales is for MoeLayer");
  }
  validate_forward_args(spec_, layout_.max_tokens_per_rank, inputs, outputs);
  if (fused_) return forward_fused(stream, inputs, outputs);
  dispatch(stream, inputs);
  compute(stream);
  combine(stream, inputs, outputs);
}

void EpLayer::require_staged(const char* what) const {
  if (fused_) {
    throw Error(ErrorCode::unsupported, std::string("EpLayer::") + what +
                                            " is the staged layer's: a fused layer (EpLayerOptions::fused) runs its "
                                            "forward as one launch");
  }
}

void EpLayer::forward_fused(cudaStream_t stream, const MoeInputs& inputs, const MoeOutputs& outputs) {
  if (!peer_lost_.empty()) throw Error(ErrorCode::timeout, peer_lost_);
  dispatched_tokens_ = inputs.num_tokens;
  const auto launch = detail::SingleKernelLaunch::of(*local_experts_, static_cast<int>(expected_recv_rows()));
  kernels::EpFusedParams ep{};
  ep.peer_bases = buffer_->device_peer_table();
  ep.layout = fused_layout_;
  ep.rank = rendezvous_.rank();
  ep.num_experts = spec_.num_experts;
  ep.num_tokens = inputs.num_tokens;
  ep.topk_ids = inputs.topk_ids;
  ep.topk_weights = inputs.topk_weights;
  ep.x = static_cast<const uint4*>(inputs.x);
  ep.ue8m0 = spec_.scale_format == ScaleFormat::ue8m0;
  ep.y = static_cast<__nv_bfloat16*>(outputs.y);
  ep.error_flags = error_flags_;
  ep.calls = fused_calls_;
  ep.fault = fault_;
  ep.timeout_ns = barrier_timeout_ns_;
  // One publish item per CTA at most (a rank with no tokens still has one: its arrivals are owed).
  ep.publish_tokens = std::max(1, (inputs.num_tokens + launch.choices.grid - 1) / launch.choices.grid);
  ep.publish_items = std::max(1, (inputs.num_tokens + ep.publish_tokens - 1) / ep.publish_tokens);
  kernels::MoeCall call{};
  call.num_tokens = static_cast<int>(fused_layout_.virtual_tokens());
  call.timeline_stamps = timeline_stamps_;
  kernels::launch_ep_fused_forward(launch.params, launch.choices, call, ep, stream);
}

void EpLayer::dispatch(cudaStream_t stream, const MoeInputs& inputs) {
  require_staged("dispatch");
  if (!peer_lost_.empty()) throw Error(ErrorCode::timeout, peer_lost_);
  kernels::EpDispatchParams d{};
  d.peer_bases = buffer_->device_peer_table();
  d.layout = layout_;
  d.barrier = barrier_params();
  d.rank = rendezvous_.rank();
  d.num_tokens = inputs.num_tokens;
  dispatched_tokens_ = inputs.num_tokens;
  d.num_experts = spec_.num_experts;
  d.topk_ids = inputs.topk_ids;
  d.topk_weights = inputs.topk_weights;
  d.x = static_cast<const uint4*>(inputs.x);
  d.ue8m0 = spec_.scale_format == ScaleFormat::ue8m0;
  d.token_dest = token_dest_;
  d.tile_counts = tile_counts_;
  d.dest_base = dest_base_;
  d.recv_total = recv_total_;
  d.error_flags = error_flags_;
  d.tickets = tickets_;
  d.timeline = kernels::Timeline{timeline_stamps_};
  // A rank with no tokens still takes part: its counts (zeros) and barriers are owed to the peers.
  // Each launch overlaps the previous kernel's tail and waits for it before touching memory.
  kernels::launch_overlapping_previous(kernels::ep_count_kernel, kernels::ep_dispatch_tiles(inputs.num_tokens),
                                       kernels::kDispatchTileTokens, 0, stream, "ep_count_kernel", d);
  kernels::launch_overlapping_previous(kernels::ep_push_kernel, row_blocks(num_sms_, inputs.num_tokens),
                                       kernels::kEpRowThreads, 0, stream, "ep_push_kernel", d);
}

void EpLayer::compute(cudaStream_t stream) {
  require_staged("compute");
  const char* buffer = static_cast<const char*>(buffer_->local());
  MoeInputs local{static_cast<int>(layout_.max_recv_rows), buffer + layout_.recv_tokens, nullptr,
                  reinterpret_cast<const int32_t*>(buffer + layout_.recv_ids),
                  reinterpret_cast<const float*>(buffer + layout_.recv_weights)};
  local.num_valid_tokens = recv_total_;
  if (layout_.fp8_rows) {
    local.x_scales = reinterpret_cast<const float*>(buffer + layout_.recv_scales);
    local.x_scale_stride = static_cast<int>(layout_.max_recv_rows);
  }
  // The launch is sized for every rank's worst case; its tiles for what arrives when the ranks carry
  // batches like this one's (the count stays on the device).
  local.expected_valid_tokens = static_cast<int>(expected_recv_rows());
  local_experts_->forward(stream, local, MoeOutputs{static_cast<char*>(buffer_->local()) + layout_.partial_sums});
}

void EpLayer::combine(cudaStream_t stream, const MoeInputs& inputs, const MoeOutputs& outputs) {
  require_staged("combine");
  if (layout_.fp8_partials) {
    // Blocks for the rows that arrive when every rank's batch is like this one's; they stride over
    // the count on the device, whatever it is.
    const kernels::EpQuantizePartialsParams q{buffer_->local(), layout_, recv_total_, fault_};
    kernels::launch_overlapping_previous(kernels::ep_quantize_partials_kernel, row_blocks(num_sms_, expected_recv_rows()),
                                         kernels::kEpRowThreads, 0, stream, "ep_quantize_partials_kernel", q);
  }
  // Every rank's local pass has written its partial sums (and their FP8 codes) before any rank
  // reads them. The next call's dispatch rewrites peers' buffers only after its count barrier,
  // which no rank passes before every rank has finished this reduction: no closing barrier is
  // needed.
  launch_barrier(stream, barrier_params(),
                 kernels::Timeline{timeline_stamps_}, layout::kCombineBarrierStart);
  if (inputs.num_tokens == 0) return;
  kernels::EpCombineParams c{};
  c.peer_bases = buffer_->device_peer_table();
  c.layout = layout_;
  c.rank = rendezvous_.rank();
  c.num_tokens = inputs.num_tokens;
  c.token_dest = token_dest_;
  c.y = static_cast<__nv_bfloat16*>(outputs.y);
  c.fault = fault_;
  c.timeline = kernels::Timeline{timeline_stamps_};
  const long threads = static_cast<long>(inputs.num_tokens) * (spec_.hidden / 8);
  kernels::launch_overlapping_previous(kernels::ep_reduce_kernel,
                                       static_cast<int>((threads + kernels::kEpReduceThreads - 1) / kernels::kEpReduceThreads),
                                       kernels::kEpReduceThreads, 0, stream, "ep_reduce_kernel", c);
}

long EpLayer::take_invalid_routing_ids(cudaStream_t stream) {
  int32_t count = 0;
  MEGAMOE_CUDA_CHECK(cudaMemcpyAsync(&count, error_flags_, sizeof count, cudaMemcpyDeviceToHost, stream));
  MEGAMOE_CUDA_CHECK(cudaMemsetAsync(error_flags_, 0, sizeof count, stream));
  MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  return count;
}

void EpLayer::check_peers(cudaStream_t stream) {
  kernels::RankFault fault{};
  MEGAMOE_CUDA_CHECK(cudaMemcpyAsync(&fault, fault_, sizeof fault, cudaMemcpyDeviceToHost, stream));
  MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (fault.failed == 0) return;
  peer_lost_ = "rank " + std::to_string(rendezvous_.rank()) + " gave up " +
               (fused_ ? "waiting for a peer in forward " : "cross-rank barrier ") + std::to_string(fault.epoch) +
               " after " + std::to_string(fault.waited_ns / 1000000) +
               " ms: rank " + std::to_string(fault.peer) + " had arrived " + std::to_string(fault.seen) + " times, " +
               std::to_string(fault.epoch) + " expected (it stalled or died). This expert-parallel layer is unusable "
               "from then on (its outputs are NaN, its calls throw); the process and its CUDA context are intact";
  throw Error(ErrorCode::timeout, peer_lost_);
}

EpLayer::Delivered EpLayer::last_delivered(cudaStream_t stream) const {
  require_staged("last_delivered");
  MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  const char* buffer = static_cast<const char*>(buffer_->local());
  Delivered d;
  const int world = layout_.world_size, rank = rendezvous_.rank();
  std::vector<int32_t> matrix(static_cast<size_t>(world) * world);
  MEGAMOE_CUDA_CHECK(cudaMemcpy(matrix.data(), buffer + layout_.counts, matrix.size() * sizeof(int32_t),
                                cudaMemcpyDeviceToHost));
  for (int src = 0; src < world; ++src) d.counts.push_back(matrix[static_cast<size_t>(src) * world + rank]);
  int received = 0;
  MEGAMOE_CUDA_CHECK(cudaMemcpy(&received, recv_total_, sizeof received, cudaMemcpyDeviceToHost));
  d.origins.resize(static_cast<size_t>(layout::EpBufferLayout::kOriginFields) * received);
  d.local_ids.resize(static_cast<size_t>(layout_.top_k) * received);
  MEGAMOE_CUDA_CHECK(cudaMemcpy(d.origins.data(), buffer + layout_.recv_origin, d.origins.size() * sizeof(int32_t),
                                cudaMemcpyDeviceToHost));
  MEGAMOE_CUDA_CHECK(cudaMemcpy(d.local_ids.data(), buffer + layout_.recv_ids, d.local_ids.size() * sizeof(int32_t),
                                cudaMemcpyDeviceToHost));
  return d;
}

}  // namespace megamoe::comm
