// Kernel launches of the forward: every kernel after the first goes out with programmatic stream
// serialization (see ptx/grid_dependency.cuh), which CUDA graphs keep as programmatic edges.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <utility>

#include "kernels/cuda_check.hpp"

namespace megamoe::kernels {

// Lets kKernel take `bytes` of dynamic shared memory (beyond the 48 KB default) on the current
// device. The attribute belongs to each device's context, so a process that runs layers on
// several GPUs needs it set on every one: each kernel keeps one bit per device ordinal it has set
// it on (ordinals past 63 set it on every call).
template <auto kKernel>
void allow_dynamic_smem(int bytes) {
  static std::atomic<uint64_t> configured_devices{0};
  int device = 0;
  MEGAMOE_CUDA_CHECK(cudaGetDevice(&device));
  const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
  if (bit != 0 && (configured_devices.load(std::memory_order_acquire) & bit) != 0) return;
  MEGAMOE_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  configured_devices.fetch_or(bit, std::memory_order_release);
}

// `cluster_size` > 1 launches the grid in thread-block clusters of that many CTAs along x (the
// grid a multiple of it).
template <class... Params, class... Args>
void launch_overlapping_previous_in_clusters(int cluster_size, void (*kernel)(Params...), dim3 grid, dim3 block,
                                             size_t smem_bytes, cudaStream_t stream, const char* name, Args&&... args) {
  cudaLaunchAttribute attributes[2]{};
  attributes[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attributes[0].val.programmaticStreamSerializationAllowed = 1;
  attributes[1].id = cudaLaunchAttributeClusterDimension;
  attributes[1].val.clusterDim.x = static_cast<unsigned>(cluster_size);
  attributes[1].val.clusterDim.y = 1;
  attributes[1].val.clusterDim.z = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  config.attrs = attributes;
  config.numAttrs = cluster_size > 1 ? 2 : 1;
  cuda_check(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...), name, __FILE__, __LINE__);
}

template <class... Params, class... Args>
void launch_overlapping_previous(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes,
                                 cudaStream_t stream, const char* name, Args&&... args) {
  launch_overlapping_previous_in_clusters(1, kernel, grid, block, smem_bytes, stream, name, std::forward<Args>(args)...);
}

}  // namespace megamoe::kernels
