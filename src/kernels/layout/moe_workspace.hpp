// Workspace of one single-GPU forward: the host sizes the allocation with this struct and the
// kernels carve the same allocation with it. Every region starts on a 128-byte boundary.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/layout/weight_layout.hpp"
#include "megamoe/spec.hpp"
#include "megamoe/weights.hpp"

namespace megamoe::layout {

inline constexpr size_t kRegionAlignment = 128;
// The single-kernel forward's (scheduler/forward_items.hpp; comm/ep_fused_roles.cuh adds its own).
inline constexpr int kForwardCounterSlots = 16;

MEGAMOE_HOST_DEVICE constexpr size_t align_up(size_t value, size_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

// Lays regions out one after another, each at kRegionAlignment: take(bytes) returns the next
// region's offset; `end` is the bytes taken so far.
struct RegionCursor {
  size_t end = 0;
  MEGAMOE_HOST_DEVICE constexpr size_t take(size_t bytes) {
    const size_t offset = end;
    end = align_up(end + bytes, kRegionAlignment);
    return offset;
  }
};

// fp8_tensor's activation scales as the kernels read them, in the workspace: written once when the
// layer is built (InputScales::from_checkpoint), or each forward by the dynamic-scale kernels
// (quant/dynamic_tensor_scales.cuh). A factor is what values are multiplied by before their E4M3
// encoding, 1 / scale (quant::tensor_factor).
struct TensorScaleSlots {
  float fc1_scale;        // x's
  float fc1_factor;
  float fc2_scale;        // FC2's input's (SwiGLU's output)
  float fc2_factor;
  // Dynamic only; zero between forwards (the x-amax kernel's last block clears them for the next).
  uint32_t x_amax_bits;      // float bits of the largest finite |x| (atomicMax: non-negative floats order as their bits)
  uint32_t x_blocks_done;    // x-amax blocks finished
  uint32_t fc2_amax_bits;    // the largest finite |FC1 output| (rounded to bf16) of any routed row
  uint32_t reserved;
};

struct MoeWorkspaceLayout {
  // Shape facts the layout was built from.
  int num_experts = 0;
  int top_k = 0;
  int hidden = 0;
  int intermediate = 0;
  int max_tokens = 0;
  int row_padding = 1;       // each expert's segment of the pool is padded to this many rows
  int element_bytes = 2;     // 1 for fp8, 2 for bf16
  bool has_scales = false;   // fp8_block keeps one fp32 scale per row per 128 channels
  bool tensor_scales = false;   // fp8_tensor: its TensorScaleSlots
  bool dynamic_scales = false;  // fp8_tensor with InputScales::dynamic: FC1 stores bf16, then one pass encodes it
  size_t pool_rows = 0;      // worst-case rows of the expert-contiguous pool

  // Byte offsets of each region. "slot" is t * k + j: token t's j-th routed expert.
  size_t expert_counts = 0;      // int32 [E]: the router's row counters, zero between forwards
  size_t routing_blocks_done = 0;  // uint32 [1]: router blocks finished, zero between forwards
  size_t expert_rows = 0;        // int32 [E]: routed rows per expert in this forward
  size_t expert_offsets = 0;     // int32 [E+1]: first pool row of each expert, segments padded
  size_t token_tile_prefix = 0;  // int32 [E+1]: token tiles of the experts before each expert
  size_t token_tile_expert = 0;  // int32 [T*k]: the expert of each token tile (a tile holds >= 1 routed row)
  size_t gemm_tiles_claimed = 0; // uint32 [2]: tiles FC1 / FC2 claimed past their first wave
  size_t fc1_tiles_done = 0;     // uint32 [E+1]: FC1 tiles stored per expert, then in all; FC2 waits on them
  size_t fc1_blocks_issued = 0;  // uint32 [1]: FC1's weight blocks issued, where counted (producer/weight_producer.cuh)
  size_t routed_ids = 0;         // int32 [T*k]: expert of each slot, -1 when unused
  size_t routed_weights = 0;     // fp32 [T*k]: routing weight of each slot
  size_t slot_rank = 0;          // int32 [T*k]: position of the slot inside its expert's segment
  size_t pool_slot = 0;          // int32 [pool_rows]: slot of each pool row (padding rows unset)
  size_t activations = 0;        // [pool_rows, H] gathered (and quantized) activations; where FC1
                                 // copies its rows, one per token (row = token)
  size_t activation_scales = 0;  // fp32 [H/128, pool_rows] (fp8_block), K-block-major for TMA
  size_t fc1_output = 0;         // [pool_rows, I] SwiGLU output, the FC2 input
  size_t fc1_output_bf16 = 0;    // bf16 [pool_rows, I] (dynamic_scales): FC1's output before its encoding
  size_t fc1_scales = 0;         // fp32 [I/128, pool_rows] (fp8_block), K-block-major for TMA
  size_t slot_outputs = 0;       // bf16 [T*k, H] expert outputs for the deterministic combine
  size_t y_accumulator = 0;      // fp32 [T, H] atomically accumulated output (fast combine)
  size_t error_flags = 0;        // int32 [4]: [0] invalid routing ids seen, reported after forward
  size_t forward_counters = 0;   // uint32 [kForwardCounterSlots]: the single-kernel forward's hand-offs,
                                 // zero between forwards
  size_t tensor_scale_slots = 0; // TensorScaleSlots (tensor_scales)
  size_t total_bytes = 0;

  template <class T>
  MEGAMOE_HOST_DEVICE T* at(void* base, size_t offset) const {
    return reinterpret_cast<T*>(static_cast<char*>(base) + offset);
  }

  // Rows of the pool in the worst case: every routed row plus, for each expert that can be
  // non-empty, up to row_padding - 1 rows of padding.
  MEGAMOE_HOST_DEVICE static constexpr size_t worst_case_pool_rows(int num_experts, int top_k, int max_tokens,
                                                                   int row_padding) {
    const size_t routed = static_cast<size_t>(max_tokens) * top_k;
    const size_t nonempty = routed < static_cast<size_t>(num_experts) ? routed : static_cast<size_t>(num_experts);
    return align_up(routed + nonempty * (row_padding - 1), row_padding);
  }

  MEGAMOE_HOST_DEVICE static constexpr MoeWorkspaceLayout make(int num_experts, int top_k, int hidden, int intermediate,
                                                               int max_tokens, int row_padding, Precision precision,
                                                               InputScales input_scales = InputScales::from_checkpoint) {
    MoeWorkspaceLayout l;
    l.num_experts = num_experts;
    l.top_k = top_k;
    l.hidden = hidden;
    l.intermediate = intermediate;
    l.max_tokens = max_tokens;
    l.row_padding = row_padding;
    l.element_bytes = precision == Precision::bf16 ? 2 : 1;
    l.has_scales = precision == Precision::fp8_block;
    l.tensor_scales = precision == Precision::fp8_tensor;
    l.dynamic_scales = l.tensor_scales && input_scales == InputScales::dynamic;
    l.pool_rows = worst_case_pool_rows(num_experts, top_k, max_tokens, row_padding);
    const size_t slots = static_cast<size_t>(max_tokens) * top_k;
    RegionCursor regions;
    l.expert_counts = regions.take(sizeof(int32_t) * num_experts);
    l.routing_blocks_done = regions.take(sizeof(uint32_t));
    l.expert_rows = regions.take(sizeof(int32_t) * num_experts);
    l.expert_offsets = regions.take(sizeof(int32_t) * (num_experts + 1));
    l.token_tile_prefix = regions.take(sizeof(int32_t) * (num_experts + 1));
    l.token_tile_expert = regions.take(sizeof(int32_t) * slots);
    l.gemm_tiles_claimed = regions.take(sizeof(uint32_t) * 2);
    l.fc1_tiles_done = regions.take(sizeof(uint32_t) * (num_experts + 1));
    l.fc1_blocks_issued = regions.take(sizeof(uint32_t));
    l.routed_ids = regions.take(sizeof(int32_t) * slots);
    l.routed_weights = regions.take(sizeof(float) * slots);
    l.slot_rank = regions.take(sizeof(int32_t) * slots);
    l.pool_slot = regions.take(sizeof(int32_t) * l.pool_rows);
    l.activations = regions.take(l.pool_rows * hidden * l.element_bytes);
    l.activation_scales = regions.take(l.has_scales ? l.pool_rows * (hidden / 128) * sizeof(float) : 0);
    l.fc1_output = regions.take(l.pool_rows * intermediate * l.element_bytes);
    l.fc1_output_bf16 = regions.take(l.dynamic_scales ? l.pool_rows * intermediate * sizeof(uint16_t) : 0);
    l.fc1_scales = regions.take(l.has_scales ? l.pool_rows * (intermediate / 128) * sizeof(float) : 0);
    l.slot_outputs = regions.take(slots * hidden * sizeof(uint16_t));
    l.y_accumulator = regions.take(static_cast<size_t>(max_tokens) * hidden * sizeof(float));
    l.error_flags = regions.take(sizeof(int32_t) * 4);
    l.forward_counters = regions.take(sizeof(uint32_t) * kForwardCounterSlots);
    l.tensor_scale_slots = regions.take(l.tensor_scales ? sizeof(TensorScaleSlots) : 0);
    l.total_bytes = regions.end;
    return l;
  }
};

}  // namespace megamoe::layout
