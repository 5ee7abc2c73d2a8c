// megamoe-bench: measures one MoE layer configuration and prints what it measured.
//
// On a Hopper GPU (builds with CUDA) it times MoeLayer::forward per token count (gpu_bench.cu).
// Elsewhere it runs the CPU fp64 reference on a reduced problem (fewer experts and tokens than the
// workload, said so in the output) once per token count, checks the quantization-emulating
// reference against unquantized math, and prints the plan the full workload would launch with the
// same MoeLayerOptions and its H200 floors. Bad arguments exit 2 with a message naming them.
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "bench_json.hpp"
#include "cli_args.hpp"
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
      "usage: megamoe-bench [--workload qwen35-a3b|qwen3-30b-a3b|dsv3|SHAPE] [--tokens N[,N...]]\n"
      "                     [--precision bf16|fp8_block|fp8_tensor] [--scales fp32|ue8m0]\n"
      "                     [--input-scales static|dynamic]\n"
      "                     [--routing auto|softmax|grouped|precomputed|balanced] [--experts N] [--seed S]\n"
      "                     [--token-tile auto|16|32|64|128] [--fc1-token-rows auto|pool|row_copy]\n"
      "                     [--combine deterministic|fast] [--num-sms N] [--launch auto|per_stage|single_kernel]\n"
      "                     [--weight-multicast] [--json PATH] [--cpu] [--breakdown] [--warm-l2] [--print-plan]\n"
      "Options take their value as --flag value or --flag=value.\n"
      "  --workload        named workload (default qwen35-a3b), or SHAPE, a layer of your own:\n"
      "                    experts=E,top_k=K,hidden=H,intermediate=I (softmax routing, renormalized;\n"
      "                    --routing picks another), e.g. experts=8,top_k=2,hidden=4096,intermediate=14336\n"
      "  --tokens          token counts, comma-separated (GPU default the buckets 1..8192;\n"
      "                    CPU default %d: the reference runs once per count)\n"
      "  --precision       bf16, fp8_block or fp8_tensor (default fp8_block; fp8_tensor's activation\n"
      "                    scales are calibrated on 64 sample tokens, as a checkpoint's)\n"
      "  --scales          fp8_block scale format (default fp32)\n"
      "  --input-scales    fp8_tensor's activation scales: static (default, calibrated as above) or\n"
      "                    dynamic (computed on the GPU each forward: two more kernels)\n"
      "  --routing         auto = the workload's own routing (default); precomputed = ids drawn\n"
      "                    uniformly; balanced = ids that give every expert the same number of rows\n"
      "  --experts         experts materialized for the CPU reference (default min(E, %d))\n"
      "  --seed            random seed of the generated weights and inputs (default %llu)\n"
      "  --token-tile      MoeLayerOptions::token_tile: tokens per GEMM tile (default auto, the planner's)\n"
      "  --fc1-token-rows  MoeLayerOptions::fc1_token_rows: where fp8 FC1 reads its rows (default auto)\n"
      "  --combine         MoeLayerOptions::combine, the forward's combine (default deterministic)\n"
      "  --num-sms         MoeLayerOptions::num_sms: CTAs of the GEMMs (default 0, every SM)\n"
      "  --launch          MoeLayerOptions::launch: five kernels or one (default auto, the planner's)\n"
      "  --weight-multicast  MoeLayerOptions::weight_multicast: tokens-on-M GEMMs in CTA pairs sharing\n"
      "                    each weight block (experimental, default off)\n"
      "  --json PATH       also write the measured figures as JSON (one record per token count)\n"
      "  --cpu             run the CPU reference even when a Hopper GPU is present\n"
      "  --breakdown       GPU: also time the forward's CUDA graph cut after each node (where time goes);\n"
      "                    a single-kernel forward also prints when its CTAs reached each role's points\n"
      "  --warm-l2         GPU: do not scrub L2 before each timed replay (shows what cold caches cost;\n"
      "                    the figures are then not comparable with the committed results)\n"
      "  --print-plan      GPU: print the plan each token count launches (MoeLayer::describe_plan)\n"
      "                    before the table\n"
      "On a Hopper GPU the forward is timed for each token count; elsewhere the CPU reference runs on\n"
      "a reduced problem and the planner prints what the full workload would launch with these options.\n",
      kCpuDefaultTokens, kCpuDefaultExperts, static_cast<unsigned long long>(Options{}.seed));
}

