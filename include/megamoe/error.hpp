// megamoe errors: every rejected call throws megamoe::Error before touching any caller buffer, and
// leaves the process as usable as before (no memory held, no CUDA error left pending).
#pragma once

#include <stdexcept>
#include <string>

namespace megamoe {

enum class ErrorCode {
  invalid_spec,        // MoeSpec itself is inconsistent (shapes, top_k, routing parameters)
  invalid_argument,    // a call argument is out of range (token count, dtype, sizes)
  null_pointer,        // a required buffer is null
  misaligned_pointer,  // a buffer violates the alignment the kernels rely on
  aliasing,            // an output overlaps an input
  capacity_exceeded,   // more tokens than the layer was planned for
  unsupported,         // valid request that this build cannot serve yet
  cuda_error,          // a CUDA runtime call or kernel launch failed
  out_of_memory,       // a device allocation failed (nothing is left allocated by the failed call)
  no_device,           // no usable GPU: none visible, no driver, or not a Hopper GPU
  timeout,             // a peer (another rank) did not arrive in time
};

const char* to_string(ErrorCode code);

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message)
      : std::runtime_error(std::string("megamoe: ") + to_string(code) + ": " + message), code_(code) {}
  ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

}  // namespace megamoe
