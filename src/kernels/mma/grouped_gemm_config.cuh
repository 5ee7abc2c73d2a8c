// The grouped GEMM's configuration, shared by all of its roles: the tile shapes, the stage ring
// and its shared-memory storage, the register budget per role, and a launch's parameters. A token
// tile of 16, 32 or 64 is the swapAB layout (channels on wgmma M, tokens on N); 128 is the
// tokens-on-M layout (mma/tokens_on_m_mainloop.cuh). The producers fill the same stages in both:
// a block of 256 weight rows and one of the tile's token rows. The kernel
// (impls/sm90_grouped_gemm_swapab.cuh) composes the roles; each role's header takes this config.
#pragma once

#include <cute/tensor.hpp>

#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/bfloat16.h>
#include <cutlass/float8.h>

#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "kernels/epilogue/gemm_op.hpp"
#include "kernels/layout/gemm_smem.hpp"
#include "kernels/permute/stage_row_copy.cuh"
#include "kernels/pipeline/pair_claims.cuh"
#include "kernels/scheduler/grouped_tile_scheduler.cuh"
#include "megamoe/spec.hpp"

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
// (permute/stage_row_copy.cuh) instead of one lane's TMA loads of the gathered pool (FC1, fp8_block or
// fp8_tensor).
// kPairs: the CTAs run in clusters of two on the tiles 2u and 2u + 1 of the pairs' numbering
// (scheduler/tile_numbering.hpp: an expert's short tiles after its full ones); where those share a
// weight block each CTA loads half of it into both by TMA multicast
// (docs/decisions.md#weight-multicast-pairs).
// kPrecision: bf16 or E4M3 operands; fp8_block promotes each K block with the stage's weight and
// token scales, fp8_tensor (like bf16) accumulates straight through K and applies its per-tensor
// scales to the tile's accumulators before the epilogue (epilogue/tensor_scales.cuh).
template <Precision kPrecision_, int kTokenTile, GemmOp kOp, bool kCopiesRows = false, bool kPairs = false>
struct GroupedGemmConfig {
  static constexpr Precision kPrecision = kPrecision_;
  using Element = std::conditional_t<kPrecision == Precision::bf16, cutlass::bfloat16_t, cutlass::float_e4m3_t>;
  static constexpr bool kFp8 = kPrecision != Precision::bf16;
  static constexpr bool kBlockScales = kPrecision == Precision::fp8_block;
  static constexpr bool kTensorScales = kPrecision == Precision::fp8_tensor;
  static constexpr GemmOp kGemmOp = kOp;
  static constexpr bool kCopiesTokenRows = kCopiesRows;
  static constexpr bool kTokensOnM = layout::gemm_tokens_on_m(kTokenTile);
  static constexpr bool kSharesWeights = kPairs;
  static constexpr int kClusterSize = kPairs ? 2 : 1;
  static_assert(!kCopiesRows || (kFp8 && kOp == GemmOp::fc1_swiglu),
                "rows (and fp8_block's scales) are copied from x's fp8 copy, by FC1");
  static_assert(!(kCopiesRows && kTokensOnM), "the row copy fills swapAB's token blocks only");
  static_assert(!kPairs || kTokensOnM, "CTA pairs share the weight blocks of the tokens-on-M layout only");
  // FC1 waits for the gather's whole grid; FC2 per expert for FC1's tiles (pipeline/fc1_handoff.cuh).
  static constexpr bool kWaitsForFc1 = kOp != GemmOp::fc1_swiglu;
  static constexpr int kBlockM = layout::kGemmChannelTile;
  static constexpr int kBlockN = kTokenTile;
  static constexpr int kBlockK = layout::kGemmKBytes / static_cast<int>(sizeof(Element));
  static constexpr int kStages = layout::gemm_stages(kTokenTile, kBlockScales, layout::kSm90SmemPerBlockOptin);
  static constexpr int kMathWarpgroups = layout::kGemmMathWarpgroups;
  static constexpr int kThreads = kGemmThreads;
  static constexpr int kConsumerThreads = 128 * kMathWarpgroups;
  static constexpr int kQuantBlock = 128;
  static constexpr int kMBlocks = kBlockM / (64 * kMathWarpgroups);  // m64 blocks per math warpgroup
  static_assert(kMBlocks >= 1 && 64 * kMBlocks <= kQuantBlock,
                "a math warpgroup's rows must lie in one weight scale block");

