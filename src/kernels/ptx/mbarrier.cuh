// mbarrier wrappers (PTX ISA "mbarrier") and a wait that can end: every mbarrier wait in megamoe
// goes through wait_parity(), and every spin on a global counter inside a kernel that issues wgmma
// through wait_until(); both trap instead of hanging forever.
#pragma once

#include <cstdint>

namespace megamoe::ptx {

__device__ __forceinline__ uint32_t smem_address(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

__device__ __forceinline__ void mbarrier_init(uint64_t* barrier, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_address(barrier)), "r"(arrivals));
}

// Ends a barrier's life, so that its memory may be initialized again (PTX requires it before an
// mbarrier.init of a location that holds a valid barrier).
__device__ __forceinline__ void mbarrier_inval(uint64_t* barrier) {
  asm volatile("mbarrier.inval.shared::cta.b64 [%0];" ::"r"(smem_address(barrier)) : "memory");
}

// Makes barrier initialization visible to the async proxy (TMA) and the other threads.
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void mbarrier_arrive(uint64_t* barrier) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_address(barrier)) : "memory");
}

__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* barrier, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_address(barrier)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ bool mbarrier_try_wait_parity(uint64_t* barrier, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(done)
      : "r"(smem_address(barrier)), "r"(parity)
      : "memory");
  return done != 0;
}

// About 17 s at 1.98 GHz: far beyond any legitimate wait inside one kernel, and long enough for
// runs under compute-sanitizer, which slow kernels down a hundredfold.
inline constexpr long long kWaitTimeoutCycles = 1LL << 35;

// Polls until ready() holds (with a pause of sleep_ns between polls when it is not 0); a wait past
// kWaitTimeoutCycles traps, so a lost arrival or publication surfaces as a launch failure at the
// next synchronization instead of a hang. It cannot print who waited: any call (printf) in a
// kernel that issues wgmma makes ptxas serialize every wgmma of it (C7510). The cross-rank waits,
// which issue no wgmma, do print.
template <class Ready>
__device__ __forceinline__ void wait_until(Ready ready, unsigned sleep_ns = 0) {
  if (ready()) return;
  const long long start = clock64();
  while (!ready()) {
    if (clock64() - start > kWaitTimeoutCycles) __trap();
    if (sleep_ns != 0) __nanosleep(sleep_ns);
  }
}

// Waits until the phase with `parity` of `barrier` completes.
__device__ __forceinline__ void wait_parity(uint64_t* barrier, uint32_t parity) {
  wait_until([&] { return mbarrier_try_wait_parity(barrier, parity); });
}

}  // namespace megamoe::ptx
