// Host side of the single-GPU forward's launches: the parameters of each stage from the layer, the
// plan's choices and the call, shared by the per-stage launches (sm90_moe_forward.cu) and the
// single-kernel forward (sm90_moe_single_kernel.cu).
#pragma once

#include <cute/tensor.hpp>

#include <string>
#include <type_traits>

#include "kernels/combine/combine_slots.cuh"
#include "kernels/cuda_check.hpp"
#include "kernels/impls/sm90_moe_forward.hpp"
#include "kernels/mma/grouped_gemm_config.cuh"
#include "kernels/permute/gather_quantize.cuh"
#include "kernels/routing/route_token.cuh"
#include "kernels/scheduler/grouped_tile_scheduler.cuh"

namespace megamoe::kernels {

using namespace cute;

struct GemmArguments {
  const void* weights;
  const float* weight_scales;
  int a_rows;
  int k;
  const void* pool;
  const float* token_scales;
  // FC1 copying its rows (GroupedGemmConfig::kCopiesRows): x quantized per token, [T, k] codes, and
  // token t's scale of K block b at b * stride + t (the gather's rows, or the caller's x_scales).
  QuantizedTokenRows token_rows;
  int out_channels;
  void* out;
  float* out_scales;
  const float* input_scale;  // fp8_tensor: the token operand's scale (layout::TensorScaleSlots)
  const float* out_factor;   // fp8_tensor FC1, static scales: 1 / FC2's input scale
  uint32_t* out_amax;        // fp8_tensor FC1, dynamic scales: bf16 out, its amax here
  bool token_operand_of_previous_grid;  // fp8_tensor FC2, dynamic scales
};

// The stage count the plan names must be the kernel's (planner and kernel would disagree).
template <class Config>
void check_planned_stages(int planned_stages) {
  if (planned_stages != Config::kStages) {
    throw Error(ErrorCode::unsupported, "internal: the plan has " + std::to_string(planned_stages) +
                                            " stages where the kernel was built with " +
                                            std::to_string(Config::kStages) + " (planner and kernel disagree)");
  }
}

// One GEMM's launch parameters; first_wave: tiles taken by CTA index without a claim.
template <class Config>
auto make_gemm_params(const MoeLayerParams& f, const GemmArguments& g, int first_wave) {
  using Element = typename Config::Element;
  const layout::MoeWorkspaceLayout& w = f.workspace_layout;
  const int pool_rows = static_cast<int>(w.pool_rows);
  Tensor weights = make_tensor(make_gmem_ptr(static_cast<const Element*>(g.weights)),
                               make_shape(g.a_rows, g.k, f.num_experts),
                               make_stride(static_cast<int64_t>(g.k), _1{}, static_cast<int64_t>(g.a_rows) * g.k));
  Tensor pool = make_tensor(make_gmem_ptr(static_cast<const Element*>(g.pool)), make_shape(pool_rows, g.k),
                            make_stride(static_cast<int64_t>(g.k), _1{}));
  // A CTA pair loads each weight block as two halves, each into both CTAs (multicast).
  using WeightsLoad = std::conditional_t<Config::kSharesWeights, SM90_TMA_LOAD_MULTICAST, SM90_TMA_LOAD>;
  auto tma_a = make_tma_atom(WeightsLoad{}, weights, typename Config::SmemLayoutA{}(_, _, 0),
                             make_shape(Int<Config::kBlockM>{}, Int<Config::kBlockK>{}), Int<Config::kClusterSize>{});
  // Token rows and their scales travel in subtiles (a stage holds one or kSubtiles of them).
  auto tma_b = make_tma_atom(SM90_TMA_LOAD{}, pool,
                             typename GemmTileColumns<Config, Config::kTokenSubtile>::SmemLayoutB{}(_, _, 0),
                             make_shape(Int<Config::kTokenSubtile>{}, Int<Config::kBlockK>{}));
  auto make_scales_tma = [&] {
    if constexpr (Config::kBlockScales) {
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
                                         (Config::kGemmOp == GemmOp::fc1_swiglu ? 0 : 1),
                                     first_wave};
  p.out_channels = g.out_channels;
  p.out = g.out;
  p.out_scales = g.out_scales;
  p.input_scale = g.input_scale;
  p.out_factor = g.out_factor;
  p.out_amax = g.out_amax;
  p.token_operand_of_previous_grid = g.token_operand_of_previous_grid;
  p.ue8m0 = f.ue8m0;
  p.pool_slot = w.at<int32_t>(f.workspace, w.pool_slot);
  p.routed_weights = w.at<float>(f.workspace, w.routed_weights);
  p.y_accumulator = w.at<float>(f.workspace, w.y_accumulator);
  p.top_k = f.top_k;
  p.fc1_tiles_done = w.at<uint32_t>(f.workspace, w.fc1_tiles_done);
  p.fc1_blocks_issued = w.at<uint32_t>(f.workspace, w.fc1_blocks_issued);
  p.fc1_channel_blocks = channel_blocks(2 * f.intermediate);
  if constexpr (Config::kCopiesTokenRows) p.token_rows = g.token_rows;
  return p;
}

// The router's parameters; the atomic combine's accumulator is zeroed by the router.
inline RoutingParams make_routing_params(const MoeLayerParams& f, const MoeLaunchChoices& c, const MoeCall& call) {
  const layout::MoeWorkspaceLayout& w = f.workspace_layout;
  const int T = call.num_tokens;
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
  routing.gemm = GemmTileCounters{w.at<uint32_t>(ws, w.gemm_tiles_claimed), w.at<uint32_t>(ws, w.fc1_tiles_done),
                                  w.at<uint32_t>(ws, w.fc1_blocks_issued)};
  return routing;
}

// fp8_tensor's activation scales in the layer's workspace.
inline layout::TensorScaleSlots* tensor_scale_slots(const MoeLayerParams& f) {
  const layout::MoeWorkspaceLayout& w = f.workspace_layout;
  return w.at<layout::TensorScaleSlots>(f.workspace, w.tensor_scale_slots);
}

inline GatherParams make_gather_params(const MoeLayerParams& f, const MoeLaunchChoices& c, const MoeCall& call,
                                       const RoutingParams& routing) {
  const layout::MoeWorkspaceLayout& w = f.workspace_layout;
  void* ws = f.workspace;
  const int T = call.num_tokens;
  GatherParams gather{};
  gather.num_tokens = T;
  gather.num_valid_tokens = call.num_valid_tokens;
  gather.top_k = f.top_k;
  gather.hidden = f.hidden;
  gather.pool_rows = static_cast<int>(w.pool_rows);
  gather.ue8m0 = f.ue8m0;
  gather.x = static_cast<const __nv_bfloat16*>(call.x);
  gather.x_scales = call.x_scales;
  gather.x_scale_stride = call.x_scale_stride;
  gather.routed_ids = routing.routed_ids;
  gather.slot_rank = routing.slot_rank;
  gather.expert_offsets = routing.expert_offsets;
  gather.pool_slot = w.at<int32_t>(ws, w.pool_slot);
  gather.rows_by_token = c.fc1_copies_token_rows;  // FC1 copies its rows (see dispatch_gemm)
  gather.activations = w.at<void>(ws, w.activations);
  gather.activation_scales = w.at<float>(ws, w.activation_scales);
  gather.tensor_factor = w.tensor_scales ? &tensor_scale_slots(f)->fc1_factor : nullptr;
  return gather;
}

inline CombineParams make_combine_params(const MoeLayerParams& f, const MoeCall& call, const RoutingParams& routing) {
  const layout::MoeWorkspaceLayout& w = f.workspace_layout;
  void* ws = f.workspace;
  const int T = call.num_tokens;
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
  return combine;
}

// The two GEMMs' operands: FC1 reads the gathered pool, FC2 FC1's output (with dynamic fp8_tensor
// scales, FC1 writes bf16 and the encoding pass FC2's E4M3 rows: quant/dynamic_tensor_scales.cuh).
inline GemmArguments fc1_arguments(const MoeLayerParams& f, const GatherParams& gather) {
  const layout::MoeWorkspaceLayout& w = f.workspace_layout;
  void* ws = f.workspace;
  layout::TensorScaleSlots* slots = w.tensor_scales ? tensor_scale_slots(f) : nullptr;
  GemmArguments fc1{};
  fc1.weights = f.w13;
  fc1.weight_scales = f.w13_scales;
  fc1.a_rows = 2 * f.intermediate;
  fc1.k = f.hidden;
  fc1.pool = gather.activations;
  fc1.token_scales = gather.activation_scales;
  // A caller's quantized x is read where it is; the gather's rows per token at row = token.
  const bool caller_rows = gather.x_scales != nullptr;
  fc1.token_rows = QuantizedTokenRows{caller_rows ? reinterpret_cast<const uint8_t*>(gather.x)
                                                  : static_cast<const uint8_t*>(gather.activations),
                                      caller_rows ? gather.x_scales : gather.activation_scales,
                                      caller_rows ? gather.x_scale_stride : gather.pool_rows,
                                      gather.pool_slot,
                                      f.top_k,
                                      f.hidden};
  fc1.out_channels = f.intermediate;
  fc1.out = w.at<void>(ws, w.dynamic_scales ? w.fc1_output_bf16 : w.fc1_output);
  fc1.out_scales = w.at<float>(ws, w.fc1_scales);
  fc1.input_scale = slots != nullptr ? &slots->fc1_scale : nullptr;
  fc1.out_factor = slots != nullptr && !w.dynamic_scales ? &slots->fc2_factor : nullptr;
  fc1.out_amax = w.dynamic_scales ? &slots->fc2_amax_bits : nullptr;
  return fc1;
}

inline GemmArguments fc2_arguments(const MoeLayerParams& f) {
  const layout::MoeWorkspaceLayout& w = f.workspace_layout;
  void* ws = f.workspace;
  GemmArguments fc2{};
  fc2.weights = f.w2;
  fc2.weight_scales = f.w2_scales;
  fc2.a_rows = f.hidden;
  fc2.k = f.intermediate;
  fc2.pool = w.at<void>(ws, w.fc1_output);
  fc2.token_scales = w.at<float>(ws, w.fc1_scales);
  fc2.out_channels = f.hidden;
  fc2.out = w.at<void>(ws, w.slot_outputs);
  fc2.input_scale = w.tensor_scales ? &tensor_scale_slots(f)->fc2_scale : nullptr;
  fc2.token_operand_of_previous_grid = w.dynamic_scales;
  return fc2;
}

}  // namespace megamoe::kernels
