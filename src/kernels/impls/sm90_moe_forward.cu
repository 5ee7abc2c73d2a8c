#include "kernels/impls/sm90_moe_forward.hpp"

#include <algorithm>
#include <type_traits>

#include "kernels/cuda_check.hpp"
#include "kernels/impls/sm90_forward_params.cuh"
#include "kernels/impls/sm90_grouped_gemm_swapab.cuh"
#include "kernels/launch.hpp"
#include "kernels/quant/dynamic_tensor_scales.cuh"
#include "kernels/routing/route_and_count.cuh"

namespace megamoe::kernels {
namespace {

template <class Config>
void launch_gemm(const MoeLayerParams& f, const MoeLaunchChoices& c, const GemmArguments& g, int planned_stages,
                 cudaStream_t stream) {
  check_planned_stages<Config>(planned_stages);
  const auto p = make_gemm_params<Config>(f, g, c.grid);
  using Params = std::remove_const_t<decltype(p)>;
  constexpr auto kernel = &sm90_grouped_gemm_swapab_kernel<Config, Params>;
  allow_dynamic_smem<kernel>(Config::kSmemBytes);
  if (c.grid % Config::kClusterSize != 0) {
    throw Error(ErrorCode::unsupported, "internal: a grid of CTA pairs needs an even CTA count (planner bug)");
  }
  launch_overlapping_previous_in_clusters(Config::kClusterSize, kernel, c.grid, Config::kThreads, Config::kSmemBytes,
                                          stream, "sm90_grouped_gemm_swapab_kernel", p);
}

template <Precision kPrecision, GemmOp kOp, bool kCopiesRows>
void dispatch_token_tile(const MoeLayerParams& f, const MoeLaunchChoices& c, const GemmArguments& g, int stages,
                         cudaStream_t stream) {
  switch (c.token_tile) {
    case 16: return launch_gemm<GroupedGemmConfig<kPrecision, 16, kOp, kCopiesRows>>(f, c, g, stages, stream);
    case 32: return launch_gemm<GroupedGemmConfig<kPrecision, 32, kOp, kCopiesRows>>(f, c, g, stages, stream);
    case 64: return launch_gemm<GroupedGemmConfig<kPrecision, 64, kOp, kCopiesRows>>(f, c, g, stages, stream);
    case layout::kGemmTokensOnMTile:
      if constexpr (!kCopiesRows) {
        if (c.weight_multicast) {
          return launch_gemm<GroupedGemmConfig<kPrecision, layout::kGemmTokensOnMTile, kOp, false, true>>(f, c, g, stages,
                                                                                                       stream);
        }
        return launch_gemm<GroupedGemmConfig<kPrecision, layout::kGemmTokensOnMTile, kOp, false>>(f, c, g, stages, stream);
      }
      throw Error(ErrorCode::unsupported, "internal: the tokens-on-M tile reads the pool, it does not copy rows");
    default: throw Error(ErrorCode::unsupported, "internal: token tile must be 16, 32, 64 or 128");
  }
}

template <GemmOp kOp>
void dispatch_gemm(const MoeLayerParams& f, const MoeLaunchChoices& c, const GemmArguments& g, int stages,
                   cudaStream_t stream) {
  // fp8 FC1 may copy its rows from x's quantized copy (the gather's rows_by_token).
  if constexpr (kOp == GemmOp::fc1_swiglu) {
    if (c.fc1_copies_token_rows) {
      if (f.precision == Precision::fp8_tensor) {
        return dispatch_token_tile<Precision::fp8_tensor, kOp, true>(f, c, g, stages, stream);
      }
      return dispatch_token_tile<Precision::fp8_block, kOp, true>(f, c, g, stages, stream);
    }
  }
  switch (f.precision) {
    case Precision::bf16: return dispatch_token_tile<Precision::bf16, kOp, false>(f, c, g, stages, stream);
    case Precision::fp8_block: return dispatch_token_tile<Precision::fp8_block, kOp, false>(f, c, g, stages, stream);
    case Precision::fp8_tensor: return dispatch_token_tile<Precision::fp8_tensor, kOp, false>(f, c, g, stages, stream);
  }
  throw Error(ErrorCode::unsupported, "internal: unknown precision");
}

inline DynamicScaleParams dynamic_scale_params(const MoeLayerParams& f, const MoeCall& call) {
  const layout::MoeWorkspaceLayout& w = f.workspace_layout;
  void* ws = f.workspace;
  DynamicScaleParams d{};
  d.num_tokens = call.num_tokens;
  d.num_valid_tokens = call.num_valid_tokens;
  d.hidden = f.hidden;
  d.intermediate = f.intermediate;
  d.num_experts = f.num_experts;
  d.x = static_cast<const __nv_bfloat16*>(call.x);
  d.expert_offsets = w.at<int32_t>(ws, w.expert_offsets);
  d.fc1_output_bf16 = w.at<__nv_bfloat16>(ws, w.fc1_output_bf16);
  d.fc1_output = w.at<uint8_t>(ws, w.fc1_output);
  d.slots = tensor_scale_slots(f);
  return d;
}

int blocks_for(long threads, int block) { return static_cast<int>((threads + block - 1) / block); }

}  // namespace

void launch_moe_forward(const MoeLayerParams& f, const MoeLaunchChoices& c, const MoeCall& call,
                        cudaStream_t stream) {
  const int T = call.num_tokens;
  if (T == 0) return;
  if (c.fc1_copies_token_rows && f.precision == Precision::bf16) {
    throw Error(ErrorCode::unsupported, "internal: FC1 copies token rows from an fp8 copy of x only");
  }
  if (c.single_kernel && c.weight_multicast) {
    throw Error(ErrorCode::unsupported, "internal: the single kernel has no CTA pairs (planner bug)");
  }
  if (c.single_kernel) return launch_single_kernel_forward(f, c, call, stream);
  const layout::MoeWorkspaceLayout& w = f.workspace_layout;
  // Dynamic fp8_tensor scales: x's amax first (quant/dynamic_tensor_scales.cuh).
  const DynamicScaleParams dynamic = w.dynamic_scales ? dynamic_scale_params(f, call) : DynamicScaleParams{};
  const int dynamic_blocks_max = kDynamicScaleBlocksPerSm * c.grid;
  auto dynamic_blocks = [&](size_t elements) {
    return std::max(1, static_cast<int>(std::min<size_t>(dynamic_blocks_max,
                                                         (elements / kDynamicScaleChunk + kDynamicScaleThreads - 1) /
                                                             kDynamicScaleThreads)));
  };
  if (w.dynamic_scales) {
    launch_overlapping_previous(x_amax_kernel, dynamic_blocks(static_cast<size_t>(T) * f.hidden),
                                kDynamicScaleThreads, 0, stream, "x_amax_kernel", dynamic);
  }
  const RoutingParams routing = make_routing_params(f, c, call);
  // For the most experts the router takes, once per device.
  allow_dynamic_smem<route_and_count_kernel>(static_cast<int>(router_smem_bytes(kMaxRoutingExperts)));
  launch_overlapping_previous(route_and_count_kernel, blocks_for(T, kRouterWarps), kRouterThreads,
                              router_smem_bytes(f.num_experts), stream, "route_and_count_kernel", routing);

  const GatherParams gather = make_gather_params(f, c, call, routing);
  auto gather_kernel = [&] {
    switch (f.precision) {
      case Precision::fp8_block: return gather_quantize_kernel<Precision::fp8_block>;
      case Precision::fp8_tensor: return gather_quantize_kernel<Precision::fp8_tensor>;
      default: return gather_quantize_kernel<Precision::bf16>;
    }
  };
  launch_overlapping_previous(gather_kernel(), T, kGatherThreads, 0, stream, "gather_quantize_kernel", gather);

  const GemmArguments fc1 = fc1_arguments(f, gather);
  dispatch_gemm<GemmOp::fc1_swiglu>(f, c, fc1, c.fc1_stages, stream);

  if (w.dynamic_scales) {
    const size_t rows = layout::MoeWorkspaceLayout::worst_case_pool_rows(f.num_experts, f.top_k, T, w.row_padding);
    launch_overlapping_previous(encode_fc1_output_kernel, dynamic_blocks(rows * f.intermediate), kDynamicScaleThreads,
                                0, stream, "encode_fc1_output_kernel", dynamic);
  }
  const GemmArguments fc2 = fc2_arguments(f);
  if (c.deterministic) {
    dispatch_gemm<GemmOp::fc2_slot_store>(f, c, fc2, c.fc2_stages, stream);
  } else {
    dispatch_gemm<GemmOp::fc2_atomic_combine>(f, c, fc2, c.fc2_stages, stream);
  }

  const CombineParams combine = make_combine_params(f, call, routing);
  const int combine_blocks = blocks_for(static_cast<long>(T) * (f.hidden / 8), 256);
  launch_overlapping_previous(c.deterministic ? combine_kernel<true> : combine_kernel<false>, combine_blocks, 256, 0,
                              stream, "combine_kernel", combine);
}

}  // namespace megamoe::kernels
