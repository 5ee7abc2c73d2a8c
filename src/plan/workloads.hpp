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
// Throws megamoe::Error(invalid_argument) listing the known names.
const Workload& find_workload(const std::string& name);

inline const std::vector<int> kTokenBuckets = {1, 16, 128, 512, 1024, 2048, 8192};

}  // namespace megamoe::plan
