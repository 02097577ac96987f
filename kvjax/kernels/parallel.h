// Run fn(0 .. items-1) over XLA's intra-op thread pool, the calling thread included, and
// return when every item is done. Tasks share the counters through a shared_ptr: a task
// that starts after the last item is done (and the call has returned) touches only that
// state, never the caller's stack.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace kvjax {

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
  std::unique_lock<std::mutex> g(work->mu);
  work->cv.wait(g, [&] { return work->done.load() == items; });
}

}  // namespace kvjax