// The names each choice takes on the command line (the library's to_string names).
template <class T>
using Choices = std::vector<std::pair<std::string, T>>;
const Choices<ScaleFormat> kScaleFormats = {{"fp32", ScaleFormat::fp32}, {"ue8m0", ScaleFormat::ue8m0}};
const Choices<InputScales> kInputScales = {{"static", InputScales::from_checkpoint}, {"dynamic", InputScales::dynamic}};
const Choices<std::string> kRoutings = {
    {"auto", "auto"}, {"softmax", "softmax"}, {"grouped", "grouped"}, {"precomputed", "precomputed"},
    {"balanced", "balanced"}};
const Choices<Fc1TokenRows> kFc1TokenRows = {
    {"auto", Fc1TokenRows::automatic}, {"pool", Fc1TokenRows::pool}, {"row_copy", Fc1TokenRows::row_copy}};
const Choices<ForwardLaunch> kLaunches = {{"auto", ForwardLaunch::automatic},
                                          {"per_stage", ForwardLaunch::per_stage},
                                          {"single_kernel", ForwardLaunch::single_kernel}};
const Choices<CombineMode> kCombineModes = {{"deterministic", CombineMode::deterministic},
                                            {"fast", CombineMode::fast}};

// An integer for a MoeLayerOptions field: its range is megamoe::validate's to check (one owner of
// the message), so any int passes here.
int parse_option_int(const std::string& flag, const std::string& text, const char* what) {
  return static_cast<int>(cli::parse_integer(flag, text, INT_MIN, INT_MAX, what));
}

Options parse(int argc, char** argv) {
  using cli::parse_choice;
  using cli::switch_option;
  using cli::value_option;
  using Value = const std::string&;
  Options o;
  o.provenance = provenance_of_run(argc, argv);
  const auto set = [](bool& flag) { return [&flag] { flag = true; }; };
  cli::parse(argc, argv, {
      switch_option("--help", [] {
        print_usage();
        std::exit(0);
      }),
      switch_option("--cpu", set(o.force_cpu)),
      switch_option("--breakdown", set(o.breakdown)),
      switch_option("--warm-l2", set(o.warm_l2)),
      switch_option("--print-plan", set(o.print_plan)),
      switch_option("--weight-multicast", set(o.layer.weight_multicast)),
      value_option("--workload", [&](Value v) { o.workload = v; }),
      value_option("--tokens", [&](Value v) { o.tokens = cli::parse_count_list("--tokens", v, kMaxLayerTokens); }),
      value_option("--experts",
                   [&](Value v) {
                     o.experts = static_cast<int>(cli::parse_integer("--experts", v, 1, 1 << 24, "a positive integer"));
                   }),
      value_option("--precision", [&](Value v) { o.precision = parse_choice("--precision", v, cli::kPrecisions); }),
      value_option("--input-scales", [&](Value v) { o.input_scales = parse_choice("--input-scales", v, kInputScales); }),
      value_option("--scales", [&](Value v) { o.scale_format = parse_choice("--scales", v, kScaleFormats); }),
      value_option("--routing", [&](Value v) { o.routing = parse_choice("--routing", v, kRoutings); }),
      value_option("--seed", [&](Value v) { o.seed = cli::parse_unsigned("--seed", v); }),
      value_option("--json", [&](Value v) { o.json_path = cli::writable_file("--json", v); }),
      value_option("--token-tile",
                   [&](Value v) {
                     o.layer.token_tile = v == "auto" ? 0 : parse_option_int("--token-tile", v, "auto, 16, 32, 64 or 128");
                   }),
      value_option("--fc1-token-rows",
                   [&](Value v) { o.layer.fc1_token_rows = parse_choice("--fc1-token-rows", v, kFc1TokenRows); }),
      value_option("--combine", [&](Value v) { o.layer.combine = parse_choice("--combine", v, kCombineModes); }),
      value_option("--num-sms", [&](Value v) { o.layer.num_sms = parse_option_int("--num-sms", v, "an integer"); }),
      value_option("--launch", [&](Value v) { o.layer.launch = parse_choice("--launch", v, kLaunches); }),
  });
  if (o.input_scales == InputScales::dynamic && o.precision != Precision::fp8_tensor) {
    throw cli::UsageError(std::string("--input-scales dynamic applies to --precision fp8_tensor, not ") +
                          to_string(o.precision));
  }
  return o;
}

