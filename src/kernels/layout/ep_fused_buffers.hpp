// The symmetric buffer of the fused expert-parallel forward
// (docs/design.md#expert-parallelism-inside-the-persistent-kernel): every rank allocates the same
// layout; a rank writes its own tokens into its ids, weights and rows regions, its owners read them
// over NVLink and store their partial sums into its `returned` region (FP8 partial sums: into its
// returned_codes and returned_scales), or, where FC2 stores into the sources (fc2_stores), each
// expert's output row into its expert_rows region.
//
//   counts_in      int32 [kSignalSlots]            each source's tokens in this call, written by the
//                                                  source into every rank before it arrives
//   ids            int32 [max_tokens][k]           their routing (global expert ids; -1 for a slot
//                                                  that routes nowhere: out of range, or repeating
//                                                  an earlier slot of its token)
//   weights        fp32 [max_tokens][k]
//   rows           e4m3 or bf16 [max_tokens][H]    their rows: quantized once here for fp8_block
//                                                  layers (the gather's rule), bf16 otherwise
//   row_scales     fp32 [H/128][max_tokens]        FP8 rows: token t's scale of channel block b at
//                                                  [b][t] (the layout of MoeInputs::x_scales)
//   returned       bf16 [world][max_tokens][H]     owner o's weighted sum over its experts of this
//                                                  rank's token t, at [o][t]; with FP8 partial sums
//                                                  this rank's own sums of every virtual token
//                                                  (s, t) at [s][t], before they are quantized for s
//                                                  (0 bytes with fc2_stores)
//   expert_rows    bf16 [max_tokens][k][H]         fc2_stores only: the output row of token t's
//                                                  slot j's expert, unweighted, at [t][j], stored
//                                                  there by the expert's owner
//   returned_codes e4m3 [world][max_tokens][H]     FP8 partial sums only: owner o's sum of token t,
//   returned_scales fp32 [world][max_tokens][H/128]  quantized per 128 channels, at [o][t]
//   published      uint64 [kSignalSlots]           arrivals of each source's publication: slot s
//                                                  counts the calls whose rows source s published
//   returned_from  uint64 [kSignalSlots]           arrivals of each owner's partial sums, likewise
//   signals        uint64 [kSignalSlots]           the cross-rank barrier's (EpLayer::synchronize_ranks)
//   source_counts  int32 [kSignalSlots]            this rank's own bookkeeping (no peer reads it):
//   chunk_prefix   int32 [kSignalSlots + 2]        each source's count as its owner saw it, the
//                                                  combine's chunks of the sources before it (at
//                                                  [world] all of them), and at kChunkTokensEntry
//                                                  the tokens a chunk takes
//
// Counters only grow, so call n waits for n arrivals: nothing is reset across ranks. An owner sees
// its work as virtual tokens v = s * max_tokens + t (source rank s, token t), the single kernel's
// items over world * max_tokens rows.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/layout/ep_buffers.hpp"
#include "kernels/layout/moe_workspace.hpp"

namespace megamoe::layout {

struct EpFusedLayout : EpShape {
  static constexpr int kSignalSlots = EpBufferLayout::kSignalSlots;
  static constexpr int kChunkTokensEntry = kSignalSlots + 1;  // chunk_prefix's entry past every rank's
  // Most tokens of one source in a combine chunk, and of a rank in a reduce chunk: a CTA's math
  // threads take up to ~kMaxChunkTokens * H / 8 / 256 vectors each between two claims.
  static constexpr int kMaxChunkTokens = 16;

  size_t counts_in = 0;
  size_t ids = 0;
  size_t weights = 0;
  size_t rows = 0;
  size_t row_scales = 0;  // FP8 rows only (0 bytes otherwise)
  size_t returned = 0;
  size_t returned_codes = 0;   // FP8 partial sums only (0 bytes otherwise)
  size_t returned_scales = 0;  // likewise
  size_t expert_rows = 0;      // fc2_stores only (0 bytes otherwise)
  size_t published = 0;
  size_t returned_from = 0;
  size_t signals = 0;
  size_t source_counts = 0;
  size_t chunk_prefix = 0;
  size_t total_bytes = 0;
  bool fc2_stores = false;  // FC2's epilogue stores each expert's row into its source (EpCombine::fc2_stores)

  // The rows an owner's local pass sees: every source's slots, real or not.
  MEGAMOE_HOST_DEVICE constexpr long virtual_tokens() const {
    return static_cast<long>(world_size) * max_tokens_per_rank;
  }
  MEGAMOE_HOST_DEVICE constexpr size_t row_bytes() const { return static_cast<size_t>(hidden) * (fp8_rows ? 1 : 2); }

  // Tokens a chunk takes when `tokens` are cut into chunks for `ctas` CTAs: as many chunks as CTAs
  // while the tokens allow it (a claim costs a round trip, a CTA without a chunk idles), from 1 to
  // kMaxChunkTokens.
  MEGAMOE_HOST_DEVICE static constexpr int chunk_tokens(long tokens, int ctas) {
    const long per_cta = (tokens + ctas - 1) / ctas;
    return static_cast<int>(per_cta < 1 ? 1 : per_cta > kMaxChunkTokens ? kMaxChunkTokens : per_cta);
  }

  MEGAMOE_HOST_DEVICE static constexpr EpFusedLayout make(int world_size, int num_experts, int top_k, int hidden,
                                                          int max_tokens_per_rank, bool fp8_rows,
                                                          bool fp8_partials, bool fc2_stores) {
    EpFusedLayout l;
    static_cast<EpShape&>(l) =
        EpShape::of(world_size, num_experts, top_k, hidden, max_tokens_per_rank, fp8_rows, fp8_partials);
    l.fc2_stores = fc2_stores;
    const size_t tokens = static_cast<size_t>(max_tokens_per_rank);
    RegionCursor regions;
    l.counts_in = regions.take(sizeof(int32_t) * kSignalSlots);
    l.ids = regions.take(sizeof(int32_t) * top_k * tokens);
    l.weights = regions.take(sizeof(float) * top_k * tokens);
    l.rows = regions.take(tokens * l.row_bytes());
    l.row_scales = regions.take(fp8_rows ? sizeof(float) * (hidden / 128) * tokens : 0);
    l.returned = regions.take(fc2_stores ? 0 : static_cast<size_t>(world_size) * tokens * hidden * 2);
    l.returned_codes = regions.take(fp8_partials ? static_cast<size_t>(world_size) * tokens * hidden : 0);
    l.returned_scales =
        regions.take(fp8_partials ? sizeof(float) * static_cast<size_t>(world_size) * tokens * (hidden / 128) : 0);
    l.expert_rows = regions.take(fc2_stores ? tokens * top_k * hidden * 2 : 0);
    l.published = regions.take(sizeof(uint64_t) * kSignalSlots);
    l.returned_from = regions.take(sizeof(uint64_t) * kSignalSlots);
    l.signals = regions.take(sizeof(uint64_t) * kSignalSlots);
    l.source_counts = regions.take(sizeof(int32_t) * kSignalSlots);
    l.chunk_prefix = regions.take(sizeof(int32_t) * (kChunkTokensEntry + 1));
    l.total_bytes = regions.end;
    return l;
  }
};

}  // namespace megamoe::layout
