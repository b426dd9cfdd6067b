// The gated linear recurrence of GDN (delta rule) and Mamba2 (without), token by token, reading and
// writing each row's state in place in the pool (atlas_gdn_recurrent). The contract is
// pallas_kernels/gdn.py's gdn_recurrent (and its jnp `reference`):
//   q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv]; h_pool [S, R, Hv, Dk, Dv] (aliased to
//   the second result); slot, read_idx, q_len, fresh [B] int32.
//   A row is live when q_len > 0 and slot < S. Its state starts at pool[slot, read_idx] (zero when fresh);
//   per token t < q_len, value head h (key head h / (Hv / Hk)):
//     S = S exp(g);  delta = beta (v - S^T k)  [v without the delta rule];  S += k delta^T;  o = S^T q
//   and S is written to pool[slot, min(t, R - 1)] when t < R - 1 or t == q_len - 1. o = 0 for t >= q_len.
// Items are (row, value head): each reads its [Dk, Dv] state once, keeps it in L1 over the T tokens, and
// writes only its own slices, so items run in parallel; rows of a step hold distinct slots.
#include <cmath>
#include <cstring>
#include <vector>

#include "common.h"
#include "gdn_step.h"

namespace {

using atlas::parallel_for;
using atlas::token_update;

struct Recurrence {
  const float *q, *k, *v, *g, *beta;
  const int32_t *slot, *read_idx, *q_len, *fresh;
  float *o, *pool;
  int64_t B, T, Hk, Hv, Dk, Dv, S, R;
  bool delta_rule;
};

void run_item(const Recurrence& p, int64_t b, int64_t h, float* __restrict s, float* __restrict kv) {
  const int64_t state = p.Dk * p.Dv;
  const int64_t q_len = std::min<int64_t>(p.q_len[b], p.T);
  const int64_t slot = p.slot[b];
  const bool live = q_len > 0 && slot >= 0 && slot < p.S;
  float* o = p.o + (b * p.T * p.Hv + h) * p.Dv;            // o[b, t, h] = o + t * Hv * Dv
  for (int64_t t = q_len; t < p.T; ++t) std::memset(o + t * p.Hv * p.Dv, 0, p.Dv * sizeof(float));
  if (!live) {
    for (int64_t t = 0; t < q_len; ++t) std::memset(o + t * p.Hv * p.Dv, 0, p.Dv * sizeof(float));
    return;
  }
  const int64_t read = std::clamp<int64_t>(p.read_idx[b], 0, p.R - 1);
  if (p.fresh[b]) std::memset(s, 0, state * sizeof(float));
  else std::memcpy(s, p.pool + ((slot * p.R + read) * p.Hv + h) * state, state * sizeof(float));
  const int64_t kh = h / (p.Hv / p.Hk);
  for (int64_t t = 0; t < q_len; ++t) {
    const float* qt = p.q + ((b * p.T + t) * p.Hk + kh) * p.Dk;
    const float* kt = p.k + ((b * p.T + t) * p.Hk + kh) * p.Dk;
    const float* vt = p.v + ((b * p.T + t) * p.Hv + h) * p.Dv;
    const int64_t gi = (b * p.T + t) * p.Hv + h;
    token_update(s, kv, qt, kt, vt, std::exp(p.g[gi]), p.beta[gi], o + t * p.Hv * p.Dv, p.Dk, p.Dv, p.delta_rule);
    if (t < p.R - 1 || t == q_len - 1) {
      const int64_t pos = std::min<int64_t>(t, p.R - 1);
      std::memcpy(p.pool + ((slot * p.R + pos) * p.Hv + h) * state, s, state * sizeof(float));
    }
  }
}

ffi::Error GdnRecurrent(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                        ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> beta,
                        ffi::Buffer<ffi::F32> h_pool, ffi::Buffer<ffi::S32> slot, ffi::Buffer<ffi::S32> read_idx,
                        ffi::Buffer<ffi::S32> q_len, ffi::Buffer<ffi::S32> fresh, bool delta_rule,
                        ffi::ResultBuffer<ffi::F32> o, ffi::ResultBuffer<ffi::F32> h_out) {
  const auto qd = q.dimensions(), vd = v.dimensions(), hd = h_pool.dimensions();
  Recurrence p;
  p.B = qd[0]; p.T = qd[1]; p.Hk = qd[2]; p.Dk = qd[3]; p.Hv = vd[2]; p.Dv = vd[3]; p.S = hd[0]; p.R = hd[1];
  if (qd.size() != 4 || vd.size() != 4 || hd.size() != 5 || k.element_count() != q.element_count() || vd[0] != p.B ||
      vd[1] != p.T || p.Hv % p.Hk != 0 || hd[2] != p.Hv || hd[3] != p.Dk || hd[4] != p.Dv ||
      g.element_count() != p.B * p.T * p.Hv || beta.element_count() != p.B * p.T * p.Hv ||
      slot.element_count() != p.B || read_idx.element_count() != p.B || q_len.element_count() != p.B ||
      fresh.element_count() != p.B)
    return ffi::Error::InvalidArgument("atlas_gdn_recurrent: inconsistent shapes");
  if (h_out->typed_data() != h_pool.typed_data())
    return ffi::Error::InvalidArgument("atlas_gdn_recurrent: the state pool must be aliased to its result");
  p.q = q.typed_data(); p.k = k.typed_data(); p.v = v.typed_data(); p.g = g.typed_data();
  p.beta = beta.typed_data(); p.slot = slot.typed_data(); p.read_idx = read_idx.typed_data();
  p.q_len = q_len.typed_data(); p.fresh = fresh.typed_data(); p.o = o->typed_data(); p.pool = h_out->typed_data();
  p.delta_rule = delta_rule;
  parallel_for(pool, p.B * p.Hv, [&](int64_t i) {
    thread_local std::vector<float> s, kv;
    s.resize(p.Dk * p.Dv);
    kv.resize(p.Dv);
    run_item(p, i / p.Hv, i % p.Hv, s.data(), kv.data());
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AtlasGdnRecurrent, GdnRecurrent,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q [B, T, Hk, Dk]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k [B, T, Hk, Dk]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v [B, T, Hv, Dv]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // g [B, T, Hv]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // beta [B, T, Hv]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // h_pool [S, R, Hv, Dk, Dv]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // slot [B]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // read_idx [B]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // q_len [B]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // fresh [B]
                                  .Attr<bool>("delta_rule")
                                  .Ret<ffi::Buffer<ffi::F32>>()   // o [B, T, Hv, Dv]
                                  .Ret<ffi::Buffer<ffi::F32>>()); // h_pool, in place
