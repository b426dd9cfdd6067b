// What the CPU kernels share: XLA's FFI API and a parallel loop on XLA's intra-op thread pool.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace atlas {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

struct Job {
  std::function<void(int64_t)> fn;
  int64_t n;
  std::atomic<int64_t> next{0}, done{0};
  void work() {
    for (int64_t i; (i = next.fetch_add(1)) < n; ) {
      fn(i);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// Runs fn(i) for i in [0, n) on the calling thread and up to (pool threads - 1) helpers: the caller is a
// thread of its own, so that many workers fill the cores. The caller waits only for items already claimed
// (running now), never for a helper that has not started: no deadlock when the pool is busy. A helper
// that starts late finds no items and only touches the job, which it co-owns.
inline void parallel_for(ffi::ThreadPool& pool, int64_t n, std::function<void(int64_t)> fn) {
  if (n <= 0) return;
  auto job = std::make_shared<Job>();
  job->fn = std::move(fn);
  job->n = n;
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(pool.num_threads() - 1, 0), n - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([job] { job->work(); });
  job->work();
  while (job->done.load(std::memory_order_acquire) < n) cpu_relax();
}

}  // namespace atlas