  static_assert((kTokenTile % 16 == 0 && kTokenTile <= layout::kGemmSwapAbMaxTokenTile) || kTokensOnM,
                "token tile 16, 32 or 64 (swapAB), or 128 (tokens on M)");
  static_assert(kStages >= 3, "at least 3 stages to hide TMA latency");
  static_assert(!(kBlockScales && kBlockK != kQuantBlock), "fp8 promotion assumes one scale block per stage");
  static constexpr int kWeightScaleRows = kBlockM / kQuantBlock;  // weight scale blocks per stage
  static_assert(kQuantBlock % 64 == 0, "the rows of one m64 wgmma atom share a weight scale block");
  // A stage is full after the weight producer's arrive.expect_tx and the bytes, (fp8_block) the arrival
  // made when the scale producer's cp.async of the weight scales lands, and the token producer's
  // arrival after it issued the token loads: that last one comes after its acquire of FC1's tiles
  // (FC2), so the math warps' wait orders their own reads of the routing tables after it as well.
  // A row-copying token role arrives once per lane (its cp.async completions).
  static constexpr uint32_t kTokenArrivals = kCopiesRows ? 32 : 1;
  static constexpr uint32_t kFullArrivals = (kBlockScales ? 2 : 1) + kTokenArrivals;
  // A math warp hands a stage back with one lane's arrival after __syncwarp, or, where the token
  // scales it read came by cp.async (generic writes the next copy may overwrite), with every
  // lane's: compute-sanitizer racecheck does not follow the __syncwarp there. In a CTA pair both
  // CTAs' math warps hand each stage back to both (either CTA's weight load writes both).
  static constexpr uint32_t kEmptyArrivalsPerWarp = kCopiesRows ? 32 : 1;
  static constexpr uint32_t kEmptyArrivals = layout::kGemmConsumerWarps * kEmptyArrivalsPerWarp * kClusterSize;
  // Tiles the weight producer may have started ahead of the token producer: with fewer K blocks
  // than stages (FC2 at small I) a stage ring holds parts of up to kStages / k_blocks + 1 tiles.
  static constexpr int kTileQueue = 4;
  // Producer threads that take the tiles from the queue: the token producer, and (fp8_block) the
  // weight-scale producer.
  static constexpr int kTileFollowers = kBlockScales ? 2 : 1;

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
  // A stage's bytes: the whole weight block (in a pair, half of it from each CTA's load) and the
  // tile's token subtiles.
  __device__ __forceinline__ static uint32_t stage_tx_bytes(int subtiles) {
    constexpr int kWeightBytes = kBlockM * kBlockK * sizeof(Element);
    constexpr int kSubtileBytes = kTokenSubtile * kBlockK * sizeof(Element) + (kBlockScales ? kTokenSubtile * sizeof(float) : 0);
    return static_cast<uint32_t>(kWeightBytes + (kCopiesRows ? 0 : subtiles * kSubtileBytes));
  }

