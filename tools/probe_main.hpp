// The frame of the diagnosis probes' main(): no arguments, a Hopper GPU, one stream, and any error
// reported under the probe's name.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstring>
#include <exception>

#include "kernels/cuda_check.hpp"

namespace megamoe::bench {

// Runs probe(prop, stream) on device 0; returns main's exit status. --help alone prints the usage
// and exits 0; any other argument is refused (exit 2).
template <class Probe>
int run_probe(const char* name, int argc, char** argv, Probe&& probe) {
  if (argc > 1) {
    const bool help = argc == 2 && std::strcmp(argv[1], "--help") == 0;
    std::fprintf(help ? stdout : stderr, "usage: %s (no arguments; the cases are fixed, see the source header)\n",
                 name);
    return help ? 0 : 2;
  }
  try {
    cudaDeviceProp prop{};
    MEGAMOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    if (prop.major != 9) {
      std::fprintf(stderr, "%s needs a Hopper GPU (sm_90); found %s (sm_%d%d)\n", name, prop.name, prop.major,
                   prop.minor);
      return 1;
    }
    cudaStream_t stream;
    MEGAMOE_CUDA_CHECK(cudaStreamCreate(&stream));
    probe(prop, stream);
    MEGAMOE_CUDA_CHECK(cudaStreamDestroy(stream));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", name, e.what());
    return 1;
  }
  return 0;
}

}  // namespace megamoe::bench
