// Statistics the bench tools report.
#pragma once

#include <algorithm>
#include <vector>

namespace megamoe::bench {

// The middle sample (the upper of the two middle ones for an even count).
inline double median(std::vector<float> samples) {
  std::sort(samples.begin(), samples.end());
  return samples[samples.size() / 2];
}

}  // namespace megamoe::bench
