// Dense projection y [M, N] = x [M, K] @ W [K, N] over W packed in panels of PANEL_DN output columns
// (atlas_linear; layers/linear.pack_linear): panels [ceil(N / 64), 64 / DN_SUB, K, DN_SUB] (zero-padded; strips
// of DN_SUB columns, tiles.h), each panel contiguous so a tile streams it front to back (XLA:CPU's dot reads W
// row-strided). Items are
// (run of consecutive panels, block of up to ROW_BLOCK rows); tiles.h consumes each panel chunk by chunk.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "tiles.h"

namespace {

using namespace atlas;

constexpr int64_t MAX_RUN = 8;

ffi::Error Linear(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> panels,
                  ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), pd = panels.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || pd.size() != 4 || yd.size() != 2 || pd[1] != PANEL_DN / DN_SUB || pd[2] != xd[1] ||
      pd[3] != DN_SUB ||
      yd[0] != xd[0] || yd[1] > pd[0] * PANEL_DN || yd[1] <= (pd[0] - 1) * PANEL_DN)
    return ffi::Error::InvalidArgument("atlas_linear: shapes do not match the packed layout");
  const int64_t M = xd[0], K = xd[1], N = yd[1], num_panels = pd[0];
  const float* xs = x.typed_data();
  const float* ws = panels.typed_data();
  float* ys = y->typed_data();
  const int64_t blocks = (M + ROW_BLOCK - 1) / ROW_BLOCK;
  // an item: a run of consecutive panels (each prefetched during the one before) for one row block;
  // runs short enough that every thread gets several items
  const int64_t run = std::clamp<int64_t>(num_panels * blocks / (8 * (pool.num_threads() + 1)), 1, MAX_RUN);
  const int64_t runs = (num_panels + run - 1) / run;
  parallel_for(pool, runs * blocks, [&](int64_t item) {
    const int64_t j0 = (item / blocks) * run, j1 = std::min(num_panels, j0 + run);
    const int64_t m0 = (item % blocks) * ROW_BLOCK, m1 = std::min(M, m0 + ROW_BLOCK);
    for (int64_t j = j0; j < j1; ++j) {
      const float* panel = ws + j * K * PANEL_DN;
      const int64_t c0 = j * PANEL_DN, width = std::min<int64_t>(PANEL_DN, N - c0);
      panel_rows(xs, K, m0, m1, panel,
                 [&](int64_t m, const float* out) { std::memcpy(ys + m * N + c0, out, width * sizeof(float)); },
                 j + 1 < j1 ? panel + K * PANEL_DN : nullptr);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AtlasLinear, Linear,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // panels [ceil(N / 64), 64 / DN_SUB, K, DN_SUB]
                                  .Ret<ffi::Buffer<ffi::F32>>()); // y [M, N]

// The strip widths of the packed layouts this library was compiled for (they follow the vector width):
// layers/moe.pack_experts and layers/linear.pack_linear ask before packing.
extern "C" int atlas_up_strip() { return atlas::UP_SUB; }
extern "C" int atlas_dn_strip() { return atlas::DN_SUB; }
