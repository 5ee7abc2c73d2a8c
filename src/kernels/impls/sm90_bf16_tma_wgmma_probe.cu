#include "kernels/impls/sm90_bf16_tma_wgmma_probe.hpp"

// cute/tensor.hpp must come before the atom headers, which rely on its declarations.
#include <cute/tensor.hpp>

#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/bfloat16.h>

#include "kernels/cuda_check.hpp"

namespace megamoe::kernels {
namespace {

using namespace cute;
using Element = cutlass::bfloat16_t;
using TileA = Shape<Int<kProbeM>, Int<kProbeK>>;
using TileB = Shape<Int<kProbeN>, Int<kProbeK>>;
using SmemLayoutA = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{}, TileA{}));
using SmemLayoutB = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{}, TileB{}));
using TiledMma = decltype(make_tiled_mma(SM90_64x64x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::K>{}));
using TileFullBarrier = cutlass::arch::ClusterTransactionBarrier;

constexpr int kThreads = 128;  // one warpgroup
constexpr uint32_t kTileBytes = (kProbeM + kProbeN) * kProbeK * sizeof(Element);

struct SharedStorage {
  alignas(1024) ArrayEngine<Element, cosize_v<SmemLayoutA>> a;  // 128B swizzle wants 1024-byte alignment
  alignas(1024) ArrayEngine<Element, cosize_v<SmemLayoutB>> b;
  alignas(8) uint64_t tile_full;
};
static_assert(sizeof(SharedStorage) <= 48 * 1024, "probe must fit the default shared-memory limit");
static_assert(size(TiledMma{}) == kThreads);

template <class TmaA, class TmaB>
__global__ void __launch_bounds__(kThreads, 1)
    probe_kernel(CUTE_GRID_CONSTANT TmaA const tma_a, CUTE_GRID_CONSTANT TmaB const tma_b, float* c) {
  __shared__ SharedStorage smem;
  Tensor sA = make_tensor(make_smem_ptr(smem.a.begin()), SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(smem.b.begin()), SmemLayoutB{});
  Tensor mA = tma_a.get_tma_tensor(make_shape(Int<kProbeM>{}, Int<kProbeK>{}));
  Tensor mB = tma_b.get_tma_tensor(make_shape(Int<kProbeN>{}, Int<kProbeK>{}));
  auto [tAgA, tAsA] = tma_partition(tma_a, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sA), group_modes<0, 2>(mA));
  auto [tBgB, tBsB] = tma_partition(tma_b, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sB), group_modes<0, 2>(mB));

  const bool leader = threadIdx.x == 0;
  if (leader) {
    TileFullBarrier::init(&smem.tile_full, 1);
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  if (leader) {
    TileFullBarrier::arrive_and_expect_tx(&smem.tile_full, kTileBytes);
    copy(tma_a.with(smem.tile_full), tAgA, tAsA);
    copy(tma_b.with(smem.tile_full), tBgB, tBsB);
  }
  TileFullBarrier::wait(&smem.tile_full, 0);

  TiledMma mma;
  ThrMMA thr_mma = mma.get_thread_slice(threadIdx.x);
  Tensor tCrA = thr_mma.make_fragment_A(thr_mma.partition_A(sA));
  Tensor tCrB = thr_mma.make_fragment_B(thr_mma.partition_B(sB));
  Tensor mC = make_tensor(make_gmem_ptr(c), make_shape(Int<kProbeM>{}, Int<kProbeN>{}), make_stride(Int<kProbeN>{}, _1{}));
  Tensor tCgC = thr_mma.partition_C(mC);
  Tensor accumulators = thr_mma.make_fragment_C(tCgC);
  clear(accumulators);

  warpgroup_fence_operand(accumulators);
  warpgroup_arrive();
  gemm(mma, tCrA, tCrB, accumulators);
  warpgroup_commit_batch();
  warpgroup_wait<0>();
  warpgroup_fence_operand(accumulators);
  copy(accumulators, tCgC);
}

}  // namespace

void sm90_bf16_tma_wgmma_probe(const bf16_t* a, const bf16_t* b, float* c, cudaStream_t stream) {
  Tensor gA = make_tensor(reinterpret_cast<const Element*>(a), make_shape(Int<kProbeM>{}, Int<kProbeK>{}),
                          make_stride(Int<kProbeK>{}, _1{}));
  Tensor gB = make_tensor(reinterpret_cast<const Element*>(b), make_shape(Int<kProbeN>{}, Int<kProbeK>{}),
                          make_stride(Int<kProbeK>{}, _1{}));
  auto tma_a = make_tma_atom(SM90_TMA_LOAD{}, gA, SmemLayoutA{}, TileA{});
  auto tma_b = make_tma_atom(SM90_TMA_LOAD{}, gB, SmemLayoutB{}, TileB{});
  probe_kernel<decltype(tma_a), decltype(tma_b)><<<1, kThreads, 0, stream>>>(tma_a, tma_b, c);
  MEGAMOE_CHECK_LAUNCH("sm90_bf16_tma_wgmma_probe");
}

}  // namespace megamoe::kernels
