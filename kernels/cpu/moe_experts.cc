// Routed experts for small batches on CPU, as an XLA FFI custom call (kernels/cpu_ffi.py builds and
// registers it; kernels/moe.py selects it).
//
// Why a kernel: XLA:CPU copies an expert's weights out of the stacked [E, ...] array before each dot
// (a dynamic slice is not fused into a library matmul), so a decode step read every selected expert
// twice and wrote it once, at well under the memory bandwidth. Here each selected expert's rows are
// streamed once, straight from the stacked array, and dotted with all of that expert's tokens while
// the row is in registers/L1: the work a decode step must do, at the speed memory allows.
//
// out[t] = sum_j w[t, j] * down[e] (silu(g) * u),  [g; u] = gate_up[e] x[t],  e = ids[t, j]
// x [T, H], ids [T, K] int32 (ids outside [0, E) contribute nothing), weights [T, K] f32,
// gate_up [E, 2I, H] (gate rows, then up rows), down [E, H, I]; out [T, H] f32. All float32.
//
// Threads: one per CPU; each phase (gate/up, then down) splits the rows of all selected experts evenly, and
// each thread sums into its own [T, H] accumulator; the accumulators are added at the end. The threads are a
// persistent pool started on first use (a decode step calls this once per MoE layer: starting and joining
// threads per call cost more than a small batch's work); between calls they spin briefly, then sleep in
// the kernel, so they take no CPU from the process's other thread pools while XLA runs the rest of a step.

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kTokensPerPass = 4;  // tokens dotted with one weight row per pass (row read once per pass)

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));  // unaligned loads

inline v8 Load(const float* p) { return *reinterpret_cast<const v8u*>(p); }
inline float Sum(v8 v) { return v[0] + v[1] + v[2] + v[3] + v[4] + v[5] + v[6] + v[7]; }

// out[r * m + j] = dot(rows[r], xs[j]) for r < R, j < M; rows are `row_stride` floats apart, xs rows
// `stride` apart. R rows are streamed together: one row at a time left each core short of memory
// parallelism (~7 GB/s per core here, against ~13 for a multi-stream reduction). Software prefetching
// (of the same rows further on, or of the next rows) only slowed it down.
template <int R, int M>
inline void DotRows(const float* __restrict rows, int64_t row_stride, const float* __restrict xs, int64_t stride,
                    int64_t n, float* __restrict out) {
  v8 acc[R][M] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    v8 x[M];
    for (int j = 0; j < M; ++j) x[j] = Load(xs + j * stride + i);
    for (int r = 0; r < R; ++r) {
      const v8 w = Load(rows + r * row_stride + i);
      for (int j = 0; j < M; ++j) acc[r][j] += w * x[j];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < M; ++j) {
      float tail = 0.f;
      for (int64_t t = i; t < n; ++t) tail += rows[r * row_stride + t] * xs[j * stride + t];
      out[r * M + j] = Sum(acc[r][j]) + tail;
    }
}

// DotRows<R, mm> for a run-time token count mm in [1, kTokensPerPass].
template <int R>
inline void DotBlock(const float* rows, int64_t row_stride, const float* xs, int64_t stride, int mm, int64_t n, float* out) {
  switch (mm) {
    case 1: return DotRows<R, 1>(rows, row_stride, xs, stride, n, out);
    case 2: return DotRows<R, 2>(rows, row_stride, xs, stride, n, out);
    case 3: return DotRows<R, 3>(rows, row_stride, xs, stride, n, out);
    default: return DotRows<R, 4>(rows, row_stride, xs, stride, n, out);
  }
}

// y[j * y_stride + r] = dot(w[r], xs[j]) for every row r < num_rows of w [num_rows, n] and token j < m.
// Rows outer, tokens inner: a group of R rows is read from memory once and stays in L1 while every
// chunk of kTokensPerPass tokens is dotted with it.
template <int R>
void MatVecsR(const float* w, int64_t num_rows, int64_t n, const float* xs, int64_t stride, int m, float* y,
              int64_t y_stride) {
  float dots[R * kTokensPerPass];
  for (int64_t r = 0; r < num_rows; r += R) {
    const int rr = static_cast<int>(std::min<int64_t>(R, num_rows - r));
    for (int j0 = 0; j0 < m; j0 += kTokensPerPass) {
      const int mm = std::min(kTokensPerPass, m - j0);
      for (int k = 0; k < rr; k += (rr == R ? R : 1)) {
        const int block = rr == R ? R : 1;
        if (block == R) DotBlock<R>(w + (r + k) * n, n, xs + j0 * stride, stride, mm, n, dots);
        else DotBlock<1>(w + (r + k) * n, n, xs + j0 * stride, stride, mm, n, dots);
        for (int b = 0; b < block; ++b)
          for (int j = 0; j < mm; ++j) y[(j0 + j) * y_stride + r + k + b] = dots[b * mm + j];
      }
    }
  }
}

