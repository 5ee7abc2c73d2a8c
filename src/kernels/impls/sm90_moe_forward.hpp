// Host launchers of the single-GPU MoE forward (sm_90a): the kernel sequence
//   route_and_count (its last block scans the expert segments) -> gather_quantize
//   -> FC1 grouped GEMM (SwiGLU) -> FC2 grouped GEMM -> combine
// on one stream, with no host synchronization (CUDA-graph capturable).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/layout/moe_workspace.hpp"

namespace megamoe::kernels {

struct MoeForwardLaunch {
  // Shapes and modes.
  int num_tokens;
  const int32_t* num_valid_tokens;  // device count of real rows, or null
  int num_experts;
  int top_k;
  int hidden;
  int intermediate;
  bool fp8;
  bool ue8m0;
  int token_tile;             // 16, 32 or 64
  bool fc1_copies_token_rows; // fp8: the gather writes a row per token, FC1 copies its rows from it
  bool deterministic;         // slot store + ordered combine, else atomic combine
  int grid;                   // persistent CTAs of the GEMMs
  // Routing.
  int routing_mode;           // kernels::RoutingMode
  bool renormalize;
  int n_group;
  int topk_group;
  float routed_scaling_factor;
  const float* bias;          // device [E] or null
  // Buffers (device).
  const void* x;
  const float* router_logits;
  const int32_t* topk_ids;
  const float* topk_weights;
  void* y;
  const void* w13;            // packed [E, 2I, H]
  const float* w13_scales;    // [E, 2I/128, H/128]
  const void* w2;             // [E, H, I]
  const float* w2_scales;     // [E, H/128, I/128]
  void* workspace;
  layout::MoeWorkspaceLayout workspace_layout;
};

void launch_moe_forward(const MoeForwardLaunch& launch, cudaStream_t stream);

}  // namespace megamoe::kernels
