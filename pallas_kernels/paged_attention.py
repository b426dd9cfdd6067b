"""Ragged paged attention as a portable `pallas_call` (one program per (row, KV head)).

Contract = `atlas_jax.layers.attention.paged_attention` (the pure-jnp reference): a padded-dense
segment of B rows, row b holding q_len[b] new query tokens at positions start[b].., attending to
its pages [0, start + q_len) through block_table, causally inside its own new tokens. GQA: the
G = H / Hkv query heads of KV head h are q heads h*G .. h*G+G-1. A padding row (q_len 0) gets zeros.
The program walks the row's pages one at a time with an online softmax, reading only the pages
the row needs (trip count from start + q_len), so decode rows do not pay for longer rows.

Status: correct in interpret mode on CPU (tests/test_pallas_attention.py); the GPU tuning (KV-split
across programs for decode, scalar-prefetched block tables) is issue 5's remaining work.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

_MASKED = -1e30


def _kernel(table_ref, start_ref, qlen_ref, q_ref, k_ref, v_ref, o_ref, *, scale, page_size, groups):
    b = pl.program_id(0)
    kv_head = pl.program_id(1)
    start = start_ref[b]
    q_len = qlen_ref[b]
    q = q_ref[0].astype(jnp.float32)                              # [T, G, D]
    t, _, d = q.shape
    pos = start + jnp.arange(t, dtype=jnp.int32)
    limit = jnp.minimum(pos, start + q_len - 1)                   # [T] last KV position each query sees
    num_pages = jnp.where(q_len > 0, (start + q_len + page_size - 1) // page_size, 0)   # padding row: nothing

    def page_step(j, carry):
        m, l, acc = carry
        page = table_ref[b, j]
        k = k_ref[page, :, kv_head, :].astype(jnp.float32)        # [S, D]
        v = v_ref[page, :, kv_head, :].astype(jnp.float32)
        s = jnp.einsum("tgd,sd->tgs", q, k) * scale               # [T, G, S]
        kv_pos = j * page_size + jnp.arange(page_size, dtype=jnp.int32)
        mask = (kv_pos[None, :] <= limit[:, None])[:, None, :]     # [T, 1, S]
        m_new = jnp.maximum(m, jnp.max(jnp.where(mask, s, _MASKED), axis=-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        corr = jnp.exp(m - m_new)
        return m_new, l * corr + jnp.sum(p, axis=-1), acc * corr[..., None] + jnp.einsum("tgs,sd->tgd", p, v)

    init = (jnp.full((t, groups), _MASKED, jnp.float32), jnp.zeros((t, groups), jnp.float32),
            jnp.zeros((t, groups, d), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, num_pages, page_step, init)
    o_ref[0] = (acc / jnp.maximum(l, 1e-30)[..., None]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def paged_attention(q, k_pages, v_pages, block_table, start, q_len, *, scale: float, interpret: bool = False):
    """q [B, T, H, D]; pages [P, S, Hkv, D] (already holding the new tokens); block_table [B, Pmax];
    start, q_len [B] -> out [B, T, H, D]."""
    b, t, h, d = q.shape
    _, page_size, hkv, _ = k_pages.shape
    groups = h // hkv
    whole = lambda shape: pl.BlockSpec(shape, lambda i, j: (0,) * len(shape))
    kernel = functools.partial(_kernel, scale=scale, page_size=page_size, groups=groups)
    return pl.pallas_call(
        kernel,
        grid=(b, hkv),
        in_specs=[whole(block_table.shape), whole(start.shape), whole(q_len.shape),
                  pl.BlockSpec((1, t, groups, d), lambda i, j: (i, 0, j, 0)),
                  whole(k_pages.shape), whole(v_pages.shape)],
        out_specs=pl.BlockSpec((1, t, groups, d), lambda i, j: (i, 0, j, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        interpret=interpret,
    )(block_table, start, q_len, q, k_pages, v_pages)
