// Persistent, warp-specialized grouped GEMM for the MoE expert layers (sm_90a), swapAB form:
//   out^T[channels, tokens] = W_e[channels, K] * X_pool[tokens, K]^T   for each expert e
// Expert channels sit on wgmma M (256 per tile: 4 x m64 over the math warpgroups), the expert's
// tokens on N (16/32/64), so a handful of tokens per expert pads N instead of M=64.
//
// Roles (one CTA per SM, 128 + 128 x kGemmMathWarpgroups threads):
//   warpgroup 0, warp 0     weight producer (lane 0): TMA loads of the weight tile into a ring of
//                           stages (full/empty mbarriers)
//   warpgroup 0, warp 1     token producer (lane 0): TMA loads of the token tile (one or two
//                           32-row subtiles at 64-token tiles: an expert's short last tile takes
//                           one) and (fp8) the tokens' per-128 scales into the same stages
//                           (FC1 with kCopiesTokenRows: the whole warp copies the tile's rows
//                           of x's quantized copy with cp.async, permute/stage_row_copy.cuh)
//   warpgroup 0, warp 2     (fp8) weight-scale producer (lane 0): cp.async of the weight tile's two
//                           block scales into the same stages
//   warpgroups 1..          consumers: wgmma mainloop with per-K-block FP8 scale promotion, then
//                           the epilogue in registers (FC1: SwiGLU + requant; FC2: slot store or
//                           atomic combine)
// The weight producer claims the tiles (GroupedTileScheduler), hands them to the other producers
// and tags each tile's first stage, so the consumers walk the same sequence without a claim or a
// tile search of their own; a stage tagged with expert -1 ends it. FC1 waits for the gather's
// whole grid; FC2 waits per expert for FC1's tiles of that expert (pipeline/fc1_handoff.cuh).
#pragma once

#include <cute/tensor.hpp>

#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/bfloat16.h>
#include <cutlass/float8.h>

#include <cuda_bf16.h>

#include <type_traits>

#include "kernels/epilogue/fc1_swiglu.cuh"
#include "kernels/epilogue/fc2_combine.cuh"
#include "kernels/epilogue/gemm_op.hpp"
#include "kernels/layout/gemm_smem.hpp"
#include "kernels/layout/weight_layout.hpp"
#include "kernels/permute/stage_row_copy.cuh"
#include "kernels/pipeline/fc1_handoff.cuh"
#include "kernels/pipeline/pipeline_state.cuh"
#include "kernels/ptx/cp_async.cuh"
#include "kernels/ptx/grid_dependency.cuh"
#include "kernels/ptx/mbarrier.cuh"
#include "kernels/ptx/sync.cuh"
#include "kernels/scheduler/grouped_tile_scheduler.cuh"

namespace megamoe::kernels {

// Register budget per thread. A CTA holds the registers it launched with (__launch_bounds__ caps
// them at what kGemmThreads threads can have: 168 for 384 threads, 96 for 640); setmaxnreg.inc only
// takes what setmaxnreg.dec released, and waits forever for the rest. The producer needs addresses
// and pipeline state; the math warpgroups split what it gives up.
inline constexpr uint32_t kGemmThreads = 128 * (1 + layout::kGemmMathWarpgroups);
inline constexpr uint32_t kLaunchRegisters = 64 * 1024 / kGemmThreads / 8 * 8;
inline constexpr uint32_t kProducerRegisters = layout::kGemmMathWarpgroups == 2 ? 56 : 32;
inline constexpr uint32_t kConsumerRegisters = layout::kGemmMathWarpgroups == 2 ? 224 : 112;
static_assert(128 * kProducerRegisters + 128 * layout::kGemmMathWarpgroups * kConsumerRegisters <=
                  kLaunchRegisters * kGemmThreads,
              "the math warpgroups would wait forever for registers the producer never released");

// kCopiesRows: the token role is a whole warp copying the tile's rows of x's quantized copy
// (permute/stage_row_copy.cuh) instead of one lane's TMA loads of the gathered pool (FC1, fp8).
template <class Element_, int kTokenTile, GemmOp kOp, bool kCopiesRows = false>
struct GroupedGemmConfig {
  using Element = Element_;
  static constexpr bool kFp8 = std::is_same_v<Element, cutlass::float_e4m3_t>;
  static constexpr GemmOp kGemmOp = kOp;
  static constexpr bool kCopiesTokenRows = kCopiesRows;
  static_assert(!kCopiesRows || (kFp8 && kOp == GemmOp::fc1_swiglu), "rows are copied from x's fp8 copy, by FC1");
  // FC1 waits for the gather's whole grid; FC2 per expert for FC1's tiles (pipeline/fc1_handoff.cuh).
  static constexpr bool kWaitsForFc1 = kOp != GemmOp::fc1_swiglu;
  static constexpr int kBlockM = layout::kGemmChannelTile;
  static constexpr int kBlockN = kTokenTile;
  static constexpr int kBlockK = layout::kGemmKBytes / static_cast<int>(sizeof(Element));
  static constexpr int kStages = layout::gemm_stages(kTokenTile, kFp8, layout::kSm90SmemPerBlockOptin);
  static constexpr int kMathWarpgroups = layout::kGemmMathWarpgroups;
  static constexpr int kThreads = kGemmThreads;
  static constexpr int kConsumerThreads = 128 * kMathWarpgroups;
  static constexpr int kQuantBlock = 128;
  static constexpr int kMBlocks = kBlockM / (64 * kMathWarpgroups);  // m64 blocks per math warpgroup
  static_assert(kMBlocks >= 1 && 64 * kMBlocks <= kQuantBlock,
                "a math warpgroup's rows must lie in one weight scale block");

