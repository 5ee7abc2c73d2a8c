// MoeLayerOptions validation and printing.
#include "megamoe/options.hpp"

#include <ostream>
#include <string>

#include "megamoe/error.hpp"

namespace megamoe {

void validate_combine(CombineMode combine, const char* field) {
  if (combine != CombineMode::deterministic && combine != CombineMode::fast) {
    throw Error(ErrorCode::invalid_argument, std::string(field) + "=" + std::to_string(static_cast<int>(combine)) +
                                                 " is neither CombineMode::deterministic nor CombineMode::fast");
  }
}

void validate(const MoeLayerOptions& options, const MoeSpec& spec) {
  // An enum cast from another language's integer may name none of its values, and would take one
  // branch of each choice unannounced: an unnamed combine runs the fast one yet prints as deterministic.
  const Fc1TokenRows rows = options.fc1_token_rows;
  if (rows != Fc1TokenRows::automatic && rows != Fc1TokenRows::pool && rows != Fc1TokenRows::row_copy) {
    throw Error(ErrorCode::invalid_argument, "options.fc1_token_rows=" + std::to_string(static_cast<int>(rows)) +
                                                 " is none of Fc1TokenRows::automatic, pool and row_copy");
  }
  validate_combine(options.combine, "options.combine");
  const ForwardLaunch launch = options.launch;
  if (launch != ForwardLaunch::automatic && launch != ForwardLaunch::per_stage &&
      launch != ForwardLaunch::single_kernel) {
    throw Error(ErrorCode::invalid_argument, "options.launch=" + std::to_string(static_cast<int>(launch)) +
                                                 " is none of ForwardLaunch::automatic, per_stage and single_kernel");
  }
  const int tile = options.token_tile;
  if (tile != 0 && tile != 16 && tile != 32 && tile != 64 && tile != 128) {
    throw Error(ErrorCode::invalid_argument, "options.token_tile=" + std::to_string(tile) +
                                                 " must be 16, 32, 64 or 128 (or 0: the planner's choice per call)");
  }
  if (tile == 128 && options.fc1_token_rows == Fc1TokenRows::row_copy) {
    throw Error(ErrorCode::invalid_argument,
                "options.token_tile=128 (tokens on M) reads FC1's rows from the pool: it takes fc1_token_rows=auto or "
                "pool, not row_copy");
  }
  if (options.fc1_token_rows == Fc1TokenRows::row_copy && spec.precision == Precision::bf16) {
    throw Error(ErrorCode::invalid_argument,
                "options.fc1_token_rows=row_copy copies x's fp8 rows: it needs precision fp8_block or fp8_tensor, "
                "not bf16");
  }
  if (options.launch == ForwardLaunch::single_kernel) {
    if (options.fc1_token_rows == Fc1TokenRows::row_copy) {
      throw Error(ErrorCode::invalid_argument,
                  "options.launch=single_kernel reads FC1's rows from the pool: it takes fc1_token_rows=auto or pool, "
                  "not row_copy");
    }
    if (options.weight_multicast) {
      throw Error(ErrorCode::invalid_argument,
                  "options.launch=single_kernel launches no CTA pairs: it takes weight_multicast=false "
                  "(weight multicast runs the five kernels, launch=per_stage or auto)");
    }
  }
  if (options.num_sms < 0) {
    throw Error(ErrorCode::invalid_argument, "options.num_sms=" + std::to_string(options.num_sms) +
                                                 " must be >= 0 (0: every SM of the device)");
  }
}

void validate_max_tokens(long long max_tokens) {
  if (max_tokens < 1 || max_tokens > kMaxLayerTokens) {
    throw Error(ErrorCode::invalid_argument, "max_tokens=" + std::to_string(max_tokens) + " must be in [1, " +
                                                 std::to_string(kMaxLayerTokens) + "]");
  }
}

const char* to_string(CombineMode mode) { return mode == CombineMode::fast ? "fast" : "deterministic"; }

const char* to_string(Fc1TokenRows rows) {
  switch (rows) {
    case Fc1TokenRows::automatic: return "auto";
    case Fc1TokenRows::pool: return "pool";
    case Fc1TokenRows::row_copy: return "row_copy";
  }
  return "?";
}

const char* to_string(ForwardLaunch launch) {
  switch (launch) {
    case ForwardLaunch::automatic: return "auto";
    case ForwardLaunch::per_stage: return "per_stage";
    case ForwardLaunch::single_kernel: return "single_kernel";
  }
  return "?";
}

std::ostream& operator<<(std::ostream& os, const MoeLayerOptions& o) {
  os << "MoeLayerOptions{token_tile=";
  if (o.token_tile == 0) {
    os << "auto";
  } else {
    os << o.token_tile;
  }
  os << ", fc1_token_rows=" << to_string(o.fc1_token_rows) << ", combine=" << to_string(o.combine) << ", num_sms=";
  if (o.num_sms == 0) {
    os << "all";
  } else {
    os << o.num_sms;
  }
  return os << ", launch=" << to_string(o.launch) << (o.weight_multicast ? ", weight_multicast" : "") << "}";
}

}  // namespace megamoe
