// Host launchers of the single-GPU MoE forward (sm_90a): either the per-stage kernel sequence
//   route_and_count (its last block scans the expert segments) -> gather_quantize
//   -> FC1 grouped GEMM (SwiGLU) -> FC2 grouped GEMM -> combine
// (fp8_tensor with dynamic activation scales adds x's amax before the router and the encoding of
// FC1's bf16 output before FC2: quant/dynamic_tensor_scales.cuh)
// or all of it in one persistent kernel (impls/sm90_moe_single_kernel.cuh), on one stream, with
// no host synchronization (CUDA-graph capturable).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/layout/moe_workspace.hpp"
#include "kernels/routing/routing_limits.hpp"
#include "megamoe/spec.hpp"

namespace megamoe::kernels {

// A layer as the kernels take it: its shapes, precision and routing from the spec, and its device
// buffers. Built once, when the layer is built (and again when its routing changes).
struct MoeLayerParams {
  int num_experts;
  int top_k;
  int hidden;
  int intermediate;
  Precision precision;
  bool ue8m0;
  RoutingMode routing_mode;
  bool renormalize;
  int n_group;
  int topk_group;
  float routed_scaling_factor;
  const float* bias;          // device [E] or null (deepseek_grouped)
  const void* w13;            // packed [E, 2I, H]
  const float* w13_scales;    // fp8_block [E, 2I/128, H/128]; fp8_tensor [E, 2] (gate, up)
  const void* w2;             // [E, H, I]
  const float* w2_scales;     // fp8_block [E, H/128, I/128]; fp8_tensor [E]
  void* workspace;
  layout::MoeWorkspaceLayout workspace_layout;
};

// The planner's decisions for one forward (plan::ForwardPlan), which the launch follows. The
// stage counts are the plan's; the launcher refuses a plan whose counts differ from those of the
// kernels it instantiates, so that the printed plan cannot drift from the launched one.
struct MoeLaunchChoices {
  int token_tile;              // 16, 32 or 64 (swapAB), or 128 (tokens on M)
  bool weight_multicast;       // tokens on M: the GEMMs' CTAs in pairs sharing each weight block
  bool fc1_copies_token_rows;  // fp8_block: the gather writes a row per token, FC1 copies its rows from it
  bool deterministic;          // slot store + ordered combine, else atomic combine
  bool single_kernel;          // the whole forward in one launch (pool rows only), else one per stage
  int grid;                    // persistent CTAs of the GEMMs (of the single kernel)
  int fc1_stages;
  int fc2_stages;
};

// One call's buffers (device).
struct MoeCall {
  int num_tokens;
  const int32_t* num_valid_tokens;  // device count of real rows, or null
  const void* x;
  const float* router_logits;
  const int32_t* topk_ids;
  const float* topk_weights;
  void* y;
  const float* x_scales;  // fp8_block: x is E4M3 codes, scale of (token t, block b) at b * x_scale_stride + t
  int x_scale_stride;     // >= num_tokens
  // Diagnostic (megamoe-bench --breakdown): the single kernel folds the global timer at the
  // points of layout/forward_timeline.hpp into these stamps, [event][2] earliest and latest ns.
  unsigned long long* timeline_stamps = nullptr;
};

void launch_moe_forward(const MoeLayerParams& layer, const MoeLaunchChoices& choices, const MoeCall& call,
                        cudaStream_t stream);

// The single-kernel part of launch_moe_forward (sm90_moe_single_kernel.cu).
void launch_single_kernel_forward(const MoeLayerParams& layer, const MoeLaunchChoices& choices, const MoeCall& call,
                                  cudaStream_t stream);

// The single kernel as one rank's whole expert-parallel forward (comm/ep_fused_roles.cuh): `layer`
// holds the rank's experts, `choices` a single-kernel plan, and `call` is the rank's virtual tokens
// (num_tokens = world * max_tokens per rank; its inputs and output pointers are unused).
struct EpFusedParams;
void launch_ep_fused_forward(const MoeLayerParams& layer, const MoeLaunchChoices& choices, const MoeCall& call,
                             const EpFusedParams& ep, cudaStream_t stream);

}  // namespace megamoe::kernels
