// Exact decoding of packed weights, for the reference layer and unpack_weights.
#pragma once

#include <vector>

#include "megamoe/weights.hpp"

namespace megamoe::weights {

// One expert's weights in the original vLLM order (w13 [2I, H] gate rows then up rows,
// w2 [H, I]); fp8 values are decode(code) * scale, exact in double.
struct ExpertMatrices {
  std::vector<double> w13;
  std::vector<double> w2;
};
ExpertMatrices decode_expert(const PackedWeights& packed, int expert);

// One row of one packed matrix of `expert` (w13 rows in packed, interleaved order), decoded
// exactly: out[H] for w13, out[I] for w2.
enum class PackedMatrix { w13, w2 };
void decode_packed_row(const PackedWeights& packed, PackedMatrix matrix, int expert, int row, double* out);

}  // namespace megamoe::weights
