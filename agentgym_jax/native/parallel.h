// Splitting a custom call's work over XLA's intra-op thread pool; shared by the native kernels.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace agentgym {

inline void CpuRelax() {  // a spin-wait's pause: lets the sibling hyper-thread run
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Runs run(begin, end) over [0, items) in chunks on the calling thread and on tasks of XLA's intra-op pool. Each
// chunk is claimed from an atomic counter, so the caller never waits for a task that has not started (the pool's
// threads may all be busy, or waiting on calls of their own): it runs every unclaimed chunk itself, then waits
// only for chunks another thread is running. A task that starts late finds nothing left and returns.
struct Job {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> finished{0};
  int64_t chunks = 0;
  std::mutex mutex;
  std::condition_variable done;
  std::function<void(int64_t)> run;

  void Work() {
    for (int64_t chunk; (chunk = next.fetch_add(1)) < chunks;) {
      run(chunk);
      if (finished.fetch_add(1, std::memory_order_acq_rel) + 1 == chunks) {
        std::lock_guard<std::mutex> lock(mutex);
        done.notify_all();
      }
    }
  }

  // The caller waits for chunks other threads are running: spinning first (a chunk takes microseconds; a thread
  // put to sleep on the condition variable took tens of microseconds to wake, more than a short call's work), then
  // sleeping if that thread was descheduled.
  void Wait() {
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinMicroseconds);
    while (finished.load(std::memory_order_acquire) < chunks) {
      for (int i = 0; i < 64; ++i) CpuRelax();
      if (std::chrono::steady_clock::now() > give_up) {
        std::unique_lock<std::mutex> lock(mutex);
        done.wait(lock, [&] { return finished.load(std::memory_order_acquire) == chunks; });
        return;
      }
    }
  }

  static constexpr int64_t kSpinMicroseconds = 2000;
};

// chunks_per_worker: a pool thread can take tens of microseconds to wake, so with one chunk per worker the calling
// thread may run every chunk of a short call itself; smaller chunks let a late thread still take its share.
template <typename F>
void Parallel(xla::ffi::ThreadPool& pool, int64_t items, F&& run, int64_t chunks_per_worker = 1) {
  const int64_t workers = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), items);
  if (workers <= 1) {
    run(0, items);
    return;
  }
  auto job = std::make_shared<Job>();
  const int64_t per = (items + chunks_per_worker * workers - 1) / (chunks_per_worker * workers);
  job->chunks = (items + per - 1) / per;
  job->run = [&run, per, items](int64_t chunk) { run(chunk * per, std::min(items, (chunk + 1) * per)); };
  for (int64_t w = 1; w < workers; ++w) pool.Schedule([job] { job->Work(); });
  job->Work();
  job->Wait();
}

}  // namespace agentgym
