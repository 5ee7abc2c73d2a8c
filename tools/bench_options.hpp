// Options and helpers shared by the CPU and GPU paths of megamoe-bench.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "bench_json.hpp"
#include "megamoe/options.hpp"
#include "megamoe/spec.hpp"
#include "plan/planner.hpp"
#include "ref/random_problem.hpp"

namespace megamoe::bench {

constexpr int kCpuDefaultTokens = 4;
constexpr int kCpuDefaultExperts = 16;

struct Options {
  bool force_cpu = false;
  bool breakdown = false;   // GPU: where the time goes: the graph cut after each of its nodes, and a
                            // single kernel's timeline
  bool warm_l2 = false;     // GPU: skip the L2 scrub before each timed replay (diagnosis only)
  bool print_plan = false;  // GPU: print each token count's MoeLayer::describe_plan before the table
  std::string workload = "qwen35-a3b";
  std::vector<int> tokens;  // empty: the path's default (CPU one call of kCpuDefaultTokens, GPU the buckets)
  std::optional<int> experts;
  Precision precision = Precision::fp8_block;
  ScaleFormat scale_format = ScaleFormat::fp32;
  InputScales input_scales = InputScales::from_checkpoint;  // fp8_tensor: calibrated static or dynamic
  std::string routing = "auto";
  uint64_t seed = 0x5eed;
  std::string json_path;
  MoeLayerOptions layer;    // what the GPU path builds its MoeLayer with, and the CPU path plans with
  Provenance provenance;    // of this run, for every JSON record
};

// The routing the bench runs: the workload's own (auto) or the one --routing names; grouped
// routing gets a random per-expert correction bias, as real checkpoints have.
Routing routing_for(const Options& o, const MoeSpec& workload_spec, int experts, uint64_t seed);

// Precomputed routing's ids and weights: drawn uniformly, or with --routing balanced every expert
// the same number of rows (no expert's last token tile short but where T k / E leaves one).
ref::RandomRouting precomputed_routing(const Options& o, int tokens, int top_k, int experts, uint64_t seed);

// The routing a record names: the spec's, or "balanced" where the precomputed ids are.
std::string routing_name(const Options& o, const MoeSpec& spec);

// A record's "options" (as asked) and the decisions of the plan that launches (as planned),
// the same fields for the CPU and the GPU records.
Json options_json(const MoeLayerOptions& options);
Json& set_plan_decisions(Json& record, const plan::ForwardPlan& plan);

}  // namespace megamoe::bench
