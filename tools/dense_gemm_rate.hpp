// The dense GEMM rate of the GPU the bench runs on, measured in the same run: the compute floor
// of docs/design.md#measuring divides useful FLOPs by it.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "megamoe/spec.hpp"

namespace megamoe::bench {

struct DenseRate {
  double flops_per_s = 0.0;
  std::string method;  // what was timed, for the printout and the JSON
};

// cuBLASLt on an n x n x n problem with the layer's input type (fp8_block: E4M3 inputs with unit
// tensor scales, bf16 out; bf16: bf16 in and out), fp32 accumulation, random inputs; the median of
// timed calls after warm-up. Throws megamoe::Error when cuBLASLt offers no algorithm or fails.
DenseRate measure_dense_rate(Precision precision, cudaStream_t stream, int n = 8192);

}  // namespace megamoe::bench