  static_assert(kTokenTile % 16 == 0 && kTokenTile <= layout::kGemmMaxTokenTile, "token tile 16, 32 or 64");
  static_assert(kStages >= 3, "at least 3 stages to hide TMA latency");
  static_assert(!(kFp8 && kBlockK != kQuantBlock), "fp8 promotion assumes one scale block per stage");
  static constexpr int kWeightScaleRows = kBlockM / kQuantBlock;  // weight scale blocks per stage
  static_assert(kQuantBlock % 64 == 0, "the rows of one m64 wgmma atom share a weight scale block");
  // A stage is full after the weight producer's arrive.expect_tx and the bytes, (fp8) the arrival
  // made when the scale producer's cp.async of the weight scales lands, and the token producer's
  // arrival after it issued the token loads: that last one comes after its acquire of FC1's tiles
  // (FC2), so the math warps' wait orders their own reads of the routing tables after it as well.
  // A row-copying token role arrives once per lane (its cp.async completions).
  static constexpr uint32_t kTokenArrivals = kCopiesRows ? 32 : 1;
  static constexpr uint32_t kFullArrivals = (kFp8 ? 2 : 1) + kTokenArrivals;
  // A math warp hands a stage back with one lane's arrival after __syncwarp, or, where the token
  // scales it read came by cp.async (generic writes the next copy may overwrite), with every
  // lane's: compute-sanitizer racecheck does not follow the __syncwarp there.
  static constexpr uint32_t kEmptyArrivalsPerWarp = kCopiesRows ? 32 : 1;
  // Tiles the weight producer may have started ahead of the token producer: with fewer K blocks
  // than stages (FC2 at small I) a stage ring holds parts of up to kStages / k_blocks + 1 tiles.
  static constexpr int kTileQueue = 4;
  // Producer threads that take the tiles from the queue: the token producer, and (fp8) the
  // weight-scale producer.
  static constexpr int kTileFollowers = kFp8 ? 2 : 1;

