// The FC2 epilogue's side of expert parallelism's second combine (EpCombine::fc2_stores,
// docs/design.md#expert-parallelism-inside-the-persistent-kernel): each expert output row goes
// straight into its token's source, at [t][j] of the source's expert_rows region
// (layout/ep_fused_buffers.hpp), as its FC2 tile finishes; the source sums them (ep_fused_roles.cuh).
#pragma once

#include <cuda_bf16.h>

#include <cstddef>

#include "kernels/comm/ep_fused_params.hpp"
#include "kernels/comm/ep_rows.cuh"
#include "kernels/comm/peer_wait.cuh"
#include "kernels/comm/rank_fault.hpp"

namespace megamoe::kernels {

// FC2's parameters with the slot rows in the sources' buffers. The owner's slots are those of its
// virtual tokens v = s * max_tokens + t: slot v * k + j, whose row belongs at [t][j] of source s.
template <class Fc2Params>
struct Fc2StoresToSources : Fc2Params {
  static constexpr bool kStoresToPeers = true;
  void* const* peer_bases;  // [world] every rank's symmetric buffer
  size_t expert_rows;       // the region's offset in each of them
  int rank;                 // this rank (the owner)
  int slots_per_source;     // max_tokens * k (32-bit division: a 64-bit one spilled the epilogue)
  const RankFault* fault;   // this rank's

  // After a fault no peer's memory is touched (a lost peer's buffer may be gone): the rows go to
  // this rank's own region, whose sums are NaN from then on anyway.
  __device__ __forceinline__ __nv_bfloat16* slot_row(int slot) const {
    const int source = slot / slots_per_source;
    const int row = slot - source * slots_per_source;
    const int to = rank_fault_seen(fault) ? rank : source;
    return ep_detail::region<__nv_bfloat16>(peer_bases[to], expert_rows) + static_cast<size_t>(row) * this->out_channels;
  }
};

// `fc2` as the fused forward `ep` launches it with fc2_stores (host).
template <class Fc2Params>
Fc2StoresToSources<Fc2Params> stores_to_sources(const Fc2Params& fc2, const EpFusedParams& ep) {
  Fc2StoresToSources<Fc2Params> p{};
  static_cast<Fc2Params&>(p) = fc2;
  p.peer_bases = ep.peer_bases;
  p.expert_rows = ep.layout.expert_rows;
  p.rank = ep.rank;
  p.slots_per_source = ep.layout.max_tokens_per_rank * ep.layout.top_k;
  p.fault = ep.fault;
  return p;
}

}  // namespace megamoe::kernels
