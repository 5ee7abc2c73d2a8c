// MoeSpec: the static description of one MoE layer (shapes, precision, routing).
#pragma once

#include <iosfwd>
#include <string>
#include <variant>
#include <vector>

namespace megamoe {

enum class Precision {
  bf16,       // bf16 operands, fp32 accumulation, bf16 intermediate between FC1 and FC2
  fp8_block,  // DeepSeek-V3 format: E4M3 weights with one scale per 128x128 block,
              // activations and the FC1 output quantized per token per 128 channels
  fp8_tensor, // per-tensor FP8 (vLLM's fp8 checkpoints): E4M3 weights with one scale per expert
              // matrix (gate and up apart), the layer input and FC2's input E4M3 with one scale
              // each, static from the checkpoint or computed per forward (PackedWeights'
              // input_scales); the scales apply in the epilogues, so the mainloops accumulate
              // without per-K-block promotion
};

// How fp8_block scales are represented (fp8_tensor takes fp32 only). ue8m0 restricts every scale to a power of two
// (what DeepGEMM calls UE8M0); fp32 keeps amax / 448 as is.
enum class ScaleFormat { fp32, ue8m0 };

// softmax over all experts, then top-k; renormalize makes the k weights sum to 1.
struct SoftmaxTopK {
  bool renormalize = false;
};

// DeepSeek-V3 routing: s = sigmoid(logit); choice = s + bias; the score of a group is the sum of
// its two best choice values; the best topk_group groups survive; top-k over their experts by
// choice; weights are the raw s of the chosen experts, optionally renormalized, times
// routed_scaling_factor.
struct DeepseekGrouped {
  int n_group = 1;
  int topk_group = 1;
  float routed_scaling_factor = 1.0f;
  bool renormalize = true;
  std::vector<float> e_score_correction_bias;  // [E]; empty means all zeros
};

// The caller passes topk_ids [T, k] int32 and topk_weights [T, k] fp32.
// An id of -1 means "not routed here" and contributes nothing.
struct Precomputed {};

using Routing = std::variant<SoftmaxTopK, DeepseekGrouped, Precomputed>;

struct MoeSpec {
  int num_experts = 0;   // E
  int top_k = 0;         // k
  int hidden = 0;        // H
  int intermediate = 0;  // I (per expert; W13 has 2I rows)
  Precision precision = Precision::bf16;
  ScaleFormat scale_format = ScaleFormat::fp32;
  Routing routing = SoftmaxTopK{};
};

// Channel granularity the kernels need: 128 for fp8_block (the scale blocks) and fp8_tensor (one
// 128-byte swizzled K slice of E4M3), 64 for bf16 (one 128-byte K slice).
int channel_granularity(Precision precision);

// Throws megamoe::Error(invalid_spec) with a message naming the field and the fix. Beyond each
// field's range, the sizes derived from them must be countable: intermediate at most INT_MAX / 2
// (W13's 2I rows are an int), and the packed weights' 3 x E x H x I elements within what one
// allocation holds (PTRDIFF_MAX bytes).
void validate(const MoeSpec& spec);
// The same for `routing` in place of spec.routing (a variant left valueless by an exception too).
void validate_routing(const Routing& routing, const MoeSpec& spec);

const char* to_string(Precision precision);
const char* to_string(ScaleFormat format);
std::string to_string(const Routing& routing);
std::ostream& operator<<(std::ostream& os, const MoeSpec& spec);

}  // namespace megamoe