  using TileShape = cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>, cute::Int<kBlockK>>;
  using SmemLayoutA = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<Element>{},
                                                   cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockK>, cute::Int<kStages>>{}));
  using SmemLayoutB = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<Element>{},
                                                   cute::Shape<cute::Int<kBlockN>, cute::Int<kBlockK>, cute::Int<kStages>>{}));
  // The token block of a stage arrives in kSubtiles TMA loads of kTokenSubtile rows; a tile of
  // one subtile (an expert's short last tile) loads and multiplies only the first.
  static constexpr int kTokenSubtile = layout::gemm_token_subtile(kTokenTile);
  static constexpr int kSubtiles = kTokenTile / kTokenSubtile;
  static_assert(kTokenSubtile % 8 == 0, "a subtile starts on a swizzle atom (8 rows of 128 bytes)");
  // TMA destinations must be 128-byte aligned: each stage's token scales start on a 128-byte line.
  static constexpr int kScaleStageStride = layout::gemm_token_scale_stride(kTokenTile);
  static constexpr int kScaleSubtileStride = kScaleStageStride / kSubtiles;
  static_assert(kSubtiles == 1 || kScaleSubtileStride * sizeof(float) % 128 == 0,
                "each subtile's token scales start on a 128-byte line");
  using SmemLayoutScales = cute::Layout<cute::Shape<cute::Int<kTokenSubtile>, cute::_1, cute::Int<kStages * kSubtiles>>,
                                        cute::Stride<cute::_1, cute::_0, cute::Int<kScaleSubtileStride>>>;

  __device__ __forceinline__ static int tile_subtiles(const GroupedTile& tile) {
    return kernels::tile_subtiles(tile, kTokenTile);
  }
  __device__ __forceinline__ static uint32_t stage_tx_bytes(int subtiles) {
    constexpr int kWeightBytes = kBlockM * kBlockK * sizeof(Element);
    constexpr int kSubtileBytes = kTokenSubtile * kBlockK * sizeof(Element) + (kFp8 ? kTokenSubtile * sizeof(float) : 0);
    return static_cast<uint32_t>(kWeightBytes + (kCopiesRows ? 0 : subtiles * kSubtileBytes));
  }

  struct SharedStorage {
    alignas(1024) cute::ArrayEngine<Element, cute::cosize_v<SmemLayoutA>> a;
    alignas(1024) cute::ArrayEngine<Element, cute::cosize_v<SmemLayoutB>> b;
    alignas(128) float token_scales[kStages * kScaleStageStride];
    float weight_scales[kStages][kWeightScaleRows];
    float amax_exchange[layout::kGemmConsumerWarps + 1][kBlockN];  // per-warp partials, then per-token amax
    GroupedTile stage_tile[kStages];  // the tile that starts at the stage; expert -1: no tiles left
    uint64_t full[kStages];
    uint64_t empty[kStages];
    GroupedTile tile_queue[kTileQueue];  // weight producer -> the other producers, in claim order; expert -1 ends
    uint64_t queue_full[kTileQueue];
    uint64_t queue_empty[kTileQueue];
  };
  static_assert(kStages * (2 * sizeof(uint64_t) + kWeightScaleRows * sizeof(float) + sizeof(GroupedTile)) +
                        kTileQueue * (2 * sizeof(uint64_t) + sizeof(GroupedTile)) <=
                    layout::kGemmBarrierBytes,
                "barriers, weight scales and tile tags outgrew what the planner's stage count leaves them");
  static constexpr int kSmemBytes = static_cast<int>(sizeof(SharedStorage));
  static_assert(kSmemBytes <= layout::kSm90SmemPerBlockOptin, "shared memory over the sm_90 limit");
};

// What the math warps of a tile of kColumns token columns need: its wgmma shape and its view of
// the stages' token blocks (stage s starts at view index s * kTokenTile / kColumns). kColumns is
// the config's token tile, or its subtile for a short last tile; the rest is the config's.
template <class Config, int kColumns>
struct GemmTileColumns : Config {
  static constexpr int kBlockN = kColumns;
  static constexpr int kViewsPerStage = Config::kBlockN / kColumns;
  using Element = typename Config::Element;
  using SmemLayoutB =
      decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<Element>{},
                                   cute::Shape<cute::Int<kColumns>, cute::Int<Config::kBlockK>,
                                               cute::Int<Config::kStages * kViewsPerStage>>{}));
  using MmaAtom = decltype(cute::GMMA::ss_op_selector<Element, Element, float,
                                                      cute::Shape<cute::_64, cute::Int<kColumns>, cute::Int<Config::kBlockK>>,
                                                      cute::GMMA::Major::K, cute::GMMA::Major::K>());
  // The math warpgroups side by side on M; each thread's fragment covers kMBlocks x m64 rows. The
  // M permutation gives warpgroup w the rows [64 kMBlocks w, 64 kMBlocks (w + 1)) (row = atom row
  // + 64 kMBlocks w + 64 m for m64 block m), so all of its rows share one weight scale block.
  using PermutationM =
      cute::Layout<cute::Shape<cute::_64, cute::Int<Config::kMathWarpgroups>, cute::Int<Config::kMBlocks>>,
                   cute::Stride<cute::_1, cute::Int<64 * Config::kMBlocks>, cute::_64>>;
  using TiledMma = decltype(cute::make_tiled_mma(
      MmaAtom{}, cute::Layout<cute::Shape<cute::Int<Config::kMathWarpgroups>, cute::_1, cute::_1>>{},
      cute::Tile<PermutationM, cute::Underscore, cute::Underscore>{}));
  static_assert(cute::size(PermutationM{}) == Config::kBlockM, "the permutation covers the channel tile");
  static_assert(Config::kBlockN % kColumns == 0 && kColumns % 8 == 0, "views start on swizzle atoms");
};

