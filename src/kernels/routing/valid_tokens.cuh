// Rows at or past a device-side token count (MoeInputs::num_valid_tokens) are padding: the router,
// the gather and the combine skip them, so they route nowhere and their y rows are not written.
// The count may be the output of the kernel before the forward: read it after the grid dependency
// wait.
#pragma once

#include <cstdint>

namespace megamoe::kernels {

__device__ __forceinline__ int valid_tokens(int num_tokens, const int32_t* num_valid_tokens) {
  if (num_valid_tokens == nullptr) return num_tokens;
  return min(num_tokens, max(0, *num_valid_tokens));
}

}  // namespace megamoe::kernels
