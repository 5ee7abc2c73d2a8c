// Uses only the installed public headers and megamoe::megamoe_host: a spec, its validation with
// the error a user sees, and weight packing.
#include <cstdio>
#include <vector>

#include "megamoe/error.hpp"
#include "megamoe/spec.hpp"
#include "megamoe/weights.hpp"

int main() {
  megamoe::MoeSpec spec;
  spec.num_experts = 4;
  spec.top_k = 2;
  spec.hidden = 128;
  spec.intermediate = 128;
  spec.precision = megamoe::Precision::fp8_block;
  megamoe::validate(spec);
  std::vector<float> w13(4ull * 2 * 128 * 128, 0.01f), w2(4ull * 128 * 128, -0.02f);
  const megamoe::PackedWeights packed = megamoe::prepare_weights(spec, {w13.data(), w2.data(), megamoe::DType::fp32});
  spec.top_k = 5;
  try {
    megamoe::validate(spec);
    return 1;
  } catch (const megamoe::Error& e) {
    std::printf("packed %zu bytes per expert; a bad spec says: %s\n", packed.bytes_per_expert(), e.what());
  }
  return 0;
}
