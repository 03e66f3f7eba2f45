// KV blocks between a cache's page pools and one blocks-first array, as XLA FFI custom calls (kernels/cpu_ffi.py
// builds and registers them; kernels/block_copy.py selects them for caches on one CPU device):
//
//   scatter: pages_l [ids[l or 0, b]] <- data [n, L, rows, W] (the first row bytes of each token row), ids
//            outside [0, N_l) dropped; the pages are the results, aliased to the inputs (updated in place)
//   gather:  data [n, L, rows, W] <- pages_l [ids[l or 0, b]], each token row zero-padded to W; ids as XLA's
//            gather takes them (a negative one counts from the end, then clamped into the pool)
//
// Why kernels: a KV handoff's export and import, or a host-tier copy, move tens of MiB of whole blocks, and
// XLA:CPU's scatter copied them at ~2.4 GB/s, its gather of an export piece (6 MiB) at ~1.7 GB/s. Here each
// (block, layer) is one memcpy of contiguous rows (a row per token; the transport layout pads rows of layers
// with different shapes to one width W), split between the kernels' pool threads (pool.h). Bytes are bytes:
// any dtype.
//
// The gather runs off the thread that dispatches it only in a program XLA:CPU prices at >= 1,000 flops (it
// runs cheaper ones inline, waiting for the custom call): kernels/block_copy.py adds a small product.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#include "pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Bytes a thread copies at least: below this, waking one more costs more than it saves.
constexpr int64_t kMinBytesPerThread = 1 << 20;

struct PagePool {
  char* base;
  int64_t num_blocks;
  int64_t row_bytes;  // one token's row of this layer
};

// (block, layer) copies of `block_bytes` each, split over the pool's threads.
void ForEachCopy(int64_t n, int64_t layers, int64_t block_bytes, const std::function<void(int64_t, int64_t)>& copy) {
  const int64_t units = n * layers;
  const int64_t want = std::max<int64_t>(1, units * block_bytes / kMinBytesPerThread);
  const int threads = static_cast<int>(std::min<int64_t>(want, moray::NumCpus()));
  std::atomic<int64_t> next{0};
  moray::RunOnPool(threads, [&](int, int) {
    for (int64_t u; (u = next.fetch_add(1, std::memory_order_relaxed)) < units;) copy(u / layers, u % layers);
  });
}

// The ids of every layer ([L, n]) or one row shared by all ([1, n]); `pools` from the page buffers.
ffi::Error Check(ffi::Buffer<ffi::S32> ids, int64_t layers, const std::vector<PagePool>& pools, int64_t n, int64_t copy_row_bytes) {
  const auto d = ids.dimensions();
  if (d.size() != 2 || (d[0] != 1 && d[0] != layers) || d[1] != n)
    return ffi::Error::InvalidArgument("block copy: ids must be [1 or layers, blocks]");
  for (const PagePool& p : pools)
    if (p.row_bytes > copy_row_bytes) return ffi::Error::InvalidArgument("block copy: a layer's row is wider than the copy's");
  return ffi::Error::Success();
}

ffi::ErrorOr<PagePool> PagePoolOf(const ffi::AnyBuffer& b, int64_t rows) {
  const auto d = b.dimensions();
  if (d.size() < 2 || d[1] != rows) return ffi::Unexpected(ffi::Error::InvalidArgument("block copy: pages must be [blocks, rows, ...]"));
  const int64_t blocks = d[0];
  const int64_t row_bytes = blocks == 0 ? 0 : static_cast<int64_t>(b.size_bytes()) / (blocks * rows);
  return PagePool{static_cast<char*>(b.untyped_data()), blocks, row_bytes};
}

