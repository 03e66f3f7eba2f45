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
// Threads: one per CPU, the kernels' shared pool (pool.h); each phase (gate/up, then down) splits the rows of
// all selected experts evenly, and each thread sums into its own [T, H] accumulator; the accumulators are
// added at the end.

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <vector>

#include "matvec.h"
#include "pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using moray::MatVecs;

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

  // Both phases split the rows of all selected experts laid end to end (splitting whole experts left
  // threads idle at small batches): phase 1 hands them out in pieces (pool.h's Pieces: a thread the OS
  // parks leaves its work to the others), phase 2 in fixed shares (see there).
  moray::WorkerPool& pool = moray::Pool();
  int threads = std::max(1, std::min<int>(pool.size(), static_cast<int>((num_used * h + 63) / 64)));
  std::unique_lock<std::mutex> lease;
  if (threads > 1 && !(lease = pool.TryAcquire()).owns_lock()) threads = 1;
  std::vector<float> partial(static_cast<size_t>(threads - 1) * t * h, 0.f);
  const float* gup = gate_up.typed_data();
  const float* dp = down.typed_data();
  std::barrier sync(threads);
  moray::Pieces pieces1(num_used * 2 * inter, threads, moray::Pieces::kMinFloats / std::max<int64_t>(1, h));
  auto work = [&](int me) {
    // Phase 1: [g; u] = gate_up[e] x, the gate_up rows taken piece by piece.
    for (int64_t lo1, hi1; pieces1.Next(&lo1, &hi1);) {
      ForRows(lo1, hi1, 2 * inter, [&](int64_t u, int64_t r0, int64_t r1) {
        const int64_t first = plan.offsets[u], m = plan.offsets[u + 1] - first;
        const float* w = gup + plan.experts[u] * 2 * inter * h + r0 * h;
        MatVecs(w, r1 - r0, h, &xs[first * h], h, static_cast<int>(m), &gu[first * 2 * inter + r0], 2 * inter);
      });
    }
    sync.arrive_and_wait();
    // Phase 2: out[t] += weight * down[e] act for this thread's down rows.
    float* acc = me == 0 ? result : partial.data() + (me - 1) * t * h;
    std::vector<float> act, y;
    int64_t act_of = -1;
    // Fixed shares here, not pieces: each thread sums into its own buffer and the buffers are added at the
    // end, so which thread took which rows decides the order of the sums; pieces made the output differ
    // in the last bits from run to run (a quantization benchmark's KL of a model against itself came out
    // -3.6e-16 in a full run).
    auto [lo2, hi2] = moray::Share(num_used * h, me, threads);
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
