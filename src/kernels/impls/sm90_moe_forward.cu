#include "kernels/impls/sm90_moe_forward.hpp"

#include "kernels/combine/combine_slots.cuh"
#include "kernels/cuda_check.hpp"
#include "kernels/impls/sm90_grouped_gemm_swapab.cuh"
#include "kernels/launch.hpp"
#include "kernels/permute/gather_quantize.cuh"
#include "kernels/routing/route_and_count.cuh"
#include "kernels/scheduler/grouped_tile_scheduler.cuh"

namespace megamoe::kernels {
namespace {

using namespace cute;

struct GemmArguments {
  const void* weights;
  const float* weight_scales;
  int a_rows;
  int k;
  const void* pool;
  const float* token_scales;
  int out_channels;
  void* out;
  float* out_scales;
};

template <class Config>
void launch_gemm(const MoeLayerParams& f, const MoeLaunchChoices& c, const GemmArguments& g, int planned_stages,
                 cudaStream_t stream) {
  using Element = typename Config::Element;
  if (planned_stages != Config::kStages) {
    throw Error(ErrorCode::unsupported, "internal: the plan has " + std::to_string(planned_stages) +
                                            " stages where the kernel was built with " +
                                            std::to_string(Config::kStages) + " (planner and kernel disagree)");
  }
  const layout::MoeWorkspaceLayout& w = f.workspace_layout;
  const int pool_rows = static_cast<int>(w.pool_rows);
  Tensor weights = make_tensor(make_gmem_ptr(static_cast<const Element*>(g.weights)),
                               make_shape(g.a_rows, g.k, f.num_experts),
                               make_stride(static_cast<int64_t>(g.k), _1{}, static_cast<int64_t>(g.a_rows) * g.k));
  Tensor pool = make_tensor(make_gmem_ptr(static_cast<const Element*>(g.pool)), make_shape(pool_rows, g.k),
                            make_stride(static_cast<int64_t>(g.k), _1{}));
  auto tma_a = make_tma_atom(SM90_TMA_LOAD{}, weights, typename Config::SmemLayoutA{}(_, _, 0),
                             make_shape(Int<Config::kBlockM>{}, Int<Config::kBlockK>{}));
  // Token rows and their scales travel in subtiles (a stage holds one or kSubtiles of them).
  auto tma_b = make_tma_atom(SM90_TMA_LOAD{}, pool,
                             typename GemmTileColumns<Config, Config::kTokenSubtile>::SmemLayoutB{}(_, _, 0),
                             make_shape(Int<Config::kTokenSubtile>{}, Int<Config::kBlockK>{}));
  auto make_scales_tma = [&] {
    if constexpr (Config::kFp8) {
      Tensor scales = make_tensor(make_gmem_ptr(g.token_scales), make_shape(pool_rows, g.k / Config::kQuantBlock),
                                  make_stride(_1{}, static_cast<int64_t>(pool_rows)));
      return make_tma_atom(SM90_TMA_LOAD{}, scales, typename Config::SmemLayoutScales{}(_, _, 0),
                           make_shape(Int<Config::kTokenSubtile>{}, _1{}));
    } else {
      return 0;
    }
  };
  auto tma_scales = make_scales_tma();
  using Params = GroupedGemmParams<decltype(tma_a), decltype(tma_b), decltype(tma_scales)>;
  Params p{};
  p.tma_a = tma_a;
  p.tma_b = tma_b;
  p.tma_token_scales = tma_scales;
  p.weight_scales = g.weight_scales;
  p.a_rows = g.a_rows;
  p.k = g.k;
  p.num_experts = f.num_experts;
  p.pool_rows = pool_rows;
  // Channel blocks of a GEMM whose weights have `rows` output rows (FC1: 2I, FC2: H).
  auto channel_blocks = [](int rows) { return (rows + Config::kBlockM - 1) / Config::kBlockM; };
  p.scheduler = GroupedTileScheduler{w.at<int32_t>(f.workspace, w.token_tile_expert),
                                     w.at<int32_t>(f.workspace, w.token_tile_prefix),
                                     w.at<int32_t>(f.workspace, w.expert_offsets),
                                     w.at<int32_t>(f.workspace, w.expert_rows),
                                     f.num_experts,
                                     channel_blocks(g.a_rows),
                                     Config::kBlockN,
                                     w.at<uint32_t>(f.workspace, w.gemm_tiles_claimed) +
                                         (Config::kGemmOp == GemmOp::fc1_swiglu ? 0 : 1)};
  p.out_channels = g.out_channels;
  p.out = g.out;
  p.out_scales = g.out_scales;
  p.ue8m0 = f.ue8m0;
  p.pool_slot = w.at<int32_t>(f.workspace, w.pool_slot);
  p.routed_weights = w.at<float>(f.workspace, w.routed_weights);
  p.y_accumulator = w.at<float>(f.workspace, w.y_accumulator);
  p.top_k = f.top_k;
  p.fc1_tiles_done = w.at<uint32_t>(f.workspace, w.fc1_tiles_done);
  p.fc1_channel_blocks = channel_blocks(2 * f.intermediate);
  if constexpr (Config::kCopiesTokenRows) {
    p.token_rows = QuantizedTokenRows{static_cast<const uint8_t*>(g.pool), g.token_scales, pool_rows, p.pool_slot,
                                      f.top_k, g.k};
  }

  constexpr auto kernel = &sm90_grouped_gemm_swapab_kernel<Config, Params>;
  allow_dynamic_smem<kernel>(Config::kSmemBytes);
  launch_overlapping_previous(kernel, c.grid, Config::kThreads, Config::kSmemBytes, stream,
                              "sm90_grouped_gemm_swapab_kernel", p);
}

template <class Element, GemmOp kOp, bool kCopiesRows>
void dispatch_token_tile(const MoeLayerParams& f, const MoeLaunchChoices& c, const GemmArguments& g, int stages,
                         cudaStream_t stream) {
  switch (c.token_tile) {
    case 16: return launch_gemm<GroupedGemmConfig<Element, 16, kOp, kCopiesRows>>(f, c, g, stages, stream);
    case 32: return launch_gemm<GroupedGemmConfig<Element, 32, kOp, kCopiesRows>>(f, c, g, stages, stream);
    case 64: return launch_gemm<GroupedGemmConfig<Element, 64, kOp, kCopiesRows>>(f, c, g, stages, stream);
    default: throw Error(ErrorCode::unsupported, "internal: token tile must be 16, 32 or 64");
  }
}

template <GemmOp kOp>
void dispatch_gemm(const MoeLayerParams& f, const MoeLaunchChoices& c, const GemmArguments& g, int stages,
                   cudaStream_t stream) {
  // fp8 FC1 may copy its rows from x's quantized copy (the gather's rows_by_token).
  if constexpr (kOp == GemmOp::fc1_swiglu) {
    if (c.fc1_copies_token_rows) {
      return dispatch_token_tile<cutlass::float_e4m3_t, kOp, true>(f, c, g, stages, stream);
    }
  }
  if (f.fp8) {
    dispatch_token_tile<cutlass::float_e4m3_t, kOp, false>(f, c, g, stages, stream);
  } else {
    dispatch_token_tile<cutlass::bfloat16_t, kOp, false>(f, c, g, stages, stream);
  }
}

int blocks_for(long threads, int block) { return static_cast<int>((threads + block - 1) / block); }

}  // namespace

void launch_moe_forward(const MoeLayerParams& f, const MoeLaunchChoices& c, const MoeCall& call,
                        cudaStream_t stream) {
  const layout::MoeWorkspaceLayout& w = f.workspace_layout;
  const int T = call.num_tokens;
  if (T == 0) return;
  if (c.fc1_copies_token_rows && !f.fp8) {
    throw Error(ErrorCode::unsupported, "internal: FC1 copies token rows from the fp8 copy of x only");
  }
  void* ws = f.workspace;
  RoutingParams routing{};
  routing.num_tokens = T;
  routing.num_valid_tokens = call.num_valid_tokens;
  routing.num_experts = f.num_experts;
  routing.top_k = f.top_k;
  routing.mode = f.routing_mode;
  routing.renormalize = f.renormalize;
  routing.n_group = f.n_group;
  routing.topk_group = f.topk_group;
  routing.routed_scaling_factor = f.routed_scaling_factor;
  routing.bias = f.bias;
  routing.logits = call.router_logits;
  routing.topk_ids = call.topk_ids;
  routing.topk_weights = call.topk_weights;
  // The routing counters are zero on entry (the workspace starts zeroed and the router's last
  // block clears them), so no memset node sits before the router and every kernel overlaps the
  // previous one's launch through programmatic dependent launch.
  routing.expert_counts = w.at<int32_t>(ws, w.expert_counts);
  routing.blocks_done = w.at<uint32_t>(ws, w.routing_blocks_done);
  routing.expert_rows = w.at<int32_t>(ws, w.expert_rows);
  routing.token_tile_rows = c.token_tile;
  routing.expert_offsets = w.at<int32_t>(ws, w.expert_offsets);
  routing.token_tile_prefix = w.at<int32_t>(ws, w.token_tile_prefix);
  routing.token_tile_expert = w.at<int32_t>(ws, w.token_tile_expert);
  routing.routed_ids = w.at<int32_t>(ws, w.routed_ids);
  routing.routed_weights = w.at<float>(ws, w.routed_weights);
  routing.slot_rank = w.at<int32_t>(ws, w.slot_rank);
  routing.error_flags = w.at<int32_t>(ws, w.error_flags);
  routing.y_accumulator = c.deterministic ? nullptr : w.at<float>(ws, w.y_accumulator);
  routing.hidden = f.hidden;
  routing.gemm = GemmTileCounters{w.at<uint32_t>(ws, w.gemm_tiles_claimed), w.at<uint32_t>(ws, w.fc1_tiles_done)};
  // For the most experts the router takes, once per device.
  allow_dynamic_smem<route_and_count_kernel>(static_cast<int>(router_smem_bytes(kMaxRoutingExperts)));
  launch_overlapping_previous(route_and_count_kernel, blocks_for(T, kRouterWarps), kRouterThreads,
                              router_smem_bytes(f.num_experts), stream, "route_and_count_kernel", routing);

  GatherParams gather{};
  gather.num_tokens = T;
  gather.num_valid_tokens = call.num_valid_tokens;
  gather.top_k = f.top_k;
  gather.hidden = f.hidden;
  gather.pool_rows = static_cast<int>(w.pool_rows);
  gather.ue8m0 = f.ue8m0;
  gather.x = static_cast<const __nv_bfloat16*>(call.x);
  gather.routed_ids = routing.routed_ids;
  gather.slot_rank = routing.slot_rank;
  gather.expert_offsets = routing.expert_offsets;
  gather.pool_slot = w.at<int32_t>(ws, w.pool_slot);
  gather.rows_by_token = c.fc1_copies_token_rows;  // FC1 copies its rows (see dispatch_gemm)
  gather.activations = w.at<void>(ws, w.activations);
  gather.activation_scales = w.at<float>(ws, w.activation_scales);
  launch_overlapping_previous(f.fp8 ? gather_quantize_kernel<true> : gather_quantize_kernel<false>,
                              T, kGatherThreads, 0, stream, "gather_quantize_kernel", gather);

  const GemmArguments fc1{f.w13, f.w13_scales, 2 * f.intermediate, f.hidden, gather.activations, gather.activation_scales,
                          f.intermediate, w.at<void>(ws, w.fc1_output), w.at<float>(ws, w.fc1_scales)};
  dispatch_gemm<GemmOp::fc1_swiglu>(f, c, fc1, c.fc1_stages, stream);

  const GemmArguments fc2{f.w2, f.w2_scales, f.hidden, f.intermediate, fc1.out, fc1.out_scales,
                          f.hidden, w.at<void>(ws, w.slot_outputs), nullptr};
  if (c.deterministic) {
    dispatch_gemm<GemmOp::fc2_slot_store>(f, c, fc2, c.fc2_stages, stream);
  } else {
    dispatch_gemm<GemmOp::fc2_atomic_combine>(f, c, fc2, c.fc2_stages, stream);
  }

  CombineParams combine{};
  combine.num_tokens = T;
  combine.num_valid_tokens = call.num_valid_tokens;
  combine.top_k = f.top_k;
  combine.hidden = f.hidden;
  combine.routed_ids = routing.routed_ids;
  combine.routed_weights = routing.routed_weights;
  combine.slot_outputs = w.at<__nv_bfloat16>(ws, w.slot_outputs);
  combine.y_accumulator = w.at<float>(ws, w.y_accumulator);
  combine.y = static_cast<__nv_bfloat16*>(call.y);
  const int combine_blocks = blocks_for(static_cast<long>(T) * (f.hidden / 8), 256);
  launch_overlapping_previous(c.deterministic ? combine_kernel<true> : combine_kernel<false>, combine_blocks, 256, 0,
                              stream, "combine_kernel", combine);
}

}  // namespace megamoe::kernels
