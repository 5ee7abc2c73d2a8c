#include "comm/ep_layer.hpp"

#include <algorithm>
#include <string>

#include "kernels/comm/ep_combine.cuh"
#include "kernels/comm/ep_dispatch.cuh"
#include "kernels/comm/rank_barrier.cuh"
#include "kernels/cuda_check.hpp"
#include "megamoe/error.hpp"

namespace megamoe::comm {
namespace {

constexpr auto kBootstrapTimeout = std::chrono::seconds(60);
constexpr long long kBarrierTimeoutCycles = 20'000'000'000LL;  // ~10 s at 1.98 GHz
constexpr size_t kDefaultSharedMemoryBytes = 48 * 1024;  // dynamic shared memory without opting in

}  // namespace

EpLayer::EpLayer(const MoeSpec& spec, const PackedWeights& local_weights, int max_tokens_per_rank,
                 const FileRendezvous& rendezvous)
    : spec_(spec), rendezvous_(rendezvous) {
  validate(spec);
  const int world = rendezvous.world_size();
  if (!std::holds_alternative<Precomputed>(spec.routing)) {
    throw Error(ErrorCode::unsupported, "EpLayer takes precomputed routing (topk_ids, topk_weights)");
  }
  if (spec.num_experts % world != 0) {
    throw Error(ErrorCode::invalid_spec, "num_experts=" + std::to_string(spec.num_experts) +
                                             " must be a multiple of the world size " + std::to_string(world));
  }
  if (world > layout::EpBufferLayout::kSignalSlots) throw Error(ErrorCode::unsupported, "too many ranks for one node");
  if (kernels::ep_publish_smem_bytes(spec.num_experts, world) > kDefaultSharedMemoryBytes) {
    throw Error(ErrorCode::unsupported, "num_experts=" + std::to_string(spec.num_experts) + " on " +
                                            std::to_string(world) + " ranks needs more shared memory for dispatch than " +
                                            std::to_string(kDefaultSharedMemoryBytes) + " bytes");
  }
  layout_ = layout::EpBufferLayout::make(world, spec.num_experts, spec.top_k, spec.hidden, max_tokens_per_rank);

  MoeSpec local = spec;
  local.num_experts = layout_.experts_per_rank;
  local.top_k = 1;  // each received row goes to exactly one local expert
  local_experts_ = std::make_unique<MoeLayer>(local, local_weights, static_cast<int>(layout_.max_recv_rows));

  cudaDeviceProp prop{};
  int device = 0;
  MEGAMOE_CUDA_CHECK(cudaGetDevice(&device));
  MEGAMOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  num_sms_ = prop.multiProcessorCount;
  buffer_ = std::make_unique<SymmetricMemory>(rendezvous, "ep", layout_.total_bytes, kBootstrapTimeout);
  slot_rank_ = cuda_alloc<int32_t>(static_cast<size_t>(max_tokens_per_rank) * spec.top_k);
  tile_counts_ =
      cuda_alloc<int32_t>(static_cast<size_t>(kernels::ep_dispatch_tiles(max_tokens_per_rank, spec.top_k)) * spec.num_experts);
  tiles_done_ = cuda_alloc<uint32_t>(1);
  MEGAMOE_CUDA_CHECK(cudaMemset(tiles_done_, 0, sizeof(uint32_t)));
  recv_local_expert_ = cuda_alloc<int32_t>(layout_.max_recv_rows);
  expert_rows_ = cuda_alloc<uint16_t>(layout_.max_recv_rows * spec.hidden);
  error_flags_ = cuda_alloc<int32_t>(4);
  MEGAMOE_CUDA_CHECK(cudaMemset(error_flags_, 0, 4 * sizeof(int32_t)));
  ones_ = cuda_alloc<float>(layout_.max_recv_rows);
  const std::vector<float> ones(layout_.max_recv_rows, 1.0f);
  MEGAMOE_CUDA_CHECK(cudaMemcpy(ones_, ones.data(), ones.size() * sizeof(float), cudaMemcpyHostToDevice));
}

EpLayer::~EpLayer() {
  for (void* p : {static_cast<void*>(slot_rank_), static_cast<void*>(recv_local_expert_), expert_rows_,
                  static_cast<void*>(error_flags_), static_cast<void*>(ones_), static_cast<void*>(tile_counts_),
                  static_cast<void*>(tiles_done_)}) {
    cudaFree(p);
  }
}

void EpLayer::barrier(cudaStream_t stream) {
  kernels::RankBarrierParams p{buffer_->device_peer_table(), layout_.signals, rendezvous_.rank(),
                               rendezvous_.world_size(), ++barrier_epoch_, kBarrierTimeoutCycles};
  kernels::rank_barrier_kernel<<<1, 32 * ((rendezvous_.world_size() + 31) / 32), 0, stream>>>(p);
  MEGAMOE_CHECK_LAUNCH("rank_barrier_kernel");
}

void EpLayer::forward(cudaStream_t stream, const MoeInputs& inputs, const MoeOutputs& outputs) {
  validate_forward_args(spec_, layout_.max_tokens_per_rank, inputs, outputs);
  compute(stream, dispatch(stream, inputs));
  combine(stream, inputs, outputs);
}

int EpLayer::dispatch(cudaStream_t stream, const MoeInputs& inputs) {
  kernels::EpDispatchParams d{};
  d.peer_bases = buffer_->device_peer_table();
  d.layout = layout_;
  d.rank = rendezvous_.rank();
  d.num_tokens = inputs.num_tokens;
  d.num_experts = spec_.num_experts;
  d.topk_ids = inputs.topk_ids;
  d.x = static_cast<const uint4*>(inputs.x);
  d.slot_rank = slot_rank_;
  d.error_flags = error_flags_;
  d.recv_local_expert = recv_local_expert_;
  d.tile_counts = tile_counts_;
  d.tiles_done = tiles_done_;

  // A rank with no tokens still takes part: its counts (zeros) and barriers are owed to the peers.
  MEGAMOE_CUDA_CHECK(cudaMemsetAsync(static_cast<char*>(buffer_->local()) + layout_.arrivals, 0,
                                     sizeof(uint32_t) * layout_.experts_per_rank, stream));
  const int tiles = kernels::ep_dispatch_tiles(inputs.num_tokens, spec_.top_k);
  kernels::ep_count_kernel<<<tiles, kernels::kDispatchTileSlots, kernels::ep_count_smem_bytes(spec_.num_experts),
                             stream>>>(d);
  MEGAMOE_CHECK_LAUNCH("ep_count_kernel");
  barrier(stream);
  // Past the tiles, extra blocks only stage x, so that small batches still copy with every SM.
  kernels::ep_publish_kernel<<<std::max(tiles, num_sms_), kernels::kDispatchTileSlots,
                               kernels::ep_publish_smem_bytes(spec_.num_experts, rendezvous_.world_size()), stream>>>(d);
  MEGAMOE_CHECK_LAUNCH("ep_publish_kernel");
  barrier(stream);
  kernels::ep_pull_kernel<<<num_sms_ * 4, 256, 0, stream>>>(d);
  MEGAMOE_CHECK_LAUNCH("ep_pull_kernel");

  // The local pass needs its row count on the host (staged design; the fused kernel will not).
  std::vector<int32_t> counts(static_cast<size_t>(layout_.world_size) * layout_.experts_per_rank);
  MEGAMOE_CUDA_CHECK(cudaMemcpyAsync(counts.data(), static_cast<char*>(buffer_->local()) + layout_.recv_counts,
                                     counts.size() * sizeof(int32_t), cudaMemcpyDeviceToHost, stream));
  MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  int received = 0;
  for (int32_t c : counts) received += c;
  return received;
}

void EpLayer::compute(cudaStream_t stream, int received) {
  if (received == 0) return;
  const MoeInputs local{received, static_cast<char*>(buffer_->local()) + layout_.recv_tokens, nullptr,
                        recv_local_expert_, ones_};
  local_experts_->forward(stream, local, MoeOutputs{expert_rows_});
}

void EpLayer::combine(cudaStream_t stream, const MoeInputs& inputs, const MoeOutputs& outputs) {
  kernels::EpCombineParams c{};
  c.peer_bases = buffer_->device_peer_table();
  c.layout = layout_;
  c.rank = rendezvous_.rank();
  c.num_tokens = inputs.num_tokens;
  c.expert_rows = static_cast<const uint4*>(expert_rows_);
  c.slot_rank = slot_rank_;
  c.topk_weights = inputs.topk_weights;
  c.y = static_cast<__nv_bfloat16*>(outputs.y);
  kernels::ep_push_kernel<<<num_sms_ * 4, 256, 0, stream>>>(c);
  MEGAMOE_CHECK_LAUNCH("ep_push_kernel");
  barrier(stream);
  if (inputs.num_tokens > 0) {
    const long threads = static_cast<long>(inputs.num_tokens) * (spec_.hidden / 8);
    kernels::ep_reduce_kernel<<<static_cast<int>((threads + 255) / 256), 256, 0, stream>>>(c);
    MEGAMOE_CHECK_LAUNCH("ep_reduce_kernel");
  }
  // The next call's count kernel overwrites recv_counts on its peers: keep every rank out of it
  // until all have finished reading this call's buffers.
  barrier(stream);
}

long EpLayer::take_invalid_routing_ids(cudaStream_t stream) {
  int32_t count = 0;
  MEGAMOE_CUDA_CHECK(cudaMemcpyAsync(&count, error_flags_, sizeof count, cudaMemcpyDeviceToHost, stream));
  MEGAMOE_CUDA_CHECK(cudaMemsetAsync(error_flags_, 0, sizeof count, stream));
  MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  return count;
}

EpLayer::Delivered EpLayer::last_delivered(cudaStream_t stream) const {
  Delivered d;
  d.counts.resize(static_cast<size_t>(layout_.world_size) * layout_.experts_per_rank);
  MEGAMOE_CUDA_CHECK(cudaMemcpyAsync(d.counts.data(), static_cast<char*>(buffer_->local()) + layout_.recv_counts,
                                     d.counts.size() * sizeof(int32_t), cudaMemcpyDeviceToHost, stream));
  MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  int received = 0;
  for (int32_t c : d.counts) received += c;
  constexpr int kFields = layout::EpBufferLayout::kSourceFields;
  std::vector<int32_t> entries(kFields * static_cast<size_t>(received));
  MEGAMOE_CUDA_CHECK(cudaMemcpy(entries.data(), static_cast<char*>(buffer_->local()) + layout_.recv_sources,
                                entries.size() * sizeof(int32_t), cudaMemcpyDeviceToHost));
  for (size_t row = 0; row < static_cast<size_t>(received); ++row) {
    d.sources.insert(d.sources.end(), entries.begin() + kFields * row, entries.begin() + kFields * row + 3);
  }
  return d;
}

}  // namespace megamoe::comm
