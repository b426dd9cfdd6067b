// A Gated DeltaNet layer's sequence-local part in one call (atlas_gdn_layer): from the input projections'
// outputs to the gated-norm output the out projection reads, both state pools read and written in place.
// layers/gdn.gdn_layer's XLA path (causal conv + SiLU, q / k / v split, l2 norm, q * Dk^-0.5, the gates,
// the recurrence, rmsnorm(o) * w * silu(z)) is the reference; the pools follow gdn_recurrent.cc's contract:
//   src [B, T, W] (q | k | v before the conv), z [B, T, Wz], b, a [B, T, Wg] (the beta and decay gates'
//   inputs), laid out either grouped per key head (Qwen3-Next: src = z = qkvz, each key head's columns
//   q Dk | k Dk | v r Dv | z r Dv; b = a = ba, each key head's b r | a r) or flat (Qwen3.5: src = qkv with
//   all q | all k | all v heads, z [Hv Dv], b and a [Hv]); r = Hv / Hk.
//   conv_w [C, K] over the flat channel order q | k | v (C = 2 Hk Dk + Hv Dv); A_log, dt_bias [Hv]; norm_w [Dv];
//   h_pool [S, R, Hv, Dk, Dv], conv_pool [S, R, C, K] (aliased to results 2 and 3); slot, read_idx, q_len,
//   fresh [B] int32.
// A live row (q_len > 0, slot < S) starts from pool[slot, read_idx] (zero when fresh); after token t its
// h and conv window go to pool[slot, min(t, R - 1)] when t < R - 1 or t == q_len - 1. y [B, T, Hv Dv] is
// zero for t >= q_len and for rows that are not live.
// Items are (row, key head): the item owns its key head's conv channels and its r value heads' states.
#include <cmath>
#include <cstring>
#include <vector>

#include "common.h"
#include "gdn_step.h"
#include "tiles.h"

namespace {

using atlas::exp_vf;
using atlas::load;
using atlas::parallel_for;
using atlas::store;
using atlas::token_update;
using atlas::vf;
using atlas::VW;

struct Layer {
  const float *src, *z, *b, *a, *conv_w, *a_log, *dt_bias, *norm_w;
  const int32_t *slot, *read_idx, *q_len, *fresh;
  float *y, *h_pool, *conv_pool;
  int64_t B, T, Hk, Hv, Dk, Dv, C, K, S, R, W, Wz, Wg;
  bool grouped;
  float eps;
};

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }
inline float softplus(float x) { return std::max(x, 0.0f) + std::log1p(std::exp(-std::fabs(x))); }

// x[i] = silu(x[i]) * (gate ? gate[i] * scale[i] * mul : 1), vectorised (exp_vf: within 2 ulp of expf).
void silu_times(float* __restrict x, int64_t n, const float* gate = nullptr, const float* scale = nullptr,
                float mul = 1.0f) {
  int64_t i = 0;
  for (; i + VW <= n; i += VW) {
    const vf v = load(x + i);
    vf y = v / (1.0f + exp_vf(-v));
    if (gate) y *= load(gate + i) * load(scale + i) * mul;
    store(x + i, y);
  }
  for (; i < n; ++i) x[i] = silu(x[i]) * (gate ? gate[i] * scale[i] * mul : 1.0f);
}

// One token through a range of conv channels: each channel's window [KW] (oldest first) shifts by the token's
// input in[n]; x[n] = the window . cw[n] (before the SiLU). KW = 0: the width is k (run time).
template <int KW>
void conv_token(float* __restrict win, const float* in, const float* cw, float* __restrict x, int64_t len, int64_t k) {
  const int64_t K = KW ? KW : k;
  for (int64_t n = 0; n < len; ++n, win += K, cw += K) {
    float acc = 0.0f;
    for (int64_t m = 0; m + 1 < K; ++m) {
      win[m] = win[m + 1];
      acc += win[m] * cw[m];
    }
    win[K - 1] = in[n];
    x[n] = acc + in[n] * cw[K - 1];
  }
}

// Where key head kh's columns start in a token's row: q, k, v (src), z, and the b / a gates.
struct Offsets {
  int64_t q, k, v, z, b, a;
};

Offsets offsets(const Layer& p, int64_t kh) {
  const int64_t r = p.Hv / p.Hk;
  if (p.grouped) {
    const int64_t g = 2 * p.Dk + 2 * r * p.Dv;
    return {kh * g, kh * g + p.Dk, kh * g + 2 * p.Dk, kh * g + 2 * p.Dk + r * p.Dv, kh * 2 * r, kh * 2 * r + r};
  }
  return {kh * p.Dk, (p.Hk + kh) * p.Dk, 2 * p.Hk * p.Dk + kh * r * p.Dv, kh * r * p.Dv, kh * r, kh * r};
}

struct Scratch {
  std::vector<float> win, x, s, kv, o;
};

