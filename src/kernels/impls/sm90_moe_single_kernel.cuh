// The single-kernel forward (sm_90a, docs/design.md#single-kernel-forward): routing, gather, FC1,
// FC2 and the combine in one persistent launch of the swapAB GEMM's block (one CTA per SM), each
// CTA claiming its work in dependency order (scheduler/forward_items.hpp). The roles before and
// after the GEMMs come with the launch's parameters (run_front_role, run_back_role):
//   whole CTA            front role: route and gather items (routing/front_items.cuh)
//   producer warpgroup   FC1's producer roles, then FC2's (impls/sm90_grouped_gemm_swapab.cuh)
//   math warpgroups      FC1's mainloop and epilogue, then FC2's (mma/swapab_mainloop.cuh, or
//                        mma/tokens_on_m_mainloop.cuh at the token tile of 128)
//   whole CTA, or the    back role: the CTA's share of the combine (combine/combine_share.cuh),
//   math warpgroups      its rows staged in the idle stage ring
// Between its FC1 and FC2 tiles a CTA joins all of its threads and sets its stage ring up again
// (the two GEMMs share one ring layout); FC2 tiles wait per expert for FC1's, as between the
// per-stage kernels, and the combine for every FC2 tile. The last CTA past its last counter access
// zeroes the counters.
#pragma once

#include <cute/tensor.hpp>

#include <cstddef>
#include <cstdint>

#include "kernels/combine/combine_share.cuh"
#include "kernels/combine/combine_staged.cuh"
#include "kernels/impls/sm90_grouped_gemm_swapab.cuh"
#include "kernels/layout/forward_timeline.hpp"
#include "kernels/ptx/grid_dependency.cuh"
#include "kernels/ptx/mbarrier.cuh"
#include "kernels/routing/front_items.cuh"
#include "kernels/routing/routing_limits.hpp"
#include "kernels/scheduler/forward_items.hpp"

