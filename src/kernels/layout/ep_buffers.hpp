// The symmetric buffer of expert parallelism: every rank allocates the same layout, and peers
// address each other's copy over NVLink. The host sizes the allocation with this struct and the
// kernels carve it with it.
//
// A source token sends one row to each rank that owns at least one of its experts (not one row per
// slot): with k = 8 over two ranks that is about 1 row per remote rank instead of about 4. The
// owner runs all its local experts of that token and sends back one partial sum, which the source
// adds up over ranks in rank order.
//
//   counts        int32 [world][world]              token rows source s sends to owner o, at
//                                                   [s][o]; every source writes its row into every
//                                                   rank, so each rank finds its offsets locally
//   recv_origin   int32 [max_recv_rows][2]          (source rank, token) of each received row
//   recv_ids      int32 [max_recv_rows][k]          the token's slots as local expert ids, -1 for
//                                                   slots whose expert lives elsewhere
//   recv_weights  fp32 [max_recv_rows][k]           the token's routing weights
//   recv_tokens   bf16 [max_recv_rows][H]           the token rows, pushed by their sources, in
//                 or e4m3 [max_recv_rows][H]        canonical order (source rank, then token); FP8
//                                                   rows (fp8_block layers) are quantized once by
//                                                   their source, half the bytes on the wire
//   recv_scales   fp32 [H/128][max_recv_rows]       FP8 rows only: row r's scale of channel block b
//                                                   at [b][r] (the layout FC1's row copy reads)
//   partial_sums  bf16 [max_recv_rows][H]           the local pass's output: each received row's
//                                                   weighted sum over this rank's experts, read by
//                                                   the row's source rank in the combine
//   partial_codes e4m3 [max_recv_rows][H]           FP8 partial sums only: each partial sum
//   partial_scales fp32 [max_recv_rows][H/128]      quantized once by its owner per 128 channels,
//                                                   what other ranks read instead (half the bytes)
//   signals       uint64 [kSignalSlots]             barrier arrivals, one slot per source rank
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/layout/moe_workspace.hpp"

namespace megamoe::layout {

// What an expert-parallel buffer (this one, or the fused forward's: layout/ep_fused_buffers.hpp) is
// laid out for.
struct EpShape {
  int world_size = 1;
  int experts_per_rank = 0;
  int top_k = 0;
  int hidden = 0;
  int max_tokens_per_rank = 0;
  bool fp8_rows = false;      // token rows travel as E4M3 codes with per-128 scales, else bf16
  bool fp8_partials = false;  // partial sums travel back as the rows do, else bf16

  MEGAMOE_HOST_DEVICE static constexpr EpShape of(int world_size, int num_experts, int top_k, int hidden,
                                                  int max_tokens_per_rank, bool fp8_rows, bool fp8_partials) {
    return EpShape{world_size, num_experts / world_size, top_k, hidden, max_tokens_per_rank, fp8_rows, fp8_partials};
  }
};

struct EpBufferLayout : EpShape {
  static constexpr int kSignalSlots = 64;  // the most ranks one node holds, with room to spare
  static constexpr int kOriginFields = 2;  // source rank, token

  size_t max_recv_rows = 0;

  size_t counts = 0;
  size_t recv_origin = 0;
  size_t recv_ids = 0;
  size_t recv_weights = 0;
  size_t recv_tokens = 0;
  size_t recv_scales = 0;  // FP8 rows only (0 bytes otherwise)
  size_t partial_sums = 0;
  size_t partial_codes = 0;   // FP8 partial sums only (0 bytes otherwise)
  size_t partial_scales = 0;  // likewise
  size_t signals = 0;
  size_t total_bytes = 0;

  // Every source sends each of its tokens here at most once.
  MEGAMOE_HOST_DEVICE static constexpr size_t worst_case_recv_rows(int world_size, int max_tokens_per_rank) {
    return static_cast<size_t>(world_size) * max_tokens_per_rank;
  }

  MEGAMOE_HOST_DEVICE static constexpr EpBufferLayout make(int world_size, int num_experts, int top_k, int hidden,
                                                           int max_tokens_per_rank, bool fp8_rows,
                                                           bool fp8_partials) {
    EpBufferLayout l;
    static_cast<EpShape&>(l) =
        EpShape::of(world_size, num_experts, top_k, hidden, max_tokens_per_rank, fp8_rows, fp8_partials);
    l.max_recv_rows = worst_case_recv_rows(world_size, max_tokens_per_rank);
    RegionCursor regions;
    l.counts = regions.take(sizeof(int32_t) * world_size * world_size);
    l.recv_origin = regions.take(sizeof(int32_t) * kOriginFields * l.max_recv_rows);
    l.recv_ids = regions.take(sizeof(int32_t) * top_k * l.max_recv_rows);
    l.recv_weights = regions.take(sizeof(float) * top_k * l.max_recv_rows);
    l.recv_tokens = regions.take(l.max_recv_rows * hidden * (fp8_rows ? 1 : 2));
    l.recv_scales = regions.take(fp8_rows ? sizeof(float) * (hidden / 128) * l.max_recv_rows : 0);
    l.partial_sums = regions.take(l.max_recv_rows * hidden * 2);
    l.partial_codes = regions.take(fp8_partials ? l.max_recv_rows * hidden : 0);
    l.partial_scales = regions.take(fp8_partials ? sizeof(float) * (hidden / 128) * l.max_recv_rows : 0);
    l.signals = regions.take(sizeof(uint64_t) * kSignalSlots);
    l.total_bytes = regions.end;
    return l;
  }
};

// The expert slot `slot` of a source's routing [tokens, top_k] is routed to, or -1 when it routes
// nowhere: an id of -1 (not routed), an id outside [0, E), or an id an earlier slot of the same
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

// The ranks a source token sends its row to (bit r: rank r owns one of its routed experts), and in
// `invalid` how many of its slots hold a bad id.
MEGAMOE_HOST_DEVICE inline uint64_t ep_token_destinations(const int32_t* topk_ids, int top_k, int num_experts,
                                                          int experts_per_rank, long token, int* invalid) {
  uint64_t ranks = 0;
  *invalid = 0;
  for (int j = 0; j < top_k; ++j) {
    bool bad = false;
    const int expert = ep_slot_expert(topk_ids, top_k, num_experts, token * top_k + j, &bad);
    *invalid += bad;
    if (expert >= 0) ranks |= uint64_t{1} << (expert / experts_per_rank);
  }
  return ranks;
}

// Slot j of the token as the owner `rank` sees it: its local expert id, or -1 when the slot routes
// nowhere or to another rank.
MEGAMOE_HOST_DEVICE inline int ep_local_slot_expert(const int32_t* topk_ids, int top_k, int num_experts,
                                                    int experts_per_rank, long token, int j, int rank) {
  bool bad = false;
  const int expert = ep_slot_expert(topk_ids, top_k, num_experts, token * top_k + j, &bad);
  return expert >= 0 && expert / experts_per_rank == rank ? expert % experts_per_rank : -1;
}

}  // namespace megamoe::layout
