// The symmetric buffer of expert parallelism: every rank allocates the same layout, and peers
// address each other's copy over NVLink. The host sizes the allocation with this struct and the
// kernels carve it with it.
//
//   recv_counts   int32 [world][experts_per_rank]   written by each source rank (count exchange)
//   recv_sources  int32 [max_recv_rows][3]          (source rank, token, slot) of each received row
//   recv_tokens   [max_recv_rows][H]                pulled token rows, bf16 or E4M3
//   recv_scales   fp32 [H/128][max_recv_rows]       fp8 only, K-block-major for TMA
//   combine_rows  bf16 [max_tokens * k][H]          expert outputs pushed back to the source rank
//   signals       uint64 [kSignalSlots]             arrival counters and cross-rank barrier flags
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/layout/moe_workspace.hpp"

namespace megamoe::layout {

struct EpBufferLayout {
  static constexpr int kSignalSlots = 64;

  int world_size = 1;
  int experts_per_rank = 0;
  int top_k = 0;
  int hidden = 0;
  int max_tokens_per_rank = 0;
  bool fp8 = false;
  size_t max_recv_rows = 0;

  size_t recv_counts = 0;
  size_t recv_sources = 0;
  size_t recv_tokens = 0;
  size_t recv_scales = 0;
  size_t combine_rows = 0;
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
                                                           int max_tokens_per_rank, bool fp8) {
    EpBufferLayout l;
    l.world_size = world_size;
    l.experts_per_rank = num_experts / world_size;
    l.top_k = top_k;
    l.hidden = hidden;
    l.max_tokens_per_rank = max_tokens_per_rank;
    l.fp8 = fp8;
    l.max_recv_rows = worst_case_recv_rows(world_size, l.experts_per_rank, top_k, max_tokens_per_rank);
    size_t cursor = 0;
    auto take = [&cursor](size_t bytes) {
      const size_t offset = cursor;
      cursor = align_up(cursor + bytes, kRegionAlignment);
      return offset;
    };
    l.recv_counts = take(sizeof(int32_t) * world_size * l.experts_per_rank);
    l.recv_sources = take(sizeof(int32_t) * 3 * l.max_recv_rows);
    l.recv_tokens = take(l.max_recv_rows * hidden * (fp8 ? 1 : 2));
    l.recv_scales = take(fp8 ? l.max_recv_rows * (hidden / 128) * sizeof(float) : 0);
    l.combine_rows = take(static_cast<size_t>(max_tokens_per_rank) * top_k * hidden * 2);
    l.signals = take(sizeof(uint64_t) * kSignalSlots);
    l.total_bytes = cursor;
    return l;
  }
};

}  // namespace megamoe::layout
