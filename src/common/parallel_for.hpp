// Runs fn(i) for i in [0, count) on all hardware threads; items are handed out one at a time,
// so uneven items balance. Exceptions from fn propagate to the caller (the first one wins).
#pragma once

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace megamoe {

template <class Fn>
void parallel_for(int count, Fn&& fn) {
  std::atomic<int> next{0};
  std::exception_ptr failure;
  std::mutex failure_mutex;
  auto worker = [&] {
    for (int i = next++; i < count; i = next++) {
      try {
        fn(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(failure_mutex);
        if (!failure) failure = std::current_exception();
        next = count;
      }
    }
  };
  const int workers = std::max(1, std::min<int>(static_cast<int>(std::thread::hardware_concurrency()), count));
  std::vector<std::thread> pool;
  for (int i = 1; i < workers; ++i) pool.emplace_back(worker);
  worker();
  for (std::thread& t : pool) t.join();
  if (failure) std::rethrow_exception(failure);
}

}  // namespace megamoe
