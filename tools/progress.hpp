// Progress lines for long CPU work: silent for the first two seconds, then one updating line on
// stderr (at most two updates a second) with the count, percentage and elapsed time.
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
    if (elapsed < 2.0) return;
    if (done < total && elapsed - last_shown_ < 0.5) return;  // at most two lines a second
    shown_ = true;
    last_shown_ = elapsed;
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
  double last_shown_ = 0.0;
};

}  // namespace megamoe::bench
