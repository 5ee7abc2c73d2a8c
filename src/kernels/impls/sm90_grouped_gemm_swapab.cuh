// Persistent, warp-specialized grouped GEMM for the MoE expert layers (sm_90a). Token tiles of
// 16/32/64 take the swapAB form:
//   out^T[channels, tokens] = W_e[channels, K] * X_pool[tokens, K]^T   for each expert e
// Expert channels sit on wgmma M (256 per tile: 4 x m64 over the math warpgroups), the expert's
// tokens on N (16/32/64), so a handful of tokens per expert pads N instead of M=64. A token tile
// of 128 takes the tokens-on-M form (mma/tokens_on_m_mainloop.cuh: 128 tokens x 256 channels),
// for experts with many rows; the producers are the same for both.
//
// Roles (one CTA per SM, 128 + 128 x kGemmMathWarpgroups threads):
//   warpgroup 0, warp 0     weight producer (lane 0): TMA loads of the weight tile into a ring of
//                           stages (full/empty mbarriers)
//   warpgroup 0, warp 1     token producer (lane 0): TMA loads of the token tile (one or two
//                           32-row subtiles at 64-token tiles: an expert's short last tile takes
//                           one) and (fp8_block) the tokens' per-128 scales into the same stages
//                           (FC1 with kCopiesTokenRows: the whole warp copies the tile's rows
//                           of x's quantized copy with cp.async, permute/stage_row_copy.cuh)
//   warpgroup 0, warp 2     (fp8_block) weight-scale producer (lane 0): cp.async of the weight tile's two
//                           block scales into the same stages
//   warpgroups 1..          consumers (swapAB or tokens on M): wgmma mainloop (fp8_block: with
//                           per-K-block scale promotion; fp8_tensor: the per-tensor scales
//                           applied to the accumulators at the end), then the epilogue in registers (FC1: SwiGLU +
//                           requant; FC2: slot store or atomic combine)
// The weight producer claims the tiles (GroupedTileScheduler), hands them to the other producers
// and tags each tile's first stage, so the consumers walk the same sequence without a claim or a
// tile search of their own; a stage tagged with expert -1 ends it. FC1 waits for the gather's
// whole grid; FC2 waits per expert for FC1's tiles of that expert (pipeline/fc1_handoff.cuh).
// Each role is a header of its own (producer/weight_producer.cuh, producer/weight_scale_producer.cuh,
// producer/token_producer.cuh, mma/swapab_mainloop.cuh, mma/tokens_on_m_mainloop.cuh, with the
// hand-offs in pipeline/tile_queue.cuh and mma/tile_walk.cuh and the shared configuration in
// mma/grouped_gemm_config.cuh); this kernel sets up the barriers and composes them.
#pragma once

#include <cute/tensor.hpp>

#include "kernels/mma/grouped_gemm_config.cuh"
#include "kernels/mma/swapab_mainloop.cuh"
#include "kernels/mma/tokens_on_m_mainloop.cuh"
#include "kernels/producer/token_producer.cuh"
#include "kernels/producer/weight_producer.cuh"
#include "kernels/producer/weight_scale_producer.cuh"
#include "kernels/ptx/cluster.cuh"
#include "kernels/ptx/grid_dependency.cuh"
#include "kernels/ptx/mbarrier.cuh"