namespace megamoe::kernels {

template <class Fc1Params, class Fc2Params>
struct SingleKernelParams {
  static constexpr int kCounters = kForwardCounters;  // the forward counters its roles use
  // Whether every thread runs the back role (at kLaunchRegisters), or the math warpgroups alone
  // (at kConsumerRegisters: expert parallelism's back role spills at the launch's count).
  static constexpr bool kBackRoleOnEveryThread = true;
  FrontParams front;
  Fc1Params fc1;
  Fc2Params fc2;
  CombineParams combine;
};

// What the last CTA past its last counter access does after zeroing the counters (expert
// parallelism counts its calls).
template <class Fc1Params, class Fc2Params>
__device__ __forceinline__ void finish_forward(const SingleKernelParams<Fc1Params, Fc2Params>&) {}

// The roles before and after the GEMMs, by the type of the launch's parameters (expert parallelism
// brings its own: comm/ep_fused_roles.cuh). The single-GPU forward's: routing and gather items,
// then the combine share.
template <Precision kPrecision, class Fc1Params, class Fc2Params>
__device__ __forceinline__ void run_front_role(const SingleKernelParams<Fc1Params, Fc2Params>& p, FrontScratch& s) {
  front_items<kPrecision>(p.front, s);
}

// `counters_done()` is the CTA's arrival at the done count, which one thread calls once none of
// the CTA's threads touches a forward counter again: here as soon as the combine share has seen
// every FC2 tile stored, so that the last CTA's fence, arrival and zeroing overlap its combine
// instead of following it. Every thread of the block calls it (kBackRoleOnEveryThread); the share
// runs on all of them or on the last `math_threads` (combine_share_threads).
template <bool kDeterministic, class Fc1Params, class Fc2Params, class CountersDone>
__device__ __forceinline__ void run_back_role(const SingleKernelParams<Fc1Params, Fc2Params>& p, FrontScratch&,
                                              const CombineStaging& staging, int math_threads,
                                              CountersDone counters_done) {
  const int threads = combine_share_threads(p.combine, staging, kFrontThreads, math_threads);
  const int thread = static_cast<int>(threadIdx.x) - (kFrontThreads - threads);
  if (thread < 0) return;
  combine_share<kDeterministic>(p.combine, p.front.items.counter(kFc2TilesStored),
                                static_cast<uint32_t>(p.fc2.scheduler.num_tiles()), thread, threads, p.front.timeline,
                                staging, counters_done);
}

template <class Fc1Config, class Fc2Config>
struct SingleKernelLayout {
  static_assert(sizeof(typename Fc1Config::SharedStorage) == sizeof(typename Fc2Config::SharedStorage) &&
                    Fc1Config::kStages == Fc2Config::kStages && Fc1Config::kFullArrivals == Fc2Config::kFullArrivals &&
                    Fc1Config::kEmptyArrivalsPerWarp == Fc2Config::kEmptyArrivalsPerWarp &&
                    Fc1Config::kTileFollowers == Fc2Config::kTileFollowers && Fc1Config::kThreads == kFrontThreads,
                "FC1 and FC2 share one block and one stage ring");
  static_assert(sizeof(FrontScratch) <= sizeof(Fc1Config::SharedStorage::a),
                "the front role's scratch fits in the weight stages");
  static constexpr int kSmemBytes = static_cast<int>(sizeof(typename Fc1Config::SharedStorage));
  // The back role stages its slot rows in the weight and token stages, idle by then.
  using Storage = typename Fc2Config::SharedStorage;
  static_assert(sizeof(Storage::a) % 1024 == 0, "the token stages start where the weight stages end");
  static constexpr int kCombineStagingBytes = static_cast<int>(sizeof(Storage::a) + sizeof(Storage::b));
  static_assert(kCombineStagingBytes >=
                    kMaxTopK * combine_detail::kStagedRowBytes * Fc2Config::kConsumerThreads + kCombineStagingReserve,
                "the back roles stage a token's kMaxTopK rows a math thread, beside a role's reserve");
  static_assert(kSmemBytes <= layout::kSm90SmemPerBlockOptin, "shared memory over the sm_90 limit");
};

template <class Config>
__device__ __forceinline__ void invalidate_gemm_barriers(typename Config::SharedStorage& smem) {
  for (int s = 0; s < Config::kStages; ++s) {
    ptx::mbarrier_inval(&smem.full[s]);
    ptx::mbarrier_inval(&smem.empty[s]);
  }
  for (int q = 0; q < Config::kTileQueue; ++q) {
    ptx::mbarrier_inval(&smem.queue_full[q]);
    ptx::mbarrier_inval(&smem.queue_empty[q]);
  }
}

template <class Fc1Config, class Fc2Config, class Params>
__global__ void __launch_bounds__(kFrontThreads, 1) sm90_moe_single_kernel(CUTE_GRID_CONSTANT const Params p) {
  using Layout = SingleKernelLayout<Fc1Config, Fc2Config>;
  constexpr bool kDeterministic = Fc2Config::kGemmOp == GemmOp::fc2_slot_store;
  // As in the GEMM kernel: no static shared memory, stages at the 1 KiB-aligned start.
  extern __shared__ __align__(1024) char smem_raw[];
  auto& fc1_smem = *reinterpret_cast<typename Fc1Config::SharedStorage*>(smem_raw);
  auto& fc2_smem = *reinterpret_cast<typename Fc2Config::SharedStorage*>(smem_raw);
  auto& front_scratch = *reinterpret_cast<FrontScratch*>(smem_raw);

  if (threadIdx.x == 0) {
    if (ptx::smem_address(smem_raw) % 1024 != 0) __trap();
    init_gemm_barriers<Fc1Config>(fc1_smem);
    cute::prefetch_tma_descriptor(p.fc1.tma_a.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.fc1.tma_b.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.fc2.tma_a.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.fc2.tma_b.get_tma_descriptor());
  }
  // The caller's inputs (x, logits or ids) and the previous forward's end (its counters zeroed).
  ptx::wait_for_prerequisite_grids();
  ptx::allow_dependent_launch();
  __syncthreads();
  const Timeline& timeline = p.front.timeline;
  timeline.mark(layout::kForwardStart);

  run_front_role<Fc1Config::kPrecision>(p, front_scratch);
  // The scratch was written through the generic proxy; the stages are written by TMA next.
  ptx::fence_proxy_async_shared();
  __syncthreads();

  // Three phases after the front role: FC1, FC2 and the back role. In each, the producer warpgroup
  // and the math warpgroups take their own branch, which starts with their register count
  // (setmaxnreg again in every phase: ptxas allocates a branch's registers by the setmaxnreg
  // before it) and ends with their role: anything after a math role in its own branch (a
  // timeline mark, FC2 after FC1, the back role after FC2) makes ptxas 13.0 compile the whole
  // branch at the launch's 168 registers, which spills the tokens-on-M fp8_block fragments
  // (docs/decisions.md#register-budget). What runs between the phases runs where the branches
  // have joined, and fits the producer's count.
  // Between the GEMMs: this CTA's FC1 tiles are consumed and its ring is idle; one thread sets it
  // up for FC2 while every thread waits.
  auto between_gemms = [&] {
    // The producer and the math warpgroups arrive from their own branches, and a role's lane
    // after its warp's idle lanes: a barrier that takes threads from anywhere (compute-sanitizer
    // synccheck flagged the aligned bar.sync here). It is also the synchronization PTX asks of a
    // warpgroup between two setmaxnreg.
    constexpr uint32_t kBarrier = static_cast<uint32_t>(NamedBarrier::kRingIdle);
    ptx::named_barrier_sync_from_anywhere(kBarrier, kFrontThreads);
    if (threadIdx.x == 0) {
      invalidate_gemm_barriers<Fc1Config>(fc1_smem);
      init_gemm_barriers<Fc2Config>(fc2_smem);
    }
    ptx::named_barrier_sync_from_anywhere(kBarrier, kFrontThreads);
  };
  // Thread 0 is the weight producer, thread 128 the first math thread.
  constexpr int kMathLead = 128;
  const bool producer_warpgroup = threadIdx.x < 128;
  // One GEMM's phase: `config` a Config value (a tag: its members are static).
  const auto gemm_phase = [&](auto config, const auto& gemm, auto& smem) {
    using Config = decltype(config);
    if (producer_warpgroup) {
      ptx::setmaxnreg_decrease<kProducerRegisters>();
      producer_roles<Config, false>(gemm, smem, gemm.k / Config::kBlockK);
    } else {
      ptx::setmaxnreg_increase<kConsumerRegisters>();
      math_roles<Config>(gemm, smem, gemm.k / Config::kBlockK);
    }
  };
  gemm_phase(Fc1Config{}, p.fc1, fc1_smem);
  timeline.mark(layout::kFc1Streamed);
  timeline.mark(layout::kFc1Done, kMathLead);
  between_gemms();
  timeline.mark(layout::kFc2Started);
  gemm_phase(Fc2Config{}, p.fc2, fc2_smem);
  timeline.mark(layout::kFc2Streamed);
  timeline.mark(layout::kFc2Done, kMathLead);
  // The back phase. Where every thread runs the back role, the math warpgroups give back what the
  // producer's gave them (the code after this join is compiled for the launch's count); else the
  // producer warpgroup leaves and the math warpgroups keep theirs. The barrier is the
  // synchronization PTX asks of a warpgroup between two setmaxnreg.
  if constexpr (Params::kBackRoleOnEveryThread) {
    ptx::named_barrier_sync_from_anywhere(static_cast<uint32_t>(NamedBarrier::kBackPhase), kFrontThreads);
    if (producer_warpgroup) {
      ptx::setmaxnreg_increase<kLaunchRegisters>();
    } else {
      ptx::setmaxnreg_decrease<kLaunchRegisters>();
    }
  } else {
    if (producer_warpgroup) return;
    ptx::named_barrier_sync_from_anywhere(static_cast<uint32_t>(NamedBarrier::kBackPhase), Fc2Config::kConsumerThreads);
    ptx::setmaxnreg_increase<kConsumerRegisters>();
  }
  const ForwardItems& items = p.front.items;
  // By one thread, once the back role's last counter access is behind every thread of the CTA.
  const auto counters_done = [&] {
    // Fenced as in last_to_finish: the zeroing is ordered after every CTA's last counter access.
    __threadfence();
    if (atomicAdd(items.counter(kCtasDone), 1u) == gridDim.x - 1) {
      __threadfence();  // every CTA has passed every claim and wait of this forward
      for (int c = 0; c < Params::kCounters; ++c) items.counters[c] = 0;
      finish_forward(p);
      timeline.mark(layout::kForwardDone, static_cast<int>(threadIdx.x));
    }
  };
  const CombineStaging staging{smem_raw, Layout::kCombineStagingBytes};
  run_back_role<kDeterministic>(p, front_scratch, staging, Fc2Config::kConsumerThreads, counters_done);
  timeline.mark(layout::kCombineDone, kMathLead);
}

}  // namespace megamoe::kernels
