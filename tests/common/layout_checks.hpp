// Checks shared by the layout tests: regions listed in address order start aligned, do not
// overlap, and fit in the total.
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <utility>
#include <vector>

namespace megamoe::test {

// regions: (offset, bytes) in the order the layout places them.
inline void expect_aligned_disjoint(const std::vector<std::pair<size_t, size_t>>& regions, size_t total_bytes,
                                    size_t alignment) {
  size_t end = 0;
  for (size_t i = 0; i < regions.size(); ++i) {
    const auto& [offset, bytes] = regions[i];
    EXPECT_EQ(offset % alignment, 0u) << "region " << i;
    EXPECT_GE(offset, end) << "region " << i << " overlaps the one before";
    end = offset + bytes;
  }
  EXPECT_GE(total_bytes, end);
}

}  // namespace megamoe::test
