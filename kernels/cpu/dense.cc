// Dense float32 projections for a few tokens on CPU, as an XLA FFI custom call (kernels/cpu_ffi.py builds
// and registers it; kernels/dense.py selects it): y [T, O] = x [T, I] w[O, I]^T, the [out, in] layout of
// the checkpoints' linear layers and LM heads.
//
// Why a kernel: at decode sizes these are matrix-vector products, a stream of the weight rows. XLA:CPU
// runs them as library GEMVs on its own threads, below the memory bandwidth at batch 1 and compute-bound
// at batch 16. Here the output rows are split between the kernels' pool threads (pool.h), and each group of
// rows is read from memory once and dotted with every token while it sits in L1 (matvec.h).

#include <algorithm>
#include <cstdint>

#include "matvec.h"
#include "pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Rows of work (out rows x in width) below which one more thread costs more to wake than it saves.
constexpr int64_t kMinFloatsPerThread = 1 << 15;

ffi::Error DenseImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1])
    return ffi::Error::InvalidArgument("dense: expected x [T, I] and w [O, I]");
  const int64_t t = xd[0], in = xd[1], rows = wd[0];
  if (t == 0 || rows == 0) return ffi::Error::Success();
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  const int64_t want = std::max<int64_t>(1, rows * in / kMinFloatsPerThread);
  const int threads = static_cast<int>(std::min<int64_t>(want, moray::NumCpus()));
  moray::Pieces pieces(rows, threads, moray::Pieces::kMinFloats / in);
  moray::RunOnPool(threads, [&](int, int) {
    // Output columns [lo, hi) of every token's row: the tokens share each row read (matvec.h).
    for (int64_t lo, hi; pieces.Next(&lo, &hi);) moray::MatVecs(wp + lo * in, hi - lo, in, xp, in, static_cast<int>(t), yp + lo, rows);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MorayDenseF32, DenseImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w
                                  .Ret<ffi::Buffer<ffi::F32>>());
