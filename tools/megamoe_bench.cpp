// megamoe-bench: measures one MoE layer configuration and prints what it measured.
//
// On a Hopper GPU (builds with CUDA) it times MoeLayer::forward per token count (gpu_bench.cu).
// Elsewhere it runs the CPU fp64 reference on a reduced problem (fewer experts and tokens than the
// workload, said so in the output), checks the quantization-emulating reference against
// unquantized math, and prints the planner's configuration and the H200 floors of the full
// workload.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "bench_json.hpp"
#include "megamoe/error.hpp"
#include "megamoe/forward.hpp"
#include "megamoe/weights.hpp"
#include "plan/planner.hpp"
#include "plan/workloads.hpp"
#include "bench_options.hpp"
#if MEGAMOE_BENCH_HAS_CUDA
#include "gpu_bench.hpp"
#endif
#include "progress.hpp"
#include "ref/moe_reference.hpp"
#include "ref/random_problem.hpp"
#include "ref/routing.hpp"

namespace megamoe::bench {
namespace {

void print_usage() {
  std::printf(
      "usage: megamoe-bench [--workload qwen35-a3b|qwen3-30b-a3b|dsv3] [--tokens N]\n"
      "                     [--precision bf16|fp8_block] [--scales fp32|ue8m0]\n"
      "                     [--routing auto|softmax|grouped|precomputed] [--experts N]\n"
      "                     [--seed S] [--json PATH] [--cpu] [--breakdown] [--warm-l2]\n"
      "  --workload   named workload (default qwen35-a3b)\n"
      "  --tokens     tokens in the call (CPU reference default %d)\n"
      "  --precision  bf16 or fp8_block (default fp8_block)\n"
      "  --scales     fp8_block scale format (default fp32)\n"
      "  --routing    auto = the workload's own routing (default)\n"
      "  --experts    experts materialized for the CPU reference (default min(E, %d))\n"
      "  --seed       random seed of the generated weights and inputs\n"
      "  --json PATH  also write the measured figures as JSON\n"
      "  --cpu        run the CPU reference even when a Hopper GPU is present\n"
      "  --breakdown  GPU: also time the forward's CUDA graph cut after each node (where time goes)\n"
      "  --warm-l2    GPU: do not scrub L2 before each timed replay (shows what cold caches cost;\n"
      "               the figures are then not comparable with the committed results)\n"
      "On a Hopper GPU the forward is timed for each token count (--tokens, default the buckets\n"
      "1..8192); elsewhere the CPU reference runs on a reduced problem.\n",
      kCpuDefaultTokens, kCpuDefaultExperts);
}

[[noreturn]] void usage_error(const std::string& message) {
  std::fprintf(stderr, "megamoe-bench: %s\n(run megamoe-bench --help for the options)\n", message.c_str());
  std::exit(2);
}

int parse_positive(const std::string& flag, const std::string& text) {
  char* end = nullptr;
  const long value = std::strtol(text.c_str(), &end, 10);
  if (end == text.c_str() || *end != '\0' || value < 1 || value > 1 << 24) {
    usage_error(flag + " needs a positive integer, got '" + text + "'");
  }
  return static_cast<int>(value);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      print_usage();
      std::exit(0);
    }
    if (flag == "--cpu") {
      o.force_cpu = true;
      continue;
    }
    if (flag == "--breakdown") {
      o.breakdown = true;
      continue;
    }
    if (flag == "--warm-l2") {
      o.warm_l2 = true;
      continue;
    }
    if (i + 1 >= argc) usage_error("missing value after " + flag);
    const std::string value = argv[++i];
    if (flag == "--workload") {
      o.workload = value;
    } else if (flag == "--tokens") {
      o.tokens = parse_positive(flag, value);
    } else if (flag == "--experts") {
      o.experts = parse_positive(flag, value);
    } else if (flag == "--precision") {
      if (value == "bf16") o.precision = Precision::bf16;
      else if (value == "fp8_block") o.precision = Precision::fp8_block;
      else usage_error("--precision takes bf16 or fp8_block, got '" + value + "'");
    } else if (flag == "--scales") {
      if (value == "fp32") o.scale_format = ScaleFormat::fp32;
      else if (value == "ue8m0") o.scale_format = ScaleFormat::ue8m0;
      else usage_error("--scales takes fp32 or ue8m0, got '" + value + "'");
    } else if (flag == "--routing") {
      if (value != "auto" && value != "softmax" && value != "grouped" && value != "precomputed") {
        usage_error("--routing takes auto, softmax, grouped or precomputed, got '" + value + "'");
      }
      o.routing = value;
    } else if (flag == "--seed") {
      o.seed = std::strtoull(value.c_str(), nullptr, 10);
    } else if (flag == "--json") {
      o.json_path = value;
    } else {
      usage_error("unknown option " + flag);
    }
  }
  return o;
}

}  // namespace

