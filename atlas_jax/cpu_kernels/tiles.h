// Register tiles of the CPU GEMM kernels: R rows of activations times a packed weight panel, with the
// vector width and tile sizes of the instruction set the library is compiled for (-march=native).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common.h"

namespace atlas {

// Panel widths of the packed weights (PANEL_DN also of the dense linear kernel's panels).
constexpr int PANEL_UP = 32, PANEL_DN = 64;
#ifdef __AVX512F__
constexpr int VW = 16;                      // floats per vector register (32 registers)
constexpr int UP_ROWS = 6, UP_VECS = 2;     // 6 rows x 2 vectors x (gate, up) accumulators per pass
constexpr int DN_ROWS = 6, DN_VECS = 4;
#else
constexpr int VW = 8;                       // AVX2: 16 registers
constexpr int UP_ROWS = 6, UP_VECS = 1;     // 6 x 1 x 2 accumulators + 2 panel vectors: no spill of 16 registers
constexpr int DN_ROWS = 6, DN_VECS = 2;
#endif
static_assert(PANEL_UP % (VW * UP_VECS) == 0 && PANEL_DN % (VW * DN_VECS) == 0);

// Strips: a panel [K, W] is stored as W / SUB column strips [K, SUB], one after another, SUB = the columns
// one pass of a full tile covers (UP_SUB gate + UP_SUB up columns per row for the experts' gate_up panels). A
// pass then streams one contiguous strip (line by line: the hardware prefetcher's pattern) instead of a few
// bytes of every row of the whole panel. AVX-512: one strip per panel, the plain row-major panel.
constexpr int UP_SUB = VW * UP_VECS, DN_SUB = VW * DN_VECS;
typedef float vf __attribute__((vector_size(VW * 4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));

inline vf load(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

// exp(x) lane-wise, within 2 ulp of expf for x in [-87, 88] (clamped there: exp(-87) ~ 1.6e-38, exp(88) ~ 1.7e38):
// x = n ln2 + r (Cody-Waite, |r| <= ln2 / 2), exp(r) by Cephes' expf polynomial, 2^n into the exponent bits.
inline vf exp_vf(vf x) {
  const vf lo = vf{} - 87.0f, hi = vf{} + 88.0f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const vf t = x * 1.44269504f + 0.5f;
  vi n = __builtin_convertvector(t, vi);
  n += __builtin_convertvector(n, vf) > t;           // truncation -> floor (true lanes are -1)
  const vf nf = __builtin_convertvector(n, vf);
  const vf r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  vf p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  vi bits;
  std::memcpy(&bits, &p, sizeof p);
  bits += (n << 23);
  std::memcpy(&p, &bits, sizeof p);
  return p;
}

// Panels are consumed in chunks of KC rows (KC x 256 B = 32 KB of a 64-wide panel): every row tile of a
// block of up to ROW_BLOCK rows runs over a chunk (its partial sums kept in a 12 KB buffer) before the next
// chunk, so the chunk is read from DRAM once and re-read from L1 / L2, and a panel never has to fit in L2
// whole (K = 4096 makes 1 MB panels). Meanwhile the next chunk is prefetched into L2, spread over the
// chunk's k-iterations (Prefetch): DRAM streams under the FMAs instead of stalling the first tile.
constexpr int64_t KC = 128, ROW_BLOCK = 48;

// Lines a prefetching k-iteration issues when a chunk has fewer k-iterations than lines to fetch (one or two
// tiles of a few rows, one pass each: the memory-bound shapes, e.g. an expert's 2 pairs at 8 tokens).
constexpr int BURST = 4;

// Lines to prefetch, spread evenly over the k-iterations to come (Bresenham: `lines` credits per iteration,
// PF lines issued per `iterations * PF` credits). Even spacing keeps the line-fill buffers from filling up and
// stalling the FMA loop's own loads (measured: the same prefetches front-loaded into the first 2/3 of a chunk
// lost a third of the overlap of memory with compute).
struct Prefetch {
  const char* p = nullptr;
  const char* end = nullptr;      // end of the last segment
  const char* seg_end = nullptr;  // end of the segment p is in
  int64_t seg_bytes = 0, seg_stride = 0;
  int64_t lines = 0, iterations = 1, credit = 0;
  bool burst = false;     // BURST lines at a time (more lines than iterations), else one
  // `segments` ranges of seg_bytes, seg_stride bytes apart from next on, prefetched over `iterations`
  // k-iterations to come (a chunk of every strip of a panel: its rows [k0, k1) of each strip).
  Prefetch(const void* next, int64_t seg_bytes, int64_t seg_stride, int64_t segments, int64_t iterations)
      : p(static_cast<const char*>(next)), end(next ? p + (segments - 1) * seg_stride + seg_bytes : p),
        seg_end(p + seg_bytes), seg_bytes(seg_bytes), seg_stride(seg_stride),
        lines(std::max<int64_t>(1, segments * seg_bytes / 64)), iterations(std::max<int64_t>(1, iterations)) {
    burst = lines > this->iterations;
  }
  Prefetch() = default;   // nothing to prefetch
  bool active() const { return p < end; }
};

// The k-loop's side of a Prefetch, in registers: PF = 0 (nothing left to prefetch) compiles to nothing;
// PF = 1 or BURST (Prefetch::burst): the lines issued at a time.
template <int PF>
struct PrefetchCursor {
  Prefetch& pf;
  const char *p, *end, *seg_end;
  int64_t credit;
  const int64_t lines, cost;        // credits per iteration, credits per PF lines
  explicit PrefetchCursor(Prefetch& pf)
      : pf(pf), p(pf.p), end(pf.end), seg_end(pf.seg_end), credit(pf.credit), lines(pf.lines),
        cost(pf.iterations * PF) {}
  ~PrefetchCursor() { pf.p = p; pf.seg_end = seg_end; pf.credit = credit; }
  inline void step(int64_t) {
    if constexpr (PF > 0) {
      credit += lines;
      if (credit >= cost && p < end) {
        credit -= cost;
        for (int i = 0; i < PF; ++i) __builtin_prefetch(p + 64 * i, 0, 2);
        p += 64 * PF;
        if (p >= seg_end) {                       // on to the next strip's rows
          p = seg_end - pf.seg_bytes + pf.seg_stride;
          seg_end += pf.seg_stride;
        }
      }
    }
  }
};

// What to prefetch while chunk [k0, k1) of a panel [K, width] in strips of `sub` columns runs: the next chunk of
// every strip, or during the last one the first chunk of `next` (the panel that follows, or null). (Row-major
// panels ran faster with two chunks ahead; with strips one ahead is faster: MoE at 32 tokens 4.9 -> 4.4 ms.)
inline Prefetch chunk_prefetch(const float* panel, const float* next, int64_t K, int64_t k0, int64_t k1,
                               int64_t width, int64_t sub, int64_t iterations) {
  const int64_t strips = width / sub, stride = K * sub * 4;
  if (k1 < K) return Prefetch(panel + k1 * sub, std::min(KC, K - k1) * sub * 4, stride, strips, iterations);
  return Prefetch(next, std::min(KC, K) * sub * 4, stride, strips, iterations);
}

// Vectors a tile of `rows` rows covers per pass: narrow tiles (GEMV-like: decode) take wider passes, so a
// pass reads whole panel rows in order and keeps enough independent FMA chains in flight.
constexpr int dn_vecs(int rows) {
  return rows == 1 ? PANEL_DN / VW : rows == 2 ? std::min(4, PANEL_DN / VW) : DN_VECS;
}
constexpr int64_t dn_passes(int64_t rows) { return PANEL_DN / (VW * dn_vecs(static_cast<int>(rows))); }

// Pointers to row k0 of the strips [K, SUB] of a panel under the V vectors of pass `pass` of a tile (vector v
// covers columns (pass * V + v) * VW ...; a narrow tile's pass spans several strips).
template <int SUB, int V>
inline void strip_rows(const float* panel, int64_t K, int64_t k0, int pass, int64_t row_floats,
                       const float* (&w)[V]) {
  for (int v = 0; v < V; ++v) {
    const int c = (pass * V + v) * VW;
    w[v] = panel + (c / SUB) * K * row_floats + k0 * row_floats + c % SUB;
  }
}

// acc[r][0 : PANEL_DN] (+)= hr[r][k0 : k1] @ panel[k0 : k1, 0 : PANEL_DN] (a packed weight panel [K, PANEL_DN]
// in strips of DN_SUB columns); first: from zero.
template <int R, int PF>
void panel_tile(const float* const* hr, const float* panel, int64_t K, int64_t k0, int64_t k1, bool first,
                float (*acc_out)[PANEL_DN], Prefetch& prefetch) {
  constexpr int V = dn_vecs(R);
  PrefetchCursor<PF> pf(prefetch);
  for (int pass = 0; pass < PANEL_DN / (VW * V); ++pass) {
    const int off = pass * VW * V;
    vf acc[R][V];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) acc[r][v] = first ? vf{} : load(acc_out[r] + off + v * VW);
    const float* w[V];
    strip_rows<DN_SUB, V>(panel, K, k0, pass, DN_SUB, w);
    for (int64_t k = k0, i = 0; k < k1; ++k, i += DN_SUB) {
      pf.step(k);
      vf dv[V];
      for (int v = 0; v < V; ++v) dv[v] = load(w[v] + i);
      for (int r = 0; r < R; ++r) {
        const float b = hr[r][k];
        for (int v = 0; v < V; ++v) acc[r][v] += b * dv[v];
      }
    }
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) store(acc_out[r] + off + v * VW, acc[r][v]);
  }
}

// fn(std::integral_constant<int, R>) for the run-time row count rows in [1, ROWS].
template <int ROWS, typename Fn>
void with_rows(int rows, Fn&& fn) {
  static_assert(ROWS <= 6);
  switch (rows) {
    case 1: fn(std::integral_constant<int, 1>{}); break;
    case 2: if constexpr (ROWS >= 2) fn(std::integral_constant<int, 2>{}); break;
    case 3: if constexpr (ROWS >= 3) fn(std::integral_constant<int, 3>{}); break;
    case 4: if constexpr (ROWS >= 4) fn(std::integral_constant<int, 4>{}); break;
    case 5: if constexpr (ROWS >= 5) fn(std::integral_constant<int, 5>{}); break;
    case 6: if constexpr (ROWS >= 6) fn(std::integral_constant<int, 6>{}); break;
  }
}

// fn(std::integral_constant<int, PF>): a tile's PF argument (PrefetchCursor) for what pf has left to do.
template <typename Fn>
void with_prefetch(const Prefetch& pf, Fn&& fn) {
  if (!pf.active()) fn(std::integral_constant<int, 0>{});
  else if (pf.burst) fn(std::integral_constant<int, BURST>{});
  else fn(std::integral_constant<int, 1>{});
}

// The traversal of one panel [K, width] that the GEMM kernels share: rows [r_begin, r_end) in blocks of
// ROW_BLOCK, each block over the panel chunk by chunk (KC rows), every tile of up to TILE rows per chunk.
// The panel is stored in strips of `sub` floats per row (see UP_SUB).
// tile(r0, i, rows, k0, k1, pf) runs rows [r0, r0 + rows) (i = r0's index in its block) over chunk [k0, k1)
// while pf prefetches; block_done(b0, b1) follows a block's last chunk. passes(rows): the k-loops a tile of
// that many rows makes over a chunk (the prefetch is spread over them). next: the panel the caller runs
// after this one (its first chunk is prefetched during the last chunk here), or null.
// A block of one single-pass tile (a GEMV: decode) reads the panel front to back once; the hardware
// prefetcher streams that alone, and software prefetches only compete with it (measured on Zen 3: MoE
// experts at one token 1.01 -> 0.75 ms, batch-1 decode +15%), so such blocks prefetch nothing.
template <int TILE, typename Passes, typename Tile, typename Done>
void chunked_rows(int64_t r_begin, int64_t r_end, const float* panel, const float* next, int64_t K, int64_t width,
                  int64_t sub, Passes&& passes, Tile&& tile, Done&& block_done) {
  for (int64_t b0 = r_begin; b0 < r_end; b0 += ROW_BLOCK) {
    const int64_t b1 = std::min(r_end, b0 + ROW_BLOCK), rows = b1 - b0;
    const int64_t loops = rows / TILE * passes(TILE) + (rows % TILE ? passes(rows % TILE) : 0);
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
      const int64_t k1 = std::min(K, k0 + KC);
      Prefetch pf = loops == 1 ? Prefetch()
                                : chunk_prefetch(panel, b1 < r_end ? nullptr : next, K, k0, k1, width, sub,
                                                 loops * (k1 - k0));
      for (int64_t r0 = b0; r0 < b1; r0 += TILE)
        tile(r0, r0 - b0, static_cast<int>(std::min<int64_t>(TILE, b1 - r0)), k0, k1, pf);
    }
    block_done(b0, b1);
  }
}

