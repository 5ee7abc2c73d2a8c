// Progress lines for long CPU work: silent for the first two seconds, then one updating line on
// stderr with the count, percentage and elapsed time.
#pragma once

#include <chrono>
#include <cstdio>
#include <string>

namespace megamoe::bench {

class Progress {
 public:
  explicit Progress(std::string label) : label_(std::move(label)), start_(Clock::now()) {}
  ~Progress() {
    if (shown_) std::fprintf(stderr, "\n");
  }

  void update(long done, long total) {
    const double elapsed = seconds();
    if (elapsed < 2.0 && done < total) return;
    if (!shown_ && done == total && elapsed < 2.0) return;
    shown_ = true;
    std::fprintf(stderr, "\r  [%s] %ld/%ld (%3.0f%%) %.1f s", label_.c_str(), done, total,
                 100.0 * done / (total > 0 ? total : 1), elapsed);
    std::fflush(stderr);
  }

  double seconds() const { return std::chrono::duration<double>(Clock::now() - start_).count(); }

 private:
  using Clock = std::chrono::steady_clock;
  std::string label_;
  Clock::time_point start_;
  bool shown_ = false;
};

}  // namespace megamoe::bench