void MatVecs(const float* w, int64_t num_rows, int64_t n, const float* xs, int64_t stride, int m, float* y,
             int64_t y_stride) {
  // 4 rows x up to 2 tokens, or 2 rows x up to 4: at most 8 accumulators plus the loads in registers.
  if (m <= 2) return MatVecsR<4>(w, num_rows, n, xs, stride, m, y, y_stride);
  MatVecsR<2>(w, num_rows, n, xs, stride, m, y, y_stride);
}

// CPUs this process may run on (its affinity mask, as taskset or a container sets it).
int NumCpus() {
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
  // running the rest of the step between two layers' calls.
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

// The process's pool, started on first use; a forked child starts its own (the parent's threads are not
// in it). Never destroyed: its threads sleep until the process exits.
std::atomic<WorkerPool*> g_pool{nullptr};
std::mutex g_pool_init;

WorkerPool& Pool() {
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


// exp's argument is clamped: exp(-v) of a large v is subnormal, and subnormal arithmetic is ~100x slower
// (a layer of large activations ran at a quarter of the speed). Past |v| = 80 the result is unchanged
// to float precision for positive v, and ~0 either way for negative v.
inline float Silu(float v) { return v / (1.f + std::exp(std::min(std::max(-v, -80.f), 80.f))); }

struct Assignment {
  int32_t token;
  float weight;
};

// The selected experts with their assignments, laid out so each expert's tokens are contiguous.
struct Plan {
  std::vector<int64_t> experts;     // the selected experts
  std::vector<int64_t> offsets;     // expert u's assignments are [offsets[u], offsets[u + 1])
  std::vector<Assignment> entries;  // every assignment, grouped by expert
};

Plan MakePlan(const int32_t* ids, const float* weights, int64_t t, int64_t k, int64_t e) {
  std::vector<std::vector<Assignment>> groups(e);
  for (int64_t a = 0; a < t * k; ++a)
    if (ids[a] >= 0 && ids[a] < e) groups[ids[a]].push_back({static_cast<int32_t>(a / k), weights[a]});
  Plan plan;
  plan.offsets.push_back(0);
  for (int64_t i = 0; i < e; ++i) {
    if (groups[i].empty()) continue;
    plan.experts.push_back(i);
    plan.entries.insert(plan.entries.end(), groups[i].begin(), groups[i].end());
    plan.offsets.push_back(static_cast<int64_t>(plan.entries.size()));
  }
  return plan;
}

// Calls fn(u, r0, r1) for the pieces of [lo, hi) of the rows of every selected expert laid end to end,
// `rows` per expert.
template <typename Fn>
void ForRows(int64_t lo, int64_t hi, int64_t rows, Fn fn) {
  for (int64_t g = lo; g < hi;) {
    const int64_t u = g / rows, r0 = g % rows, r1 = std::min(rows, r0 + (hi - g));
    fn(u, r0, r1);
    g += r1 - r0;
  }
}

// This thread's share [lo, hi) of n rows, in multiples of 4 so row groups stay whole.
std::pair<int64_t, int64_t> Share(int64_t n, int me, int threads) {
  auto edge = [&](int p) { return std::min(n, (n * p / threads + 3) / 4 * 4); };
  return {edge(me), me + 1 == threads ? n : edge(me + 1)};
}

}  // namespace

namespace {

ffi::Error MoeExpertsImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> weights,
                          ffi::Buffer<ffi::F32> gate_up, ffi::Buffer<ffi::F32> down, ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions(), idd = ids.dimensions(), gud = gate_up.dimensions(), dd = down.dimensions();
  if (xd.size() != 2 || idd.size() != 2 || gud.size() != 3 || dd.size() != 3)
    return ffi::Error::InvalidArgument("moe_experts: expected x [T, H], ids [T, K], gate_up [E, 2I, H], down [E, H, I]");
  const int64_t t = xd[0], h = xd[1], k = idd[1], e = gud[0], inter = dd[2];
  if (idd[0] != t || gud[2] != h || gud[1] != 2 * inter || dd[0] != e || dd[1] != h ||
      weights.dimensions()[0] != t || weights.dimensions()[1] != k)
    return ffi::Error::InvalidArgument("moe_experts: inconsistent shapes");

  const Plan plan = MakePlan(ids.typed_data(), weights.typed_data(), t, k, e);
  const int64_t num_used = static_cast<int64_t>(plan.experts.size()), a = static_cast<int64_t>(plan.entries.size());
  float* result = out->typed_data();
  std::memset(result, 0, t * h * sizeof(float));
  if (a == 0) return ffi::Error::Success();
  const float* xp = x.typed_data();
  std::vector<float> xs(a * h), gu(a * 2 * inter);  // tokens' rows and gate/up outputs, by expert
  for (int64_t i = 0; i < a; ++i) std::memcpy(&xs[i * h], xp + plan.entries[i].token * h, h * sizeof(float));

  // Both phases split the rows of all selected experts evenly between the threads, so every thread
  // streams the same amount of weights (splitting whole experts left threads idle at small batches).
  WorkerPool& pool = Pool();
  int threads = std::max(1, std::min<int>(pool.size(), static_cast<int>((num_used * h + 63) / 64)));
  std::unique_lock<std::mutex> lease;
  if (threads > 1 && !(lease = pool.TryAcquire()).owns_lock()) threads = 1;
  std::vector<float> partial(static_cast<size_t>(threads - 1) * t * h, 0.f);
  const float* gup = gate_up.typed_data();
  const float* dp = down.typed_data();
  std::barrier sync(threads);
  auto work = [&](int me) {
    // Phase 1: [g; u] = gate_up[e] x for this thread's gate_up rows.
    auto [lo1, hi1] = Share(num_used * 2 * inter, me, threads);
    ForRows(lo1, hi1, 2 * inter, [&](int64_t u, int64_t r0, int64_t r1) {
      const int64_t first = plan.offsets[u], m = plan.offsets[u + 1] - first;
      const float* w = gup + plan.experts[u] * 2 * inter * h + r0 * h;
      MatVecs(w, r1 - r0, h, &xs[first * h], h, static_cast<int>(m), &gu[first * 2 * inter + r0], 2 * inter);
    });
    sync.arrive_and_wait();
    // Phase 2: out[t] += weight * down[e] act for this thread's down rows.
    float* acc = me == 0 ? result : partial.data() + (me - 1) * t * h;
    std::vector<float> act, y;
    int64_t act_of = -1;
    auto [lo2, hi2] = Share(num_used * h, me, threads);
    ForRows(lo2, hi2, h, [&](int64_t u, int64_t r0, int64_t r1) {
      const int64_t first = plan.offsets[u], m = plan.offsets[u + 1] - first;
      if (act_of != u) {  // silu(g) * u of this expert's tokens (cheap: m x I, recomputed per thread)
        act.resize(m * inter);
        for (int64_t j = 0; j < m; ++j) {
          const float* row = &gu[(first + j) * 2 * inter];
          for (int64_t i = 0; i < inter; ++i) act[j * inter + i] = Silu(row[i]) * row[inter + i];
        }
        act_of = u;
      }
      y.resize(m * (r1 - r0));
      const float* w = dp + plan.experts[u] * h * inter + r0 * inter;
      MatVecs(w, r1 - r0, inter, act.data(), inter, static_cast<int>(m), y.data(), r1 - r0);
      for (int64_t j = 0; j < m; ++j) {
        const Assignment& as = plan.entries[first + j];
        float* dst = acc + as.token * h + r0;
        for (int64_t r = 0; r < r1 - r0; ++r) dst[r] += as.weight * y[j * (r1 - r0) + r];
      }
    });
  };
  if (threads > 1) pool.Run(threads, work);
  else work(0);
  for (int p = 0; p + 1 < threads; ++p) {
    const float* src = partial.data() + p * t * h;
    for (int64_t i = 0; i < t * h; ++i) result[i] += src[i];
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MorayMoeExpertsF32, MoeExpertsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::S32>>()  // ids
                                  .Arg<ffi::Buffer<ffi::F32>>()  // weights
                                  .Arg<ffi::Buffer<ffi::F32>>()  // gate_up
                                  .Arg<ffi::Buffer<ffi::F32>>()  // down
                                  .Ret<ffi::Buffer<ffi::F32>>());
