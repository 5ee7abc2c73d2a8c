#include "kernels/layout/ep_buffers.hpp"

#include <gtest/gtest.h>

#include "common/layout_checks.hpp"

#include <utility>
#include <vector>

namespace megamoe::layout {
namespace {

TEST(EpBufferLayout, WorstCaseCountsEveryRowARankCanReceive) {
  // 2 ranks, 128 experts each, k=8: a token can send all 8 rows to one rank.
  EXPECT_EQ(EpBufferLayout::worst_case_recv_rows(2, 128, 8, 4096), 2u * 4096 * 8);
  // 64 ranks with 4 experts each: at most 4 rows of a token land on one rank.
  EXPECT_EQ(EpBufferLayout::worst_case_recv_rows(64, 4, 8, 128), 64u * 128 * 4);
}

TEST(EpBufferLayout, RegionsAreAlignedDisjointAndSized) {
  const EpBufferLayout l = EpBufferLayout::make(2, 256, 8, 7168, 4096);
  EXPECT_EQ(l.experts_per_rank, 128);
  const size_t rows = l.max_recv_rows;
  const std::vector<std::pair<size_t, size_t>> regions = {
      {l.send_tokens, 4096ull * 7168 * 2},
      {l.recv_counts, 4 * 2 * 128},
      {l.recv_sources, 12 * rows},
      {l.recv_tokens, rows * 7168 * 2},
      {l.combine_rows, 4096ull * 8 * 7168 * 2},
      {l.arrivals, 4 * 128},
      {l.signals, 8 * EpBufferLayout::kSignalSlots}};
  test::expect_aligned_disjoint(regions, l.total_bytes, kRegionAlignment);
}

}  // namespace
}  // namespace megamoe::layout
