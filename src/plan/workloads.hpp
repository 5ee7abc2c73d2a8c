// The named workloads of docs/design.md#measuring and the token buckets we report.
#pragma once

#include <string>
#include <vector>

#include "megamoe/spec.hpp"

namespace megamoe::plan {

struct Workload {
  std::string name;
  std::string description;
  MoeSpec spec;  // precision left at bf16; callers set it
};

const std::vector<Workload>& named_workloads();
// A named workload, or a layer of the user's own shape given as
// "experts=E,top_k=K,hidden=H,intermediate=I" (every key once, in any order; softmax routing with
// renormalized weights, as Mixtral and Qwen route), named by the string itself. Throws
// megamoe::Error(invalid_argument) listing the known names, or saying what a shape lacks; the
// values are the spec's to judge (megamoe::validate).
Workload find_workload(const std::string& name);

inline const std::vector<int> kTokenBuckets = {1, 16, 128, 512, 1024, 2048, 8192};

}  // namespace megamoe::plan
