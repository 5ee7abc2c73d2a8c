#include "gpu_bench.hpp"

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cxxabi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <optional>
#include <vector>

#include "bench_json.hpp"
#include "buffer_reader.cuh"
#include "dense_gemm_rate.hpp"
#include "device_timing.hpp"
#include "kernels/cuda_check.hpp"
#include "kernels/layout/forward_timeline.hpp"
#include "megamoe/error.hpp"
#include "megamoe/layer.hpp"
#include "plan/planner.hpp"
#include "plan/workloads.hpp"
#include "progress.hpp"
#include "ref/moe_reference.hpp"
#include "ref/random_problem.hpp"
#include "ref/routing.hpp"
#include "stamp_timeline.hpp"
#include "unfused_baseline.hpp"

namespace megamoe::bench {
namespace {

constexpr Replays kReplays{10, 100};
constexpr int kCheckedTokens = 32;  // rows compared with the CPU reference per token count

// The nodes of a captured forward in launch order (one captured stream makes a chain).
std::vector<cudaGraphNode_t> graph_chain(cudaGraph_t graph) {
  size_t count = 0;
  MEGAMOE_CUDA_CHECK(cudaGraphGetRootNodes(graph, nullptr, &count));
  if (count != 1) throw Error(ErrorCode::unsupported, "--breakdown expects a chain graph, found " + std::to_string(count) + " roots");
  std::vector<cudaGraphNode_t> chain(1);
  MEGAMOE_CUDA_CHECK(cudaGraphGetRootNodes(graph, chain.data(), &count));
  for (;;) {
    MEGAMOE_CUDA_CHECK(cudaGraphNodeGetDependentNodes(chain.back(), nullptr, nullptr, &count));
    if (count == 0) return chain;
    if (count != 1) throw Error(ErrorCode::unsupported, "--breakdown expects a chain graph, a node has " + std::to_string(count) + " dependents");
    cudaGraphNode_t next = nullptr;
    cudaGraphEdgeData edge{};  // programmatic edges between the kernels are not default edges
    MEGAMOE_CUDA_CHECK(cudaGraphNodeGetDependentNodes(chain.back(), &next, &edge, &count));
    chain.push_back(next);
  }
}

// "void megamoe::kernels::gather_quantize_kernel<true>(megamoe::kernels::GatherParams)" -> "gather_quantize_kernel".
std::string node_name(cudaGraphNode_t node) {
  cudaGraphNodeType type;
  MEGAMOE_CUDA_CHECK(cudaGraphNodeGetType(node, &type));
  if (type == cudaGraphNodeTypeMemset) return "memset";
  if (type != cudaGraphNodeTypeKernel) return "graph node of type " + std::to_string(static_cast<int>(type));
  cudaKernelNodeParams params{};
  MEGAMOE_CUDA_CHECK(cudaGraphKernelNodeGetParams(node, &params));
  const char* mangled = nullptr;
  MEGAMOE_CUDA_CHECK(cudaFuncGetName(&mangled, params.func));
  int status = 0;
  char* demangled = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  std::string name = status == 0 && demangled ? demangled : mangled;
  std::free(demangled);
  name = name.substr(0, name.find_first_of("<("));
  const size_t scope = name.rfind("::");
  return scope == std::string::npos ? name : name.substr(scope + 2);
}

// The kernels one replay of `graph` launches: its kernel nodes, those of child graphs included.
int count_kernel_launches(cudaGraph_t graph) {
  size_t count = 0;
  MEGAMOE_CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &count));
  std::vector<cudaGraphNode_t> nodes(count);
  if (count > 0) MEGAMOE_CUDA_CHECK(cudaGraphGetNodes(graph, nodes.data(), &count));
  int kernels = 0;
  for (size_t i = 0; i < count; ++i) {
    cudaGraphNodeType type;
    MEGAMOE_CUDA_CHECK(cudaGraphNodeGetType(nodes[i], &type));
    if (type == cudaGraphNodeTypeKernel) {
      ++kernels;
    } else if (type == cudaGraphNodeTypeGraph) {
      cudaGraph_t child = nullptr;
      MEGAMOE_CUDA_CHECK(cudaGraphChildGraphNodeGetGraph(nodes[i], &child));
      kernels += count_kernel_launches(child);
    }
  }
  return kernels;
}

