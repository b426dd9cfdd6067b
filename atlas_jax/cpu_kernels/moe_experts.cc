// Routed MoE experts on the CPU, as one XLA FFI custom call (atlas_moe_experts), over packed weights.
//
// y[n] = sum over the pairs p of token n: weight[p] * down_e(act(x[n] @ gate_e, x[n] @ up_e)), e = p's expert.
// Pairs arrive sorted by expert (`token` [P] = source row of each pair, `weight` [P], `sizes` [E] = run
// lengths). Every expert's weights are read in place from the resident packed tensors (layout below):
// no gather, no copy, and only experts with pairs are read (decode reads its k experts).
//   phase 1: hidden[p, :] = act(x[token[p]] @ gate_e, x[token[p]] @ up_e)   items: (expert, run of panels)
//   phase 2: y[:, c] = sum_p weight[p] * hidden[p] @ down_e[:, c]          items: output panels of y
// Packed weights (moe.pack_experts): panels of PANEL_UP hidden columns and panels of PANEL_DN output columns,
// each in strips (tiles.h: UP_SUB, DN_SUB), gate and up side by side per strip row; zero-padded to whole
// panels, so no tile has a column tail:
//   gate_up [E, Fp / PANEL_UP, PANEL_UP / UP_SUB, H, 2 * UP_SUB] (SwiGLU: gate | up) or [.., H, UP_SUB] (relu2: up)
//   down    [E, Hp / PANEL_DN, PANEL_DN / DN_SUB, Fp, DN_SUB]
// Each panel is consumed chunk by chunk by all of an expert's row tiles (tiles.h: chunked_rows), the next chunk
// prefetched meanwhile. Items of a phase write disjoint memory, so they run in parallel without locks (common.h: parallel_for).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "tiles.h"