namespace megamoe::kernels {

// The producer warpgroup's roles, by thread: one lane of warp 0 the weights, one lane of warp 2
// the fp8_block weight scales, warp 1 the tokens (one lane of TMA loads, or the whole warp where FC1
// copies token rows); the rest of the warpgroup idles. The other warpgroups do the math.
enum class ProducerRole { weights, weight_scales, tokens, idle };

template <class Config>
__device__ __forceinline__ ProducerRole producer_role() {
  const int warp = threadIdx.x / 32;
  constexpr int kTokenWarp = 1;
  const bool whole_warp = Config::kCopiesTokenRows && warp == kTokenWarp;
  if (warp > Config::kTileFollowers || (threadIdx.x % 32 != 0 && !whole_warp)) return ProducerRole::idle;
  if (warp == 0) return ProducerRole::weights;
  if (Config::kBlockScales && warp == 2) return ProducerRole::weight_scales;
  return ProducerRole::tokens;
}

// The stage ring's and the tile queue's barriers, by one thread before the block's first barrier;
// the single-kernel forward sets them up again between its two GEMMs, when nothing waits on them.
template <class Config>
__device__ __forceinline__ void init_gemm_barriers(typename Config::SharedStorage& smem) {
  for (int s = 0; s < Config::kStages; ++s) {
    ptx::mbarrier_init(&smem.full[s], Config::kFullArrivals);
    ptx::mbarrier_init(&smem.empty[s], Config::kEmptyArrivals);
  }
  for (int q = 0; q < Config::kTileQueue; ++q) {
    ptx::mbarrier_init(&smem.queue_full[q], 1);
    ptx::mbarrier_init(&smem.queue_empty[q], Config::kTileFollowers);
  }
  if constexpr (Config::kSharesWeights) {
    for (int q = 0; q < kPairMailboxSlots; ++q) {
      ptx::mbarrier_init(&smem.pair_mailbox_full[q], 1);
      ptx::mbarrier_init(&smem.pair_mailbox_empty[q], 1);
    }
  }
  ptx::fence_barrier_init();
}

// The producer warpgroup's threads after their register decrease: each runs its role to the end
// of the GEMM's tiles.
// Lane 0 of three warps fills the stages: warp 0 the weight block (and the tile tags), warp 1
// the token block, warp 2 (fp8_block) the weight block's scales. One thread's chain of instructions
// per stage bounds how fast a CTA turns its stages over (a longer chain slowed the GEMMs at
// every batch size: docs/decisions.md#producer-threads); split, each chain is a fraction as long.
// All wait for the same empty barriers; a stage is full after every part's arrival and bytes,
// in any order (its transaction count may go below zero until the weight part's expect_tx).
// The weight producer claims the tiles and hands them to the others through a queue.
// kPacesFc2ByFc1: FC1 and FC2 are grids of their own (producer/weight_producer.cuh).
template <class Config, bool kPacesFc2ByFc1, class Params>
__device__ __forceinline__ void producer_roles(const Params& p, typename Config::SharedStorage& smem, int k_blocks) {
  switch (producer_role<Config>()) {
    case ProducerRole::weights: return weight_producer<Config, kPacesFc2ByFc1>(p, smem, k_blocks);
    case ProducerRole::weight_scales: return weight_scale_producer<Config>(p, smem, k_blocks);
    case ProducerRole::tokens: return token_producer<Config>(p, smem, k_blocks);
    case ProducerRole::idle: return;
  }
}

// The math warpgroups' threads after their register increase: the mainloop and epilogue of the
// config's layout, to the end of the GEMM's tiles.
template <class Config, class Params>
__device__ __forceinline__ void math_roles(const Params& p, typename Config::SharedStorage& smem, int k_blocks) {
  if constexpr (Config::kTokensOnM) {
    tokens_on_m_math_warpgroups<Config>(p, smem, k_blocks);
  } else {
    math_warpgroups<Config>(p, smem, k_blocks);
  }
}

template <class Config, class Params>
__global__ void __launch_bounds__(Config::kThreads, 1)
    sm90_grouped_gemm_swapab_kernel(CUTE_GRID_CONSTANT const Params p) {
  using namespace cute;
  using SharedStorage = typename Config::SharedStorage;
  // The swizzled stages need 1 KiB alignment. Declared rather than computed from the address at
  // run time: a computed offset made every shared-memory address of the producer's per-stage chain
  // a few instructions longer (the compiler rematerializes it under the producer's register cap).
  // The kernel has no static shared memory, and the runtime places dynamic shared memory at the
  // 1 KiB-aligned start of the block's window; the first thread checks it.
  extern __shared__ __align__(1024) char smem_raw[];
  SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_raw);

  const int warpgroup = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    if (ptx::smem_address(smem_raw) % 1024 != 0) __trap();
    init_gemm_barriers<Config>(smem);
    cute::prefetch_tma_descriptor(p.tma_a.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_b.get_tma_descriptor());
  }
  // A CTA pair's weight loads and stage hand-backs reach the other CTA's barriers: both CTAs'
  // barriers are initialized before either starts.
  if constexpr (Config::kSharesWeights) {
    ptx::cluster_sync();
  } else {
    __syncthreads();
  }
  // The next kernel may launch as soon as every CTA of this one runs: it too reads only weights
  // and routing results before its own dependency wait (see the producer below).
  ptx::allow_dependent_launch();
  if (threadIdx.x < 32) p.scheduler.prefetch_to_l1(threadIdx.x);

  const int k_blocks = p.k / Config::kBlockK;
  if (warpgroup == 0) {
    ptx::setmaxnreg_decrease<kProducerRegisters>();
    producer_roles<Config, true>(p, smem, k_blocks);
  } else {
    // The math warpgroups read the previous kernel's output only through the stages. FC1's wait
    // all the same, so that no write of FC1 can overtake a read of the gather; FC2's writes (slot
    // rows or the accumulator) are read by no kernel before it in this forward, and its reads of
    // the gather's slot table follow the producer's acquire of FC1's tiles (the last arrival on
    // each stage).
    // With dynamic fp8_tensor scales FC2's token operand scale is the encoding grid's (read by the
    // epilogue's TensorScales), so FC2's math warps wait for it too.
    if (!Config::kWaitsForFc1 || p.token_operand_of_previous_grid) ptx::wait_for_prerequisite_grids();
    ptx::setmaxnreg_increase<kConsumerRegisters>();
    math_roles<Config>(p, smem, k_blocks);
  }
  // Neither CTA of a pair leaves while the other may still hand a stage back to it (each warp
  // converged first: the cluster barrier is .aligned, and the producer roles ran on single lanes).
  if constexpr (Config::kSharesWeights) {
    __syncwarp();
    ptx::cluster_sync();
  }
}

}  // namespace megamoe::kernels
