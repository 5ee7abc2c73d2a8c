// Kernel launches of the forward: every kernel after the first goes out with programmatic stream
// serialization (see ptx/grid_dependency.cuh), which CUDA graphs keep as programmatic edges.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "kernels/cuda_check.hpp"

namespace megamoe::kernels {

template <class... Params, class... Args>
void launch_overlapping_previous(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes,
                                 cudaStream_t stream, const char* name, Args&&... args) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  cuda_check(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...), name, __FILE__, __LINE__);
}

}  // namespace megamoe::kernels
