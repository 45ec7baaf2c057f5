// Runs independent work items on a few threads: the rank classes of a layout, the layouts
// of a sweep, the cases of a validation run.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <system_error>
#include <thread>
#include <vector>

namespace memsim {

// Calls fn(i) for every i in [0, n), on at most `jobs` threads (the caller's included),
// never more threads than items or than the machine's cores. A thread the system refuses
// to start is simply not used: the others take its items.
// REQUIRES: fn is safe to call concurrently for different i and does not throw.
template <typename Fn>
void ParallelFor(size_t n, int jobs, Fn&& fn) {
  const size_t cores = std::max(1u, std::thread::hardware_concurrency());
  const size_t threads = std::min({static_cast<size_t>(std::max(1, jobs)), n, cores});
  std::atomic<size_t> next{0};
  auto worker = [&] {
    for (size_t i = next++; i < n; i = next++) fn(i);
  };
  std::vector<std::thread> pool;
  for (size_t t = 1; t < threads; ++t) {
    try {
      pool.emplace_back(worker);
    } catch (const std::system_error&) {
      break;
    }
  }
  worker();
  for (std::thread& t : pool) t.join();
}

}  // namespace memsim
