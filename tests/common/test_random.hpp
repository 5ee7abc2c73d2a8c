// Seeded randomness for tests: every test draws fresh inputs, and a failure prints the seed.
// MEGAMOE_TEST_SEED=<n> replays a failing run.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "megamoe/dtypes.hpp"

namespace megamoe::test {

inline uint64_t test_seed() {
  if (const char* fixed = std::getenv("MEGAMOE_TEST_SEED")) return std::strtoull(fixed, nullptr, 10);
  return std::random_device{}();
}

// A generator whose seed is attached to every assertion failure in its scope.
class SeededRng {
 public:
  SeededRng() : seed_(test_seed()), engine_(seed_), trace_(__FILE__, __LINE__, "MEGAMOE_TEST_SEED=" + std::to_string(seed_)) {}
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
