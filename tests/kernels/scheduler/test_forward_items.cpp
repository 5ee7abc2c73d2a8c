// How the single-kernel forward cuts a call into items (scheduler/forward_items.hpp): every token
// is routed and gathered exactly once, whatever the token count and the grid.
#include "kernels/scheduler/forward_items.hpp"

#include <gtest/gtest.h>

#include <vector>

namespace megamoe::kernels {
namespace {

TEST(ForwardItems, EveryTokenIsRoutedAndGatheredOnce) {
  for (int ctas : {1, 7, 132}) {
    for (int tokens : {1, 2, 3, 11, 12, 13, 100, 264, 1000, 4096, 65536}) {
      SCOPED_TRACE(::testing::Message() << tokens << " tokens, " << ctas << " CTAs");
      const ForwardItems items = make_forward_items(nullptr, tokens, ctas);
      // Route items: kFrontWarps tokens each, the last one possibly short.
      EXPECT_EQ(items.route_items, (tokens + kFrontWarps - 1) / kFrontWarps);
      EXPECT_GE(items.route_items * kFrontWarps, tokens);
      EXPECT_LT((items.route_items - 1) * kFrontWarps, tokens);
      // Gather items: none only where one route item holds at most kLoneGatherTokens tokens (it
      // gathers them); else they cover the tokens, none of them empty, about two per CTA.
      const bool lone = items.route_items == 1 && tokens <= kLoneGatherTokens;
      EXPECT_EQ(items.gather_items == 0, lone);
      EXPECT_GE(items.gather_tokens, 1);
      if (!lone) {
        std::vector<int> gathered(tokens, 0);
        for (int item = 0; item < items.gather_items; ++item) {
          const int first = item * items.gather_tokens;
          EXPECT_LT(first, tokens) << "gather item " << item << " is empty";
          for (int t = first; t < first + items.gather_tokens && t < tokens; ++t) ++gathered[t];
        }
        for (int t = 0; t < tokens; ++t) ASSERT_EQ(gathered[t], 1) << "token " << t;
        EXPECT_LE(items.gather_items, 2 * ctas);
      }
      EXPECT_EQ(items.gathered_when_ready(), static_cast<uint32_t>(lone ? 1 : items.gather_items));
    }
  }
}

TEST(ForwardItems, CountersAreTheWorkspaceSlots) {
  uint32_t slots[layout::kForwardCounterSlots] = {};
  const ForwardItems items = make_forward_items(slots, 1, 1);
  EXPECT_EQ(items.counter(kFrontTickets), slots);
  EXPECT_EQ(items.counter(kCtasDone), slots + kCtasDone);
  EXPECT_LE(static_cast<int>(kForwardCounters), layout::kForwardCounterSlots);
}

}  // namespace
}  // namespace megamoe::kernels
