#include "kernels/layout/ep_fused_buffers.hpp"

#include <gtest/gtest.h>

#include <utility>
#include <vector>

#include "common/layout_checks.hpp"

namespace megamoe::layout {
namespace {

// Every source's count, a source's own tokens (ids, weights, rows: FP8 codes with scales
// [H / 128][tokens], or bf16), every owner's partial sums of them [world][tokens][H] (and, FP8
// partial sums, their codes and per-128 scales) or, where FC2 stores into the sources, every
// slot's expert row [tokens][k][H], the arrival counters and the barrier's slots, and the owner's
// bookkeeping: aligned, disjoint, each of its size.
TEST(EpFusedLayout, RegionsAreAlignedDisjointAndSized) {
  struct Case {
    bool fp8_rows, fp8_partials, fc2_stores;
  };
  for (const Case c : {Case{false, false, false}, Case{true, false, false}, Case{false, true, false},
                       Case{true, true, false}, Case{false, false, true}, Case{true, false, true}}) {
    const auto [fp8_rows, fp8_partials, fc2_stores] = c;
    const EpFusedLayout l = EpFusedLayout::make(4, 256, 8, 7168, 4096, fp8_rows, fp8_partials, fc2_stores);
    EXPECT_EQ(l.experts_per_rank, 64);
    EXPECT_EQ(l.fp8_rows, fp8_rows);
    EXPECT_EQ(l.fp8_partials, fp8_partials);
    EXPECT_EQ(l.fc2_stores, fc2_stores);
    EXPECT_EQ(l.virtual_tokens(), 4 * 4096);
    EXPECT_EQ(l.row_bytes(), fp8_rows ? 7168u : 2u * 7168);
    const size_t tokens = 4096, slots = EpFusedLayout::kSignalSlots;
    std::vector<std::pair<size_t, size_t>> regions = {
        {l.counts_in, 4 * slots},
        {l.ids, 4 * 8 * tokens},
        {l.weights, 4 * 8 * tokens},
        {l.rows, tokens * l.row_bytes()},
        {l.returned, fc2_stores ? 0 : 4 * tokens * 7168 * 2},
        {l.published, 8 * slots},
        {l.returned_from, 8 * slots},
        {l.signals, 8 * slots},
        {l.source_counts, 4 * slots},
        {l.chunk_prefix, 4 * (slots + 2)}};
    EXPECT_EQ(EpFusedLayout::kChunkTokensEntry, slots + 1) << "past the total of chunks at [world], for any world";
    if (fp8_partials) {  // after `returned`
      regions.insert(regions.begin() + 5, {{l.returned_codes, 4 * tokens * 7168},
                                           {l.returned_scales, 4 * 4 * tokens * (7168 / 128)}});
    }
    if (fc2_stores) {  // after `returned` (FP8 partial sums never come with it)
      regions.insert(regions.begin() + 5, {l.expert_rows, tokens * 8 * 7168 * 2});
    } else {
      EXPECT_EQ(l.expert_rows, l.published) << "no bytes without fc2_stores";
    }
    if (fp8_rows) regions.insert(regions.begin() + 4, {l.row_scales, 4 * (7168 / 128) * tokens});
    test::expect_aligned_disjoint(regions, l.total_bytes, kRegionAlignment);
  }
}

// Both expert-parallel buffers are laid out for the same shape from the same arguments.
TEST(EpFusedLayout, SharesTheStagedLayoutsShape) {
  const EpShape staged = EpBufferLayout::make(2, 16, 4, 256, 64, true, true);
  const EpShape fused = EpFusedLayout::make(2, 16, 4, 256, 64, true, true, false);
  EXPECT_EQ(fused.world_size, staged.world_size);
  EXPECT_EQ(fused.experts_per_rank, staged.experts_per_rank);
  EXPECT_EQ(fused.top_k, staged.top_k);
  EXPECT_EQ(fused.hidden, staged.hidden);
  EXPECT_EQ(fused.max_tokens_per_rank, staged.max_tokens_per_rank);
  EXPECT_EQ(fused.fp8_rows, staged.fp8_rows);
  EXPECT_EQ(fused.fp8_partials, staged.fp8_partials);
}

// Chunks of the combine and the reduce: at most one a CTA while the tokens allow, each of the
// fewest tokens that achieve it (1 to kMaxChunkTokens).
TEST(EpFusedLayout, ChunksGiveEveryCtaWorkWhileTheTokensAllow) {
  constexpr int kMax = EpFusedLayout::kMaxChunkTokens;
  EXPECT_EQ(EpFusedLayout::chunk_tokens(0, 132), 1) << "no tokens: no chunk, and no division by zero";
  EXPECT_EQ(EpFusedLayout::chunk_tokens(1, 132), 1);
  EXPECT_EQ(EpFusedLayout::chunk_tokens(64, 132), 1);
  EXPECT_EQ(EpFusedLayout::chunk_tokens(132, 132), 1);
  EXPECT_EQ(EpFusedLayout::chunk_tokens(133, 132), 2);
  EXPECT_EQ(EpFusedLayout::chunk_tokens(512, 132), 4);
  EXPECT_EQ(EpFusedLayout::chunk_tokens(2048, 132), kMax);
  EXPECT_EQ(EpFusedLayout::chunk_tokens(8L * 65536, 132), kMax) << "capped: the reduce's owners fit its scratch";
  for (const int ctas : {1, 7, 66, 132}) {
    for (long tokens = 1; tokens <= 40L * ctas; tokens += 1 + tokens / 16) {
      const long per = EpFusedLayout::chunk_tokens(tokens, ctas);
      const long chunks = (tokens + per - 1) / per;
      ASSERT_GE(per, 1);
      ASSERT_LE(per, kMax);
      if (tokens <= static_cast<long>(kMax) * ctas) {
        EXPECT_LE(chunks, ctas) << tokens << " tokens on " << ctas << " CTAs";
        if (per > 1) {  // no smaller chunk would do: one token fewer a chunk leaves a CTA two
          EXPECT_GT((tokens + per - 2) / (per - 1), ctas) << tokens << " tokens on " << ctas << " CTAs";
        }
      } else {
        EXPECT_EQ(per, kMax) << tokens << " tokens on " << ctas << " CTAs";
      }
    }
  }
}

}  // namespace
}  // namespace megamoe::layout
