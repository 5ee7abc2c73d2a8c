// The single-kernel forward as one rank's whole expert-parallel forward: the same kernel
// (impls/sm90_moe_single_kernel.cuh) with expert parallelism's roles before and after the GEMMs
// (comm/ep_fused_roles.cuh), chosen by the type of its parameters
// (docs/design.md#expert-parallelism-inside-the-persistent-kernel).
#pragma once

#include "kernels/comm/ep_expert_rows.cuh"
#include "kernels/comm/ep_fused_roles.cuh"
#include "kernels/impls/sm90_moe_single_kernel.cuh"

namespace megamoe::kernels {

template <class Fc1Params, class Fc2Params>
struct EpFusedKernelParams : SingleKernelParams<Fc1Params, Fc2Params> {
  static constexpr int kCounters = kEpForwardCounters;
  static constexpr bool kBackRoleOnEveryThread = false;  // ep_back_role spills at kLaunchRegisters
  EpFusedParams ep;
};

template <Precision kPrecision, class Fc1Params, class Fc2Params>
__device__ __forceinline__ void run_front_role(const EpFusedKernelParams<Fc1Params, Fc2Params>& p, FrontScratch& s) {
  ep_front_items(p.front, p.ep, s);
}

// Its chunks are claimed to the end, so the CTA's arrival at the done count comes last. It runs on
// the math warpgroups, the last `math_threads` threads of the block (kBackRoleOnEveryThread false).
template <bool kDeterministic, class Fc1Params, class Fc2Params, class CountersDone>
__device__ __forceinline__ void run_back_role(const EpFusedKernelParams<Fc1Params, Fc2Params>& p, FrontScratch&,
                                              const CombineStaging& staging, int math_threads,
                                              CountersDone counters_done) {
  static_assert(kDeterministic, "the fused expert-parallel forward stores slot rows (its partial sums need them)");
  const int math_thread = static_cast<int>(threadIdx.x) - (kFrontThreads - math_threads);
  ep_back_role(p.combine, p.ep, p.front.items, p.front.timeline, static_cast<uint32_t>(p.fc2.scheduler.num_tiles()),
               staging, math_thread, math_threads);
  // Every math thread is past its last counter access: the last claim, which found no chunk, is
  // behind a barrier of them.
  if (math_thread == 0) counters_done();
}

// The last CTA to finish, after zeroing the counters: this rank's calls, which the next forward's
// arrivals count to.
template <class Fc1Params, class Fc2Params>
__device__ __forceinline__ void finish_forward(const EpFusedKernelParams<Fc1Params, Fc2Params>& p) {
  *p.ep.calls += 1;
}

}  // namespace megamoe::kernels
