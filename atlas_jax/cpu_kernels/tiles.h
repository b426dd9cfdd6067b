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
constexpr int UP_ROWS = 3, UP_VECS = 2;
constexpr int DN_ROWS = 6, DN_VECS = 2;
#endif
static_assert(PANEL_UP % (VW * UP_VECS) == 0 && PANEL_DN % (VW * DN_VECS) == 0);
typedef float vf __attribute__((vector_size(VW * 4)));

inline vf load(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

// A software prefetch of the next panel spread over the current panel's k-loops: one cache line every
// (mask + 1) iterations into L2, so that panel's DRAM stream overlaps this one's compute (a tile that
// streams its panel from DRAM runs at the core's share of DRAM bandwidth, well below FMA speed).
// Only for panels that few rows re-read: with many row tiles the first tile's stream is amortised, and a
// second panel in L2 would evict the one being re-read.
constexpr int64_t PREFETCH_MIN_ROWS = 2, PREFETCH_MAX_ROWS = 48;
inline bool prefetches(int64_t rows) { return rows >= PREFETCH_MIN_ROWS && rows <= PREFETCH_MAX_ROWS; }
struct Prefetch {
  const char* p = nullptr;
  const char* end = nullptr;
  int64_t mask = 0;
  // next [bytes] prefetched over `iterations` k-iterations to come.
  Prefetch() = default;
  Prefetch(const void* next, int64_t bytes, int64_t iterations)
      : p(static_cast<const char*>(next)), end(p + bytes) {
    const int64_t every = std::max<int64_t>(1, iterations / std::max<int64_t>(1, bytes / 64));
    while ((mask + 1) * 2 <= every) mask = mask * 2 + 1;
  }
  bool active() const { return p < end; }
};

// The k-loop's side of a Prefetch, in registers: PF = false compiles to nothing.
template <bool PF>
struct PrefetchCursor {
  const char *p, *end;
  int64_t mask;
  explicit PrefetchCursor(const Prefetch& pf) : p(pf.p), end(pf.end), mask(pf.mask) {}
  inline void step(int64_t k) {
    if constexpr (PF) {
      if ((k & mask) == 0 && p < end) {
        __builtin_prefetch(p, 0, 2);
        p += 64;
      }
    }
  }
};

// out[r][0 : PANEL_DN] = hr[r][0 : K] @ panel [K, PANEL_DN] (a packed weight panel, rows contiguous).
template <int R, bool PF>
void panel_tile(const float* const* hr, const float* panel, int64_t K, float (*out)[PANEL_DN], Prefetch& prefetch) {
  PrefetchCursor<PF> pf(prefetch);
  for (int pass = 0; pass < PANEL_DN / (VW * DN_VECS); ++pass) {
    const int off = pass * VW * DN_VECS;
    vf acc[R][DN_VECS] = {};
    const float* w = panel + off;
    for (int64_t k = 0; k < K; ++k, w += PANEL_DN) {
      pf.step(k);
      vf dv[DN_VECS];
      for (int v = 0; v < DN_VECS; ++v) dv[v] = load(w + v * VW);
      for (int r = 0; r < R; ++r) {
        const float b = hr[r][k];
        for (int v = 0; v < DN_VECS; ++v) acc[r][v] += b * dv[v];
      }
    }
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < DN_VECS; ++v) store(out[r] + off + v * VW, acc[r][v]);
  }
  prefetch.p = pf.p;
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

// Rows a[r * K : (r + 1) * K] for r in [r_begin, r_end) times one panel [K, PANEL_DN], DN_ROWS rows a tile;
// emit(r, out_row) receives each row's PANEL_DN results. next: the panel to prefetch meanwhile (or null).
template <typename Emit>
void panel_rows(const float* a, int64_t K, int64_t r_begin, int64_t r_end, const float* panel, Emit&& emit,
                const float* next = nullptr) {
  const int64_t tiles = (r_end - r_begin + DN_ROWS - 1) / DN_ROWS;
  Prefetch pf(next, next && prefetches(r_end - r_begin) ? K * PANEL_DN * 4 : 0,
              tiles * (PANEL_DN / (VW * DN_VECS)) * K);
  for (int64_t r0 = r_begin; r0 < r_end; r0 += DN_ROWS) {
    const int rows = static_cast<int>(std::min<int64_t>(DN_ROWS, r_end - r0));
    const float* ar[DN_ROWS];
    for (int r = 0; r < rows; ++r) ar[r] = a + (r0 + r) * K;
    alignas(64) float out[DN_ROWS][PANEL_DN];
    with_rows<DN_ROWS>(rows, [&](auto R) { 
      if (pf.active()) panel_tile<R(), true>(ar, panel, K, out, pf);
      else panel_tile<R(), false>(ar, panel, K, out, pf);
    });
    for (int r = 0; r < rows; ++r) emit(r0 + r, out[r]);
  }
}

}  // namespace atlas
