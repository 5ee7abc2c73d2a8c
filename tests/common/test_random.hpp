// Seeded randomness for tests: every run draws fresh inputs, and a failure prints the run's seed.
// MEGAMOE_TEST_SEED=<n> replays a failing run: each test's seed (and each cached fixture's, through
// seed_for) comes from the run's seed and its own name, so a test replays alone or in any order.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "megamoe/dtypes.hpp"

namespace megamoe::test {

// The run's seed: MEGAMOE_TEST_SEED, or one fresh random seed per process.
inline uint64_t run_seed() {
  static const uint64_t seed = [] {
    if (const char* fixed = std::getenv("MEGAMOE_TEST_SEED")) return static_cast<uint64_t>(std::strtoull(fixed, nullptr, 10));
    return static_cast<uint64_t>(std::random_device{}());
  }();
  return seed;
}

// The run's seed for what `name` names (a test, a cached fixture): the same in every run with the
// same run seed, whatever else that run does first (64-bit FNV-1a of the name, mixed in).
inline uint64_t seed_for(const std::string& name) {
  uint64_t hash = 0xcbf29ce484222325ull;
  for (const char ch : name) hash = (hash ^ static_cast<unsigned char>(ch)) * 0x100000001b3ull;
  return run_seed() ^ hash;
}

// The current test's seed (the run's own outside a test).
inline uint64_t test_seed() {
  const ::testing::TestInfo* test = ::testing::UnitTest::GetInstance()->current_test_info();
  return test == nullptr ? run_seed() : seed_for(std::string(test->test_suite_name()) + "." + test->name());
}

// A generator whose seed is attached to every assertion failure in its scope.
class SeededRng {
 public:
  SeededRng()
      : seed_(test_seed()),
        engine_(seed_),
        trace_(__FILE__, __LINE__, "MEGAMOE_TEST_SEED=" + std::to_string(run_seed()) + " replays this run") {}
  uint64_t seed() const { return seed_; }
  std::mt19937_64& engine() { return engine_; }

  float uniform(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(engine_); }
  float normal(float stddev = 1.0f) { return std::normal_distribution<float>(0.0f, stddev)(engine_); }
  int integer(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(engine_); }

  std::vector<float> normals(size_t n, float stddev = 1.0f) {
    std::vector<float> v(n);
    for (float& x : v) x = normal(stddev);
    return v;
  }
  std::vector<bf16_t> bf16_normals(size_t n, float stddev = 1.0f) {
    std::vector<bf16_t> v(n);
    for (bf16_t& x : v) x = bf16_t::from_float(normal(stddev));
    return v;
  }

 private:
  uint64_t seed_;
  std::mt19937_64 engine_;
  ::testing::ScopedTrace trace_;
};

}  // namespace megamoe::test