// Median microseconds of replays of `graph`, `before_replay` running outside the timed events.
template <class BeforeReplay>
double median_graph_us(cudaGraph_t graph, cudaStream_t stream, BeforeReplay& before_replay) {
  cudaGraphExec_t exec;
  MEGAMOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  const double ms = median_ms(stream, kReplays, [&] { MEGAMOE_CUDA_CHECK(cudaGraphLaunch(exec, stream)); }, before_replay);
  cudaGraphExecDestroy(exec);
  return 1e3 * ms;
}

__global__ void empty_kernel() {}

// What a replay costs before any of the forward's work: a graph of one empty kernel, timed like
// the forward. Node 0 of the breakdown includes this much.
template <class BeforeReplay>
double time_empty_graph(cudaStream_t stream, BeforeReplay& before_replay) {
  cudaGraph_t graph = capture_graph(stream, [&] {
    empty_kernel<<<1, 32, 0, stream>>>();
    MEGAMOE_CUDA_CHECK(cudaGetLastError());
  });
  const double us = median_graph_us(graph, stream, before_replay);
  cudaGraphDestroy(graph);
  return us;
}

// Where the forward's time goes, measured inside the graph: the graph cut after each node is timed
// like the whole, and each node is charged the difference, launch gaps included.
template <class BeforeReplay>
Json time_graph_prefixes(cudaGraph_t graph, cudaStream_t stream, BeforeReplay& before_replay, int tokens) {
  const std::vector<cudaGraphNode_t> chain = graph_chain(graph);
  Json nodes = Json::array();
  std::printf("    where the time goes at %d tokens (graph cut after each node):\n", tokens);
  const double launch_floor_us = time_empty_graph(stream, before_replay);
  std::printf("         graph of one empty kernel          %8.1f us  (launch floor, inside node 0)\n", launch_floor_us);
  nodes.push(Json::object().set("node", "empty_kernel_graph").set("cumulative_us", launch_floor_us).set("added_us", 0.0));
  double previous_us = 0;
  for (size_t i = 0; i < chain.size(); ++i) {
    cudaGraph_t cut;
    MEGAMOE_CUDA_CHECK(cudaGraphClone(&cut, graph));
    for (size_t j = chain.size(); j-- > i + 1;) {
      cudaGraphNode_t cloned = nullptr;
      MEGAMOE_CUDA_CHECK(cudaGraphNodeFindInClone(&cloned, chain[j], cut));
      MEGAMOE_CUDA_CHECK(cudaGraphDestroyNode(cloned));
    }
    const double us = median_graph_us(cut, stream, before_replay);
    cudaGraphDestroy(cut);
    const std::string name = node_name(chain[i]);
    std::printf("      %2zu %-34s +%8.1f us  (cumulative %8.1f us)\n", i, name.c_str(), us - previous_us, us);
    nodes.push(Json::object().set("node", name).set("cumulative_us", us).set("added_us", us - previous_us));
    previous_us = us;
  }
  return nodes;
}

// A single-kernel forward's timeline (layout/forward_timeline.hpp): its graph captured again with
// the layer's timeline on, replayed like the timed graph, the medians printed and returned.
template <class Forward, class BeforeReplay>
Json time_single_kernel_roles(MoeLayer& layer, cudaStream_t stream, Forward&& forward, BeforeReplay& before_replay,
                              int tokens) {
  StampTimeline timeline(layout::kForwardTimelineEvents, layout::kForwardTimelineEventNames);
  layer.set_timeline(timeline.stamps());
  cudaGraph_t graph = capture_graph(stream, forward);
  layer.set_timeline(nullptr);
  cudaGraphExec_t exec;
  MEGAMOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < kReplays.timed; ++i) {
    before_replay();
    timeline.preset(stream);
    MEGAMOE_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    timeline.collect(stream, layout::kForwardStart);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  std::printf("    the single kernel's roles at %d tokens (median of %d replays, after the first CTA's start):\n%s",
              tokens, kReplays.timed, timeline.lines("      ").c_str());
  return timeline.json();
}

double measure_hbm_read_bytes_per_s(cudaStream_t stream, int num_sms) {
  BufferReader reader(stream, size_t{2} << 30, num_sms);
  const double ms = median_ms(stream, kReplays, reader);
  return reader.bytes() / (ms * 1e-3);
}

}  // namespace

bool hopper_gpu_available(std::string* name) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    return false;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess || prop.major != 9) return false;
  *name = prop.name;
  return true;
}