namespace {

using namespace atlas;

constexpr int64_t UP_RUN = 16;

inline vf activate(bool glu, vf g, vf u) {
  if (glu) return g / (1.0f + exp_vf(-g)) * u;        // silu(gate) * up
  const vf r = u > 0.0f ? u : vf{};                   // relu(up)^2
  return r * r;
}

// Vectors per pass for a tile of `rows` rows: narrow tiles (decode) take wider passes (see tiles.h dn_vecs).
constexpr int up_vecs(int rows) {
  return rows == 1 ? PANEL_UP / VW : rows == 2 ? std::min(2, PANEL_UP / VW) : UP_VECS;
}
constexpr int64_t up_passes(int64_t rows) { return PANEL_UP / (VW * up_vecs(static_cast<int>(rows))); }

// Over panel rows [h0, h1) of a panel [H, PANEL_UP] in strips of UP_SUB columns (tiles.h; GLU: a strip row is
// UP_SUB gate | UP_SUB up): ag[r], au[r] (+)= xr[r] @ gate / up panel columns (first: from zero);
// last: hr[r][0 : PANEL_UP] = act(ag[r], au[r]) instead of storing the sums.
template <int R, bool GLU, int PF>
void up_tile(const float* const* xr, const float* panel, int64_t H, int64_t h0, int64_t h1, bool first, bool last,
             float (*ag_out)[PANEL_UP], float (*au_out)[PANEL_UP], float* const* hr, Prefetch& prefetch) {
  constexpr int V = up_vecs(R);
  constexpr int row = GLU ? 2 * UP_SUB : UP_SUB;      // floats per strip row
  PrefetchCursor<PF> pf(prefetch);
  for (int pass = 0; pass < PANEL_UP / (VW * V); ++pass) {
    const int off = pass * VW * V;
    vf ag[R][V], au[R][V];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) {
        ag[r][v] = first || !GLU ? vf{} : load(ag_out[r] + off + v * VW);
        au[r][v] = first ? vf{} : load(au_out[r] + off + v * VW);
      }
    const float* w[V];
    strip_rows<UP_SUB, V>(panel, H, h0, pass, row, w);
    for (int64_t h = h0, i = 0; h < h1; ++h, i += row) {
      pf.step(h);
      vf gv[V], uv[V];
      for (int v = 0; v < V; ++v) {
        if (GLU) gv[v] = load(w[v] + i);
        uv[v] = load(w[v] + i + (GLU ? UP_SUB : 0));
      }
      for (int r = 0; r < R; ++r) {
        const float b = xr[r][h];
        for (int v = 0; v < V; ++v) {
          if (GLU) ag[r][v] += b * gv[v];
          au[r][v] += b * uv[v];
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) {
        if (last) {
          store(hr[r] + off + v * VW, activate(GLU, ag[r][v], au[r][v]));
        } else {
          if (GLU) store(ag_out[r] + off + v * VW, ag[r][v]);
          store(au_out[r] + off + v * VW, au[r][v]);
        }
      }
  }
}

struct Problem {
  const float *x, *weight, *gate_up, *down;
  const int32_t* token;
  std::vector<int64_t> start, size;   // per expert: first sorted pair, pair count
  int64_t H, Fp, Hp, E;
  bool glu;
  float *hidden, *y;
};

// hidden[pairs of e, PANEL_UP * j : + PANEL_UP], chunk by chunk (tiles.h: chunked_rows), prefetching the first
// chunk of panel j + 1 during the last chunk when `prefetch`.
void up_panel(const Problem& p, int64_t e, int64_t j, bool prefetch) {
  const int64_t width = (p.glu ? 2 : 1) * PANEL_UP, panel_size = p.H * width;
  const float* panel = p.gate_up + (e * (p.Fp / PANEL_UP) + j) * panel_size;
  alignas(64) float ag[ROW_BLOCK][PANEL_UP], au[ROW_BLOCK][PANEL_UP];
  chunked_rows<UP_ROWS>(p.start[e], p.start[e] + p.size[e], panel, prefetch ? panel + panel_size : nullptr, p.H,
      width, width / (PANEL_UP / UP_SUB), up_passes,
      [&](int64_t r0, int64_t i, int rows, int64_t h0, int64_t h1, Prefetch& pf) {
        const float* xr[UP_ROWS];
        float* hr[UP_ROWS];
        for (int r = 0; r < rows; ++r) {
          xr[r] = p.x + static_cast<int64_t>(p.token[r0 + r]) * p.H;
          hr[r] = p.hidden + (r0 + r) * p.Fp + j * PANEL_UP;
        }
        with_rows<UP_ROWS>(rows, [&](auto R) {
          with_prefetch(pf, [&](auto lines) {
            if (p.glu) up_tile<R(), true, lines()>(xr, panel, p.H, h0, h1, h0 == 0, h1 == p.H, ag + i, au + i, hr, pf);
            else up_tile<R(), false, lines()>(xr, panel, p.H, h0, h1, h0 == 0, h1 == p.H, ag + i, au + i, hr, pf);
          });
        });
      },
      [](int64_t, int64_t) {});
}

// Phase 2 item: y[:, PANEL_DN * c : + PANEL_DN] (columns < H) over the used experts' pairs, each expert's
// panel prefetched during the one before.
void down_panel(const Problem& p, const std::vector<int64_t>& used, int64_t c, int64_t num_tokens) {
  const int64_t c0 = c * PANEL_DN, width = std::min<int64_t>(PANEL_DN, p.H - c0);
  for (int64_t n = 0; n < num_tokens; ++n) std::memset(p.y + n * p.H + c0, 0, width * sizeof(float));
  auto panel = [&](int64_t e) { return p.down + (e * (p.Hp / PANEL_DN) + c) * p.Fp * PANEL_DN; };
  for (size_t i = 0; i < used.size(); ++i) {
    const int64_t e = used[i];
    panel_rows(p.hidden, p.Fp, p.start[e], p.start[e] + p.size[e], panel(e), [&](int64_t pair, const float* out) {
      float* yr = p.y + static_cast<int64_t>(p.token[pair]) * p.H + c0;
      const float w = p.weight[pair];
      for (int64_t i = 0; i < width; ++i) yr[i] += w * out[i];
    }, i + 1 < used.size() ? panel(used[i + 1]) : nullptr);
  }
}

ffi::Error MoeExperts(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> token,
                      ffi::Buffer<ffi::F32> weight, ffi::Buffer<ffi::S32> sizes, ffi::Buffer<ffi::F32> gate_up,
                      ffi::Buffer<ffi::F32> down, ffi::ResultBuffer<ffi::F32> y,
                      ffi::ResultBuffer<ffi::F32> hidden) {
  const auto gd = gate_up.dimensions(), dd = down.dimensions();
  if (gd.size() != 5 || dd.size() != 5)
    return ffi::Error::InvalidArgument("atlas_moe_experts: gate_up / down are not packed panels (rank 5)");
  Problem p;
  p.E = gd[0]; p.H = x.dimensions()[1]; p.Fp = gd[1] * PANEL_UP; p.Hp = dd[1] * PANEL_DN;
  p.glu = gd[4] == 2 * UP_SUB;
  const int64_t num_tokens = x.dimensions()[0];
  const int64_t pairs = token.dimensions()[0];
  if (gd[2] != PANEL_UP / UP_SUB || gd[3] != p.H || (gd[4] != UP_SUB && !p.glu) || dd[0] != p.E ||
      dd[2] != PANEL_DN / DN_SUB || dd[3] != p.Fp || dd[4] != DN_SUB || p.Hp < p.H || p.Hp - p.H >= PANEL_DN ||
      sizes.dimensions()[0] != p.E || weight.dimensions()[0] != pairs || hidden->dimensions()[0] != pairs ||
      hidden->dimensions()[1] != p.Fp)
    return ffi::Error::InvalidArgument("atlas_moe_experts: shapes do not match the packed layout");
  p.x = x.typed_data(); p.weight = weight.typed_data(); p.gate_up = gate_up.typed_data();
  p.down = down.typed_data(); p.token = token.typed_data();
  p.hidden = hidden->typed_data(); p.y = y->typed_data();
  p.start.resize(p.E); p.size.resize(p.E);
  int64_t total = 0;
  for (int64_t e = 0; e < p.E; ++e) {
    p.start[e] = total;
    p.size[e] = std::max<int32_t>(sizes.typed_data()[e], 0);
    total += p.size[e];
  }
  if (total > pairs) return ffi::Error::InvalidArgument("atlas_moe_experts: sizes exceed the pairs");
  for (int64_t i = 0; i < total; ++i)
    if (p.token[i] < 0 || p.token[i] >= num_tokens)
      return ffi::Error::InvalidArgument("atlas_moe_experts: token index out of range");

  std::vector<int64_t> used;
  for (int64_t e = 0; e < p.E; ++e) if (p.size[e] > 0) used.push_back(e);
  // phase 1 items: runs of consecutive panels of one expert, each panel prefetched during the one before
  const int64_t up_panels = p.Fp / PANEL_UP, run = std::min<int64_t>(UP_RUN, up_panels);
  const int64_t runs = (up_panels + run - 1) / run;
  parallel_for(pool, static_cast<int64_t>(used.size()) * runs, [&](int64_t i) {
    const int64_t j0 = (i % runs) * run, j1 = std::min(up_panels, j0 + run);
    for (int64_t j = j0; j < j1; ++j) up_panel(p, used[i / runs], j, j + 1 < j1);
  });
  parallel_for(pool, p.Hp / PANEL_DN, [&](int64_t c) { down_panel(p, used, c, num_tokens); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AtlasMoeExperts, MoeExperts,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [N, H]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // token [P]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // weight [P]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // sizes [E]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // gate_up, packed
                                  .Arg<ffi::Buffer<ffi::F32>>()   // down, packed
                                  .Ret<ffi::Buffer<ffi::F32>>()   // y [N, H]
                                  .Ret<ffi::Buffer<ffi::F32>>()); // hidden [P, Fp] (scratch)
