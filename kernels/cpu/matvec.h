// Matrix-vector products over float32 weight rows for a few tokens at a time, at the speed memory streams
// the rows: the inner loops of the CPU kernels (kernels/cpu/*.cc).
#pragma once

#include <algorithm>
#include <cstdint>

namespace moray {

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));  // unaligned loads
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));

template <typename V>
struct Lanes;
template <>
struct Lanes<v8> {
  static constexpr int kWidth = 8;
  using Unaligned = v8u;
};
template <>
struct Lanes<v16> {
  static constexpr int kWidth = 16;
  using Unaligned = v16u;
};

template <typename V>
inline V Load(const float* p) {
  return *reinterpret_cast<const typename Lanes<V>::Unaligned*>(p);
}

template <typename V>
inline float Sum(V v) {
  float s = 0.f;
  for (int i = 0; i < Lanes<V>::kWidth; ++i) s += v[i];
  return s;
}

// out[r * M + j] = dot(rows[r], xs[j]) for r < R, j < M; rows are `row_stride` floats apart, xs rows
// `stride` apart. U vectors of each row per iteration, each into its own accumulators: the additions into
// one accumulator are a chain of dependent FMAs, and a single chain per row held a core to ~7 GB/s.
template <typename V, int R, int M, int U>
inline void DotRows(const float* __restrict rows, int64_t row_stride, const float* __restrict xs, int64_t stride,
                    int64_t n, float* __restrict out) {
  constexpr int W = Lanes<V>::kWidth;
  V acc[U][R][M] = {};
  int64_t i = 0;
  for (; i + U * W <= n; i += U * W)
    for (int u = 0; u < U; ++u) {
      V x[M];
      for (int j = 0; j < M; ++j) x[j] = Load<V>(xs + j * stride + i + u * W);
      for (int r = 0; r < R; ++r) {
        const V w = Load<V>(rows + r * row_stride + i + u * W);
        for (int j = 0; j < M; ++j) acc[u][r][j] += w * x[j];
      }
    }
  for (; i + W <= n; i += W)
    for (int j = 0; j < M; ++j) {
      const V x = Load<V>(xs + j * stride + i);
      for (int r = 0; r < R; ++r) acc[0][r][j] += Load<V>(rows + r * row_stride + i) * x;
    }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < M; ++j) {
      V sum = acc[0][r][j];
      for (int u = 1; u < U; ++u) sum += acc[u][r][j];
      float tail = 0.f;
      for (int64_t t = i; t < n; ++t) tail += rows[r * row_stride + t] * xs[j * stride + t];
      out[r * M + j] = Sum(sum) + tail;
    }
}

// DotRows<V, R, mm, U> for a run-time token count mm in [1, kTokensPerPass] (exactly mm tokens' rows are read).
constexpr int kTokensPerPass = 4;

template <typename V, int R, int U>
inline void DotBlock(const float* rows, int64_t row_stride, const float* xs, int64_t stride, int mm, int64_t n, float* out) {
  switch (mm) {
    case 1: return DotRows<V, R, 1, U>(rows, row_stride, xs, stride, n, out);
    case 2: return DotRows<V, R, 2, U>(rows, row_stride, xs, stride, n, out);
    case 3: return DotRows<V, R, 3, U>(rows, row_stride, xs, stride, n, out);
    default: return DotRows<V, R, 4, U>(rows, row_stride, xs, stride, n, out);
  }
}

// y[j * y_stride + r] = dot(w[r], xs[j]) for every row r < num_rows of w [num_rows, n] and token j < m.
// Rows outer, tokens inner: a group of R rows is read from memory once and stays in L1 while every
// pass of up to M <= kTokensPerPass tokens is dotted with it; rows past the last whole group go one by one.
template <typename V, int R, int M, int U>
void MatVecsBlocked(const float* w, int64_t num_rows, int64_t n, const float* xs, int64_t stride, int m, float* y,
                    int64_t y_stride) {
  static_assert(M >= 1 && M <= kTokensPerPass);
  float dots[R * M];
  for (int64_t r = 0; r < num_rows; r += R) {
    const int block = r + R <= num_rows ? R : 1;
    for (int j0 = 0; j0 < m; j0 += M) {
      const int mm = std::min(M, m - j0);
      for (int64_t k = r; k < std::min(r + R, num_rows); k += block) {
        if (block == R) DotBlock<V, R, U>(w + k * n, n, xs + j0 * stride, stride, mm, n, dots);
        else DotBlock<V, 1, U>(w + k * n, n, xs + j0 * stride, stride, mm, n, dots);
        for (int b = 0; b < block; ++b)
          for (int j = 0; j < mm; ++j) y[(j0 + j) * y_stride + k + b] = dots[b * mm + j];
      }
    }
  }
}

// The blocking by token count, measured on one core on rows of 256 and 1024 floats (the bench preset's
// expert and attention widths). Up to 4 tokens: one row at a time, so the weights are one sequential stream
// (8 rows streamed side by side read short rows at a third of the speed: 8.5 against 26 GB/s for rows of
// 256 at batch 1), with 4 (one token) or 2 vectors per iteration in flight. More tokens are compute-bound:
// on AVX-512 a 4-row x 4-token block of 16-float accumulators fills the 32 vector registers (35 GFLOP/s
// at 16 tokens against 28 one row at a time) once rows are long enough to amortise its start.
inline void MatVecs(const float* w, int64_t num_rows, int64_t n, const float* xs, int64_t stride, int m, float* y,
                    int64_t y_stride) {
  if (m == 1) return MatVecsBlocked<v8, 1, 1, 4>(w, num_rows, n, xs, stride, m, y, y_stride);
  if (m == 2) return MatVecsBlocked<v8, 1, 2, 2>(w, num_rows, n, xs, stride, m, y, y_stride);
#if defined(__AVX512F__)
  if (m > kTokensPerPass && n >= 512) return MatVecsBlocked<v16, 4, 4, 1>(w, num_rows, n, xs, stride, m, y, y_stride);
#endif
  MatVecsBlocked<v8, 1, 4, 2>(w, num_rows, n, xs, stride, m, y, y_stride);
}

}  // namespace moray
