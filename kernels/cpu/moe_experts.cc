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
// Threads: OpenMP over the selected experts (largest groups first, dynamic schedule), each thread
// summing into its own [T, H] accumulator; the accumulators are added at the end.

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kTokensPerPass = 4;  // tokens dotted with one weight row per pass (row read once per pass)

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));  // unaligned loads
constexpr int64_t kLine = 16;       // floats per 64-byte cache line
constexpr int64_t kPrefetch = 1024;  // floats ahead (2 KiB): rows are 1-4 KiB, often one page each, and
                                    // the hardware prefetcher stops at page ends; this keeps the next
                                    // row's lines in flight while the current one is dotted

inline v8 Load(const float* p) { return *reinterpret_cast<const v8u*>(p); }
inline float Sum(v8 v) { return v[0] + v[1] + v[2] + v[3] + v[4] + v[5] + v[6] + v[7]; }

// out[r * m + j] = dot(rows[r], xs[j]) for r < R, j < M; rows are `row_stride` floats apart, xs rows
// `stride` apart. R rows are streamed together: one row at a time left each core short of memory
// parallelism (~7 GB/s per core here, against ~13 for a multi-stream reduction).
template <int R, int M>
inline void DotRows(const float* __restrict rows, int64_t row_stride, const float* __restrict xs, int64_t stride,
                    int64_t n, float* __restrict out) {
  v8 acc[R][M] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    if (i % kLine == 0)
      for (int r = 0; r < R; ++r) __builtin_prefetch(rows + r * row_stride + i + kPrefetch, 0, 0);
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

// y[j * y_stride + r] = dot(w[r], xs[j]) for every row r < num_rows of w and token j < m (m <= 4).
template <int M>
void MatVecs(const float* w, int64_t num_rows, int64_t n, const float* xs, int64_t stride, float* y, int64_t y_stride) {
  constexpr int R = M <= 2 ? 4 : 2;
  float dots[R * M];
  int64_t r = 0;
  for (; r + R <= num_rows; r += R) {
    DotRows<R, M>(w + r * n, n, xs, stride, n, dots);
    for (int k = 0; k < R; ++k)
      for (int j = 0; j < M; ++j) y[j * y_stride + r + k] = dots[k * M + j];
  }
  for (; r < num_rows; ++r) {
    DotRows<1, M>(w + r * n, n, xs, stride, n, dots);
    for (int j = 0; j < M; ++j) y[j * y_stride + r] = dots[j];
  }
}

void MatVecs(const float* w, int64_t num_rows, int64_t n, const float* xs, int64_t stride, int m, float* y,
             int64_t y_stride) {
  switch (m) {
    case 1: return MatVecs<1>(w, num_rows, n, xs, stride, y, y_stride);
    case 2: return MatVecs<2>(w, num_rows, n, xs, stride, y, y_stride);
    case 3: return MatVecs<3>(w, num_rows, n, xs, stride, y, y_stride);
    default: return MatVecs<4>(w, num_rows, n, xs, stride, y, y_stride);
  }
}

inline float Silu(float v) { return v / (1.f + std::exp(-v)); }

struct Assignment {
  int32_t token;
  float weight;
};

// One expert on its m tokens, adding weight * result into acc [T, H].
inline float* scratch_y(std::vector<float>& scratch, int64_t m, int64_t h) { return scratch.data() + scratch.size() - m * h; }

void RunExpert(const float* x, const std::vector<Assignment>& group, const float* gate_up, const float* down, int64_t h,
               int64_t inter, float* acc, std::vector<float>& scratch) {
  const int64_t m = static_cast<int64_t>(group.size());
  scratch.resize(2 * m * h + 3 * m * inter);
  float* xs = scratch.data();           // [m, H] the tokens' rows, contiguous
  float* gu = xs + m * h;               // [m, 2I]
  float* act = gu + 2 * m * inter;      // [m, I]
  for (int64_t j = 0; j < m; ++j) std::memcpy(xs + j * h, x + group[j].token * h, h * sizeof(float));
  for (int64_t j0 = 0; j0 < m; j0 += kTokensPerPass) {
    const int mm = static_cast<int>(std::min<int64_t>(kTokensPerPass, m - j0));
    MatVecs(gate_up, 2 * inter, h, xs + j0 * h, h, mm, gu + j0 * 2 * inter, 2 * inter);
  }
  for (int64_t j = 0; j < m; ++j)
    for (int64_t i = 0; i < inter; ++i) act[j * inter + i] = Silu(gu[j * 2 * inter + i]) * gu[j * 2 * inter + inter + i];
  float* y = scratch_y(scratch, m, h);  // [m, H] down outputs
  for (int64_t j0 = 0; j0 < m; j0 += kTokensPerPass) {
    const int mm = static_cast<int>(std::min<int64_t>(kTokensPerPass, m - j0));
    MatVecs(down, h, inter, act + j0 * inter, inter, mm, y + j0 * h, h);
  }
  for (int64_t j = 0; j < m; ++j) {
    float* dst = acc + group[j].token * h;
    const float wt = group[j].weight;
    for (int64_t r = 0; r < h; ++r) dst[r] += wt * y[j * h + r];
  }
}

ffi::Error MoeExpertsImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> weights,
                          ffi::Buffer<ffi::F32> gate_up, ffi::Buffer<ffi::F32> down, ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions(), idd = ids.dimensions(), gud = gate_up.dimensions(), dd = down.dimensions();
  if (xd.size() != 2 || idd.size() != 2 || gud.size() != 3 || dd.size() != 3)
    return ffi::Error::InvalidArgument("moe_experts: expected x [T, H], ids [T, K], gate_up [E, 2I, H], down [E, H, I]");
  const int64_t t = xd[0], h = xd[1], k = idd[1], e = gud[0], inter = dd[2];
  if (idd[0] != t || gud[2] != h || gud[1] != 2 * inter || dd[0] != e || dd[1] != h ||
      weights.dimensions()[0] != t || weights.dimensions()[1] != k)
    return ffi::Error::InvalidArgument("moe_experts: inconsistent shapes");

  const int32_t* id = ids.typed_data();
  const float* w = weights.typed_data();
  std::vector<std::vector<Assignment>> groups(e);
  for (int64_t a = 0; a < t * k; ++a)
    if (id[a] >= 0 && id[a] < e) groups[id[a]].push_back({static_cast<int32_t>(a / k), w[a]});
  std::vector<int64_t> used;
  for (int64_t i = 0; i < e; ++i)
    if (!groups[i].empty()) used.push_back(i);
  std::stable_sort(used.begin(), used.end(), [&](int64_t a, int64_t b) { return groups[a].size() > groups[b].size(); });

  float* result = out->typed_data();
  std::memset(result, 0, t * h * sizeof(float));
  const int threads = std::max(1, std::min<int>(omp_get_max_threads(), static_cast<int>(used.size())));
  std::vector<float> partial(static_cast<size_t>(threads > 1 ? threads - 1 : 0) * t * h, 0.f);
  const float* xp = x.typed_data();
  const float* gup = gate_up.typed_data();
  const float* dp = down.typed_data();
#pragma omp parallel num_threads(threads)
  {
    const int me = omp_get_thread_num();
    float* acc = me == 0 ? result : partial.data() + (me - 1) * t * h;
    std::vector<float> scratch;
#pragma omp for schedule(dynamic, 1)
    for (size_t u = 0; u < used.size(); ++u) {
      const int64_t ex = used[u];
      RunExpert(xp, groups[ex], gup + ex * 2 * inter * h, dp + ex * h * inter, h, inter, acc, scratch);
    }
  }
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
