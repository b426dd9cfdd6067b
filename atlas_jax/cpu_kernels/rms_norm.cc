// RMSNorm over the last axis as one custom call (XLA:CPU splits it into four thunks: square, a partial
// reduce-window, rsqrt, scale), and the pre-norm residual block's add fused with it:
//   atlas_rms_norm:     y = x * rsqrt(mean(x^2) + eps) * s
//   atlas_add_rms_norm: r = x + h; y = r * rsqrt(mean(r^2) + eps) * s; returns (r, y)
// s = w, or 1 + w when `zero_centred` (Qwen3-Next). x, h, r, y [M, D] fp32; w [D]. Rows run in parallel.
#include <cmath>
#include <cstdint>

#include "tiles.h"

namespace {

using namespace atlas;

// y[0:D] = r * rsqrt(mean(r^2) + eps) * scale(w), for one row already summed into r.
void norm_row(const float* r, const float* w, int64_t D, float eps, bool zero_centred, float* y) {
  vf acc = vf{};
  int64_t d = 0;
  for (; d + VW <= D; d += VW) {
    const vf v = load(r + d);
    acc += v * v;
  }
  float ss = 0.0f;
  for (int i = 0; i < VW; ++i) ss += acc[i];
  for (; d < D; ++d) ss += r[d] * r[d];
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
  const float offset = zero_centred ? 1.0f : 0.0f;
  for (d = 0; d < D; ++d) y[d] = r[d] * inv * (offset + w[d]);
}

template <typename F>
void rows(ffi::ThreadPool& pool, int64_t M, int64_t D, F&& fn) {
  const int64_t per = std::max<int64_t>(1, 16384 / std::max<int64_t>(D, 1));   // ~64 KB of a row block an item
  if (M <= per) {
    for (int64_t m = 0; m < M; ++m) fn(m);
    return;
  }
  parallel_for(pool, (M + per - 1) / per, [&](int64_t b) {
    for (int64_t m = b * per; m < std::min(M, (b + 1) * per); ++m) fn(m);
  });
}

template <typename Dims>
bool shapes_ok(const Dims& xd, int64_t w_count) {
  return xd.size() == 2 && xd[1] == w_count;
}

ffi::Error RmsNorm(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, float eps,
                   bool zero_centred, ffi::ResultBuffer<ffi::F32> y) {
  if (!shapes_ok(x.dimensions(), w.element_count()) || y->element_count() != x.element_count())
    return ffi::Error::InvalidArgument("atlas_rms_norm: x, y [M, D], w [D]");
  const int64_t M = x.dimensions()[0], D = x.dimensions()[1];
  const float *xs = x.typed_data(), *ws = w.typed_data();
  float* ys = y->typed_data();
  rows(pool, M, D, [&](int64_t m) { norm_row(xs + m * D, ws, D, eps, zero_centred, ys + m * D); });
  return ffi::Error::Success();
}

ffi::Error AddRmsNorm(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> h,
                      ffi::Buffer<ffi::F32> w, float eps, bool zero_centred, ffi::ResultBuffer<ffi::F32> r,
                      ffi::ResultBuffer<ffi::F32> y) {
  if (!shapes_ok(x.dimensions(), w.element_count()) || h.element_count() != x.element_count() ||
      r->element_count() != x.element_count() || y->element_count() != x.element_count())
    return ffi::Error::InvalidArgument("atlas_add_rms_norm: x, h, r, y [M, D], w [D]");
  const int64_t M = x.dimensions()[0], D = x.dimensions()[1];
  const float *xs = x.typed_data(), *hs = h.typed_data(), *ws = w.typed_data();
  float *rs = r->typed_data(), *ys = y->typed_data();
  rows(pool, M, D, [&](int64_t m) {
    float* rr = rs + m * D;
    for (int64_t d = 0; d < D; ++d) rr[d] = xs[m * D + d] + hs[m * D + d];
    norm_row(rr, ws, D, eps, zero_centred, ys + m * D);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AtlasRmsNorm, RmsNorm,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w [D]
                                  .Attr<float>("eps")
                                  .Attr<bool>("zero_centred")
                                  .Ret<ffi::Buffer<ffi::F32>>()); // y [M, D]

XLA_FFI_DEFINE_HANDLER_SYMBOL(AtlasAddRmsNorm, AddRmsNorm,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // h [M, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w [D]
                                  .Attr<float>("eps")
                                  .Attr<bool>("zero_centred")
                                  .Ret<ffi::Buffer<ffi::F32>>()   // r = x + h [M, D]
                                  .Ret<ffi::Buffer<ffi::F32>>()); // y [M, D]
