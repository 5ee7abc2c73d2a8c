// Permute role: one block per token copies its activation row into the pool row of each of its
// routed slots (expert-contiguous order), quantizing to E4M3 on the way: per 128 channels in
// fp8_block mode, with the layer input's one scale in fp8_tensor mode. The token is read and
// quantized once, whatever k is. With rows_by_token (fp8_block),
// the quantized row is written once, at row `token`, and only the pool slot table is per slot:
// FC1 copies its tiles' rows from there (permute/stage_row_copy.cuh). A caller's x already quantized
// (GatherParams::x_scales, fp8_block) is copied into the pool rows as it is, or, with rows_by_token,
// left where it is for FC1 to copy from: then the gather only fills the pool slot table.
//
// A block per token, so that a small batch's rows are read by 256 threads at once (one warp per
// token took 12 us for one token on an H200, this takes 1.5-2); one rolled loop of one 8-channel
// chunk per thread, one load ahead.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/ptx/grid_dependency.cuh"
#include "kernels/quant/fp8_block_scale.cuh"
#include "kernels/routing/routing_limits.hpp"
#include "kernels/routing/valid_tokens.cuh"
#include "megamoe/spec.hpp"

namespace megamoe::kernels {

inline constexpr int kGatherThreads = 256;
inline constexpr int kGatherChunkElements = 8;  // one 16-byte load of bf16 per thread and chunk

struct GatherParams {
  int num_tokens;
  const int32_t* num_valid_tokens;  // device count, or null: all num_tokens rows are real
  int top_k;
  int hidden;
  int pool_rows;
  bool ue8m0;
  const __nv_bfloat16* x;        // [T, H]; E4M3 codes [T, H] where x_scales is set
  const float* x_scales;         // fp8_block, x already quantized: token t's scale of block b at
                                 // b * x_scale_stride + t; null: x is bf16 and quantized here
  int x_scale_stride;
  const int32_t* routed_ids;     // [T, k]
  const int32_t* slot_rank;      // [T, k]
  const int32_t* expert_offsets; // [E+1]
  int32_t* pool_slot;            // [pool_rows]
  bool rows_by_token;            // fp8_block: activations row = token (one per token), not one per slot
  void* activations;             // [pool_rows, H] bf16 or e4m3
  float* activation_scales;      // [H/128, pool_rows] (fp8_block)
  const float* tensor_factor;    // fp8_tensor: x is encoded as e4m3(x * *tensor_factor), 1 / its scale
                                 // (layout::TensorScaleSlots::fc1_factor, read after the dependency wait)
};

// One 8-channel chunk of a token into the pool rows of its slots (row < 0: unused slot).
// Called by whole warps; out-of-range lanes (in_range false) take part in the shuffles only.
// tensor_factor: fp8_tensor's encoding factor of x.
template <Precision kPrecision>
__device__ __forceinline__ void write_chunk(const GatherParams& p, uint4 raw, int chunk, bool in_range,
                                            const int32_t* slot_rows, int num_rows, float tensor_factor) {
  constexpr int kLanesPerBlock = 128 / kGatherChunkElements;
  if constexpr (kPrecision != Precision::bf16) {
    float f[kGatherChunkElements];
    bf16x8_to_floats(raw, f);
    uint2 packed;
    BlockScale s{};
    if constexpr (kPrecision == Precision::fp8_block) {
      // The 16 lanes of one 128-channel block are a contiguous half-warp.
      s = encode_lane_block_values(f, p.ue8m0, reinterpret_cast<uint16_t*>(&packed));
    } else {
      encode_with_factor(f, tensor_factor, reinterpret_cast<uint16_t*>(&packed));
    }
    const int block = chunk / kLanesPerBlock;
    for (int j = 0; j < num_rows; ++j) {
      const int row = slot_rows[j];
      if (row < 0 || !in_range) continue;
      reinterpret_cast<uint2*>(static_cast<uint8_t*>(p.activations) + static_cast<size_t>(row) * p.hidden)[chunk] = packed;
      if (kPrecision == Precision::fp8_block && chunk % kLanesPerBlock == 0) {
        p.activation_scales[static_cast<size_t>(block) * p.pool_rows + row] = s.scale;
      }
    }
  } else {
    for (int j = 0; j < num_rows; ++j) {
      const int row = slot_rows[j];
      if (row < 0 || !in_range) continue;
      reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(p.activations) + static_cast<size_t>(row) * p.hidden)[chunk] = raw;
    }
  }
}

// Slot j of `token`: its pool row (-1: unused), which the pool slot table then names.
__device__ __forceinline__ int place_slot(const GatherParams& p, int token, int j) {
  const size_t slot = static_cast<size_t>(token) * p.top_k + j;
  const int expert = p.routed_ids[slot];
  if (expert < 0) return -1;
  const int row = p.expert_offsets[expert] + p.slot_rank[slot];
  p.pool_slot[row] = static_cast<int32_t>(slot);
  return row;
}