void run_item(const Layer& p, int64_t b, int64_t kh, Scratch& w) {
  const int64_t r = p.Hv / p.Hk, K = p.K, state = p.Dk * p.Dv;
  const int64_t q_len = std::min<int64_t>(p.q_len[b], p.T);
  const int64_t slot = p.slot[b];
  const bool live = q_len > 0 && slot >= 0 && slot < p.S;
  for (int64_t t = live ? q_len : 0; t < p.T; ++t)
    std::memset(p.y + ((b * p.T + t) * p.Hv + kh * r) * p.Dv, 0, r * p.Dv * sizeof(float));
  if (!live) return;
  // The item's channels, in local order q (Dk) | k (Dk) | v (r Dv): (first global channel, count) per range.
  const int64_t range_start[3] = {kh * p.Dk, (p.Hk + kh) * p.Dk, 2 * p.Hk * p.Dk + kh * r * p.Dv};
  const int64_t range_len[3] = {p.Dk, p.Dk, r * p.Dv};
  const int64_t nch = 2 * p.Dk + r * p.Dv;
  const Offsets off = offsets(p, kh);
  const int64_t src_start[3] = {off.q, off.k, off.v};
  w.win.resize(nch * K);
  w.x.resize(nch);
  w.s.resize(r * state);
  w.kv.resize(p.Dv);
  w.o.resize(p.Dv);
  const int64_t read = std::clamp<int64_t>(p.read_idx[b], 0, p.R - 1);
  auto conv_at = [&](int64_t pos, int64_t range) {
    return p.conv_pool + ((slot * p.R + pos) * p.C + range_start[range]) * K;
  };
  auto h_at = [&](int64_t pos, int64_t j) { return p.h_pool + ((slot * p.R + pos) * p.Hv + kh * r + j) * state; };
  float* win = w.win.data();
  for (int64_t i = 0, c = 0; i < 3; c += range_len[i], ++i) {
    if (p.fresh[b]) std::memset(win + c * K, 0, range_len[i] * K * sizeof(float));
    else std::memcpy(win + c * K, conv_at(read, i), range_len[i] * K * sizeof(float));
  }
  for (int64_t j = 0; j < r; ++j) {
    if (p.fresh[b]) std::memset(w.s.data() + j * state, 0, state * sizeof(float));
    else std::memcpy(w.s.data() + j * state, h_at(read, j), state * sizeof(float));
  }
  float* x = w.x.data();
  for (int64_t t = 0; t < q_len; ++t) {
    const int64_t bt = b * p.T + t;
    for (int64_t i = 0, c = 0; i < 3; c += range_len[i], ++i) {     // causal conv, then SiLU
      const float* in = p.src + bt * p.W + src_start[i];
      const float* cw = p.conv_w + range_start[i] * K;
      if (K == 4) conv_token<4>(win + c * K, in, cw, x + c, range_len[i], K);
      else conv_token<0>(win + c * K, in, cw, x + c, range_len[i], K);
    }
    silu_times(x, nch);
    float* q = x;
    float* k = x + p.Dk;
    float qq = 0.0f, kk = 0.0f;                    // l2 norms (fla's l2norm, eps 1e-6); q also * Dk^-0.5
    for (int64_t i = 0; i < p.Dk; ++i) qq += q[i] * q[i], kk += k[i] * k[i];
    const float qs = 1.0f / std::sqrt(qq + 1e-6f) / std::sqrt(float(p.Dk)), ks = 1.0f / std::sqrt(kk + 1e-6f);
    for (int64_t i = 0; i < p.Dk; ++i) q[i] *= qs, k[i] *= ks;
    for (int64_t j = 0; j < r; ++j) {
      const int64_t h = kh * r + j;
      const float g = -std::exp(p.a_log[h]) * softplus(p.a[bt * p.Wg + off.a + j] + p.dt_bias[h]);
      const float beta = 1.0f / (1.0f + std::exp(-p.b[bt * p.Wg + off.b + j]));
      float* o = w.o.data();
      token_update(w.s.data() + j * state, w.kv.data(), q, k, x + 2 * p.Dk + j * p.Dv, std::exp(g), beta, o, p.Dk,
                   p.Dv, true);
      float ss = 0.0f;                             // rmsnorm(o) * norm_w * silu(z)
      for (int64_t i = 0; i < p.Dv; ++i) ss += o[i] * o[i];
      float* y = p.y + (bt * p.Hv + h) * p.Dv;
      std::memcpy(y, p.z + bt * p.Wz + off.z + j * p.Dv, p.Dv * sizeof(float));
      silu_times(y, p.Dv, o, p.norm_w, 1.0f / std::sqrt(ss / float(p.Dv) + p.eps));
    }
    if (t < p.R - 1 || t == q_len - 1) {
      const int64_t pos = std::min<int64_t>(t, p.R - 1);
      for (int64_t i = 0, c = 0; i < 3; c += range_len[i], ++i)
        std::memcpy(conv_at(pos, i), win + c * K, range_len[i] * K * sizeof(float));
      for (int64_t j = 0; j < r; ++j) std::memcpy(h_at(pos, j), w.s.data() + j * state, state * sizeof(float));
    }
  }
}

