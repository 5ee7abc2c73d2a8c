// EpLayer: the MoE layer expert-parallel across the GPUs of one node, staged:
//   dispatch (count exchange, then each token row pushed once to every rank owning one of its
//   experts) -> all local experts of each received token through the single-GPU MoeLayer, which
//   sums them with the routing weights into the symmetric buffer -> combine (each source reads its
//   tokens' partial sums from their owners over NVLink and adds them in rank order). No host
//   synchronization: the local pass takes the received row count from the device
//   (MoeInputs::num_valid_tokens), so a forward is CUDA-graph capturable.
// One process per GPU (megamoe-run); every call is collective over the ranks.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "comm/rendezvous.hpp"
#include "comm/symmetric_memory.hpp"
#include "kernels/comm/rank_fault.hpp"
#include "kernels/layout/ep_buffers.hpp"
#include "kernels/layout/ep_fused_buffers.hpp"
#include "megamoe/forward.hpp"
#include "megamoe/layer.hpp"

namespace megamoe::kernels {
struct RankBarrierParams;
}  // namespace megamoe::kernels

namespace megamoe::comm {

// How long a cross-rank barrier waits for a peer before it gives up (EpLayer::check_peers).
inline constexpr std::chrono::milliseconds kDefaultBarrierTimeout{10000};

// How token rows travel from their source to their experts' owners.
enum class EpTokenRows {
  automatic,  // fp8 for fp8_block layers, bf16 for bf16 and fp8_tensor ones
  bf16,       // the bf16 rows as given; the owner's layer quantizes them (fp8_tensor: with its own
              // activation scale, docs/usage.md#expert-parallelism)
  fp8,        // fp8_block only: quantized once by the source (E4M3 + one fp32 scale per 128
              // channels, the layer's own rule), half the bytes; the owner's layer takes them as they
              // are (MoeInputs::x_scales), so y is the same, bit for bit, as with bf16 rows
};
const char* to_string(EpTokenRows rows);

// How the owners' partial sums travel back to their tokens' sources.
enum class EpPartialSums {
  bf16,  // as the local pass rounds them
  fp8,   // quantized once by their owner per 128 channels (E4M3 + fp32 scales), half the bytes;
         // not bf16's bits: the error it adds is measured (docs/decisions.md#fp8-partial-sums).
         // Needs hidden a multiple of 128.
};
const char* to_string(EpPartialSums sums);

// How a fused layer's owners return their experts' outputs to each token's source
// (docs/design.md#expert-parallelism-inside-the-persistent-kernel); the staged layer's way is
// owner_sums.
enum class EpCombine {
  owner_sums,  // once FC2 is done, the owner sums its experts' rows of each token and stores that
               // partial sum into the source (as EpLayerOptions::partial_sums says), which adds the
               // owners' sums in rank order: the staged layer's y, bit for bit
  fc2_stores,  // FC2's epilogue stores each expert's output row straight into its source as the
               // tile finishes, and the source sums the token's k rows in slot order: the
               // single-GPU layer's y, bit for bit; up to k rows a token cross NVLink instead of
               // one per owner, with no combine phase on the owner. bf16 rows only.
};
const char* to_string(EpCombine combine);

struct EpLayerOptions {
  // How long a device-side barrier waits for a peer.
  std::chrono::milliseconds barrier_timeout = kDefaultBarrierTimeout;
  EpTokenRows token_rows = EpTokenRows::automatic;
  EpPartialSums partial_sums = EpPartialSums::bf16;
  // Where the symmetric buffer lives: CUDA IPC (one node) or NVSHMEM's symmetric heap (a build with
  // MEGAMOE_NVSHMEM; every rank must choose the same).
  SymmetricBackend symmetric_memory = SymmetricBackend::cuda_ipc;
  // The symmetric buffer's name in the rendezvous: layers that live at the same time on one
  // rendezvous need names of their own (every rank builds them in the same order).
  std::string buffer_name = "ep";
  // One launch per forward: dispatch, the local experts and the combine as roles of the
  // single-kernel forward (docs/design.md#expert-parallelism-inside-the-persistent-kernel),
  // designed to give the staged layer's y bit for bit, which its one-GPU tests (ranks sharing one
  // GPU) confirm; off by default until it has been measured against the staged layer on two GPUs.
  // Needs FP8 token rows with fp8_block (bf16 rows with bf16) and a barrier timeout of at most
  // kMaxFusedBarrierTimeout; takes either partial sums (FP8 ones give the staged FP8 layer's y bit
  // for bit); every rank must choose the same. The phases (dispatch, compute, combine) and
  // last_delivered are the staged layer's only.
  bool fused = false;
  // fused=true only (with partial_sums=bf16 for fc2_stores); every rank must choose the same.
  EpCombine combine = EpCombine::owner_sums;
};

// The fused forward's cross-rank waits run inside a kernel whose own waits trap after ~17 s
// (ptx::kWaitTimeoutCycles) and may follow one of them: a peer must be given up on well before.
inline constexpr std::chrono::milliseconds kMaxFusedBarrierTimeout = kDefaultBarrierTimeout;

class EpLayer {
 public:
  // `spec` describes the whole layer (all E experts, precomputed routing); `local_weights` holds
  // this rank's E / world experts [rank * E / world, (rank + 1) * E / world), packed for a spec
  // with that many experts.
  EpLayer(const MoeSpec& spec, const PackedWeights& local_weights, int max_tokens_per_rank,
          const FileRendezvous& rendezvous, const EpLayerOptions& options = {});
  // The same from packed weights the caller holds elsewhere (host or device memory): copied.
  EpLayer(const MoeSpec& spec, const PackedWeightsView& local_weights, int max_tokens_per_rank,
          const FileRendezvous& rendezvous, const EpLayerOptions& options = {});
  ~EpLayer();
  EpLayer(const EpLayer&) = delete;
  EpLayer& operator=(const EpLayer&) = delete;

