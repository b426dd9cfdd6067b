"""Ragged paged attention as portable `pallas_call`s.

Contract = `atlas_jax.layers.attention.paged_attention` (the pure-jnp reference): a padded-dense
segment of B rows, row b holding q_len[b] new query tokens at positions start[b].., attending to
its pages [0, start + q_len) through block_table, causally inside its own new tokens; optional
logit soft-cap (cap * tanh(s / cap)) and sliding window (a query at p sees p - window + 1 .. p).
GQA: the G = H / Hkv query heads of KV head h are q heads h*G .. h*G+G-1, and one program serves
all G of them, so each KV page is read once per KV head. A padding row (q_len 0) gets zeros.

Two kernels:
- `_rows_kernel` (any q_len): grid (row, KV head); the program walks only the pages the row needs
  (from the window's first page to start + q_len) with an online softmax.
- `_decode_kernel` (q_len = 1 segments): grid (row, KV head, split); the row's pages are divided
  into `num_splits` ranges walked in parallel, each leaving (max, sum, unnormalised output); a
  log-sum-exp combine merges them. A batch of few rows with long contexts then still fills the GPU.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

_MASKED = -1e30
_HI = jax.lax.Precision.HIGHEST
TARGET_PROGRAMS = 264          # ~2 waves of an H100/H200's 132 SMs: decode splits aim for this


def _whole(shape):
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def _first_page(start, page_size, window):
    """The first page any query of a row starting at `start` can see."""
    if window is None:
        return jnp.int32(0)
    return jnp.maximum(start - window + 1, 0) // page_size


def _page_update(carry, q, k, v, q_pos, kv_pos, limit, *, scale, soft_cap, window):
    """One page of the online softmax. q [M, D] (M = query rows x groups); k, v [S, D];
    q_pos, limit [M, 1] int32; kv_pos [1, S]. carry = (m [M, 1], l [M, 1], acc [M, D])."""
    m, l, acc = carry
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=_HI, preferred_element_type=jnp.float32)
    s = s * scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    mask = kv_pos <= limit
    if window is not None:
        mask &= kv_pos > q_pos - window
    m_new = jnp.maximum(m, jnp.max(jnp.where(mask, s, _MASKED), axis=1, keepdims=True))
    p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
    corr = jnp.exp(m - m_new)
    acc = acc * corr + jnp.dot(p, v, precision=_HI, preferred_element_type=jnp.float32)
    return m_new, l * corr + jnp.sum(p, axis=1, keepdims=True), acc


def _rows_kernel(table_ref, start_ref, qlen_ref, q_ref, k_ref, v_ref, o_ref, *, page_size, **opts):
    b, kv_head = pl.program_id(0), pl.program_id(1)
    start, q_len = start_ref[b], qlen_ref[b]
    _, t, _, groups, d = q_ref.shape
    q = q_ref[0, :, 0].astype(jnp.float32).reshape(t * groups, d)                   # row i = (token i // G, group i % G)
    q_pos = start + jax.lax.broadcasted_iota(jnp.int32, (t * groups, 1), 0) // groups
    limit = jnp.minimum(q_pos, start + q_len - 1)
    kv_iota = jax.lax.broadcasted_iota(jnp.int32, (1, page_size), 1)
    end = jnp.where(q_len > 0, (start + q_len + page_size - 1) // page_size, 0)

    def page_step(j, carry):
        page = table_ref[b, j]
        k = k_ref[page, :, kv_head, :].astype(jnp.float32)                    # [S, D]
        v = v_ref[page, :, kv_head, :].astype(jnp.float32)
        return _page_update(carry, q, k, v, q_pos, j * page_size + kv_iota, limit, **opts)

    m = t * groups
    init = (jnp.full((m, 1), _MASKED, jnp.float32), jnp.zeros((m, 1), jnp.float32), jnp.zeros((m, d), jnp.float32))
    _, l, acc = jax.lax.fori_loop(_first_page(start, page_size, opts["window"]), end, page_step, init)
    o_ref[0, :, 0] = (acc / jnp.maximum(l, 1e-30)).reshape(t, groups, d).astype(o_ref.dtype)


def _decode_kernel(table_ref, start_ref, qlen_ref, q_ref, k_ref, v_ref, m_ref, l_ref, acc_ref, *,
                   page_size, num_splits, **opts):
    b, kv_head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, q_len = start_ref[b], qlen_ref[b]
    groups, d = q_ref.shape[2], q_ref.shape[3]
    q = q_ref[0, 0].astype(jnp.float32)                                       # [G, D]
    q_pos = jnp.full((groups, 1), start, jnp.int32)
    first = _first_page(start, page_size, opts["window"])
    end = jnp.where(q_len > 0, start // page_size + 1, first)                 # the one query sits at `start`
    per_split = (end - first + num_splits - 1) // num_splits
    lo = first + split * per_split
    hi = jnp.minimum(lo + per_split, end)
    kv_iota = jax.lax.broadcasted_iota(jnp.int32, (1, page_size), 1)

    def page_step(j, carry):
        page = table_ref[b, j]
        k = k_ref[page, :, kv_head, :].astype(jnp.float32)
        v = v_ref[page, :, kv_head, :].astype(jnp.float32)
        return _page_update(carry, q, k, v, q_pos, j * page_size + kv_iota, q_pos, **opts)

    init = (jnp.full((groups, 1), _MASKED, jnp.float32), jnp.zeros((groups, 1), jnp.float32),
            jnp.zeros((groups, d), jnp.float32))
    m, l, acc = jax.lax.fori_loop(lo, hi, page_step, init)
    m_ref[0, 0, 0] = m[:, 0]
    l_ref[0, 0, 0] = l[:, 0]
    acc_ref[0, 0, 0] = acc


def decode_splits(batch: int, kv_heads: int, max_pages: int) -> int:
    """KV splits per (row, KV head) so that the grid has about TARGET_PROGRAMS programs."""
    return max(1, min(max_pages, TARGET_PROGRAMS // max(1, batch * kv_heads)))


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "window", "num_splits", "interpret"))
def paged_attention(q, k_pages, v_pages, block_table, start, q_len, *, scale: float, soft_cap: float | None = None,
                    window: int | None = None, num_splits: int | None = None, interpret: bool = False):
    """q [B, T, H, D]; pages [P, S, Hkv, D] (already holding the new tokens); block_table [B, Pmax];
    start, q_len [B] -> out [B, T, H, D]. T = 1 takes the split-KV decode kernel (num_splits:
    None = `decode_splits`)."""
    b, t, h, d = q.shape
    _, page_size, hkv, _ = k_pages.shape
    groups = h // hkv
    opts = dict(scale=scale, soft_cap=soft_cap, window=window, page_size=page_size)
    qg = q.reshape(b, t, hkv, groups, d)
    head_in = [_whole(block_table.shape), _whole(start.shape), _whole(q_len.shape)]
    if t > 1:
        out = pl.pallas_call(
            functools.partial(_rows_kernel, **opts),
            grid=(b, hkv),
            in_specs=head_in + [pl.BlockSpec((1, t, 1, groups, d), lambda i, j: (i, 0, j, 0, 0)),
                                _whole(k_pages.shape), _whole(v_pages.shape)],
            out_specs=pl.BlockSpec((1, t, 1, groups, d), lambda i, j: (i, 0, j, 0, 0)),
            out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
            interpret=interpret,
        )(block_table, start, q_len, qg, k_pages, v_pages)
        return out.reshape(b, t, h, d)
    splits = num_splits or decode_splits(b, hkv, block_table.shape[1])
    stat = pl.BlockSpec((1, 1, 1, groups), lambda i, j, s: (i, j, s, 0))
    m, l, acc = pl.pallas_call(
        functools.partial(_decode_kernel, num_splits=splits, **opts),
        grid=(b, hkv, splits),
        in_specs=head_in + [pl.BlockSpec((1, 1, groups, d), lambda i, j, s: (i, j, 0, 0)),
                            _whole(k_pages.shape), _whole(v_pages.shape)],
        out_specs=[stat, stat, pl.BlockSpec((1, 1, 1, groups, d), lambda i, j, s: (i, j, s, 0, 0))],
        out_shape=[jax.ShapeDtypeStruct((b, hkv, splits, groups), jnp.float32)] * 2
        + [jax.ShapeDtypeStruct((b, hkv, splits, groups, d), jnp.float32)],
        interpret=interpret,
    )(block_table, start, q_len, qg[:, 0], k_pages, v_pages)
    return combine_splits(m, l, acc).reshape(b, 1, h, d).astype(q.dtype)


def combine_splits(m, l, acc):
    """Log-sum-exp merge of per-split partial softmaxes: m, l [..., splits, G], acc [..., splits, G, D]
    -> [..., G, D]. Empty splits (m = -1e30, l = 0) weigh nothing; an all-empty row gives zeros."""
    top = jnp.max(m, axis=-2, keepdims=True)
    w = jnp.exp(m - top)
    total = jnp.sum(l * w, axis=-2)
    return jnp.sum(acc * w[..., None], axis=-3) / jnp.maximum(total, 1e-30)[..., None]