  struct SharedStorage {
    alignas(1024) cute::ArrayEngine<Element, cute::cosize_v<SmemLayoutA>> a;
    alignas(1024) cute::ArrayEngine<Element, cute::cosize_v<SmemLayoutB>> b;
    alignas(128) float token_scales[kStages * kScaleStageStride];
    float weight_scales[kStages][kWeightScaleRows];
    // FC1: swapAB's per-warp partials, then per-token amax; tokens on M, a short tile's per-row
    // amax of each warpgroup's half (a whole tile reduces a row within a quad of lanes).
    float amax_exchange[kTokensOnM ? kMathWarpgroups : layout::kGemmConsumerWarps + 1][kTokensOnM ? kTokenSubtile : kBlockN];
    GroupedTile stage_tile[kStages];  // the tile that starts at the stage; expert -1: no tiles left
    uint64_t full[kStages];
    uint64_t empty[kStages];
    GroupedTile tile_queue[kTileQueue];  // weight producer -> the other producers, in claim order; expert -1 ends
    uint64_t queue_full[kTileQueue];
    uint64_t queue_empty[kTileQueue];
    // A CTA pair's claimed units, first CTA -> second (pipeline/pair_claims.cuh).
    int32_t pair_mailbox[kPairMailboxSlots];
    uint64_t pair_mailbox_full[kPairMailboxSlots];
    uint64_t pair_mailbox_empty[kPairMailboxSlots];
  };
  static_assert(kStages * (2 * sizeof(uint64_t) + kWeightScaleRows * sizeof(float) + sizeof(GroupedTile)) +
                        kTileQueue * (2 * sizeof(uint64_t) + sizeof(GroupedTile)) +
                        kPairMailboxSlots * (sizeof(int32_t) + 2 * sizeof(uint64_t)) <=
                    layout::kGemmBarrierBytes,
                "barriers, weight scales and tile tags outgrew what the planner's stage count leaves them");
  static_assert(sizeof(SharedStorage::amax_exchange) <= layout::kGemmExchangeBytes,
                "the amax exchange outgrew what the planner's stage count leaves it");
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
  // Whether FC2's slot rows go to other GPUs' memory (expert parallelism's fused forward:
  // comm/ep_expert_rows.cuh), whose tiles are then fenced at system scope before they count as
  // stored.
  static constexpr bool kStoresToPeers = false;

  TmaA tma_a;                    // weights [E][a_rows][K]
  TmaB tma_b;                    // pool [pool_rows][K]
  TmaScales tma_token_scales;    // fp8_block: [K/128][pool_rows]
  const float* weight_scales;    // fp8_block: [E][a_rows/128][K/128]; fp8_tensor: [E][2] (fc1: gate, up) or [E] (fc2)
  const float* input_scale;      // fp8_tensor: the scale of the token operand (x's, or FC2's input;
                                 // layout::TensorScaleSlots), read when a tile starts
  int a_rows;                    // 2I (fc1) or H (fc2)
  int k;                         // H (fc1) or I (fc2)
  int num_experts;
  int pool_rows;
  GroupedTileScheduler scheduler;
  // Epilogue.
  int out_channels;              // I (fc1) or H (fc2)
  void* out;                     // fc1: [pool_rows, I] (fp8 or bf16); fc2 slot store: bf16 [T*k, H]
  float* out_scales;             // fc1 fp8_block: [I/128, pool_rows]
  const float* out_factor;       // fc1 fp8_tensor: h is stored as e4m3(h * *out_factor), 1 / FC2's input scale
  uint32_t* out_amax;            // fc1 fp8_tensor, dynamic scales: h is stored in bf16 and its largest finite
                                 // |value| folded in here (quant/dynamic_tensor_scales.cuh); else null
  bool token_operand_of_previous_grid;  // fc2 fp8_tensor, dynamic scales: the E4M3 rows and their scale come
                                        // from the encoding grid before this one, not from FC1's counters
  bool ue8m0;
  const int32_t* pool_slot;      // fc2
  const float* routed_weights;   // fc2 atomic
  float* y_accumulator;          // fc2 atomic: fp32 [T, H]
  int top_k;
  uint32_t* fc1_tiles_done;      // [E+1]: fc1 adds one per stored tile (its expert's, all); fc2 waits
  uint32_t* fc1_blocks_issued;   // [1]: where FC1 has fewer tiles than the grid CTAs, fc1 counts the weight
                                 // blocks it has issued and fc2's first weights wait on it (weight_producer.cuh)
  int fc1_channel_blocks;        // fc1 tiles per token tile of an expert
  QuantizedTokenRows token_rows; // fc1 with a row-copying token role: what it copies
  // Inside the single-kernel forward, which has no earlier grid to wait for: fc1's token producer
  // waits until tokens_ready reaches tokens_ready_count (the gather's items), and fc2 adds one
  // to tiles_stored per stored tile (the combine waits for all). Null in the per-stage forward.
  const uint32_t* tokens_ready;
  uint32_t tokens_ready_count;
  uint32_t* tiles_stored;

  // FC2 slot store: where slot `slot`'s expert output row goes.
  __device__ __forceinline__ __nv_bfloat16* slot_row(int slot) const {
    return static_cast<__nv_bfloat16*>(out) + static_cast<size_t>(slot) * out_channels;
  }
};

}  // namespace megamoe::kernels
