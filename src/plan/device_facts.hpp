// What the planner needs to know about a GPU. Read from the device at run time; the
// h200_measured() figures serve planning on machines without a GPU (CPU-only bench, tests).
#pragma once

#include <iosfwd>
#include <string>

#include "megamoe/spec.hpp"

namespace megamoe::plan {

struct DeviceFacts {
  std::string name;
  int num_sms = 0;
  int smem_per_block_optin = 0;        // bytes of dynamic shared memory one CTA may take
  long long l2_bytes = 0;
  double hbm_read_bytes_per_s = 0.0;    // measured sustained read bandwidth
  double dense_fp8_flops_per_s = 0.0;   // measured dense FP8 GEMM rate
  double dense_bf16_flops_per_s = 0.0;  // measured dense bf16 GEMM rate

  double dense_flops_per_s(Precision precision) const {
    return precision == Precision::bf16 ? dense_bf16_flops_per_s : dense_fp8_flops_per_s;
  }

  // An H200 as measured on the lent machines (docs/decisions.md#h200-facts): 132 SMs, 227 KiB
  // opt-in shared memory, 60 MB L2, 4.45 TB/s HBM read, cuBLASLt 1459 TFLOP/s E4M3 and 790
  // TFLOP/s bf16 at 8192^3.
  static DeviceFacts h200_measured();
};

std::ostream& operator<<(std::ostream& os, const DeviceFacts& facts);

}  // namespace megamoe::plan