// Everything one launch needs; TMA descriptors travel by value as __grid_constant__.
template <class TmaA, class TmaB, class TmaScales>
struct GroupedGemmParams {
  TmaA tma_a;                    // weights [E][a_rows][K]
  TmaB tma_b;                    // pool [pool_rows][K]
  TmaScales tma_token_scales;    // fp8: [K/128][pool_rows]
  const float* weight_scales;    // fp8: [E][a_rows/128][K/128]
  int a_rows;                    // 2I (fc1) or H (fc2)
  int k;                         // H (fc1) or I (fc2)
  int num_experts;
  int pool_rows;
  GroupedTileScheduler scheduler;
  // Epilogue.
  int out_channels;              // I (fc1) or H (fc2)
  void* out;                     // fc1: [pool_rows, I] (fp8 or bf16); fc2 slot store: bf16 [T*k, H]
  float* out_scales;             // fc1 fp8: [I/128, pool_rows]
  bool ue8m0;
  const int32_t* pool_slot;      // fc2
  const float* routed_weights;   // fc2 atomic
  float* y_accumulator;          // fc2 atomic: fp32 [T, H]
  int top_k;
  uint32_t* fc1_tiles_done;      // [E+1]: fc1 adds one per stored tile (its expert's, all); fc2 waits
  int fc1_channel_blocks;        // fc1 tiles per token tile of an expert
  QuantizedTokenRows token_rows; // fc1 with a row-copying token role: what it copies
};


