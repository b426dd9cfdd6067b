// Grouped-query attention of a few query tokens per row over the paged KV cache, reading K / V in place
// from the pages (atlas_paged_attention): decode and verify steps. The contract is layers/attention.py's
// paged_attention without soft-cap or window (and pallas_kernels/paged_attention.py's):
//   q [B, T, H, D]; k_pages, v_pages [P, S, Hkv, D]; block_table [B, MP]; start, q_len [B] int32.
//   Query t < q_len of row b sits at position start + t and attends to KV positions 0 .. start + t, the
//   position's page being block_table[b, pos / S]; o[b, t] = softmax(scale q k^T) v, o = 0 for t >= q_len.
// Items are (row, KV head): each walks its row's positions once, a block at a time, for all G = H / Hkv
// query heads x T tokens sharing that KV head (online softmax), so each K / V vector is read once. XLA's
// form gathers every block of pages into a copy first (a [B, 256, Hkv, D] block per row and step).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "tiles.h"

namespace {

using namespace atlas;

constexpr int64_t BLOCK = 64;            // KV positions per online-softmax block

struct Attention {
  const float *q, *k, *v;
  const int32_t *table, *start, *q_len;
  float* o;
  int64_t B, T, H, D, P, S, Hkv, MP;
  float scale;
};

inline float dot(const float* a, const float* b, int64_t n) {
  vf acc{};
  int64_t i = 0;
  for (; i + VW <= n; i += VW) acc += load(a + i) * load(b + i);
  float s = 0.0f;
  for (int j = 0; j < VW; ++j) s += acc[j];
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float* __restrict y, float a, const float* __restrict x, int64_t n) {
  int64_t i = 0;
  const vf av = vf{} + a;
  for (; i + VW <= n; i += VW) store(y + i, load(y + i) + av * load(x + i));
  for (; i < n; ++i) y[i] += a * x[i];
}

// scratch: Q rows of [D] accumulators, then m, l [Q], then scores [Q, BLOCK]
void run_item(const Attention& p, int64_t b, int64_t kvh, std::vector<float>& scratch) {
  const int64_t G = p.H / p.Hkv, Q = G * p.T, D = p.D;
  const int64_t q_len = std::clamp<int64_t>(p.q_len[b], 0, p.T);
  float* out = p.o + b * p.T * p.H * D;                       // o[b, t, h] = out + (t * H + h) * D
  for (int64_t t = 0; t < p.T; ++t)
    for (int64_t g = 0; g < G; ++g) std::memset(out + (t * p.H + kvh * G + g) * D, 0, D * sizeof(float));
  if (q_len == 0) return;
  const int64_t start = std::max<int64_t>(p.start[b], 0);
  const int64_t end = std::min(start + q_len, p.MP * p.S);     // positions [0, end) exist
  scratch.resize(Q * D + 2 * Q + Q * BLOCK);
  float *acc = scratch.data(), *m = acc + Q * D, *l = m + Q, *s = l + Q;
  std::fill(acc, acc + Q * D, 0.0f);
  std::fill(m, m + Q, -INFINITY);
  std::fill(l, l + Q, 0.0f);
  const int32_t* table = p.table + b * p.MP;
  const float* kv_at[BLOCK];
  const float* vv_at[BLOCK];
  for (int64_t j0 = 0; j0 < end; j0 += BLOCK) {
    const int64_t n = std::min(BLOCK, end - j0);
    int64_t live = 0;                                          // positions of the block on a valid page
    int64_t pos[BLOCK];
    for (int64_t j = 0; j < n; ++j) {
      const int64_t page = table[(j0 + j) / p.S];
      if (page < 0 || page >= p.P) continue;                   // an unfilled table entry: nothing there
      const int64_t off = ((page * p.S + (j0 + j) % p.S) * p.Hkv + kvh) * D;
      kv_at[live] = p.k + off;
      vv_at[live] = p.v + off;
      pos[live++] = j0 + j;
    }
    for (int64_t t = 0; t < q_len; ++t) {
      const int64_t limit = start + t;                          // the query's own position
      for (int64_t g = 0; g < G; ++g) {
        const int64_t qi = t * G + g;
        const float* qv = p.q + ((b * p.T + t) * p.H + kvh * G + g) * D;
        float* sq = s + qi * BLOCK;
        float top = m[qi];
        for (int64_t j = 0; j < live; ++j) {
          sq[j] = pos[j] <= limit ? p.scale * dot(qv, kv_at[j], D) : -INFINITY;
          top = std::max(top, sq[j]);
        }
        if (top == -INFINITY) continue;                          // nothing visible yet
        const float corr = std::exp(m[qi] - top);
        float sum = 0.0f;
        for (int64_t j = 0; j < live; ++j) sum += (sq[j] = std::exp(sq[j] - top));
        l[qi] = l[qi] * corr + sum;
        m[qi] = top;
        float* a = acc + qi * D;
        if (corr != 1.0f) for (int64_t d = 0; d < D; ++d) a[d] *= corr;
      }
    }
    for (int64_t j = 0; j < live; ++j)                          // acc += p v, each V vector read once
      for (int64_t qi = 0; qi < q_len * G; ++qi)
        if (s[qi * BLOCK + j] != 0.0f && m[qi] != -INFINITY) axpy(acc + qi * D, s[qi * BLOCK + j], vv_at[j], D);
  }
  for (int64_t t = 0; t < q_len; ++t)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t qi = t * G + g;
      if (l[qi] <= 0.0f) continue;
      const float inv = 1.0f / l[qi];
      float* dst = out + (t * p.H + kvh * G + g) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = acc[qi * D + d] * inv;
    }
}

template <typename A, typename B>
bool same_dims(const A& a, const B& b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
}

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pages,
                          ffi::Buffer<ffi::F32> v_pages, ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> start,
                          ffi::Buffer<ffi::S32> q_len, float scale, ffi::ResultBuffer<ffi::F32> o) {
  const auto qd = q.dimensions(), kd = k_pages.dimensions(), td = table.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || td.size() != 2 || !same_dims(v_pages.dimensions(), kd) || kd[3] != qd[3] ||
      kd[2] == 0 || qd[2] % kd[2] != 0 || td[0] != qd[0] || start.element_count() != qd[0] ||
      q_len.element_count() != qd[0] || !same_dims(o->dimensions(), qd))
    return ffi::Error::InvalidArgument("atlas_paged_attention: inconsistent shapes");
  Attention p;
  p.B = qd[0]; p.T = qd[1]; p.H = qd[2]; p.D = qd[3]; p.P = kd[0]; p.S = kd[1]; p.Hkv = kd[2]; p.MP = td[1];
  p.q = q.typed_data(); p.k = k_pages.typed_data(); p.v = v_pages.typed_data(); p.table = table.typed_data();
  p.start = start.typed_data(); p.q_len = q_len.typed_data(); p.o = o->typed_data(); p.scale = scale;
  parallel_for(pool, p.B * p.Hkv, [&](int64_t i) {
    thread_local std::vector<float> scratch;
    run_item(p, i / p.Hkv, i % p.Hkv, scratch);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AtlasPagedAttention, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q [B, T, H, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k_pages [P, S, Hkv, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v_pages [P, S, Hkv, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // block_table [B, MP]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // start [B]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // q_len [B]
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>()); // o [B, T, H, D]
