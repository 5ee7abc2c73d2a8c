// The symmetric buffer of expert parallelism: every rank allocates the same layout, and peers
// address each other's copy over NVLink. The host sizes the allocation with this struct and the
// kernels carve it with it.
//
//   send_tokens   bf16 [max_tokens][H]              this rank's tokens, pulled by expert owners
//   recv_counts   int32 [world][experts_per_rank]   rows each source rank sends to each local expert
//   recv_sources  int32 [max_recv_rows][4]          (source rank, token, slot, local expert) of each
//                                                   received row, one 16-byte store
//   recv_tokens   bf16 [max_recv_rows][H]           pulled rows, expert-contiguous, canonical order
//   combine_rows  bf16 [max_tokens * k][H]          expert outputs pushed back by the owners
//   arrivals      uint32 [experts_per_rank]         rows pulled per local expert (release)
//   signals       uint64 [kSignalSlots]             barrier arrivals, one slot per source rank
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/layout/moe_workspace.hpp"

namespace megamoe::layout {

struct EpBufferLayout {
  static constexpr int kSignalSlots = 64;  // the most ranks one node holds, with room to spare
  static constexpr int kSourceFields = 4;  // source rank, token, slot, local expert

  int world_size = 1;
  int experts_per_rank = 0;
  int top_k = 0;
  int hidden = 0;
  int max_tokens_per_rank = 0;
  size_t max_recv_rows = 0;

  size_t send_tokens = 0;
  size_t recv_counts = 0;
  size_t recv_sources = 0;
  size_t recv_tokens = 0;
  size_t combine_rows = 0;
  size_t arrivals = 0;
  size_t signals = 0;
  size_t total_bytes = 0;

  // A token sends at most min(k, experts_per_rank) rows to one rank, so a rank receives at most
  // world * max_tokens * that many rows.
  MEGAMOE_HOST_DEVICE static constexpr size_t worst_case_recv_rows(int world_size, int experts_per_rank, int top_k,
                                                                   int max_tokens_per_rank) {
    const int per_token = top_k < experts_per_rank ? top_k : experts_per_rank;
    return static_cast<size_t>(world_size) * max_tokens_per_rank * per_token;
  }

  MEGAMOE_HOST_DEVICE static constexpr EpBufferLayout make(int world_size, int num_experts, int top_k, int hidden,
                                                           int max_tokens_per_rank) {
    EpBufferLayout l;
    l.world_size = world_size;
    l.experts_per_rank = num_experts / world_size;
    l.top_k = top_k;
    l.hidden = hidden;
    l.max_tokens_per_rank = max_tokens_per_rank;
    l.max_recv_rows = worst_case_recv_rows(world_size, l.experts_per_rank, top_k, max_tokens_per_rank);
    size_t cursor = 0;
    auto take = [&cursor](size_t bytes) {
      const size_t offset = cursor;
      cursor = align_up(cursor + bytes, kRegionAlignment);
      return offset;
    };
    l.send_tokens = take(static_cast<size_t>(max_tokens_per_rank) * hidden * 2);
    l.recv_counts = take(sizeof(int32_t) * world_size * l.experts_per_rank);
    l.recv_sources = take(sizeof(int32_t) * kSourceFields * l.max_recv_rows);
    l.recv_tokens = take(l.max_recv_rows * hidden * 2);
    l.combine_rows = take(static_cast<size_t>(max_tokens_per_rank) * top_k * hidden * 2);
    l.arrivals = take(sizeof(uint32_t) * l.experts_per_rank);
    l.signals = take(sizeof(uint64_t) * kSignalSlots);
    l.total_bytes = cursor;
    return l;
  }
};

// Canonical order of the rows an owner receives: by local expert, then source rank, then the
// slot's rank inside its expert at that source (slot order). The first row of (source rank, local
// expert): rows of earlier local experts from every source (expert_prefix, the exclusive prefix
// over local experts of the rows each receives), then this expert's rows from earlier sources.
// counts: the owner's recv_counts [world][experts_per_rank].
MEGAMOE_HOST_DEVICE inline long ep_segment_base(const int32_t* counts, const int32_t* expert_prefix, int experts_per_rank,
                                                int source_rank, int local_expert) {
  long base = expert_prefix[local_expert];
  for (int s = 0; s < source_rank; ++s) base += counts[s * experts_per_rank + local_expert];
  return base;
}

// The expert slot `slot` of a source's routing [tokens, top_k] sends its row to, or -1 when it
// sends none: an id of -1 (not routed), an id outside [0, E), or an id an earlier slot of the same
// token already holds. `invalid` is set for the last two, which the caller reports.
MEGAMOE_HOST_DEVICE inline int ep_slot_expert(const int32_t* topk_ids, int top_k, int num_experts, long slot,
                                              bool* invalid) {
  const int id = topk_ids[slot];
  *invalid = false;
  if (id == -1) return -1;
  if (id < 0 || id >= num_experts) {
    *invalid = true;
    return -1;
  }
  const long first_of_token = slot - slot % top_k;
  for (long earlier = first_of_token; earlier < slot; ++earlier) {
    if (topk_ids[earlier] == id) {
      *invalid = true;
      return -1;
    }
  }
  return id;
}

}  // namespace megamoe::layout
