// Options and helpers shared by the CPU and GPU paths of megamoe-bench.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "megamoe/spec.hpp"

namespace megamoe::bench {

constexpr int kCpuDefaultTokens = 4;
constexpr int kCpuDefaultExperts = 16;

struct Options {
  bool force_cpu = false;
  bool breakdown = false;  // GPU: also time the forward's graph cut after each of its nodes
  bool warm_l2 = false;    // GPU: skip the L2 scrub before each timed replay (diagnosis only)
  std::string workload = "qwen35-a3b";
  std::optional<int> tokens;
  std::optional<int> experts;
  Precision precision = Precision::fp8_block;
  ScaleFormat scale_format = ScaleFormat::fp32;
  std::string routing = "auto";
  uint64_t seed = 0x5eed;
  std::string json_path;
};

// The routing the bench runs: the workload's own (auto) or the one --routing names; grouped
// routing gets a random per-expert correction bias, as real checkpoints have.
Routing routing_for(const Options& o, const MoeSpec& workload_spec, int experts, uint64_t seed);

}  // namespace megamoe::bench
