// Command-line parsing shared by megamoe-bench and megamoe-ep-bench: `--flag value` and
// `--flag=value`, and a message naming the flag and the value for an unknown option, a missing
// value or a bad number. run_main turns such a UsageError into exit code 2.
#pragma once

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "megamoe/error.hpp"
#include "megamoe/spec.hpp"

namespace megamoe::bench::cli {

class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// One option a program takes. A switch (no `apply_value`) takes no value; any other option takes
// exactly one, as the next argument or after '='.
struct Option {
  std::string name;                                       // "--tokens"
  std::function<void()> apply_switch;                     // switches
  std::function<void(const std::string&)> apply_value;    // options with a value
};

inline Option switch_option(std::string name, std::function<void()> apply) {
  return Option{std::move(name), std::move(apply), nullptr};
}
inline Option value_option(std::string name, std::function<void(const std::string&)> apply) {
  return Option{std::move(name), nullptr, std::move(apply)};
}

// Applies argv[1..] to `options` in order. Throws UsageError for an unknown option, a stray
// argument, a value missing (the next argument is another --option, or there is none) or given to
// a switch, and whatever an option's apply throws.
inline void parse(int argc, char** argv, const std::vector<Option>& options) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("--", 0) != 0) throw UsageError("unexpected argument '" + arg + "'");
    const size_t equals = arg.find('=');
    const std::string name = arg.substr(0, equals);
    const Option* option = nullptr;
    for (const Option& candidate : options) {
      if (candidate.name == name) option = &candidate;
    }
    if (option == nullptr) throw UsageError("unknown option " + name);
    if (!option->apply_value) {
      if (equals != std::string::npos) throw UsageError(name + " takes no value, got '" + arg.substr(equals + 1) + "'");
      option->apply_switch();
      continue;
    }
    if (equals != std::string::npos) {
      option->apply_value(arg.substr(equals + 1));
      continue;
    }
    // A following --option is not taken as the value ("--json --cpu" would write a file "--cpu").
    if (i + 1 >= argc) throw UsageError(name + " needs a value");
    if (std::string(argv[i + 1]).rfind("--", 0) == 0) {
      throw UsageError(name + " needs a value, got the option " + argv[i + 1]);
    }
    option->apply_value(argv[++i]);
  }
}

// A decimal integer in [min, max], all of `text` (no sign for min >= 0, no spaces, no suffix).
inline long long parse_integer(const std::string& flag, const std::string& text, long long min, long long max,
                               const char* what) {
  const auto bad = [&] { return UsageError(flag + " needs " + what + ", got '" + text + "'"); };
  const bool sign = !text.empty() && (text[0] == '-' || text[0] == '+');
  if (text.size() == (sign ? 1u : 0u) || (sign && min >= 0 && text[0] == '-')) throw bad();
  for (size_t i = sign ? 1 : 0; i < text.size(); ++i) {
    if (text[i] < '0' || text[i] > '9') throw bad();
  }
  errno = 0;
  const long long value = std::strtoll(text.c_str(), nullptr, 10);
  if (errno == ERANGE || value < min || value > max) throw bad();
  return value;
}

// A decimal integer in [0, 2^64 - 1].
inline uint64_t parse_unsigned(const std::string& flag, const std::string& text) {
  const auto bad = [&] { return UsageError(flag + " needs a non-negative integer, got '" + text + "'"); };
  if (text.empty()) throw bad();
  for (char c : text) {
    if (c < '0' || c > '9') throw bad();
  }
  errno = 0;
  const unsigned long long value = std::strtoull(text.c_str(), nullptr, 10);
  if (errno == ERANGE) throw bad();
  return value;
}

// A comma-separated list of positive integers, each at most `max`, none twice ("1,16,128").
inline std::vector<int> parse_count_list(const std::string& flag, const std::string& text, long long max) {
  const std::string what = "positive integers up to " + std::to_string(max) + ", separated by commas";
  std::vector<int> counts;
  size_t start = 0;
  for (;;) {
    const size_t comma = text.find(',', start);
    const std::string item = text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    if (item.empty()) throw UsageError(flag + " needs " + what + ", got '" + text + "'");
    try {
      counts.push_back(static_cast<int>(parse_integer(flag, item, 1, max, "")));
    } catch (const UsageError&) {
      throw UsageError(flag + " needs " + what + ", got '" + item + "'" + (item == text ? "" : " in '" + text + "'"));
    }
    for (size_t j = 0; j + 1 < counts.size(); ++j) {
      if (counts[j] == counts.back()) throw UsageError(flag + " lists " + item + " twice in '" + text + "'");
    }
    if (comma == std::string::npos) return counts;
    start = comma + 1;
  }
}

// A file the program writes when it is done (--json PATH), checked now: a benchmark of minutes must
// not end in "cannot write". Makes its parent folders, as the writer would, and leaves no file of
// its own behind (an existing one is opened to append, so not truncated).
inline std::string writable_file(const std::string& flag, const std::string& path) {
  const auto bad = [&](const std::string& why) {
    return UsageError(flag + " needs a file it can write, got '" + path + "': " + why);
  };
  if (path.empty()) throw bad("an empty path");
  const std::filesystem::path target(path);
  std::error_code error;
  if (target.has_parent_path()) {
    std::filesystem::create_directories(target.parent_path(), error);
    if (error) throw bad(error.message());
  }
  const bool existed = std::filesystem::exists(target, error);
  errno = 0;
  if (!std::ofstream(target, std::ios::app)) throw bad(errno != 0 ? std::strerror(errno) : "cannot open it");
  if (!existed) std::filesystem::remove(target, error);
  return path;
}

// One of `choices` by name: parse_choice("--precision", text, {{"bf16", bf16}, {"fp8_block", fp8}}).
template <class T>
T parse_choice(const std::string& flag, const std::string& text, const std::vector<std::pair<std::string, T>>& choices) {
  std::string names;
  for (size_t i = 0; i < choices.size(); ++i) {
    if (choices[i].first == text) return choices[i].second;
    names += (i == 0 ? "" : i + 1 == choices.size() ? " or " : ", ") + choices[i].first;
  }
  throw UsageError(flag + " takes " + names + ", got '" + text + "'");
}

// The names --precision takes (the library's to_string names).
inline const std::vector<std::pair<std::string, Precision>> kPrecisions = {{"bf16", Precision::bf16},
                                                                           {"fp8_block", Precision::fp8_block},
                                                                           {"fp8_tensor", Precision::fp8_tensor}};

// Runs `check` (library calls that judge the arguments: find_workload, validate) and turns the
// megamoe::Error it throws for a bad argument or spec (invalid_argument, invalid_spec) into a
// UsageError with the library's message.
template <class Check>
void check_usage(Check&& check) {
  try {
    check();
  } catch (const Error& e) {
    if (e.code() != ErrorCode::invalid_argument && e.code() != ErrorCode::invalid_spec) throw;
    throw UsageError(e.what());
  }
}

// main's body: a UsageError prints `program: message` and the --help hint and returns 2, any
// other exception prints `program: what` and returns 1.
template <class Body>
int run_main(const char* program, Body&& body) {
  try {
    return body();
  } catch (const UsageError& e) {
    std::fprintf(stderr, "%s: %s\n(run %s --help for the options)\n", program, e.what(), program);
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", program, e.what());
    return 1;
  }
}

}  // namespace megamoe::bench::cli