// Rows a[r * K : (r + 1) * K] for r in [r_begin, r_end) times one panel [K, PANEL_DN] (strips of DN_SUB),
// DN_ROWS rows a tile, chunk by chunk (chunked_rows); emit(r, out_row) receives each row's PANEL_DN results.
// next: as chunked_rows.
template <typename Emit>
void panel_rows(const float* a, int64_t K, int64_t r_begin, int64_t r_end, const float* panel, Emit&& emit,
                const float* next = nullptr) {
  alignas(64) float out[ROW_BLOCK][PANEL_DN];
  chunked_rows<DN_ROWS>(r_begin, r_end, panel, next, K, PANEL_DN, DN_SUB, dn_passes,
      [&](int64_t r0, int64_t i, int rows, int64_t k0, int64_t k1, Prefetch& pf) {
        const float* ar[DN_ROWS];
        for (int r = 0; r < rows; ++r) ar[r] = a + (r0 + r) * K;
        with_rows<DN_ROWS>(rows, [&](auto R) {
          with_prefetch(pf, [&](auto lines) { panel_tile<R(), lines()>(ar, panel, K, k0, k1, k0 == 0, out + i, pf); });
        });
      },
      [&](int64_t b0, int64_t b1) { for (int64_t r = b0; r < b1; ++r) emit(r, out[r - b0]); });
}

}  // namespace atlas
