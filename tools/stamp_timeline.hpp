// The host side of the kernels' diagnostic timeline (src/kernels/pipeline/timeline.cuh): device
// stamps preset before each call, read after it, and the median over calls of when the first and
// the last block reached each point, in µs after the first block reached the origin point.
#pragma once

#include <cuda_runtime_api.h>

#include <climits>
#include <cstdio>
#include <string>
#include <vector>

#include "bench_json.hpp"
#include "bench_stats.hpp"
#include "kernels/cuda_check.hpp"

namespace megamoe::bench {

class StampTimeline {
 public:
  StampTimeline(int events, const char* const* names) : names_(names, names + events), first_(events), last_(events) {
    preset_.resize(2 * events);
    for (int e = 0; e < events; ++e) preset_[2 * e] = ULLONG_MAX, preset_[2 * e + 1] = 0;
    MEGAMOE_CUDA_CHECK(cudaMalloc(&stamps_, preset_.size() * sizeof(unsigned long long)));
  }
  ~StampTimeline() { cudaFree(stamps_); }
  StampTimeline(const StampTimeline&) = delete;
  StampTimeline& operator=(const StampTimeline&) = delete;

  unsigned long long* stamps() const { return stamps_; }

  // Before a call on `stream`.
  void preset(cudaStream_t stream) {
    MEGAMOE_CUDA_CHECK(cudaMemcpyAsync(stamps_, preset_.data(), preset_.size() * sizeof preset_[0],
                                       cudaMemcpyHostToDevice, stream));
  }

  // After the call: waits for it and keeps its stamps relative to the origin point's first.
  void collect(cudaStream_t stream, int origin) {
    std::vector<unsigned long long> got(preset_.size());
    MEGAMOE_CUDA_CHECK(cudaMemcpyAsync(got.data(), stamps_, got.size() * sizeof got[0], cudaMemcpyDeviceToHost, stream));
    MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    const unsigned long long start = got[2 * origin];
    for (size_t e = 0; e < names_.size(); ++e) {
      if (got[2 * e + 1] == 0 || start == ULLONG_MAX) continue;  // not reached in this call
      first_[e].push_back(static_cast<float>(static_cast<double>(got[2 * e]) - static_cast<double>(start)) / 1e3f);
      last_[e].push_back(static_cast<float>(static_cast<double>(got[2 * e + 1]) - static_cast<double>(start)) / 1e3f);
    }
  }

  // One line per point reached: `prefix`, its name, the medians.
  std::string lines(const std::string& prefix) const {
    std::string text;
    for (size_t e = 0; e < names_.size(); ++e) {
      if (first_[e].empty()) continue;
      char line[160];
      std::snprintf(line, sizeof line, "%s%-22s first %8.1f us, last %8.1f us\n", prefix.c_str(), names_[e].c_str(),
                    median(first_[e]), median(last_[e]));
      text += line;
    }
    return text;
  }

  // The same as JSON: [{"point", "first_us", "last_us", "calls"}].
  Json json() const {
    Json points = Json::array();
    for (size_t e = 0; e < names_.size(); ++e) {
      if (first_[e].empty()) continue;
      points.push(Json::object()
                      .set("point", names_[e])
                      .set("first_us", median(first_[e]))
                      .set("last_us", median(last_[e]))
                      .set("calls", static_cast<int>(first_[e].size())));
    }
    return points;
  }

 private:
  std::vector<std::string> names_;
  std::vector<unsigned long long> preset_;
  unsigned long long* stamps_ = nullptr;
  std::vector<std::vector<float>> first_, last_;
};

}  // namespace megamoe::bench
