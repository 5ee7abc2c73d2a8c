// The GPU path of megamoe-bench (built with CUDA).
#pragma once

#include <string>

#include "bench_options.hpp"

namespace megamoe::bench {

// True when device 0 is a Hopper GPU; `name` receives its name.
bool hopper_gpu_available(std::string* name);

// Times MoeLayer::forward (a layer built with options.layer) under a CUDA graph for each token
// count, against the floors of docs/design.md#measuring (HBM read bandwidth measured in the same
// run), counts the kernels the graph launches, checks the output against the CPU reference on a
// sample of tokens, prints a table and writes JSON when asked.
int run_gpu(const Options& options, const std::string& gpu_name);

}  // namespace megamoe::bench
