"""Ragged paged attention as `pallas_call`s lowered through Triton on GPU (interpreted on CPU).

Contract = `atlas_jax.layers.attention.paged_attention` (the pure-jnp reference): a padded-dense
segment of B rows, row b holding q_len[b] new query tokens at positions start[b].., attending to
its pages [0, start + q_len) through block_table, causally inside its own new tokens; optional
logit soft-cap (cap * tanh(s / cap)) and sliding window (a query at p sees p - window + 1 .. p).
GQA: the G = H / Hkv query heads of KV head h are q heads h*G .. h*G+G-1, and one program serves
all G of them, so each KV page is read once per KV head. A padding row (q_len 0) gets zeros.

Layout in the kernels: queries regrouped per KV head as [B, Hkv, M, D] with M = Tp x Gp rows
(row i = token i // Gp, group i % Gp), T and G padded to powers of two (Triton's rule for every
array in a kernel body) and M to at least 16 (the smallest dot Triton emits); padded rows are
masked and sliced off in the wrapper.

Two kernels, chosen by T:
- `_split_kernel` (T <= SPLIT_MAX_T: decode and verify): grid (row, KV head, split); the row's
  pages are divided into `num_splits` ranges walked in parallel, each leaving (max, sum,
  unnormalised output); a log-sum-exp combine merges them. Few rows with long contexts still fill
  the GPU.
- `_rows_kernel` (prefill chunks): grid (row, KV head, query block); a program holds
  BLOCK_ELEMS / D query rows (128 at D = 128, 64 at D = 256) and walks only the pages its block can see (window start .. its last query).

Dots take bf16 operands as they are, accumulating in fp32 (tensor cores); fp32 inputs use HIGHEST.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import GPU_PARAMS, WIDE_PARAMS, pow2, whole

_MASKED = -1e30
TARGET_PROGRAMS = 264          # ~2 waves of an H100/H200's 132 SMs: decode splits aim for this
SPLIT_MAX_T = 8                # decode / verify rows take the split-KV kernel
BLOCK_ELEMS = 16384            # query rows x head dim per prefill program (fp32 accumulator in registers)
MIN_ROWS = 16                  # Triton's smallest dot


def supported(page_size: int, head_dim: int) -> bool:
    """Shapes the compiled kernels take (powers of two a dot can use); others run on XLA."""
    return page_size == pow2(page_size) >= 16 and head_dim == pow2(head_dim) >= 16


def _precision(dtype):
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else jax.lax.Precision.DEFAULT


def _first_page(start, page_size, window):
    """The first page any query of a row starting at `start` can see."""
    if window is None:
        return jnp.int32(0)
    return jnp.maximum(start - window + 1, 0) // page_size


def _walk(table_ref, k_ref, v_ref, b, kv_head, lo, hi, q, q_pos, limit, *, page_size, scale, soft_cap, window):
    """Online softmax of q [M, D] over the row's pages lo .. hi - 1; q_pos, limit [M, 1].
    Returns (m [M, 1], l [M, 1], acc [M, D]) fp32. The next page's index is read one step ahead."""
    rows, d = q.shape
    prec = _precision(q.dtype)
    kv_iota = jax.lax.broadcasted_iota(jnp.int32, (1, page_size), 1)
    last = table_ref.shape[1] - 1

    def step(j, carry):
        m, l, acc, page = carry
        nxt = table_ref[b, jnp.minimum(j + 1, last)]
        k = k_ref[page, :, kv_head, :]                                         # [S, D]
        v = v_ref[page, :, kv_head, :]
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=prec,
                                preferred_element_type=jnp.float32) * scale     # [M, S]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        kv_pos = j * page_size + kv_iota
        mask = kv_pos <= limit
        if window is not None:
            mask &= kv_pos > q_pos - window
        m_new = jnp.maximum(m, jnp.max(jnp.where(mask, s, _MASKED), axis=1, keepdims=True))
        p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
        corr = jnp.exp(m - m_new)
        acc = acc * corr + jnp.dot(p.astype(v.dtype), v, precision=prec, preferred_element_type=jnp.float32)
        return m_new, l * corr + jnp.sum(p, axis=1, keepdims=True), acc, nxt

    init = (jnp.full((rows, 1), _MASKED, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
            jnp.zeros((rows, d), jnp.float32), table_ref[b, jnp.minimum(lo, last)])
    m, l, acc, _ = jax.lax.fori_loop(lo, hi, step, init)
    return m, l, acc


def _query_rows(start, q_len, first_row, rows, groups):
    """Positions [rows, 1] of query rows first_row.. (row i = token i // groups) and the causal
    limit of each (its own position, capped at the row's last real token)."""
    q_pos = start + (first_row + jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0)) // groups
    return q_pos, jnp.minimum(q_pos, start + q_len - 1)