// The CPU reference's reduced problem of the workload `full`: o.experts (default min(E, 16)) of
// its experts, with the routing the bench runs.
MoeSpec reduced_spec(const Options& o, const MoeSpec& full) {
  MoeSpec spec = full;
  spec.num_experts = o.experts.value_or(std::min(full.num_experts, kCpuDefaultExperts));
  spec.routing = routing_for(o, full, spec.num_experts, o.seed);
  return spec;
}

// The workload and the layer options checked before any work, by the library's own checks: an
// unknown workload or options the spec cannot take are usage errors, with the library's message.
void check_usage(const Options& o) {
  MoeSpec spec;
  cli::check_usage([&] {
    spec = plan::find_workload(o.workload).spec;
    spec.precision = o.precision;
    spec.scale_format = o.scale_format;
    validate(o.layer, spec);
    // A shape of the user's own (or a routing the shape cannot split) is judged here too, so that
    // a value the layer cannot take is a usage error naming it, before any weights are made.
    MoeSpec routed = spec;
    routed.routing = routing_for(o, spec, spec.num_experts, o.seed);
    validate(routed);
  });
  // --experts sizes the reduced problem: a count that is not some of the workload's experts, or
  // that its routing cannot split, is refused here, naming the option, not after the weights.
  if (!o.experts) return;
  const std::string experts = std::to_string(*o.experts);
  if (*o.experts > spec.num_experts) {
    throw cli::UsageError("--experts takes at most the " + std::to_string(spec.num_experts) + " experts of " +
                          o.workload + ", got '" + experts + "'");
  }
  try {
    validate(reduced_spec(o, spec));
  } catch (const Error& e) {
    throw cli::UsageError("--experts " + experts + " cannot make a reduced " + o.workload + ": " + e.what());
  }
}

}  // namespace

Routing routing_for(const Options& o, const MoeSpec& workload_spec, int experts, uint64_t seed) {
  std::string mode = o.routing;
  if (mode == "auto") mode = std::holds_alternative<DeepseekGrouped>(workload_spec.routing) ? "grouped" : "softmax";
  if (mode == "softmax") return SoftmaxTopK{.renormalize = true};
  if (mode == "precomputed" || mode == "balanced") return Precomputed{};
  DeepseekGrouped grouped = std::holds_alternative<DeepseekGrouped>(workload_spec.routing)
                                ? std::get<DeepseekGrouped>(workload_spec.routing)
                                : DeepseekGrouped{.n_group = 8, .topk_group = 4, .routed_scaling_factor = 2.5f};
  std::mt19937_64 engine(seed);
  std::uniform_real_distribution<float> bias(-0.05f, 0.05f);
  grouped.e_score_correction_bias.resize(experts);
  for (float& b : grouped.e_score_correction_bias) b = bias(engine);
  return grouped;
}

ref::RandomRouting precomputed_routing(const Options& o, int tokens, int top_k, int experts, uint64_t seed) {
  return o.routing == "balanced" ? ref::make_balanced_routing(tokens, top_k, experts, seed)
                                 : ref::make_random_routing(tokens, top_k, experts, seed);
}

std::string routing_name(const Options& o, const MoeSpec& spec) {
  return o.routing == "balanced" ? "balanced" : to_string(spec.routing);
}

Json options_json(const MoeLayerOptions& options) {
  return Json::object()
      .set("token_tile", options.token_tile)
      .set("fc1_token_rows", to_string(options.fc1_token_rows))
      .set("combine", to_string(options.combine))
      .set("num_sms", options.num_sms)
      .set("launch", to_string(options.launch))
      .set("weight_multicast", options.weight_multicast);
}

Json& set_plan_decisions(Json& record, const plan::ForwardPlan& plan) {
  return record.set("token_tile", plan.token_tile)
      .set("single_kernel", plan.single_kernel)
      .set("fc1_copies_token_rows", plan.fc1_copies_token_rows)
      .set("combine", to_string(plan.combine))
      .set("grid", plan.grid)
      .set("weight_multicast", plan.weight_multicast);
}

