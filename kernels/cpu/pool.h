// The CPU kernels' one worker pool (kernels/cpu/*.cc): started on the first call of any kernel and shared by
// every kernel of a step, so no call starts or joins threads (a decode step calls the kernels a few times
// per layer, and starting threads per call cost more than a small batch's work).
#pragma once

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>

namespace moray {

// CPUs this process may run on (its affinity mask, as taskset or a container sets it).
inline int NumCpus() {
  static const int n = []() -> int {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
    return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  }();
  return n;
}

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Plain threads rather than OpenMP: an OpenMP team here made libgomp count more busy threads than CPUs
// and throttle the spinning of every other OpenMP user in the process (llama.cpp's decode ran at half
// speed beside it). Every worker takes part in every job (those past `threads` just check in), so a job
// starts only once the last one is over everywhere: no worker can mistake one job's settings for another's.
// Between jobs the workers spin briefly, then sleep in the kernel, so they take no CPU from the process's
// other thread pools while XLA runs the rest of a step.
class WorkerPool {
 public:
  explicit WorkerPool(int workers) : workers_(workers) {
    for (int p = 1; p <= workers; ++p) std::thread([this, p] { Loop(p); }).detach();
  }

  // The pool for one call, or an empty lock when another call holds it (XLA runs the devices of a mesh
  // on threads of their own): that call then runs on its own thread.
  std::unique_lock<std::mutex> TryAcquire() { return std::unique_lock<std::mutex>(busy_, std::try_to_lock); }

  // fn(0) on the calling thread and fn(1..threads-1) on the workers (threads <= size()); the caller holds
  // the pool (TryAcquire).
  void Run(int threads, const std::function<void(int)>& fn) {
    job_ = &fn;
    active_ = std::min(threads, workers_ + 1);
    remaining_.store(workers_, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);
    generation_.notify_all();
    fn(0);
    for (int i = 0; i < kSpins && remaining_.load(std::memory_order_acquire) != 0; ++i) CpuRelax();
    for (int r; (r = remaining_.load(std::memory_order_acquire)) != 0;) remaining_.wait(r, std::memory_order_acquire);
  }

  int size() const { return workers_ + 1; }

 private:
  // A few microseconds (a pause is tens of cycles): longer spins would take the CPU from the XLA threads
  // running the rest of the step between two kernel calls.
  static constexpr int kSpins = 1 << 8;

  void Loop(int p) {
    uint64_t seen = 0;
    for (;;) {
      uint64_t g = generation_.load(std::memory_order_acquire);
      for (int i = 0; i < kSpins && g == seen; ++i, g = generation_.load(std::memory_order_acquire)) CpuRelax();
      while (g == seen) {
        generation_.wait(seen, std::memory_order_acquire);
        g = generation_.load(std::memory_order_acquire);
      }
      seen = g;
      if (p < active_) (*job_)(p);
      if (remaining_.fetch_sub(1, std::memory_order_acq_rel) == 1) remaining_.notify_one();
    }
  }

  const int workers_;
  std::mutex busy_;
  const std::function<void(int)>* job_ = nullptr;
  int active_ = 0;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> remaining_{0};
};

// The process's pool (one for every kernel: inline variables are one object across the library's files),
// started on first use; a forked child starts its own (the parent's threads are not in it). Never destroyed:
// its threads sleep until the process exits.
inline std::atomic<WorkerPool*> g_pool{nullptr};
inline std::mutex g_pool_init;

inline WorkerPool& Pool() {
  WorkerPool* pool = g_pool.load(std::memory_order_acquire);
  if (pool != nullptr) return *pool;
  std::lock_guard<std::mutex> lock(g_pool_init);
  if ((pool = g_pool.load(std::memory_order_acquire)) == nullptr) {
    static std::once_flag atfork;
    std::call_once(atfork, [] { pthread_atfork(nullptr, nullptr, [] { g_pool.store(nullptr); }); });
    pool = new WorkerPool(NumCpus() - 1);
    g_pool.store(pool, std::memory_order_release);
  }
  return *pool;
}

// Runs work(me, threads) for me in [0, threads) on the pool, or work(0, 1) on the calling thread when the
// pool is busy (another device's call) or one thread is enough.
inline void RunOnPool(int threads, const std::function<void(int, int)>& work) {
  WorkerPool& pool = Pool();
  threads = std::max(1, std::min(threads, pool.size()));
  std::unique_lock<std::mutex> lease;
  if (threads > 1 && !(lease = pool.TryAcquire()).owns_lock()) threads = 1;
  if (threads == 1) return work(0, 1);
  pool.Run(threads, [&](int me) { work(me, threads); });
}

// Pieces [lo, hi) of n rows handed out one at a time from a shared counter (multiples of 4, so the
// matrix-vector row groups stay whole; about `per_thread` pieces per thread). Why not fixed shares: on a
// small machine the engine's host thread prepares the next step beside this one, and the OS then parks
// one of the kernel's threads for a time slice; with fixed halves the other finished its half and waited,
// with pieces it takes the parked thread's remaining work.
class Pieces {
 public:
  // Floats of weights per piece the callers ask for at least (256 KiB): smaller pieces cost more in
  // hand-outs and loop starts than they balance.
  static constexpr int64_t kMinFloats = 1 << 16;
  // `min_rows`: the fewest rows a piece holds (kMinFloats / row length).
  Pieces(int64_t n, int threads, int64_t min_rows = 4, int64_t per_thread = 8)
      : n_(n), size_((std::max({int64_t{4}, min_rows, n / (std::max(1, threads) * per_thread)}) + 3) / 4 * 4) {}
  bool Next(int64_t* lo, int64_t* hi) {
    const int64_t start = next_.fetch_add(size_, std::memory_order_relaxed);
    if (start >= n_) return false;
    *lo = start;
    *hi = std::min(n_, start + size_);
    return true;
  }

 private:
  const int64_t n_, size_;
  std::atomic<int64_t> next_{0};
};

// This thread's fixed share [lo, hi) of n rows, in multiples of 4 (for work whose results each thread sums
// on its own: fixed shares keep the order of the final sums, so a step's output is the same on every run).
inline std::pair<int64_t, int64_t> Share(int64_t n, int me, int threads) {
  auto edge = [&](int p) { return std::min(n, (n * p / threads + 3) / 4 * 4); };
  return {edge(me), me + 1 == threads ? n : edge(me + 1)};
}

}  // namespace moray