def _split_kernel(table_ref, start_ref, qlen_ref, q_ref, k_ref, v_ref, m_ref, l_ref, acc_ref, *,
                  groups, num_splits, page_size, window, **opts):
    b, kv_head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, q_len = start_ref[b], qlen_ref[b]
    q = q_ref[0, 0]                                                           # [M, D]
    q_pos, limit = _query_rows(start, q_len, 0, q.shape[0], groups)
    first = _first_page(start, page_size, window)
    end = jnp.where(q_len > 0, (start + q_len + page_size - 1) // page_size, first)
    per_split = (end - first + num_splits - 1) // num_splits
    lo = first + split * per_split
    hi = jnp.minimum(lo + per_split, end)
    m, l, acc = _walk(table_ref, k_ref, v_ref, b, kv_head, lo, hi, q, q_pos, limit,
                      page_size=page_size, window=window, **opts)
    m_ref[0, 0, 0] = m
    l_ref[0, 0, 0] = l
    acc_ref[0, 0, 0] = acc


def _rows_kernel(table_ref, start_ref, qlen_ref, q_ref, k_ref, v_ref, o_ref, *, groups, page_size, window, **opts):
    b, kv_head, block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, q_len = start_ref[b], qlen_ref[b]
    q = q_ref[0, 0]                                                           # [BLOCK, D]
    rows = q.shape[0]
    q_pos, limit = _query_rows(start, q_len, block * rows, rows, groups)
    first_token = start + block * (rows // groups)                            # this block's first query
    last_token = jnp.minimum(first_token + rows // groups, start + q_len) - 1
    lo = _first_page(first_token, page_size, window)
    hi = jnp.where(last_token >= first_token, last_token // page_size + 1, lo)
    _, l, acc = _walk(table_ref, k_ref, v_ref, b, kv_head, lo, hi, q, q_pos, limit,
                      page_size=page_size, window=window, **opts)
    o_ref[0, 0] = (acc / jnp.maximum(l, 1e-30)).astype(o_ref.dtype)


def decode_splits(batch: int, kv_heads: int, max_pages: int) -> int:
    """KV splits per (row, KV head) so that the grid has about TARGET_PROGRAMS programs."""
    return max(1, min(max_pages, TARGET_PROGRAMS // max(1, batch * kv_heads)))


def _regroup(q, hkv, t_pad, g_pad):
    """q [B, T, H, D] -> [B, Hkv, t_pad * g_pad, D] (zero rows for padded tokens and groups)."""
    b, t, h, d = q.shape
    g = h // hkv
    qg = jnp.pad(q.reshape(b, t, hkv, g, d), ((0, 0), (0, t_pad - t), (0, 0), (0, g_pad - g), (0, 0)))
    return qg.transpose(0, 2, 1, 3, 4).reshape(b, hkv, t_pad * g_pad, d)


def _ungroup(o, t, h):
    """[B, Hkv, t_pad * g_pad, D] -> [B, T, H, D]."""
    b, hkv, _, d = o.shape
    g = h // hkv
    return o.reshape(b, hkv, -1, pow2(g), d)[:, :, :t, :g].transpose(0, 2, 1, 3, 4).reshape(b, t, h, d)


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "window", "num_splits", "interpret"))
def paged_attention(q, k_pages, v_pages, block_table, start, q_len, *, scale: float, soft_cap: float | None = None,
                    window: int | None = None, num_splits: int | None = None, interpret: bool = False):
    """q [B, T, H, D]; pages [P, S, Hkv, D] (already holding the new tokens); block_table [B, Pmax];
    start, q_len [B] -> out [B, T, H, D]. T <= SPLIT_MAX_T takes the split-KV kernel (num_splits:
    None = `decode_splits`), longer chunks the query-block kernel."""
    b, t, h, d = q.shape
    _, page_size, hkv, _ = k_pages.shape
    if not interpret and not supported(page_size, d):
        raise ValueError(f"compiled paged attention needs power-of-two page size and head dim >= 16, "
                         f"got {page_size} and {d}")
    g_pad = pow2(h // hkv)
    out_dtype, q = q.dtype, q.astype(k_pages.dtype)
    opts = dict(scale=scale, soft_cap=soft_cap, window=window, page_size=page_size, groups=g_pad)
    head_in = [whole(block_table.shape), whole(start.shape), whole(q_len.shape)]
    pools = [whole(k_pages.shape), whole(v_pages.shape)]
    if t <= SPLIT_MAX_T:
        t_pad = max(pow2(t), MIN_ROWS // g_pad)
        rows = t_pad * g_pad
        qg = _regroup(q, hkv, t_pad, g_pad)
        splits = num_splits or decode_splits(b, hkv, block_table.shape[1])
        stat = pl.BlockSpec((1, 1, 1, rows, 1), lambda i, j, s: (i, j, s, 0, 0))
        m, l, acc = pl.pallas_call(
            functools.partial(_split_kernel, num_splits=splits, **opts),
            grid=(b, hkv, splits),
            in_specs=head_in + [pl.BlockSpec((1, 1, rows, d), lambda i, j, s: (i, j, 0, 0))] + pools,
            out_specs=[stat, stat, pl.BlockSpec((1, 1, 1, rows, d), lambda i, j, s: (i, j, s, 0, 0))],
            out_shape=[jax.ShapeDtypeStruct((b, hkv, splits, rows, 1), jnp.float32)] * 2
            + [jax.ShapeDtypeStruct((b, hkv, splits, rows, d), jnp.float32)],
            compiler_params=GPU_PARAMS, interpret=interpret,
        )(block_table, start, q_len, qg, k_pages, v_pages)
        out = combine_splits(m[..., 0], l[..., 0], acc)
    else:
        block_tokens = max(1, BLOCK_ELEMS // d // g_pad)
        t_pad = -(-t // block_tokens) * block_tokens if t > block_tokens else max(pow2(t), MIN_ROWS // g_pad)
        rows = min(t_pad, block_tokens) * g_pad
        qg = _regroup(q, hkv, t_pad, g_pad)
        out = pl.pallas_call(
            functools.partial(_rows_kernel, **opts),
            grid=(b, hkv, t_pad * g_pad // rows),
            in_specs=head_in + [pl.BlockSpec((1, 1, rows, d), lambda i, j, r: (i, j, r, 0))] + pools,
            out_specs=pl.BlockSpec((1, 1, rows, d), lambda i, j, r: (i, j, r, 0)),
            out_shape=jax.ShapeDtypeStruct(qg.shape, jnp.float32),
            compiler_params=WIDE_PARAMS, interpret=interpret,
        )(block_table, start, q_len, qg, k_pages, v_pages)
    return _ungroup(out, t, h).astype(out_dtype)


def combine_splits(m, l, acc):
    """Log-sum-exp merge of per-split partial softmaxes: m, l [..., splits, M], acc [..., splits, M, D]
    -> [..., M, D]. Empty splits (m = -1e30, l = 0) weigh nothing; an all-empty row gives zeros."""
    top = jnp.max(m, axis=-2, keepdims=True)
    w = jnp.exp(m - top)
    total = jnp.sum(l * w, axis=-2)
    return jnp.sum(acc * w[..., None], axis=-3) / jnp.maximum(total, 1e-30)[..., None]
