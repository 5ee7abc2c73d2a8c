// The GPU path of megamoe-bench (built with CUDA).
#pragma once

#include <string>

#include "bench_options.hpp"

namespace megamoe::bench {

// True when device 0 is a Hopper GPU; `name` receives its name.
bool hopper_gpu_available(std::string* name);

// Times MoeLayer::forward under a CUDA graph for each token count, against the floors of
// DESIGN.md "Measuring" (HBM read bandwidth measured in the same run), checks the output against
// the CPU reference on a sample of tokens, prints a table and writes JSON when asked.
int run_gpu(const Options& options, const std::string& gpu_name);

}  // namespace megamoe::bench
