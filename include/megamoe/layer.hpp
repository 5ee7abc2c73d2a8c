// MoeLayer: the single-GPU MoE layer on a Hopper GPU (built when CUDA is enabled).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "megamoe/forward.hpp"
#include "megamoe/spec.hpp"
#include "megamoe/weights.hpp"

namespace megamoe {

enum class CombineMode {
  deterministic,  // per-slot bf16 expert rows reduced in fp32 in fixed slot order: bit-identical across runs
  fast,           // FC2 epilogue adds weighted rows with fp32 atomics; order varies run to run
};

class MoeLayer {
 public:
  // Uploads the packed weights to the current device and allocates the workspace for up to
  // `max_tokens` tokens per call. Throws megamoe::Error.
  MoeLayer(const MoeSpec& spec, const PackedWeights& weights, int max_tokens);
  // The same from packed weights the caller holds elsewhere (host or device memory): copied.
  MoeLayer(const MoeSpec& spec, const PackedWeightsView& weights, int max_tokens);
  ~MoeLayer();
  MoeLayer(const MoeLayer&) = delete;
  MoeLayer& operator=(const MoeLayer&) = delete;

  // y = MoE(x) on `stream`. Validates the arguments first (nothing is launched on bad input);
  // enqueues kernels only: no host synchronization, so it can be captured in a CUDA graph.
  // Calls share the layer's workspace: two calls may not run at the same time (on two streams
  // without an event between them, or two graphs replayed concurrently). Order them, or give
  // each stream its own MoeLayer.
  void forward(cudaStream_t stream, const MoeInputs& inputs, const MoeOutputs& outputs,
               CombineMode mode = CombineMode::deterministic);

  // Routes later calls with `routing` instead of the spec's (experts, top_k and shapes stay):
  // another router setting without a second copy of the weights, as a framework whose routing is
  // a call argument needs. Validated as the constructor validates the spec (nothing changes on a
  // throw). It waits for the device to be idle before it replaces a DeepseekGrouped bias, so it
  // is not for use during CUDA-graph capture or between a forward and the work that needs it.
  void set_routing(const Routing& routing);

  // Synchronizes `stream`, returns how many routed ids were invalid (>= E, or a duplicate within
  // a token) since the last call, and resets the count. Invalid ids contribute nothing.
  long take_invalid_routing_ids(cudaStream_t stream);

  const MoeSpec& spec() const { return spec_; }
  int max_tokens() const { return max_tokens_; }
  size_t workspace_bytes() const;

 private:
  struct Impl;
  MoeSpec spec_;
  int max_tokens_;
  Impl* impl_;
};

}  // namespace megamoe
