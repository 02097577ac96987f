// Run fn(0 .. items-1) over XLA's intra-op thread pool, the calling thread included, and
// return when every item is done. Tasks share the counters through a shared_ptr: a task
// that starts after the last item is done (and the call has returned) touches only that
// state, never the caller's stack. Once every item is claimed the caller spins on the
// done counter for up to SPIN_US before it sleeps on the condition variable: a decode step
// makes hundreds of short calls, and a sleeping caller's wake-up is a large share of each.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace kvjax {

constexpr int64_t SPIN_US = 200;  // the longest the caller spins before it sleeps

template <typename Fn>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t items, const Fn& fn) {
  struct Work {
    std::atomic<int64_t> next{0}, done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto work = std::make_shared<Work>();
  const Fn* fp = &fn;
  auto worker = [work, fp, items]() {
    for (int64_t it; (it = work->next.fetch_add(1)) < items;) {
      (*fp)(it);
      if (work->done.fetch_add(1) + 1 == items) {
        std::lock_guard<std::mutex> g(work->mu);
        work->cv.notify_all();
      }
    }
  };
  int64_t threads = std::max<int64_t>(1, pool.num_threads());
  int64_t helpers = std::min<int64_t>(threads, items) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([worker]() { worker(); });
  worker();
  const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(SPIN_US);
  for (int n = 0; work->done.load(std::memory_order_acquire) != items; ++n) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
    if ((n & 255) == 255 && std::chrono::steady_clock::now() > until) break;
  }
  std::unique_lock<std::mutex> g(work->mu);
  work->cv.wait(g, [&] { return work->done.load() == items; });
}

}  // namespace kvjax