  // Collective. inputs: x [T, H] bf16, topk_ids / topk_weights [T, k] with global expert ids
  // (-1 = not routed). forward = dispatch, then compute, then combine; the phases are public so
  // that they can be timed, and must be called in that order, on every rank. Throws the error of
  // check_peers, before launching anything, once check_peers has seen a peer lost.
  void forward(cudaStream_t stream, const MoeInputs& inputs, const MoeOutputs& outputs);

  // Pushes this rank's token rows to their experts' owners; returns once enqueued (no host sync).
  void dispatch(cudaStream_t stream, const MoeInputs& inputs);
  // The local experts on the rows dispatch delivered (their count stays on the device).
  void compute(cudaStream_t stream);
  // Reads this rank's tokens' partial sums from their owners and reduces them into y (with FP8
  // partial sums, quantizing this rank's own first: the combine's cost includes it).
  void combine(cudaStream_t stream, const MoeInputs& inputs, const MoeOutputs& outputs);

  // Collective: returns (on the stream) once every rank has reached it; for benchmarks that time
  // a phase from a common start.
  void synchronize_ranks(cudaStream_t stream);

  // Synchronizes; ids >= E or duplicates seen on this rank since the last call.
  long take_invalid_routing_ids(cudaStream_t stream);

  // Synchronizes `stream`; throws Error(ErrorCode::timeout), naming the barrier, the peer and how
  // long it waited, when a cross-rank barrier of an earlier call gave up because a peer did not
  // arrive within the barrier timeout (it stalled or died). From that barrier on, this rank's
  // expert-parallel kernels return at once without touching any peer's memory and the combine
  // writes NaN into y; the layer stays unusable (every later forward throws the same error), the
  // process and its CUDA context stay usable.
  void check_peers(cudaStream_t stream);

  // What the last forward delivered to this rank (for tests; synchronizes): token rows per source
  // rank [world], then per received row, in canonical order, its (source rank, token) and its k
  // slots as local expert ids (-1: elsewhere or nowhere). Read it before this rank runs anything
  // that lets a peer finish its part of this rank's later collective calls: a peer's next forward
  // of this layer rewrites the counts here before its first barrier.
  struct Delivered {
    std::vector<int32_t> counts;
    std::vector<int32_t> origins;
    std::vector<int32_t> local_ids;
  };
  Delivered last_delivered(cudaStream_t stream) const;

  const MoeSpec& spec() const { return spec_; }
  const layout::EpBufferLayout& buffer_layout() const { return layout_; }
  // How this layer's token rows travel (automatic resolved).
  EpTokenRows token_rows() const { return layout_.fp8_rows ? EpTokenRows::fp8 : EpTokenRows::bf16; }
  EpPartialSums partial_sums() const { return layout_.fp8_partials ? EpPartialSums::fp8 : EpPartialSums::bf16; }
  bool fused() const { return fused_; }
  EpCombine combine() const { return fused_layout_.fc2_stores ? EpCombine::fc2_stores : EpCombine::owner_sums; }
  SymmetricBackend symmetric_memory() const { return buffer_->backend(); }

  // Diagnosis (megamoe-ep-bench --timeline): later calls fold the global timer at the points of
  // layout/ep_timeline.hpp into `stamps` (device, [kEpTimelineEvents][2]: earliest, latest ns;
  // the caller resets them), or a fused layer's at those of layout/forward_timeline.hpp
  // ([kForwardTimelineEvents][2]); null turns it off.
  void set_timeline(unsigned long long* stamps) { timeline_stamps_ = stamps; }

 private:
  kernels::RankBarrierParams barrier_params() const;
  void forward_fused(cudaStream_t stream, const MoeInputs& inputs, const MoeOutputs& outputs);
  // Throws for the phases a fused layer does not have.
  void require_staged(const char* what) const;

  MoeSpec spec_;
  const FileRendezvous& rendezvous_;
  layout::EpBufferLayout layout_;         // the staged layer's buffer (sizes only, where fused)
  bool fused_ = false;
  layout::EpFusedLayout fused_layout_;    // the fused forward's buffer
  size_t signals_offset_ = 0;             // the barrier's signal slots in whichever buffer
  std::unique_ptr<SymmetricMemory> buffer_;
  std::unique_ptr<MoeLayer> local_experts_;
  int num_sms_ = 0;
  // The rows that arrive when every rank's batch is like this rank's last dispatch (at most the
  // buffer's): what the launches after it are planned for, the count itself staying on the device.
  long expected_recv_rows() const;
  int dispatched_tokens_ = 0;             // this rank's batch in the last dispatch or fused forward (plans the tiles)
  uint64_t* barriers_passed_ = nullptr;   // device [1]: barriers run so far, the same count on every rank
  uint64_t* fused_calls_ = nullptr;       // device [1]: fused forwards run so far, likewise
  int32_t* token_dest_ = nullptr;         // [max_tokens, world] position of each token's row per owner
  int32_t* tile_counts_ = nullptr;        // [dispatch tiles, world] count -> push scratch
  int32_t* dest_base_ = nullptr;          // [world]
  int32_t* recv_total_ = nullptr;         // [1] rows received in this call
  uint32_t* tickets_ = nullptr;           // [2] last-block tickets: count, push
  int32_t* error_flags_ = nullptr;
  kernels::RankFault* fault_ = nullptr;   // device [1]: what this rank's barriers record
  long long barrier_timeout_ns_ = 0;
  std::string peer_lost_;                 // check_peers' message once it saw a fault
  unsigned long long* timeline_stamps_ = nullptr;
};

}  // namespace megamoe::comm