ffi::Error ScatterImpl(ffi::Buffer<ffi::S32> ids, ffi::AnyBuffer data, ffi::RemainingArgs pages, ffi::RemainingRets outs) {
  const auto dd = data.dimensions();
  if (dd.size() < 3) return ffi::Error::InvalidArgument("block scatter: data must be [blocks, layers, rows, ...]");
  const int64_t n = dd[0], layers = dd[1], rows = dd[2];
  if (static_cast<int64_t>(pages.size()) != layers || static_cast<int64_t>(outs.size()) != layers)
    return ffi::Error::InvalidArgument("block scatter: one page pool per layer");
  std::vector<PagePool> pools;
  for (int64_t l = 0; l < layers; ++l) {
    auto in = pages.get<ffi::AnyBuffer>(l);
    auto res = outs.get<ffi::AnyBuffer>(l);
    if (in.has_error()) return in.error();
    if (res.has_error()) return res.error();
    ffi::AnyBuffer& dst = **res;
    // The results alias the inputs (input_output_aliases); were XLA to give another buffer, keep the pages.
    if (dst.untyped_data() != in->untyped_data()) std::memcpy(dst.untyped_data(), in->untyped_data(), in->size_bytes());
    auto pool = PagePoolOf(dst, rows);
    if (pool.has_error()) return pool.error();
    pools.push_back(*pool);
  }
  if (n == 0 || layers == 0 || rows == 0) return ffi::Error::Success();
  const int64_t data_row = static_cast<int64_t>(data.size_bytes()) / (n * layers * rows);
  if (auto e = Check(ids, layers, pools, n, data_row); e.failure()) return e;
  const int32_t* idp = ids.typed_data();
  const int64_t id_stride = ids.dimensions()[0] == 1 ? 0 : n;
  const char* src = static_cast<const char*>(data.untyped_data());
  ForEachCopy(n, layers, rows * data_row, [&](int64_t b, int64_t l) {
    const PagePool& p = pools[l];
    const int64_t id = idp[l * id_stride + b];
    if (id < 0 || id >= p.num_blocks) return;  // padding, or a window block let go: dropped
    const char* from = src + (b * layers + l) * rows * data_row;
    char* to = p.base + id * rows * p.row_bytes;
    if (p.row_bytes == data_row) return static_cast<void>(std::memcpy(to, from, rows * data_row));
    for (int64_t r = 0; r < rows; ++r) std::memcpy(to + r * p.row_bytes, from + r * data_row, p.row_bytes);
  });
  return ffi::Error::Success();
}

ffi::Error GatherImpl(ffi::Buffer<ffi::S32> ids, ffi::RemainingArgs pages, ffi::Result<ffi::AnyBuffer> out) {
  const auto od = out->dimensions();
  if (od.size() < 3) return ffi::Error::InvalidArgument("block gather: the result must be [blocks, layers, rows, ...]");
  const int64_t n = od[0], layers = od[1], rows = od[2];
  if (static_cast<int64_t>(pages.size()) != layers) return ffi::Error::InvalidArgument("block gather: one page pool per layer");
  std::vector<PagePool> pools;
  for (int64_t l = 0; l < layers; ++l) {
    auto in = pages.get<ffi::AnyBuffer>(l);
    if (in.has_error()) return in.error();
    auto pool = PagePoolOf(*in, rows);
    if (pool.has_error()) return pool.error();
    pools.push_back(*pool);
  }
  if (n == 0 || layers == 0 || rows == 0) return ffi::Error::Success();
  const int64_t out_row = static_cast<int64_t>(out->size_bytes()) / (n * layers * rows);
  if (auto e = Check(ids, layers, pools, n, out_row); e.failure()) return e;
  const int32_t* idp = ids.typed_data();
  const int64_t id_stride = ids.dimensions()[0] == 1 ? 0 : n;
  char* dst = static_cast<char*>(out->untyped_data());
  ForEachCopy(n, layers, rows * out_row, [&](int64_t b, int64_t l) {
    const PagePool& p = pools[l];
    char* to = dst + (b * layers + l) * rows * out_row;
    if (p.num_blocks == 0) return static_cast<void>(std::memset(to, 0, rows * out_row));
    int64_t id = idp[l * id_stride + b];
    if (id < 0) id += p.num_blocks;
    id = std::clamp<int64_t>(id, 0, p.num_blocks - 1);
    const char* from = p.base + id * rows * p.row_bytes;
    if (p.row_bytes == out_row) return static_cast<void>(std::memcpy(to, from, rows * out_row));
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(to + r * out_row, from + r * p.row_bytes, p.row_bytes);
      std::memset(to + r * out_row + p.row_bytes, 0, out_row - p.row_bytes);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MorayGatherBlocks, GatherImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // ids [1 or L, n]
                                  .RemainingArgs()               // pages, one per layer
                                  .Ret<ffi::AnyBuffer>());       // data [n, L, rows, ...]

XLA_FFI_DEFINE_HANDLER_SYMBOL(MorayScatterBlocks, ScatterImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // ids [1 or L, n]
                                  .Arg<ffi::AnyBuffer>()         // data [n, L, rows, ...]
                                  .RemainingArgs()               // pages, one per layer
                                  .RemainingRets());             // the pages, aliased to the inputs
