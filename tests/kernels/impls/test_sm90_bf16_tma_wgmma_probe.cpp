#include "kernels/impls/sm90_bf16_tma_wgmma_probe.hpp"

#include <gtest/gtest.h>

#include <cmath>

#include "common/gpu_test.hpp"
#include "common/test_random.hpp"

namespace megamoe::kernels {
namespace {

TEST(Sm90Bf16TmaWgmmaProbe, MatchesFp64Product) {
  MEGAMOE_REQUIRE_HOPPER();
  test::SeededRng rng;
  for (int trial = 0; trial < 3; ++trial) {
    const std::vector<bf16_t> a = rng.bf16_normals(kProbeM * kProbeK);
    const std::vector<bf16_t> b = rng.bf16_normals(kProbeN * kProbeK);
    test::DeviceBuffer<bf16_t> a_dev(a.size()), b_dev(b.size());
    test::DeviceBuffer<float> c_dev(kProbeM * kProbeN);
    a_dev.upload(a);
    b_dev.upload(b);
    c_dev.poison();
    sm90_bf16_tma_wgmma_probe(a_dev.get(), b_dev.get(), c_dev.get(), nullptr);
    MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<float> c = c_dev.download();

    for (int m = 0; m < kProbeM; ++m) {
      for (int n = 0; n < kProbeN; ++n) {
        double exact = 0.0, magnitude = 0.0;
        for (int k = 0; k < kProbeK; ++k) {
          const double product = double(a[m * kProbeK + k].to_float()) * b[n * kProbeK + k].to_float();
          exact += product;
          magnitude += std::fabs(product);
        }
        // bf16 products are exact in fp32; only the fp32 sums round.
        ASSERT_NEAR(c[m * kProbeN + n], exact, 1e-6 * magnitude + 1e-6) << "m=" << m << " n=" << n;
      }
    }
  }
}

}  // namespace
}  // namespace megamoe::kernels
