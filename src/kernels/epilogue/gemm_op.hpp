// What a grouped GEMM does with its accumulators, and the named barriers of the GEMM's block: its
// math warpgroups' epilogue steps, and, in the single-kernel forward, its front role's gather
// groups, the ring between the GEMMs, the combine and expert parallelism's chunks.
#pragma once

#include <cstdint>

namespace megamoe::kernels {

enum class GemmOp { fc1_swiglu, fc2_slot_store, fc2_atomic_combine };

enum class NamedBarrier : uint32_t {
  kEpilogueExchange = 1,  // 0 is __syncthreads
  kFc1TileStored = 2,     // every math thread has stored its part of an FC1 tile
  kTileStored = 3,        // the same for an FC2 tile (single-kernel forward)
  kCombineShare = 4,      // every FC2 tile is stored: the share's threads combine (single-kernel forward)
  kRingIdle = 5,          // the whole block, between the two GEMMs (single-kernel forward)
  kRowAmaxExchanged = 6,  // both math warpgroups wrote their half's row amaxes (tokens-on-M FC1, short tile)
  kEpChunkClaimed = 7,    // the math threads know their CTA's next chunk (fused expert parallelism)
  kEpChunkStored = 8,     // every math thread has stored its part of that chunk
  kBackPhase = 9,         // the threads of the back role, before it (single-kernel forward)
  kGatherGroupFirst = 10,  // 10 + g: gather group g's threads (single-kernel front role; kGatherGroups of them)
};

}  // namespace megamoe::kernels