int run_gpu(const Options& o, const std::string& gpu_name) {
  const plan::Workload& workload = plan::find_workload(o.workload);
  MoeSpec spec = workload.spec;
  spec.precision = o.precision;
  spec.scale_format = o.scale_format;
  spec.routing = routing_for(o, workload.spec, spec.num_experts, o.seed);
  validate(spec);
  const std::vector<int> token_counts = o.tokens.empty() ? plan::kTokenBuckets : o.tokens;
  const int max_tokens = *std::max_element(token_counts.begin(), token_counts.end());

  cudaDeviceProp prop{};
  MEGAMOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("megamoe-bench on %s (%d SMs): %s, %s\n", gpu_name.c_str(), prop.multiProcessorCount,
              workload.name.c_str(), to_string(spec.precision));
  cudaStream_t stream;
  MEGAMOE_CUDA_CHECK(cudaStreamCreate(&stream));

  plan::DeviceFacts facts = plan::DeviceFacts::h200_measured();
  facts.name = gpu_name;
  facts.num_sms = prop.multiProcessorCount;
  facts.smem_per_block_optin = static_cast<int>(prop.sharedMemPerBlockOptin);
  facts.hbm_read_bytes_per_s = measure_hbm_read_bytes_per_s(stream, prop.multiProcessorCount);
  // The compute floor's dense rate, measured now; the H200 figure (docs/decisions.md#h200-facts)
  // stands in (and the output says so) when cuBLASLt cannot run the problem.
  std::string dense_rate_source;
  try {
    const DenseRate dense = measure_dense_rate(spec.precision, stream);
    (spec.precision == Precision::bf16 ? facts.dense_bf16_flops_per_s : facts.dense_fp8_flops_per_s) =
        dense.flops_per_s;
    dense_rate_source = dense.method;
  } catch (const Error& e) {
    dense_rate_source = std::string("docs/decisions.md#h200-facts figure; measuring it failed: ") + e.what();
  }
  std::printf("  HBM read bandwidth measured now: %.2f TB/s\n  dense %s rate %.0f TFLOP/s (%s)\n",
              facts.hbm_read_bytes_per_s / 1e12, to_string(spec.precision), facts.dense_flops_per_s(spec.precision) / 1e12,
              dense_rate_source.c_str());

  const ref::RandomWeights weights = ref::make_random_weights(spec, o.seed, o.input_scales);
  PackedWeights packed;
  {
    Progress progress("prepare_weights, experts");
    packed = prepare_weights(spec, weights.view(), [&](int done, int total) { progress.update(done, total); });
  }
  MoeLayer layer(spec, packed, max_tokens, o.layer);
  // The plan's decisions for the records, from the planner with the layer's inputs; each count's
  // is checked against the layer's own describe_plan, the plan its forward launches.
  const plan::LayerPlan layer_plan = plan::plan_layer(spec, max_tokens, o.layer, facts, packed.input_scales);
  std::vector<plan::ForwardPlan> forward_plans;
  for (int tokens : token_counts) {
    forward_plans.push_back(plan::plan_forward(spec, layer_plan, tokens, o.layer.combine, facts));
    std::ostringstream mine;
    mine << forward_plans.back();
    const std::string launched = layer.describe_plan(tokens, o.layer.combine);
    if (launched.size() < mine.str().size() ||
        launched.compare(launched.size() - mine.str().size(), std::string::npos, mine.str()) != 0) {
      throw std::logic_error("internal: the bench's plan of " + std::to_string(tokens) +
                             " tokens differs from the layer's:\n" + mine.str() + "\nlayer:\n" + launched);
    }
  }
  // A layer's weights are not in L2 when a model runs it (the other layers' weights passed through
  // since), but a replayed graph finds them there when they fit (qwen35 at 1 token touches 25 MB
  // of a 60 MB L2). Reading twice the L2 size before each timed replay evicts them and leaves only
  // clean lines behind (a write would leave dirty lines whose write-back the replay would pay).
  BufferReader scrub(stream, 2 * static_cast<size_t>(prop.l2CacheSize), prop.multiProcessorCount);
  auto before_replay = [&] {
    if (!o.warm_l2) scrub();
  };
  if (o.warm_l2) std::printf("  --warm-l2: L2 is NOT scrubbed between replays; not comparable with committed results\n");
  UnfusedBaseline baseline(spec, weights.view(), max_tokens);
  std::printf("  workspace %.1f MiB for up to %d tokens\n", layer.workspace_bytes() / 1048576.0, max_tokens);
  std::cout << "  options " << o.layer << "\n";
  std::printf("  baseline: routing given, host-built permutation, grouped cuBLAS bf16 GEMMs (one call per layer GEMM), plain kernels\n\n");

  if (o.print_plan) {
    for (int tokens : token_counts) {
      std::printf("  plan of a forward of %d tokens (MoeLayer::describe_plan):\n", tokens);
      std::istringstream lines(layer.describe_plan(tokens, o.layer.combine));
      for (std::string line; std::getline(lines, line);) std::printf("    %s\n", line.c_str());
    }
    std::printf("\n");
  }

  // rel err: against the quantization-emulating reference; exact err: against unquantized math
  // (what the precision's quantization costs); base err: the bf16 baseline's, against the latter.
  std::printf("  %6s | %9s | %9s | %9s | %9s | %11s | %9s | %9s | %11s | %10s | %9s | %8s\n", "tokens", "median us",
              "floor us", "x floor", "TFLOP/s", "weight TB/s", "rel err", "exact err", "baseline us", "x baseline",
              "base err", "launches");
  Json records = Json::array();
  std::mt19937_64 engine(o.seed + 7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (size_t count_index = 0; count_index < token_counts.size(); ++count_index) {
    const int tokens = token_counts[count_index];
    const int H = spec.hidden, E = spec.num_experts, k = spec.top_k;
    std::vector<bf16_t> x(static_cast<size_t>(tokens) * H);
    for (bf16_t& v : x) v = bf16_t::from_float(normal(engine));
    std::vector<float> logits(static_cast<size_t>(tokens) * E);
    for (float& l : logits) l = normal(engine);
    std::vector<int32_t> ids;
    std::vector<float> weights_host;
    if (std::holds_alternative<Precomputed>(spec.routing)) {
      ref::RandomRouting routing = precomputed_routing(o, tokens, k, E, o.seed + tokens);
      ids = std::move(routing.ids);
      weights_host = std::move(routing.weights);
    } else {
      const ref::RoutingResult routing = ref::route(spec, logits.data(), tokens);
      ids = routing.ids;
      weights_host = routing.weights;
    }
    DeviceBuffer x_dev(x.size() * 2), logits_dev(logits.size() * 4), ids_dev(ids.size() * 4),
        weights_dev(weights_host.size() * 4), y_dev(x.size() * 2);
    x_dev.upload(x);
    logits_dev.upload(logits);
    ids_dev.upload(ids);
    weights_dev.upload(weights_host);
    MEGAMOE_CUDA_CHECK(cudaMemsetAsync(y_dev.as<void>(), 0xFF, x.size() * 2, stream));
    const MoeInputs inputs{tokens, x_dev.as<void>(), logits_dev.as<float>(), ids_dev.as<int32_t>(), weights_dev.as<float>()};

    const auto forward = [&] { layer.forward(stream, inputs, MoeOutputs{y_dev.as<void>()}, o.layer.combine); };
    cudaGraph_t graph = capture_graph(stream, forward);
    const int launches = count_kernel_launches(graph);
    const double us = median_graph_us(graph, stream, before_replay);
    Json breakdown = Json::array(), roles = Json::array();
    if (o.breakdown) breakdown = time_graph_prefixes(graph, stream, before_replay, tokens);
    cudaGraphDestroy(graph);
    if (o.breakdown && forward_plans[count_index].single_kernel) {
      roles = time_single_kernel_roles(layer, stream, forward, before_replay, tokens);
    }

    // The first rows against the CPU reference (routing is per token, so a prefix is a valid call).
    std::vector<bf16_t> y(x.size());
    MEGAMOE_CUDA_CHECK(cudaMemcpy(y.data(), y_dev.as<void>(), y.size() * 2, cudaMemcpyDeviceToHost));
    const int checked = std::min(tokens, kCheckedTokens);
    std::vector<bf16_t> y_ref(static_cast<size_t>(checked) * H);
    // Dynamic activation scales come from all `tokens`: the reference on the first rows applies the
    // layer's (the tests check how the layer computes them).
    std::optional<ref::ActivationScaleOverride> scales;
    if (spec.precision == Precision::fp8_tensor && packed.input_scales == InputScales::dynamic) {
      const MoeLayer::ActivationScales used = layer.activation_scales(stream);
      scales = ref::ActivationScaleOverride{used.fc1, used.fc2};
    }
    const ref::ReferenceReport ref = ref::reference_forward(
        spec, packed, MoeInputs{checked, x.data(), logits.data(), ids.data(), weights_host.data()},
        MoeOutputs{y_ref.data()}, {}, scales);
    std::vector<double> y_device(ref.y.size());
    for (size_t i = 0; i < y_device.size(); ++i) y_device[i] = y[i].to_float();
    const double rel_err = ref::relative_l2(y_device, ref.y);
    const std::vector<double> y_layer = y_device;

    // The baseline on the same inputs, checked against unquantized math (it computes in bf16).
    MEGAMOE_CUDA_CHECK(cudaMemsetAsync(y_dev.as<void>(), 0xFF, x.size() * 2, stream));
    const double baseline_us = 1e3 * median_ms(stream, kReplays, [&] {
      baseline.forward(stream, tokens, x_dev.as<void>(), ids_dev.as<int32_t>(), weights_dev.as<float>(), y_dev.as<void>());
    }, before_replay);
    MEGAMOE_CUDA_CHECK(cudaMemcpy(y.data(), y_dev.as<void>(), y.size() * 2, cudaMemcpyDeviceToHost));
    std::vector<bf16_t> y_exact(static_cast<size_t>(checked) * H);
    const ref::ReferenceReport exact = ref::reference_forward_unquantized(
        spec, weights.view(), MoeInputs{checked, x.data(), logits.data(), ids.data(), weights_host.data()},
        MoeOutputs{y_exact.data()});
    for (size_t i = 0; i < y_device.size(); ++i) y_device[i] = y[i].to_float();
    const double baseline_rel_err = ref::relative_l2(y_device, exact.y);
    const double unquantized_rel_err = ref::relative_l2(y_layer, exact.y);

    const plan::Floors floors = ref::routed_floors(spec, ids.data(), tokens, facts);
    std::printf("  %6d | %9.1f | %9.1f | %9.2f | %9.1f | %11.2f | %9.2e | %9.2e | %11.1f | %10.2f | %9.2e | %8d\n",
                tokens, us, floors.floor_us, us / floors.floor_us, floors.useful_flops / (us * 1e-6) / 1e12,
                floors.weight_bytes / (us * 1e-6) / 1e12, rel_err, unquantized_rel_err, baseline_us, us / baseline_us,
                baseline_rel_err, launches);
    std::fflush(stdout);
    Json record = Json::object();
    record.set("workload", workload.name)
        .set("precision", to_string(spec.precision))
        .set("routing", routing_name(o, spec))
        .set("input_scales", spec.precision != Precision::fp8_tensor                  ? "none"
                             : packed.input_scales == InputScales::dynamic ? "dynamic"
                                                                            : "static (calibrated)")
        .set("tokens", tokens)
        .set("gpu", gpu_name)
        .set("median_us", us)
        .set("floor_us", floors.floor_us)
        .set("floor_bound", floors.bound)
        .set("touched_experts", floors.touched_experts)
        .set("weight_bytes", floors.weight_bytes)
        .set("useful_flops", floors.useful_flops)
        .set("hbm_read_bytes_per_s", facts.hbm_read_bytes_per_s)
        .set("dense_flops_per_s", facts.dense_flops_per_s(spec.precision))
        .set("dense_rate_source", dense_rate_source)
        .set("baseline_us", baseline_us)
        .set("baseline", "cublasGemmGroupedBatchedEx bf16 (FC1, FC2) + plain kernels, routing given, host-built row lists")
        .set("baseline_rel_err_vs_unquantized", baseline_rel_err)
        .set("rel_err", rel_err)
        .set("rel_err_vs_unquantized", unquantized_rel_err)
        .set("rel_err_rows_checked", checked)
        .set("l2", o.warm_l2 ? "warm (not scrubbed)" : "scrubbed before each timed replay")
        .set("launches", launches)
        .set("options", options_json(o.layer));
    set_plan_decisions(record, forward_plans[count_index])
        .set("breakdown", std::move(breakdown))
        .set("single_kernel_timeline", std::move(roles));
    records.push(std::move(set_provenance(record, o.provenance)));
  }
  cudaStreamDestroy(stream);
  if (!o.json_path.empty()) {
    write_json_file(o.json_path, records);
    std::printf("\nwrote %s\n", o.json_path.c_str());
  }
  return 0;
}

}  // namespace megamoe::bench