Routing routing_for(const Options& o, const MoeSpec& workload_spec, int experts, uint64_t seed) {
  std::string mode = o.routing;
  if (mode == "auto") mode = std::holds_alternative<DeepseekGrouped>(workload_spec.routing) ? "grouped" : "softmax";
  if (mode == "softmax") return SoftmaxTopK{.renormalize = true};
  if (mode == "precomputed") return Precomputed{};
  DeepseekGrouped grouped = std::holds_alternative<DeepseekGrouped>(workload_spec.routing)
                                ? std::get<DeepseekGrouped>(workload_spec.routing)
                                : DeepseekGrouped{.n_group = 8, .topk_group = 4, .routed_scaling_factor = 2.5f};
  std::mt19937_64 engine(seed);
  std::uniform_real_distribution<float> bias(-0.05f, 0.05f);
  grouped.e_score_correction_bias.resize(experts);
  for (float& b : grouped.e_score_correction_bias) b = bias(engine);
  return grouped;
}

namespace {

int run_cpu(const Options& o) {
  const plan::Workload& workload = plan::find_workload(o.workload);
  MoeSpec full = workload.spec;
  full.precision = o.precision;
  full.scale_format = o.scale_format;

  // The reduced problem the CPU reference can afford.
  MoeSpec spec = full;
  spec.num_experts = o.experts.value_or(std::min(full.num_experts, kCpuDefaultExperts));
  const int tokens = o.tokens.value_or(kCpuDefaultTokens);
  spec.routing = routing_for(o, full, spec.num_experts, o.seed);
  full.routing = spec.routing;
  if (auto* grouped = std::get_if<DeepseekGrouped>(&full.routing)) grouped->e_score_correction_bias.clear();
  validate(spec);

  std::printf("megamoe-bench: no Hopper GPU in use (none found, a CPU-only build, or --cpu);\n"
              "running the CPU fp64 reference on a reduced problem: %d of %d experts, %d tokens.\n\n",
              spec.num_experts, full.num_experts, tokens);
  std::cout << "workload " << workload.name << " (" << workload.description << ")\n  full:    " << full
            << "\n  reduced: " << spec << "\n\n";

  const int E = spec.num_experts, H = spec.hidden, I = spec.intermediate, k = spec.top_k;
  const ref::RandomWeights random_weights = ref::make_random_weights(spec, o.seed);
  std::mt19937_64 engine(o.seed + 1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<bf16_t> x(static_cast<size_t>(tokens) * H);
  for (bf16_t& v : x) v = bf16_t::from_float(normal(engine));
  std::vector<float> logits(static_cast<size_t>(tokens) * E);
  for (float& l : logits) l = normal(engine);
  const ref::RandomRouting precomputed = ref::make_random_routing(tokens, k, E, o.seed + 2);

  const WeightsView view = random_weights.view();
  Progress pack_progress("prepare_weights, experts");
  const PackedWeights packed = prepare_weights(spec, view, [&](int done, int total) { pack_progress.update(done, total); });
  const double pack_s = pack_progress.seconds();

  const MoeInputs inputs{tokens, x.data(), logits.data(), precomputed.ids.data(), precomputed.weights.data()};
  std::vector<bf16_t> y(static_cast<size_t>(tokens) * H), y_exact(y.size());
  Progress ref_progress("reference forward, experts");
  const ref::ReferenceReport report =
      ref::reference_forward(spec, packed, inputs, MoeOutputs{y.data()},
                             [&](int done, int total) { ref_progress.update(done, total); });
  const double reference_s = ref_progress.seconds();
  Progress exact_progress("unquantized reference, experts");
  const ref::ReferenceReport exact =
      ref::reference_forward_unquantized(spec, view, inputs, MoeOutputs{y_exact.data()},
                                         [&](int done, int total) { exact_progress.update(done, total); });
  const double rel_err = ref::relative_l2(report.y, exact.y);
  const plan::Floors reduced_floors =
      ref::routed_floors(spec, report.routing.ids.data(), tokens, plan::DeviceFacts::h200_measured());
  const double reference_gflops = reduced_floors.useful_flops / reference_s / 1e9;

  const plan::DeviceFacts h200 = plan::DeviceFacts::h200_measured();
  const plan::LayerPlan layer_plan = plan::plan_layer(full, std::max(tokens, plan::kTokenBuckets.back()), {}, h200);
  std::cout << "\nplanner, full workload on " << h200 << ":\n  " << layer_plan << "\n  "
            << plan::plan_forward(full, layer_plan, tokens, CombineMode::deterministic, h200) << "\n\n";

  std::printf("H200 floors of the full workload (%s, uniform routing):\n", to_string(full.precision));
  std::printf("  %7s | %8s | %10s | %10s | %9s | %s\n", "tokens", "experts", "weights MB", "GFLOP", "floor us", "bound");
  bench::Json floors_json = bench::Json::array();
  std::vector<int> buckets = plan::kTokenBuckets;
  if (std::find(buckets.begin(), buckets.end(), tokens) == buckets.end()) {
    buckets.push_back(tokens);
    std::sort(buckets.begin(), buckets.end());
  }
  for (int bucket : buckets) {
    const plan::Floors f = plan::expected_floors(full, bucket, h200);
    std::printf("  %7d | %8.1f | %10.1f | %10.2f | %9.2f | %s\n", bucket, f.touched_experts, f.weight_bytes / 1e6,
                f.useful_flops / 1e9, f.floor_us, f.bound);
    floors_json.push(bench::Json::object()
                         .set("tokens", bucket)
                         .set("touched_experts", f.touched_experts)
                         .set("weight_bytes", f.weight_bytes)
                         .set("useful_flops", f.useful_flops)
                         .set("floor_us", f.floor_us)
                         .set("bound", f.bound));
  }

  std::printf("\nmeasured on this CPU (reduced problem: %d experts, %d tokens, %s):\n", E, tokens, to_string(spec.precision));
  std::printf("  prepare_weights                 %10.3f s (%.1f MB packed)\n", pack_s,
              (packed.w13.size() + packed.w2.size()) / 1e6);
  std::printf("  reference forward (fp64)        %10.3f s (%.2f GFLOP/s useful, %.1f ms/token)\n", reference_s,
              reference_gflops, reference_s * 1e3 / tokens);
  std::printf("  rel. L2 error vs unquantized    %10.3e (%s emulation against fp64 math on the bf16 weights)\n",
              rel_err, to_string(spec.precision));
  std::printf("  invalid routing ids             %10ld\n", report.invalid_ids);

  if (!o.json_path.empty()) {
    bench::Json record = bench::Json::object();
    record.set("tool", "megamoe-bench")
        .set("mode", "cpu-reference")
        .set("workload", workload.name)
        .set("precision", to_string(spec.precision))
        .set("scale_format", to_string(spec.scale_format))
        .set("routing", to_string(spec.routing))
        .set("tokens", tokens)
        .set("experts_materialized", E)
        .set("experts_full", full.num_experts)
        .set("hidden", H)
        .set("intermediate", I)
        .set("top_k", k)
        .set("seed", static_cast<long long>(o.seed))
        .set("prepare_weights_s", pack_s)
        .set("reference_s", reference_s)
        .set("reference_gflops", reference_gflops)
        .set("rel_err_vs_unquantized", rel_err)
        .set("invalid_ids", static_cast<long long>(report.invalid_ids))
        .set("h200_floors", floors_json);
    write_json_file(o.json_path, record);
    std::printf("\nwrote %s\n", o.json_path.c_str());
  }
  return 0;
}

}  // namespace
}  // namespace megamoe::bench

int main(int argc, char** argv) {
  const megamoe::bench::Options options = megamoe::bench::parse(argc, argv);
  try {
#if MEGAMOE_BENCH_HAS_CUDA
    std::string gpu;
    if (!options.force_cpu && megamoe::bench::hopper_gpu_available(&gpu)) return megamoe::bench::run_gpu(options, gpu);
#endif
    return megamoe::bench::run_cpu(options);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "megamoe-bench: %s\n", e.what());
    return 1;
  }
}