template <class Config, class Params>
__global__ void __launch_bounds__(Config::kThreads, 1)
    sm90_grouped_gemm_swapab_kernel(CUTE_GRID_CONSTANT const Params p) {
  using namespace cute;
  using SharedStorage = typename Config::SharedStorage;
  constexpr int kStages = Config::kStages;
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
    for (int s = 0; s < kStages; ++s) {
      ptx::mbarrier_init(&smem.full[s], Config::kFullArrivals);
      ptx::mbarrier_init(&smem.empty[s], layout::kGemmConsumerWarps * Config::kEmptyArrivalsPerWarp);
    }
    for (int q = 0; q < Config::kTileQueue; ++q) {
      ptx::mbarrier_init(&smem.queue_full[q], 1);
      ptx::mbarrier_init(&smem.queue_empty[q], Config::kTileFollowers);
    }
    ptx::fence_barrier_init();
    cute::prefetch_tma_descriptor(p.tma_a.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_b.get_tma_descriptor());
  }
  __syncthreads();
  // The next kernel may launch as soon as every CTA of this one runs: it too reads only weights
  // and routing results before its own dependency wait (see the producer below).
  ptx::allow_dependent_launch();
  if (threadIdx.x < 32) p.scheduler.prefetch_to_l1(threadIdx.x);

  Tensor sA = make_tensor(make_smem_ptr(smem.a.begin()), typename Config::SmemLayoutA{});  // (BM, BK, S)
  const int k_blocks = p.k / Config::kBlockK;

  if (warpgroup == 0) {
    // ---------------------------------------------------------------- producers
    // Lane 0 of three warps fills the stages: warp 0 the weight block (and the tile tags), warp 1
    // the token block, warp 2 (fp8) the weight block's scales. One thread's chain of instructions
    // per stage bounds how fast a CTA turns its stages over (a longer chain slowed the GEMMs at
    // every batch size: docs/decisions.md#producer-threads); split, each chain is a fraction as long.
    // All wait for the same empty barriers; a stage is full after every part's arrival and bytes,
    // in any order (its transaction count may go below zero until the weight part's expect_tx).
    // The weight producer claims the tiles and hands them to the others through a queue.
    ptx::setmaxnreg_decrease<kProducerRegisters>();
    const int warp = threadIdx.x / 32;
    constexpr int kTokenWarp = 1;
    const bool whole_warp = Config::kCopiesTokenRows && warp == kTokenWarp;
    if (warp > Config::kTileFollowers || (threadIdx.x % 32 != 0 && !whole_warp)) return;
    using QueueState = pipeline::PipelineState<Config::kTileQueue>;
    // A follower's next tile from the weight producer (expert -1: none left).
    auto take_tile = [&](QueueState& queue) {
      ptx::wait_parity(&smem.queue_full[queue.stage], queue.phase);
      const GroupedTile tile = smem.tile_queue[queue.stage];
      ptx::mbarrier_arrive(&smem.queue_empty[queue.stage]);
      queue.advance();
      return tile;
    };

    if (warp == 0) {
      // ------------------------------------------------------------ weight producer
      Tensor mA = p.tma_a.get_tma_tensor(make_shape(p.a_rows, p.k, p.num_experts));
      Tensor gA = local_tile(mA, typename Config::TileShape{}, make_coord(_, _, _), Step<_1, X, _1>{});  // (BM,BK,m,k,E)
      // (Named tensors rather than structured bindings: the loader below captures them.)
      const auto a_slices = tma_partition(p.tma_a, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sA), group_modes<0, 2>(gA));
      Tensor tAgA = get<0>(a_slices);
      Tensor tAsA = get<1>(a_slices);
      // A tile's first stage carries its tag, written before the stage's first arrival, which
      // orders it before the consumers' wait (they read the tag only where a tile starts).
      // The weights of an expert with one token tile are read once in the forward: they go into
      // L2 first in line for eviction, and what is read again (the gathered tokens, FC1's output,
      // the slot rows the combine reads) stays. An expert with more token tiles has them running
      // side by side on other CTAs, so even its last tile's loads may come before another tile's
      // reads of the same rows (with the hint there, 2048 tokens lost ~9 us).
      auto load_weights = [&](const GroupedTile& tile, int kb, int stage) {
        if (kb == 0) smem.stage_tile[stage] = tile;
        ptx::mbarrier_arrive_expect_tx(&smem.full[stage], Config::stage_tx_bytes(Config::tile_subtiles(tile)));
        const auto hint = tile.expert_token_tiles == 1 ? TMA::CacheHintSm90::EVICT_FIRST : TMA::CacheHintSm90::EVICT_NORMAL;
        copy(p.tma_a.with(smem.full[stage], 0, hint), tAgA(_, tile.channel_block, kb, tile.expert), tAsA(_, stage));
      };
      QueueState queue;
      auto hand_over = [&](const GroupedTile& tile) {
        ptx::wait_parity(&smem.queue_empty[queue.stage], queue.phase ^ 1);
        smem.tile_queue[queue.stage] = tile;
        ptx::mbarrier_arrive(&smem.queue_full[queue.stage]);
        queue.advance();
      };

      // Weights and routing results do not depend on the previous kernel: the routing was
      // complete before this grid could launch (the router and the gather each wait for their
      // predecessor before releasing the next kernel, and this kernel releases its successor only
      // after every CTA has started). So the first tile's first kStages weight blocks stream in
      // before the dependency wait, overlapping the previous kernel's tail (FC1 waits for the
      // whole previous grid after them; FC2 only per expert, in the token producer).
      const int num_tiles = p.scheduler.num_tiles();
      int linear = blockIdx.x;
      int prefetched = 0;
      GroupedTile tile{};
      if (linear < num_tiles) {
        tile = p.scheduler.tile(linear);
        hand_over(tile);
        for (; prefetched < k_blocks && prefetched < kStages; ++prefetched) load_weights(tile, prefetched, prefetched);
      }
      if constexpr (!Config::kWaitsForFc1) ptx::wait_for_prerequisite_grids();
      pipeline::PipelineState<kStages> state;
      int issued = 0;
      while (linear < num_tiles) {
        // Claimed as the tile starts, so that the atomic's round trip overlaps the tile's loads.
        const int next = p.scheduler.claim_next_tile();
        for (int kb = 0; kb < k_blocks; ++kb, ++issued) {
          if (issued >= prefetched) {
            ptx::wait_parity(&smem.empty[state.stage], state.phase ^ 1);
            load_weights(tile, kb, state.stage);
          }
          state.advance();
        }
        linear = next;
        if (linear < num_tiles) {
          tile = p.scheduler.tile(linear);
          hand_over(tile);
        }
      }
      GroupedTile end{};
      end.expert = -1;
      hand_over(end);
      // The end tag: a stage with no bytes, full after this producer's arrivals alone.
      ptx::wait_parity(&smem.empty[state.stage], state.phase ^ 1);
      smem.stage_tile[state.stage].expert = -1;
      for (uint32_t a = 0; a < Config::kFullArrivals; ++a) ptx::mbarrier_arrive(&smem.full[state.stage]);
      return;
    }

    if (Config::kFp8 && warp == 2) {
      // ------------------------------------------------------------ weight-scale producer
      // The weight tile's two block scales travel with each stage (a load per K block in the math
      // warps was a dependent global round trip per block: with the tile search, a third of FC1
      // at one token). They are weights, so they need no dependency wait.
      const int scale_rows = p.a_rows / Config::kQuantBlock;
      pipeline::PipelineState<kStages> state;
      QueueState queue;
      for (GroupedTile tile = take_tile(queue); tile.expert >= 0; tile = take_tile(queue)) {
        const float* source[Config::kWeightScaleRows];  // the tile's block scales at K block 0
        for (int r = 0; r < Config::kWeightScaleRows; ++r) {
          // A last channel block with fewer rows repeats its last scale row; those rows are padding.
          const int row = min(tile.channel_block * Config::kWeightScaleRows + r, scale_rows - 1);
          source[r] = p.weight_scales + (static_cast<size_t>(tile.expert) * scale_rows + row) * k_blocks;
        }
        for (int kb = 0; kb < k_blocks; ++kb) {
          ptx::wait_parity(&smem.empty[state.stage], state.phase ^ 1);
          for (int r = 0; r < Config::kWeightScaleRows; ++r) ptx::cp_async_4(&smem.weight_scales[state.stage][r], source[r] + kb);
          ptx::cp_async_mbarrier_arrive_noinc(&smem.full[state.stage]);
          state.advance();
        }
      }
      return;
    }

    // -------------------------------------------------------------- token producer
    if constexpr (Config::kCopiesTokenRows) {
      ptx::wait_for_prerequisite_grids();  // x's quantized copy and the pool slots are the gather's
      QueueState queue;
      StageRowCopy<Config>::run(p.token_rows, reinterpret_cast<uint8_t*>(smem.b.begin()), smem.token_scales, smem.full,
                                smem.empty, k_blocks, [&] { return take_tile(queue); });
      return;
    }
    // Token blocks travel in subtiles: view index stage * kSubtiles + subtile.
    using Subtiles = GemmTileColumns<Config, Config::kTokenSubtile>;
    Tensor sB = make_tensor(make_smem_ptr(smem.b.begin()), typename Subtiles::SmemLayoutB{});  // (BS, BK, S x subtiles)
    Tensor mB = p.tma_b.get_tma_tensor(make_shape(p.pool_rows, p.k));
    Tensor gB = local_tile(mB, make_shape(Int<Config::kTokenSubtile>{}, Int<Config::kBlockK>{}), make_coord(_, _));  // (BS,BK,n,k)
    const auto b_slices = tma_partition(p.tma_b, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sB), group_modes<0, 2>(gB));
    Tensor tBgB = get<0>(b_slices);
    Tensor tBsB = get<1>(b_slices);
    // One subtile, then the second unless the tile is short: no run-time loop, which made this
    // chain (then the only producer's) a generic unrolled loop of loads
    // (docs/decisions.md#32-row-subtile).
    static_assert(Config::kSubtiles <= 2, "a stage holds one or two token subtiles");
    auto load_subtile = [&](int subtile, int kb, int stage, int view) {
      copy(p.tma_b.with(smem.full[stage]), tBgB(_, subtile, kb), tBsB(_, view));
      if constexpr (Config::kFp8) {
        Tensor sS = make_tensor(make_smem_ptr(smem.token_scales), typename Config::SmemLayoutScales{});  // (BS,1,S x subtiles)
        Tensor mS = p.tma_token_scales.get_tma_tensor(make_shape(p.pool_rows, k_blocks));
        Tensor gS = local_tile(mS, make_shape(Int<Config::kTokenSubtile>{}, _1{}), make_coord(_, _));  // (BS,1,n,kb)
        auto [tSgS, tSsS] =
            tma_partition(p.tma_token_scales, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sS), group_modes<0, 2>(gS));
        copy(p.tma_token_scales.with(smem.full[stage]), tSgS(_, subtile, kb), tSsS(_, view));
      }
    };
    auto load_tokens = [&](const GroupedTile& tile, int kb, int stage) {
      const int first_subtile = tile.pool_row / Config::kTokenSubtile;
      load_subtile(first_subtile, kb, stage, stage * Config::kSubtiles);
      if (Config::kSubtiles == 2 && Config::tile_subtiles(tile) == 2) {
        load_subtile(first_subtile + 1, kb, stage, stage * Config::kSubtiles + 1);
      }
      ptx::mbarrier_arrive(&smem.full[stage]);
    };
    // The token blocks are the previous kernel's output: for FC1 they wait for the whole previous
    // grid, for FC2 per tile for the tile's expert.
    if constexpr (!Config::kWaitsForFc1) ptx::wait_for_prerequisite_grids();
    Fc1Progress fc1{p.fc1_tiles_done, p.num_experts,
                     static_cast<uint32_t>(p.fc1_channel_blocks * p.scheduler.token_tiles())};
    pipeline::PipelineState<kStages> state;
    QueueState queue;
    for (GroupedTile tile = take_tile(queue); tile.expert >= 0; tile = take_tile(queue)) {
      for (int kb = 0; kb < k_blocks; ++kb) {
        ptx::wait_parity(&smem.empty[state.stage], state.phase ^ 1);
        if (Config::kWaitsForFc1 && kb == 0) fc1.wait_for_expert(tile.expert, p.fc1_channel_blocks * tile.expert_token_tiles);
        load_tokens(tile, kb, state.stage);
        state.advance();
      }
    }
    // FC2 reads what it needs of FC1 through the counters; this wait only makes FC2's completion
    // imply FC1's, which the kernels after it (and the next forward) rely on.
    if constexpr (Config::kWaitsForFc1) ptx::wait_for_prerequisite_grids();
    return;
  }

  // The math warpgroups read the previous kernel's output only through the stages. FC1's wait all
  // the same, so that no write of FC1 can overtake a read of the gather; FC2's writes (slot rows or
  // the accumulator) are read by no kernel before it in this forward, and its reads of the gather's
  // slot table follow the producer's acquire of FC1's tiles (the last arrival on each stage).
  if constexpr (!Config::kWaitsForFc1) ptx::wait_for_prerequisite_grids();
  // ------------------------------------------------------------------ consumers
  ptx::setmaxnreg_increase<kConsumerRegisters>();
  const int consumer_thread = threadIdx.x - 128;
  const int lane = consumer_thread % 32;
  pipeline::PipelineState<kStages> state;
  // After the block's batch has completed its reads of the stage.
  auto release_stage = [&](int stage) {
    if constexpr (Config::kEmptyArrivalsPerWarp == 32) {
      ptx::mbarrier_arrive(&smem.empty[stage]);
    } else {
      __syncwarp();
      if (lane == 0) ptx::mbarrier_arrive(&smem.empty[stage]);
    }
  };

  // One tile of Columns::kBlockN token columns, from its first stage (already full) to its stored
  // output. Instantiated for the token tile and, where there is one, for the short last tile of
  // one subtile; the compiler gives both the same registers.
  auto consume_tile = [&](auto columns, const GroupedTile& tile) {
    using Columns = decltype(columns);
    typename Columns::TiledMma mma;
    ThrMMA thr_mma = mma.get_thread_slice(consumer_thread);
    Tensor sB = make_tensor(make_smem_ptr(smem.b.begin()), typename Columns::SmemLayoutB{});  // (BN, BK, S x views)
    Tensor tCrA = thr_mma.make_fragment_A(thr_mma.partition_A(sA));  // (MMA, kMBlocks, MMA_K, S)
    Tensor tCrB = thr_mma.make_fragment_B(thr_mma.partition_B(sB));  // (MMA, 1, MMA_K, S x views)
    using TileMN = Shape<Int<Columns::kBlockM>, Int<Columns::kBlockN>>;
    Tensor acc = partition_fragment_C(mma, TileMN{});                // (MMA=(2,2,N/8), kMBlocks, 1)
    // fp8: each K block accumulates unscaled into `partial`, then is promoted into `acc` with its
    // weight scale times each token's scale.
    Tensor partial = partition_fragment_C(mma, TileMN{});
    // Tile coordinates of this thread's fragment: element (v0, v1, v2) of m-block m sits at row
    // base_row[m] + 8 v1 and column base_col + 8 v2 + v0 (the sm90 GMMA accumulator layout).
    Tensor coords = thr_mma.partition_C(make_identity_tensor(TileMN{}));
    static_assert(decltype(size<1>(acc))::value == Config::kMBlocks, "one fragment mode per m64 block");
    int base_row[Config::kMBlocks];
    CUTE_UNROLL
    for (int m = 0; m < Config::kMBlocks; ++m) base_row[m] = get<0>(coords(make_coord(0, 0, 0), m, 0));
    const int base_col = get<1>(coords(make_coord(0, 0, 0), 0, 0));

    // The 4 k32 steps of the K block in `stage`, as one wgmma batch into `out` (accumulating, or
    // overwriting it first when `accumulate` is false).
    auto issue_block = [&](auto& out, int stage, bool accumulate) {
      warpgroup_fence_operand(out);
      warpgroup_arrive();
      mma.accumulate_ = accumulate ? GMMA::ScaleOut::One : GMMA::ScaleOut::Zero;
      CUTE_UNROLL
      for (int k = 0; k < size<2>(tCrA); ++k) {
        gemm(mma, tCrA(_, _, k, stage), tCrB(_, _, k, stage * Columns::kViewsPerStage), out);
        mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
    };
    // fp8: the scales of one K block as this thread applies them, weight scale times token scale
    // for each of its (N/8) x 2 (v2, v0) columns (all m64 blocks of a warpgroup share the weight
    // scale, see PermutationM). Read from shared memory as soon as the stage is full, so that the
    // reads overlap the wgmma batch instead of following it.
    constexpr int kColGroups = Columns::kBlockN / 8;
    using BlockScales = float[kColGroups][2];
    auto read_block_scales = [&](int stage, BlockScales& scales) {
      // The lane that hands the stage back reads the weight scale and broadcasts it: the
      // producer's cp.async that later rewrites it is then ordered after the read by that lane's
      // own arrival (a read by the other lanes would be ordered by the __syncwarp alone, which
      // compute-sanitizer racecheck does not follow).
      const float mine = lane == 0 ? smem.weight_scales[stage][base_row[0] / Config::kQuantBlock] : 0.0f;
      const float weight_scale = __shfl_sync(0xffffffffu, mine, 0);
      const float* token_scale = smem.token_scales + stage * Config::kScaleStageStride;
      CUTE_UNROLL
      for (int v2 = 0; v2 < kColGroups; ++v2) {
        // Columns base_col + 8 v2 + {0, 1}: base_col is even, so one 8-byte load.
        const float2 ts = *reinterpret_cast<const float2*>(token_scale + base_col + 8 * v2);
        scales[v2][0] = weight_scale * ts.x;
        scales[v2][1] = weight_scale * ts.y;
      }
    };
    auto promote = [&](auto& block, const BlockScales& scales) {
      CUTE_UNROLL
      for (int v2 = 0; v2 < kColGroups; ++v2)
        CUTE_UNROLL
        for (int v0 = 0; v0 < 2; ++v0)
          CUTE_UNROLL
          for (int m = 0; m < Config::kMBlocks; ++m)
            CUTE_UNROLL
            for (int v1 = 0; v1 < 2; ++v1)
              acc(make_coord(v0, v1, v2), m, 0) += block(make_coord(v0, v1, v2), m, 0) * scales[v2][v0];
    };

    gemm_detail::Fc2TileSlots<Columns> slots;
    if constexpr (Config::kGemmOp != GemmOp::fc1_swiglu) slots.load(p, tile, base_col);
    clear(acc);
    for (int kb = 0; kb < k_blocks; ++kb) {
      if (kb > 0) ptx::wait_parity(&smem.full[state.stage], state.phase);  // K block 0's: before the tile
      // Copied rows came through the generic proxy; the wgmma reads through the async one.
      if constexpr (Config::kCopiesTokenRows) ptx::fence_proxy_async_shared();
      if constexpr (Config::kFp8) {
        BlockScales scales;
        read_block_scales(state.stage, scales);
        issue_block(partial, state.stage, false);
        warpgroup_wait<0>();
        warpgroup_fence_operand(partial);
        release_stage(state.stage);
        promote(partial, scales);
      } else {
        issue_block(acc, state.stage, true);
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc);
        release_stage(state.stage);
      }
      state.advance();
    }

    if constexpr (Config::kGemmOp == GemmOp::fc1_swiglu) {
      gemm_detail::fc1_swiglu_epilogue<Columns>(p, tile, acc, base_row, base_col, smem, consumer_thread);
      publish_fc1_tile(p.fc1_tiles_done, tile.expert, p.num_experts, static_cast<uint32_t>(NamedBarrier::kFc1TileStored),
                       Config::kConsumerThreads, consumer_thread);
    } else {
      gemm_detail::fc2_epilogue<Columns>(p, tile, acc, base_row, base_col, slots);
    }
  };

  // The first stage of each tile names it. Lane 0, which hands stages back, reads the tag for its
  // warp (as with the weight scale above, its own arrival then orders the read before any rewrite).
  auto stage_tile = [&](int stage) { return broadcast_from_lane0(lane == 0 ? smem.stage_tile[stage] : GroupedTile{}); };
  using WholeTile = GemmTileColumns<Config, Config::kBlockN>;
  using ShortTile = GemmTileColumns<Config, Config::kTokenSubtile>;
  ptx::wait_parity(&smem.full[state.stage], state.phase);
  for (GroupedTile tile = stage_tile(state.stage); tile.expert >= 0;) {
    if (Config::tile_subtiles(tile) < Config::kSubtiles) consume_tile(ShortTile{}, tile);
    else consume_tile(WholeTile{}, tile);
    ptx::wait_parity(&smem.full[state.stage], state.phase);
    tile = stage_tile(state.stage);
  }
}

}  // namespace megamoe::kernels