namespace {

// One CPU reference forward of `tokens` tokens on the reduced problem, against unquantized math.
struct CpuRun {
  int tokens = 0;
  double reference_s = 0;
  double reference_gflops = 0;
  double rel_err = 0;
  long invalid_ids = 0;
};

CpuRun run_reference(const Options& o, const MoeSpec& spec, const ref::RandomWeights& random_weights,
                     const PackedWeights& packed, int tokens) {
  const uint64_t seed = o.seed;
  const int E = spec.num_experts, H = spec.hidden, k = spec.top_k;
  // Each count's inputs come from the seed alone, so that a count's figures do not depend on the
  // other counts listed with it.
  std::mt19937_64 engine(seed + 1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<bf16_t> x(static_cast<size_t>(tokens) * H);
  for (bf16_t& v : x) v = bf16_t::from_float(normal(engine));
  std::vector<float> logits(static_cast<size_t>(tokens) * E);
  for (float& l : logits) l = normal(engine);
  const ref::RandomRouting precomputed = precomputed_routing(o, tokens, k, E, seed + 2);

  const MoeInputs inputs{tokens, x.data(), logits.data(), precomputed.ids.data(), precomputed.weights.data()};
  std::vector<bf16_t> y(static_cast<size_t>(tokens) * H), y_exact(y.size());
  Progress ref_progress("reference forward, " + std::to_string(tokens) + " tokens, experts");
  const ref::ReferenceReport report =
      ref::reference_forward(spec, packed, inputs, MoeOutputs{y.data()},
                             [&](int done, int total) { ref_progress.update(done, total); });
  CpuRun run;
  run.tokens = tokens;
  run.reference_s = ref_progress.seconds();
  Progress exact_progress("unquantized reference, " + std::to_string(tokens) + " tokens, experts");
  const ref::ReferenceReport exact =
      ref::reference_forward_unquantized(spec, random_weights.view(), inputs, MoeOutputs{y_exact.data()},
                                         [&](int done, int total) { exact_progress.update(done, total); });
  run.rel_err = ref::relative_l2(report.y, exact.y);
  const plan::Floors floors =
      ref::routed_floors(spec, report.routing.ids.data(), tokens, plan::DeviceFacts::h200_measured());
  run.reference_gflops = floors.useful_flops / run.reference_s / 1e9;
  run.invalid_ids = report.invalid_ids;
  return run;
}

std::string join_counts(const std::vector<int>& counts) {
  std::string text;
  for (size_t i = 0; i < counts.size(); ++i) text += (i ? ", " : "") + std::to_string(counts[i]);
  return text;
}

int run_cpu(const Options& o) {
  const plan::Workload& workload = plan::find_workload(o.workload);
  MoeSpec full = workload.spec;
  full.precision = o.precision;
  full.scale_format = o.scale_format;

  // The reduced problem the CPU reference can afford.
  const MoeSpec spec = reduced_spec(o, full);
  const std::vector<int> counts = o.tokens.empty() ? std::vector<int>{kCpuDefaultTokens} : o.tokens;
  const int n_runs = static_cast<int>(counts.size());
  full.routing = spec.routing;
  if (auto* grouped = std::get_if<DeepseekGrouped>(&full.routing)) grouped->e_score_correction_bias.clear();
  validate(spec);

  std::printf("megamoe-bench: no Hopper GPU in use (none found, a CPU-only build, or --cpu);\n"
              "running the CPU fp64 reference on a reduced problem: %d of %d experts, %s.\n\n",
              spec.num_experts, full.num_experts,
              n_runs == 1 ? (std::to_string(counts[0]) + (counts[0] == 1 ? " token" : " tokens")).c_str()
                          : (std::to_string(n_runs) + " runs, one per token count (" + join_counts(counts) + " tokens)")
                                .c_str());
  std::cout << "workload " << workload.name << " (" << workload.description << ")\n  full:    " << full
            << "\n  reduced: " << spec << "\n\n";

  const int E = spec.num_experts, H = spec.hidden, I = spec.intermediate, k = spec.top_k;
  const ref::RandomWeights random_weights = ref::make_random_weights(spec, o.seed, o.input_scales);
  Progress pack_progress("prepare_weights, experts");
  const PackedWeights packed =
      prepare_weights(spec, random_weights.view(), [&](int done, int total) { pack_progress.update(done, total); });
  const double pack_s = pack_progress.seconds();
  std::vector<CpuRun> runs;
  for (int tokens : counts) runs.push_back(run_reference(o, spec, random_weights, packed, tokens));

  // What a GPU run of these counts with these options would launch: the layer megamoe-bench would
  // build (for the largest count) and each count's forward.
  const plan::DeviceFacts h200 = plan::DeviceFacts::h200_measured();
  const plan::LayerPlan layer_plan =
      plan::plan_layer(full, *std::max_element(counts.begin(), counts.end()), o.layer, h200,
                       full.precision == Precision::fp8_tensor ? o.input_scales : InputScales::from_checkpoint);
  std::vector<plan::ForwardPlan> forward_plans;
  std::cout << "planner, full workload on " << h200 << ":\n  " << layer_plan;
  for (int tokens : counts) {
    forward_plans.push_back(plan::plan_forward(full, layer_plan, tokens, o.layer.combine, h200));
    std::cout << "\n  " << forward_plans.back();
  }
  std::cout << "\n\n";

  std::printf("H200 floors of the full workload (%s, uniform routing):\n", to_string(full.precision));
  std::printf("  %7s | %8s | %10s | %10s | %9s | %s\n", "tokens", "experts", "weights MB", "GFLOP", "floor us", "bound");
  bench::Json floors_json = bench::Json::array();
  std::vector<int> buckets = plan::kTokenBuckets;
  for (int tokens : counts) {
    if (std::find(buckets.begin(), buckets.end(), tokens) == buckets.end()) buckets.push_back(tokens);
  }
  std::sort(buckets.begin(), buckets.end());
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

  std::printf("\nmeasured on this CPU (reduced problem: %d experts, %s):\n", E, to_string(spec.precision));
  std::printf("  prepare_weights                 %10.3f s (%.1f MB packed)\n", pack_s,
              (packed.w13.size() + packed.w2.size()) / 1e6);
  bench::Json records = bench::Json::array();
  for (int r = 0; r < n_runs; ++r) {
    const CpuRun& run = runs[r];
    std::printf("  reference run %d of %d: %d token%s\n", r + 1, n_runs, run.tokens, run.tokens == 1 ? "" : "s");
    std::printf("    reference forward (fp64)      %10.3f s (%.2f GFLOP/s useful, %.1f ms/token)\n", run.reference_s,
                run.reference_gflops, run.reference_s * 1e3 / run.tokens);
    std::printf("    rel. L2 error vs unquantized  %10.3e (%s emulation against fp64 math on the bf16 weights)\n",
                run.rel_err, to_string(spec.precision));
    std::printf("    invalid routing ids           %10ld\n", run.invalid_ids);
    bench::Json record = bench::Json::object();
    record.set("tool", "megamoe-bench")
        .set("mode", "cpu-reference")
        .set("workload", workload.name)
        .set("precision", to_string(spec.precision))
        .set("scale_format", to_string(spec.scale_format))
        .set("routing", routing_name(o, spec))
        .set("tokens", run.tokens)
        .set("experts_materialized", E)
        .set("experts_full", full.num_experts)
        .set("hidden", H)
        .set("intermediate", I)
        .set("top_k", k)
        .set("seed", o.seed)
        .set("options", options_json(o.layer));
    set_plan_decisions(record, forward_plans[r])
        .set("plan_device", h200.name)
        .set("prepare_weights_s", pack_s)
        .set("reference_s", run.reference_s)
        .set("reference_gflops", run.reference_gflops)
        .set("rel_err_vs_unquantized", run.rel_err)
        .set("invalid_ids", static_cast<long long>(run.invalid_ids))
        .set("h200_floors", floors_json);
    records.push(std::move(set_provenance(record, o.provenance)));
  }

  if (!o.json_path.empty()) {
    write_json_file(o.json_path, records);
    std::printf("\nwrote %s\n", o.json_path.c_str());
  }
  return 0;
}

}  // namespace
}  // namespace megamoe::bench

int main(int argc, char** argv) {
  return megamoe::bench::cli::run_main("megamoe-bench", [&] {
    const megamoe::bench::Options options = megamoe::bench::parse(argc, argv);
    megamoe::bench::check_usage(options);
#if MEGAMOE_BENCH_HAS_CUDA
    std::string gpu;
    if (!options.force_cpu && megamoe::bench::hopper_gpu_available(&gpu)) return megamoe::bench::run_gpu(options, gpu);
#endif
    return megamoe::bench::run_cpu(options);
  });
}
