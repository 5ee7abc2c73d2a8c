// What the fused expert-parallel forward (comm::EpLayer) launches on a rank's local layer: the
// layer's kernel parameters and the plan of a single-kernel forward, as MoeLayer::forward would
// launch one. Not part of the public interface.
#pragma once

#include "kernels/impls/sm90_moe_forward.hpp"
#include "megamoe/layer.hpp"

namespace megamoe::detail {

struct SingleKernelLaunch {
  kernels::MoeLayerParams params;
  kernels::MoeLaunchChoices choices;

  // A deterministic single-kernel forward of `layer` (built with launch = single_kernel and
  // precomputed routing) whose tiles are planned for `tokens` rows. Throws Error(unsupported)
  // where the plan is not a single kernel.
  static SingleKernelLaunch of(const MoeLayer& layer, int tokens);
};

}  // namespace megamoe::detail
