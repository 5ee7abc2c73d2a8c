// Position in a ring of pipeline stages: which stage, and the parity of its current phase.
#pragma once

#include <cstdint>

namespace megamoe::pipeline {

template <int kStages>
struct PipelineState {
  int stage = 0;
  uint32_t phase = 0;

  __device__ __forceinline__ void advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
};

}  // namespace megamoe::pipeline
