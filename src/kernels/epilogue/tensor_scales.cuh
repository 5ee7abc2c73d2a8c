// fp8_tensor's dequantization, the first step of both GEMMs' epilogues: the accumulators hold the
// sums of E4M3 code products over the whole of K (the mainloop never promotes), and one product
// of scales per output turns them into values: the expert's weight scale of the output's rows
// (FC1: its gate rows' or its up rows', FC2: its one) times the scale of the token operand (the
// layer input's, or FC2's input's). The reference (src/ref/moe_reference.cpp) multiplies the same
// decoded values in fp64.
#pragma once

#include "kernels/epilogue/gemm_op.hpp"
#include "kernels/scheduler/grouped_tile_scheduler.cuh"

namespace megamoe::kernels::gemm_detail {

// The two scales of a tile's outputs, read when the tile starts so that the global round trip
// overlaps the mainloop. FC2 has one weight scale per expert: gate and up hold the same. The token
// operand's scale is in the workspace (layout::TensorScaleSlots): written when the layer was built,
// or (dynamic scales) by a kernel this grid has waited for.
struct TensorScales {
  float gate;
  float up;

  template <class Config, class Params>
  __device__ __forceinline__ void load(const Params& p, const GroupedTile& tile) {
    const float input_scale = *p.input_scale;
    if constexpr (Config::kGemmOp == GemmOp::fc1_swiglu) {
      const float2 weight = reinterpret_cast<const float2*>(p.weight_scales)[tile.expert];
      gate = weight.x * input_scale;
      up = weight.y * input_scale;
    } else {
      gate = up = p.weight_scales[tile.expert] * input_scale;
    }
  }
};

}  // namespace megamoe::kernels::gemm_detail
