// Host launcher of the single-kernel forward (impls/sm90_moe_single_kernel.cuh), on one GPU or as
// one rank's fused expert-parallel forward (impls/sm90_moe_ep_fused.cuh).
#include <type_traits>

#include "kernels/cuda_check.hpp"
#include "kernels/impls/sm90_forward_params.cuh"
#include "kernels/impls/sm90_moe_ep_fused.cuh"
#include "kernels/impls/sm90_moe_forward.hpp"
#include "kernels/impls/sm90_moe_single_kernel.cuh"
#include "kernels/launch.hpp"

namespace megamoe::kernels {
namespace {

// The single-GPU forward brings nothing beyond the layer and the call.
struct OneGpu {};

template <class Fc1Params, class Fc2Params>
auto kernel_params(const OneGpu&) {
  return SingleKernelParams<Fc1Params, Fc2Params>{};
}

template <class Fc1Params, class Fc2Params>
auto kernel_params(const EpFusedParams& ep) {
  EpFusedKernelParams<Fc1Params, Fc2Params> p{};
  p.ep = ep;
  return p;
}

// How the call's rows are cut into front items: the single-GPU forward's, and for expert
// parallelism always with gather items (its route items never gather: the rows are remote).
ForwardItems forward_items(const OneGpu&, uint32_t* counters, int tokens, int ctas) {
  return make_forward_items(counters, tokens, ctas);
}

ForwardItems forward_items(const EpFusedParams&, uint32_t* counters, int tokens, int ctas) {
  ForwardItems items = make_forward_items(counters, tokens, ctas);
  if (items.gather_items == 0) items.gather_items = (tokens + items.gather_tokens - 1) / items.gather_tokens;
  return items;
}

// FC2's parameters as launched: expert parallelism's fc2_stores sends the slot rows to their
// sources (comm/ep_expert_rows.cuh).
template <bool kFc2StoresToSources, class Fc2Params, class Extra>
auto launched_fc2(const Fc2Params& fc2, const Extra& extra) {
  if constexpr (kFc2StoresToSources) {
    return stores_to_sources(fc2, extra);
  } else {
    return fc2;
  }
}

template <Precision kPrecision, int kTokenTile, GemmOp kFc2Op, bool kFc2StoresToSources, class Extra>
void launch_single(const MoeLayerParams& f, const MoeLaunchChoices& c, const MoeCall& call, const Extra& extra,
                   cudaStream_t stream) {
  using Fc1Config = GroupedGemmConfig<kPrecision, kTokenTile, GemmOp::fc1_swiglu>;
  using Fc2Config = GroupedGemmConfig<kPrecision, kTokenTile, kFc2Op>;
  check_planned_stages<Fc1Config>(c.fc1_stages);
  check_planned_stages<Fc2Config>(c.fc2_stages);
  const layout::MoeWorkspaceLayout& w = f.workspace_layout;
  const RoutingParams routing = make_routing_params(f, c, call);
  const GatherParams gather = make_gather_params(f, c, call, routing);
  const GemmArguments fc1 = fc1_arguments(f, gather);
  const GemmArguments fc2 = fc2_arguments(f);
  // Every tile is claimed (first_wave 0): see scheduler/forward_items.hpp.
  auto fc1_params = make_gemm_params<Fc1Config>(f, fc1, 0);
  auto fc2_params = make_gemm_params<Fc2Config>(f, fc2, 0);
  using Fc2Launched = decltype(launched_fc2<kFc2StoresToSources>(fc2_params, extra));
  auto p = kernel_params<decltype(fc1_params), Fc2Launched>(extra);
  using Params = decltype(p);
  p.front.routing = routing;
  p.front.gather = gather;
  p.front.timeline = Timeline{call.timeline_stamps};
  p.front.items = forward_items(extra, w.at<uint32_t>(f.workspace, w.forward_counters), call.num_tokens, c.grid);
  fc1_params.tokens_ready = p.front.items.counter(kGatheredItems);
  fc1_params.tokens_ready_count = p.front.items.gathered_when_ready();
  fc2_params.tiles_stored = p.front.items.counter(kFc2TilesStored);
  p.fc1 = fc1_params;
  p.fc2 = launched_fc2<kFc2StoresToSources>(fc2_params, extra);
  p.combine = make_combine_params(f, call, routing);
  using Layout = SingleKernelLayout<Fc1Config, Fc2Config>;
  constexpr auto kernel = &sm90_moe_single_kernel<Fc1Config, Fc2Config, Params>;
  allow_dynamic_smem<kernel>(Layout::kSmemBytes);
  launch_overlapping_previous(kernel, c.grid, kFrontThreads, Layout::kSmemBytes, stream, "sm90_moe_single_kernel", p);
}

template <Precision kPrecision, int kTokenTile, class Extra>
void dispatch_combine(const MoeLayerParams& f, const MoeLaunchChoices& c, const MoeCall& call, const Extra& extra,
                      cudaStream_t stream) {
  if constexpr (std::is_same_v<Extra, OneGpu>) {
    if (!c.deterministic) {
      return launch_single<kPrecision, kTokenTile, GemmOp::fc2_atomic_combine, false>(f, c, call, extra, stream);
    }
  } else {
    if (!c.deterministic) {
      throw Error(ErrorCode::unsupported, "internal: the fused expert-parallel forward combines deterministically");
    }
    if (extra.layout.fc2_stores) {
      return launch_single<kPrecision, kTokenTile, GemmOp::fc2_slot_store, true>(f, c, call, extra, stream);
    }
  }
  launch_single<kPrecision, kTokenTile, GemmOp::fc2_slot_store, false>(f, c, call, extra, stream);
}

template <Precision kPrecision, class Extra>
void dispatch_token_tile(const MoeLayerParams& f, const MoeLaunchChoices& c, const MoeCall& call, const Extra& extra,
                         cudaStream_t stream) {
  switch (c.token_tile) {
    case 16: return dispatch_combine<kPrecision, 16>(f, c, call, extra, stream);
    case 32: return dispatch_combine<kPrecision, 32>(f, c, call, extra, stream);
    case 64: return dispatch_combine<kPrecision, 64>(f, c, call, extra, stream);
    case 128: return dispatch_combine<kPrecision, 128>(f, c, call, extra, stream);  // tokens on M, without pairs
    default: break;
  }
  throw Error(ErrorCode::unsupported, "internal: the single-kernel forward takes token tiles of 16, 32, 64 or 128");
}

template <class Extra>
void dispatch_precision(const MoeLayerParams& f, const MoeLaunchChoices& c, const MoeCall& call, const Extra& extra,
                        cudaStream_t stream) {
  if (c.fc1_copies_token_rows) {
    throw Error(ErrorCode::unsupported, "internal: the single-kernel forward reads FC1's rows from the pool");
  }
  switch (f.precision) {
    case Precision::bf16: return dispatch_token_tile<Precision::bf16>(f, c, call, extra, stream);
    case Precision::fp8_block: return dispatch_token_tile<Precision::fp8_block>(f, c, call, extra, stream);
    case Precision::fp8_tensor:
      // One GPU, static activation scales (the planner refuses dynamic ones: their amaxes are
      // grid-wide); the fused expert-parallel forward sends fp8_block's rows or bf16 ones, and
      // EpLayer refuses fp8_tensor there.
      if constexpr (std::is_same_v<Extra, OneGpu>) {
        if (f.workspace_layout.dynamic_scales) break;
        return dispatch_token_tile<Precision::fp8_tensor>(f, c, call, extra, stream);
      }
      break;
  }
  throw Error(ErrorCode::unsupported, "internal: the single-kernel forward takes bf16, fp8_block, or fp8_tensor with "
                                      "static activation scales on one GPU");
}

}  // namespace

void launch_single_kernel_forward(const MoeLayerParams& f, const MoeLaunchChoices& c, const MoeCall& call,
                                  cudaStream_t stream) {
  dispatch_precision(f, c, call, OneGpu{}, stream);
}

void launch_ep_fused_forward(const MoeLayerParams& f, const MoeLaunchChoices& c, const MoeCall& call,
                             const EpFusedParams& ep, cudaStream_t stream) {
  dispatch_precision(f, c, call, ep, stream);
}

}  // namespace megamoe::kernels