ffi::Error GdnLayer(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> src, ffi::Buffer<ffi::F32> z,
                    ffi::Buffer<ffi::F32> b, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> conv_w,
                    ffi::Buffer<ffi::F32> a_log, ffi::Buffer<ffi::F32> dt_bias, ffi::Buffer<ffi::F32> norm_w,
                    ffi::Buffer<ffi::F32> h_pool, ffi::Buffer<ffi::F32> conv_pool, ffi::Buffer<ffi::S32> slot,
                    ffi::Buffer<ffi::S32> read_idx, ffi::Buffer<ffi::S32> q_len, ffi::Buffer<ffi::S32> fresh,
                    bool grouped, float eps, ffi::ResultBuffer<ffi::F32> y, ffi::ResultBuffer<ffi::F32> h_out,
                    ffi::ResultBuffer<ffi::F32> conv_out) {
  const auto sd = src.dimensions(), zd = z.dimensions(), gd = b.dimensions(), hd = h_pool.dimensions(),
             cd = conv_pool.dimensions();
  if (sd.size() != 3 || zd.size() != 3 || gd.size() != 3 || hd.size() != 5 || cd.size() != 4)
    return ffi::Error::InvalidArgument("atlas_gdn_layer: wrong ranks");
  Layer p;
  p.B = sd[0]; p.T = sd[1]; p.W = sd[2]; p.Wz = zd[2]; p.Wg = gd[2];
  p.S = hd[0]; p.R = hd[1]; p.Hv = hd[2]; p.Dk = hd[3]; p.Dv = hd[4]; p.C = cd[2]; p.K = cd[3];
  p.Hk = (p.C - p.Hv * p.Dv) / (2 * p.Dk);
  p.grouped = grouped;
  p.eps = eps;
  const int64_t r = p.Hk > 0 ? p.Hv / p.Hk : 0;
  const bool widths = grouped ? p.W == p.Hk * (2 * p.Dk + 2 * r * p.Dv) && p.Wz == p.W && p.Wg == p.Hk * 2 * r
                              : p.W == p.C && p.Wz == p.Hv * p.Dv && p.Wg == p.Hv;
  if (p.Hk <= 0 || p.Hv % p.Hk != 0 || 2 * p.Hk * p.Dk + p.Hv * p.Dv != p.C || !widths || zd[0] != p.B ||
      zd[1] != p.T || gd[0] != p.B || gd[1] != p.T || a.element_count() != b.element_count() || cd[0] != p.S ||
      cd[1] != p.R || conv_w.element_count() != p.C * p.K || a_log.element_count() != p.Hv ||
      dt_bias.element_count() != p.Hv || norm_w.element_count() != p.Dv || slot.element_count() != p.B ||
      read_idx.element_count() != p.B || q_len.element_count() != p.B || fresh.element_count() != p.B)
    return ffi::Error::InvalidArgument("atlas_gdn_layer: inconsistent shapes");
  if (h_out->typed_data() != h_pool.typed_data() || conv_out->typed_data() != conv_pool.typed_data())
    return ffi::Error::InvalidArgument("atlas_gdn_layer: the state pools must be aliased to their results");
  p.src = src.typed_data(); p.z = z.typed_data(); p.b = b.typed_data(); p.a = a.typed_data();
  p.conv_w = conv_w.typed_data(); p.a_log = a_log.typed_data(); p.dt_bias = dt_bias.typed_data();
  p.norm_w = norm_w.typed_data(); p.slot = slot.typed_data(); p.read_idx = read_idx.typed_data();
  p.q_len = q_len.typed_data(); p.fresh = fresh.typed_data();
  p.y = y->typed_data(); p.h_pool = h_out->typed_data(); p.conv_pool = conv_out->typed_data();
  parallel_for(pool, p.B * p.Hk, [&](int64_t i) {
    thread_local Scratch scratch;
    run_item(p, i / p.Hk, i % p.Hk, scratch);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AtlasGdnLayer, GdnLayer,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // src [B, T, W]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // z [B, T, Wz]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // b [B, T, Wg]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // a [B, T, Wg]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // conv_w [C, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // A_log [Hv]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // dt_bias [Hv]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // norm_w [Dv]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // h_pool [S, R, Hv, Dk, Dv]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // conv_pool [S, R, C, K]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // slot [B]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // read_idx [B]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // q_len [B]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // fresh [B]
                                  .Attr<bool>("grouped")
                                  .Attr<float>("eps")
                                  .Ret<ffi::Buffer<ffi::F32>>()   // y [B, T, Hv Dv]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // h_pool, in place
                                  .Ret<ffi::Buffer<ffi::F32>>()); // conv_pool, in place