// One token by a group of kThreads threads (whole warps; `thread` is this one's index in the group,
// `sync()` the group's barrier), one 8-channel chunk per thread at a time, one load ahead (every
// thread of the group calls it; `slot_rows` is kMaxTopK ints of the group's shared memory). `wait`
// runs between the first load of x and the first read of the routing: the per-stage kernel's
// dependency wait. Token -1 (none this round, where the caller's other groups have one): the group
// loads and stores nothing but takes the same barriers as with a token, so that every group takes
// its barrier equally often.
template <Precision kPrecision, int kThreads, class Wait, class Sync>
__device__ __forceinline__ void gather_token_by_group(const GatherParams& p, int token, int32_t* slot_rows, int thread,
                                                      Wait wait, Sync sync) {
  static_assert(kThreads % 32 == 0, "write_chunk is called by whole warps");
  const bool has_token = token >= 0;
  const int chunks = has_token ? p.hidden / kGatherChunkElements : 0;  // none: no load and no write
  const uint4* source = reinterpret_cast<const uint4*>(p.x + static_cast<size_t>(has_token ? token : 0) * p.hidden);
  const uint4 zero = make_uint4(0, 0, 0, 0);
  int chunk = thread;
  uint4 raw = chunk < chunks ? source[chunk] : zero;
  if (!wait()) return;
  [[maybe_unused]] float tensor_factor = 0.0f;
  if constexpr (kPrecision == Precision::fp8_tensor) {
    if (has_token) tensor_factor = *p.tensor_factor;
  }
  // Thread j < k looks up slot j's pool row while the first chunk is on its way.
  if (has_token && thread < p.top_k) {
    const int row = place_slot(p, token, thread);
    slot_rows[thread] = p.rows_by_token ? token : row;
  }
  sync();
  const int num_rows = p.rows_by_token ? 1 : p.top_k;
  // Group-uniform trip count, so every lane reaches the shuffles of each chunk.
  for (int first = 0; first < chunks; first += kThreads) {
    const int next = chunk + kThreads;
    const uint4 next_raw = next < chunks ? source[next] : zero;
    write_chunk<kPrecision>(p, raw, chunk, chunk < chunks, slot_rows, num_rows, tensor_factor);
    chunk = next;
    raw = next_raw;
  }
  sync();  // the next token rewrites slot_rows
}

// The same by a whole block.
template <Precision kPrecision, int kThreads, class Wait>
__device__ __forceinline__ void gather_token_by_block(const GatherParams& p, int token, int32_t* slot_rows, Wait wait) {
  gather_token_by_group<kPrecision, kThreads>(p, token, slot_rows, static_cast<int>(threadIdx.x), wait,
                                              [] { __syncthreads(); });
}

// A row already in the pool's encoding (`vectors` 16-byte vectors of E4M3 codes or of bf16 values)
// into the pool row of each used slot of slot_rows, with kScales its per-128-channel scales (channel
// block b's at scales[b * scale_stride]). Every thread of a group of kThreads (`thread` its index
// there), once slot_rows is written and visible to it.
template <int kThreads, bool kScales>
__device__ __forceinline__ void copy_row_to_slots(const GatherParams& p, const int32_t* slot_rows, const uint4* row,
                                                  int vectors, const float* scales, size_t scale_stride, int thread) {
  uint4* pool = static_cast<uint4*>(p.activations);
  for (int v = thread; v < vectors; v += kThreads) {
    const uint4 value = row[v];
    for (int j = 0; j < p.top_k; ++j) {
      if (slot_rows[j] >= 0) pool[static_cast<size_t>(slot_rows[j]) * vectors + v] = value;
    }
  }
  if constexpr (kScales) {
    for (int block = thread; block < p.hidden / 128; block += kThreads) {
      const float scale = scales[static_cast<size_t>(block) * scale_stride];
      for (int j = 0; j < p.top_k; ++j) {
        if (slot_rows[j] >= 0) p.activation_scales[static_cast<size_t>(block) * p.pool_rows + slot_rows[j]] = scale;
      }
    }
  }
}

// One token of a caller's quantized x (GatherParams::x_scales) by a whole block: its pool slots,
// then, unless FC1 copies its rows from x itself (rows_by_token), its codes and scales into the
// pool row of each slot unchanged.
template <int kThreads, class Wait>
__device__ __forceinline__ void gather_quantized_token_by_block(const GatherParams& p, int token, int32_t* slot_rows,
                                                                Wait wait) {
  if (!wait()) return;
  if (threadIdx.x < p.top_k) slot_rows[threadIdx.x] = place_slot(p, token, threadIdx.x);
  if (p.rows_by_token) return;
  __syncthreads();
  const int vectors = p.hidden / 16;  // 16 codes each
  const uint4* codes = reinterpret_cast<const uint4*>(p.x) + static_cast<size_t>(token) * vectors;
  copy_row_to_slots<kThreads, true>(p, slot_rows, codes, vectors, p.x_scales + token, p.x_scale_stride,
                                    static_cast<int>(threadIdx.x));
}

template <Precision kPrecision>
__global__ void __launch_bounds__(kGatherThreads) gather_quantize_kernel(GatherParams p) {
  __shared__ int32_t slot_rows[kMaxTopK];
  const int token = blockIdx.x;
  auto wait = [&] {
    ptx::wait_for_prerequisite_grids();
    ptx::allow_dependent_launch();
    return token < valid_tokens(p.num_tokens, p.num_valid_tokens);  // padding: the router left it unrouted
  };
  if constexpr (kPrecision == Precision::fp8_block) {
    if (p.x_scales != nullptr) return gather_quantized_token_by_block<kGatherThreads>(p, token, slot_rows, wait);
  }
  // x is the caller's input: no kernel of this forward writes it, and this grid cannot start before
  // the router released it, which the router does only after waiting for the caller's kernels. So
  // the first chunk may load before this grid's own dependency wait.
  gather_token_by_block<kPrecision, kGatherThreads>(p, token, slot_rows, wait);
}

}  // namespace megamoe::kernels
