// EpLayer: the MoE layer expert-parallel across the GPUs of one node, staged:
//   dispatch (count exchange, source lists, NVLink pull) -> the local experts through the
//   single-GPU MoeLayer -> combine (NVLink push back, deterministic weighted reduction).
// One process per GPU (megamoe-run); every call is collective over the ranks.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <vector>

#include "comm/rendezvous.hpp"
#include "comm/symmetric_memory.hpp"
#include "kernels/layout/ep_buffers.hpp"
#include "megamoe/forward.hpp"
#include "megamoe/layer.hpp"

namespace megamoe::comm {

class EpLayer {
 public:
  // `spec` describes the whole layer (all E experts, precomputed routing); `local_weights` holds
  // this rank's E / world experts [rank * E / world, (rank + 1) * E / world), packed for a spec
  // with that many experts.
  EpLayer(const MoeSpec& spec, const PackedWeights& local_weights, int max_tokens_per_rank,
          const FileRendezvous& rendezvous);
  ~EpLayer();
  EpLayer(const EpLayer&) = delete;
  EpLayer& operator=(const EpLayer&) = delete;

  // Collective. inputs: x [T, H] bf16, topk_ids / topk_weights [T, k] with global expert ids
  // (-1 = not routed). Synchronizes `stream` once, to size the local expert pass.
  // forward = dispatch, then compute, then combine; the phases are public so they can be timed.
  void forward(cudaStream_t stream, const MoeInputs& inputs, const MoeOutputs& outputs);

  // Pulls every row routed to this rank's experts; returns how many arrived (synchronizes).
  int dispatch(cudaStream_t stream, const MoeInputs& inputs);
  // The local experts on the `received` rows dispatch delivered.
  void compute(cudaStream_t stream, int received);
  // Pushes the expert rows back and reduces this rank's outputs; ends with every rank done.
  void combine(cudaStream_t stream, const MoeInputs& inputs, const MoeOutputs& outputs);

  // Synchronizes; ids >= E or duplicates seen on this rank since the last call.
  long take_invalid_routing_ids(cudaStream_t stream);

  // What the last forward delivered to this rank (for tests): counts [world][experts_per_rank]
  // and (source rank, token, slot) per received row in canonical order.
  struct Delivered {
    std::vector<int32_t> counts;
    std::vector<int32_t> sources;
  };
  Delivered last_delivered(cudaStream_t stream) const;

  const layout::EpBufferLayout& buffer_layout() const { return layout_; }

 private:
  void barrier(cudaStream_t stream);

  MoeSpec spec_;
  const FileRendezvous& rendezvous_;
  layout::EpBufferLayout layout_;
  std::unique_ptr<SymmetricMemory> buffer_;
  std::unique_ptr<MoeLayer> local_experts_;
  int num_sms_ = 0;
  uint64_t barrier_epoch_ = 0;
  int32_t* slot_rank_ = nullptr;          // [max_tokens, k]
  int32_t* recv_local_expert_ = nullptr;  // [max_recv_rows]
  float* ones_ = nullptr;                 // [max_recv_rows] routing weights of the local pass
  void* expert_rows_ = nullptr;           // bf16 [max_recv_rows, H]
  int32_t* error_flags_ = nullptr;
  int32_t* tile_counts_ = nullptr;        // [dispatch tiles, E] count -> publish scratch
  uint32_t* tiles_done_ = nullptr;        // count kernel's last-block ticket, zero between calls
};

}  // namespace megamoe::comm
