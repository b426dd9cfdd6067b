"""Gated DeltaNet kernels as `pallas_call`s lowered through Triton on GPU (interpreted on CPU):
the recurrent / verify step and chunked prefill.

State layout shared by both (and by speculative rollback): a pool `h [S, R, Hv, Dk, Dv]` fp32, R
state positions per slot. A row reads its initial state at (slot, read_idx) — zeros when `fresh` —
and writes the state after its token t at (slot, t) for t < R - 1, and its final state at
(slot, min(q_len - 1, R - 1)). With R = 1 that is a plain per-slot state updated in place; with
R = K the verify step leaves the state after every draft position, so a rollback to accepted
position j is "read index j next step", with no copy.

Per token (value head h, key head h // r, q already l2-normed and scaled, k l2-normed):
    S = S * exp(g);  S = S + k (beta (v - S^T k))^T;  o = S^T q
Value columns of S are independent, so programs split Dv into blocks (grid row x head x v-block):
a program's state stays small and a batch-1 decode still has enough programs. Matrix-vector
products are broadcasts + reductions (Triton has no dot below 16 rows).

Chunked prefill (WY form, CHUNK tokens) runs in two kernels: `_wy_kernel`, one program per
(chunk, value head), all chunks in parallel, solves the chunk's unit-lower-triangular system once
(forward substitution: bounded for nearly parallel keys, where a power series overflows) and
leaves u = T (beta v) and w = T (beta k exp(gc)); `_chunked_kernel` then carries the state across
a sequence's chunks per (row, value head, Dv block).

A padding row (q_len 0 or slot >= S) writes nothing and returns zeros.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import GPU_PARAMS, WIDE_PARAMS, pow2, whole

CHUNK = 64
TARGET_PROGRAMS = 264          # ~2 waves of an H100/H200's 132 SMs
_HI = jax.lax.Precision.HIGHEST


def supported(dk: int, dv: int) -> bool:
    """Head dims the compiled kernels take (powers of two a dot can use); others run on XLA."""
    return dk == pow2(dk) >= 16 and dv == pow2(dv) >= 16


def block_v(batch: int, heads: int, dv: int) -> int:
    """Dv columns per program: <= 64 (registers), halved down to 16 while the grid is under
    TARGET_PROGRAMS programs."""
    bv = min(dv, 64)
    while bv > 16 and dv % (bv // 2) == 0 and batch * heads * (dv // bv) < TARGET_PROGRAMS:
        bv //= 2
    return bv if dv % bv == 0 else dv


def _dot(a, b):
    return jnp.dot(a, b, precision=_HI, preferred_element_type=jnp.float32)


def _dot_t(a, b):   # a @ b.T
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=_HI, preferred_element_type=jnp.float32)


def _tdot(a, b):    # a.T @ b
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=_HI, preferred_element_type=jnp.float32)


# ---------------------------------------------------------------------------------------------
# Recurrent / verify: T (small) tokens per row, one at a time.

def _recurrent_kernel(meta_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, h_in, o_ref, h_out, *, block_v, delta_rule):
    b, head, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    slot, read_idx, q_len, fresh = meta_ref[b, 0], meta_ref[b, 1], meta_ref[b, 2], meta_ref[b, 3]
    num_slots, positions = h_in.shape[0], h_in.shape[1]
    t_max = q_ref.shape[1]
    cols = pl.ds(vb * block_v, block_v)
    live = (q_len > 0) & (slot < num_slots)
    safe_slot = jnp.where(live, slot, 0)
    s0 = h_in[safe_slot, read_idx, head, :, cols]                        # [Dk, BV]
    s0 = jnp.where(live & (fresh == 0), s0, 0.0)

    def token(t, s):
        k = k_ref[0, t, 0, :][:, None]                                   # [Dk, 1]
        q = q_ref[0, t, 0, :][:, None]
        v = v_ref[0, t, 0, :][None, :]                                   # [1, BV]
        on = t < q_len
        g = jnp.where(on, g_ref[0, t, 0], 0.0)
        beta = jnp.where(on, beta_ref[0, t, 0], 0.0)
        s = s * jnp.exp(g)
        if delta_rule:
            v = v - jnp.sum(k * s, axis=0, keepdims=True)                # [1, BV]
        s = s + k * (v * beta)                                           # outer product k (beta v)^T
        o = jnp.sum(q * s, axis=0, keepdims=True)
        o_ref[0, t, 0, :] = jnp.where(on, o, 0.0)[0].astype(o_ref.dtype)

        @pl.when(live & on & ((t < positions - 1) | (t == q_len - 1)))
        def _():
            h_out[slot, jnp.minimum(t, positions - 1), head, :, cols] = s
        return s

    jax.lax.fori_loop(0, t_max, token, s0)


@functools.partial(jax.jit, static_argnames=("interpret", "delta_rule"), donate_argnames=("h_pool",))
def gdn_recurrent(q, k, v, g, beta, h_pool, slot, read_idx, q_len, fresh, *, interpret: bool = False,
                  delta_rule: bool = True):
    """q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv] (fp32); h_pool [S, R, Hv, Dk, Dv];
    slot, read_idx, q_len [B] int32; fresh [B] bool. Returns (o [B, T, Hv, Dv] fp32, h_pool).
    T is padded to a power of two inside (padded tokens are beyond q_len). delta_rule=False: the
    Mamba2 update S = S exp(g) + beta k v^T (layers/gdn.py)."""
    b, t, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    if not interpret and not supported(dk, dv):
        raise ValueError(f"compiled GDN needs power-of-two head dims >= 16, got Dk {dk}, Dv {dv}")
    r = hv // hk
    bv = block_v(b, hv, dv)
    tp = pow2(t)
    pad = lambda x: jnp.pad(x.astype(jnp.float32), [(0, 0), (0, tp - t)] + [(0, 0)] * (x.ndim - 2))
    meta = jnp.stack([slot, read_idx, q_len, fresh.astype(jnp.int32)], axis=1)
    o, h_pool = pl.pallas_call(
        functools.partial(_recurrent_kernel, block_v=bv, delta_rule=delta_rule),
        grid=(b, hv, dv // bv),
        in_specs=[whole(meta.shape),
                  pl.BlockSpec((1, tp, 1, dk), lambda i, h, j: (i, 0, h // r, 0)),
                  pl.BlockSpec((1, tp, 1, dk), lambda i, h, j: (i, 0, h // r, 0)),
                  pl.BlockSpec((1, tp, 1, bv), lambda i, h, j: (i, 0, h, j)),
                  pl.BlockSpec((1, tp, 1), lambda i, h, j: (i, 0, h)),
                  pl.BlockSpec((1, tp, 1), lambda i, h, j: (i, 0, h)),
                  whole(h_pool.shape)],
        out_specs=[pl.BlockSpec((1, tp, 1, bv), lambda i, h, j: (i, 0, h, j)), whole(h_pool.shape)],
        out_shape=[jax.ShapeDtypeStruct((b, tp, hv, dv), jnp.float32),
                   jax.ShapeDtypeStruct(h_pool.shape, h_pool.dtype)],
        input_output_aliases={6: 1},
        compiler_params=GPU_PARAMS, interpret=interpret,
    )(meta, *(pad(x) for x in (q, k, v, g, beta)), h_pool)
    return o[:, :t], h_pool


# ---------------------------------------------------------------------------------------------
# Chunked prefill: the WY form, CHUNK tokens at a time, sequences packed on one token axis.

def _masks(c):
    row = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
    return row, col


def _cumulative(g, row, col):
    """g [C] per-token log decay -> (gc as a column [C, 1], gc as a row [1, C], total decay scalar)."""
    gc_col = jnp.sum(jnp.where(row >= col, g[None, :], 0.0), axis=1, keepdims=True)
    gc_row = jnp.sum(jnp.where(row <= col, g[:, None], 0.0), axis=0, keepdims=True)
    return gc_col, gc_row, jnp.sum(g)


def unit_lower_inverse(a):
    """(I + a)^-1 for strictly lower-triangular a [C, C], by forward substitution row by row:
    row i = e_i - a[i, :] @ inv (rows < i final). Entries stay bounded for nearly parallel keys."""
    c = a.shape[0]
    row, col = _masks(c)
    rid = jax.lax.broadcasted_iota(jnp.int32, (c, 1), 0)
    cid = jax.lax.broadcasted_iota(jnp.int32, (1, c), 1)

    def solve_row(i, inv):
        a_i = jnp.sum(jnp.where(row == i, a, 0.0), axis=0)[:, None]           # a[i, :] as a column [C, 1]
        new = jnp.where(cid == i, 1.0, 0.0) - jnp.sum(a_i * inv, axis=0, keepdims=True)   # [1, C]
        return jnp.where(rid == i, new, inv)

    return jax.lax.fori_loop(1, c, solve_row, (row == col).astype(jnp.float32))


def _wy_kernel(k_ref, v_ref, g_ref, beta_ref, u_ref, w_ref):
    """One (chunk, value head): u = T (beta v) [C, Dv], w = T (beta k exp(gc)) [C, Dk]."""
    k = k_ref[:, 0, :]                                                    # [C, Dk]
    v = v_ref[:, 0, :]                                                    # [C, Dv]
    g = g_ref[:, 0]
    beta = beta_ref[:, 0][:, None]                                        # [C, 1]
    row, col = _masks(g.shape[0])
    gc_col, gc_row, _ = _cumulative(g, row, col)
    kb = k * beta
    a = jnp.where(row > col, _dot_t(kb, k) * jnp.exp(jnp.where(row > col, gc_col - gc_row, 0.0)), 0.0)
    inv = unit_lower_inverse(a)
    u_ref[:, 0, :] = _dot(inv, v * beta)
    w_ref[:, 0, :] = _dot(inv, kb * jnp.exp(gc_col))


def _chunked_kernel(meta_ref, q_ref, k_ref, g_ref, u_ref, w_ref, h_in, o_ref, h_out, *, block_v, ratio, delta_rule):
    b, head, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    offset, length = meta_ref[b, 0], meta_ref[b, 1]
    slot, read_idx, fresh = meta_ref[b, 2], meta_ref[b, 3], meta_ref[b, 4]
    num_slots, positions = h_in.shape[0], h_in.shape[1]
    c = CHUNK
    kh = head // ratio
    cols = pl.ds(vb * block_v, block_v)
    live = (length > 0) & (slot < num_slots)
    safe_slot = jnp.where(live, slot, 0)
    s0 = h_in[safe_slot, read_idx, head, :, cols]
    s0 = jnp.where(live & (fresh == 0), s0, 0.0)
    row, col = _masks(c)

    def chunk(i, s):
        rows = pl.ds(pl.multiple_of(offset + i * c, c), c)
        q = q_ref[rows, kh, :]                                            # [C, Dk]
        k = k_ref[rows, kh, :]
        gc_col, gc_row, g_last = _cumulative(g_ref[rows, head], row, col)
        decay = jnp.exp(jnp.where(row >= col, gc_col - gc_row, -jnp.inf))  # [C, C]
        v_new = u_ref[rows, head, cols]                                   # [C, BV]
        if delta_rule:
            v_new = v_new - _dot(w_ref[rows, head, :], s)
        o = _dot(q * jnp.exp(gc_col), s) + _dot(_dot_t(q, k) * decay, v_new)
        o_ref[rows, head, cols] = o.astype(o_ref.dtype)
        return s * jnp.exp(g_last) + _tdot(k * jnp.exp(g_last - gc_col), v_new)

    s = jax.lax.fori_loop(0, (length + c - 1) // c, chunk, s0)

    @pl.when(live)
    def _():
        h_out[slot, jnp.minimum(length - 1, positions - 1), head, :, cols] = s


@functools.partial(jax.jit, static_argnames=("interpret", "delta_rule"), donate_argnames=("h_pool",))
def gdn_chunked(q, k, v, g, beta, h_pool, offset, length, slot, read_idx, fresh, *, interpret: bool = False,
                delta_rule: bool = True):
    """Chunk-aligned packed layout: q, k [N, Hk, Dk]; v [N, Hv, Dv]; g, beta [N, Hv], N a multiple
    of CHUNK; sequence b owns tokens offset[b] .. offset[b] + length[b] - 1, offset[b] a multiple of
    CHUNK, and the rows up to the next CHUNK boundary (their inputs are ignored, their outputs
    unspecified). Only the final state is written (at min(length - 1, R - 1)). Returns (o [N, Hv, Dv] fp32, h_pool).
    delta_rule=False (Mamba2's SSD): no triangular solve, u = beta v and w = 0."""
    n, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    if n % CHUNK:
        raise ValueError(f"token axis {n} is not a multiple of {CHUNK}")
    if not interpret and not supported(dk, dv):
        raise ValueError(f"compiled GDN needs power-of-two head dims >= 16, got Dk {dk}, Dv {dv}")
    nseq, ratio = offset.shape[0], hv // hk
    # Tokens outside every sequence decay nothing and write nothing (k = beta = g = 0).
    pos = jnp.arange(n, dtype=jnp.int32)[:, None]
    inside = jnp.any((pos >= offset[None, :]) & (pos < (offset + length)[None, :]), axis=1)
    on = lambda x: jnp.where(inside.reshape((n,) + (1,) * (x.ndim - 1)), x.astype(jnp.float32), 0.0)
    q, v = q.astype(jnp.float32), v.astype(jnp.float32)
    k, g, beta = on(k), on(g), on(beta)
    if delta_rule:
        u, w = _wy(k, v, g, beta, interpret)
    else:
        u, w = v * beta[..., None], jnp.zeros((1,), jnp.float32)          # w unused
    bv = block_v(nseq, hv, dv)
    meta = jnp.stack([offset, length, slot, read_idx, fresh.astype(jnp.int32)], axis=1)
    return pl.pallas_call(
        functools.partial(_chunked_kernel, block_v=bv, ratio=ratio, delta_rule=delta_rule),
        grid=(nseq, hv, dv // bv),
        in_specs=[whole(meta.shape), whole(q.shape), whole(k.shape), whole(g.shape), whole(u.shape),
                  whole(w.shape), whole(h_pool.shape)],
        out_specs=[whole(v.shape), whole(h_pool.shape)],
        out_shape=[jax.ShapeDtypeStruct(v.shape, jnp.float32), jax.ShapeDtypeStruct(h_pool.shape, h_pool.dtype)],
        input_output_aliases={6: 1},
        compiler_params=WIDE_PARAMS, interpret=interpret,
    )(meta, q, k, g, u, w, h_pool)


def _wy(k, v, g, beta, interpret):
    """The WY kernel over every (chunk, value head): (u [N, Hv, Dv], w [N, Hv, Dk])."""
    n, hk, dk = k.shape
    hv, dv = v.shape[1], v.shape[2]
    ratio = hv // hk
    return pl.pallas_call(
        _wy_kernel,
        grid=(n // CHUNK, hv),
        in_specs=[pl.BlockSpec((CHUNK, 1, dk), lambda c, h: (c, h // ratio, 0)),
                  pl.BlockSpec((CHUNK, 1, dv), lambda c, h: (c, h, 0)),
                  pl.BlockSpec((CHUNK, 1), lambda c, h: (c, h)),
                  pl.BlockSpec((CHUNK, 1), lambda c, h: (c, h))],
        out_specs=[pl.BlockSpec((CHUNK, 1, dv), lambda c, h: (c, h, 0)),
                   pl.BlockSpec((CHUNK, 1, dk), lambda c, h: (c, h, 0))],
        out_shape=[jax.ShapeDtypeStruct((n, hv, dv), jnp.float32), jax.ShapeDtypeStruct((n, hv, dk), jnp.float32)],
        compiler_params=WIDE_PARAMS, interpret=interpret,
    )(k, v, g, beta)


def align_offsets(lengths, chunk: int = CHUNK):
    """Chunk-aligned start of each sequence when packed one after another (exclusive cumsum of
    lengths rounded up to chunks)."""
    padded = (lengths + chunk - 1) // chunk * chunk
    return jnp.cumsum(padded) - padded


def gdn_chunked_prefill(q, k, v, g, beta, h_pool, cu_seqlens, slot, read_idx, fresh, *, interpret: bool = False,
                        delta_rule: bool = True):
    """Varlen entry: sequences packed back to back on the token axis (q, k [N, Hk, Dk], v [N, Hv, Dv],
    g, beta [N, Hv]), sequence b = tokens cu_seqlens[b] .. cu_seqlens[b+1] - 1. Scatters them to
    the chunk-aligned layout, runs `gdn_chunked`, gathers back. Returns (o [N, Hv, Dv], h_pool)."""
    n = q.shape[0]
    nseq = cu_seqlens.shape[0] - 1
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    aligned = align_offsets(lengths)
    size = -(-(n + nseq * (CHUNK - 1)) // CHUNK) * CHUNK
    seq_of = jnp.searchsorted(cu_seqlens, jnp.arange(n), side="right") - 1
    dest = aligned[seq_of] + jnp.arange(n) - cu_seqlens[seq_of]                   # [N]
    spread = lambda x: jnp.zeros((size,) + x.shape[1:], x.dtype).at[dest].set(x)
    o, h_pool = gdn_chunked(*(spread(x) for x in (q, k, v, g, beta)), h_pool, aligned, lengths, slot,
                            read_idx, fresh, interpret=interpret, delta_rule=delta_rule)
    return o[dest], h_pool


# ---------------------------------------------------------------------------------------------
# Pure-jnp reference for both: token-by-token, per row (independent of the WY algebra above).

def reference(q, k, v, g, beta, h_pool, slot, read_idx, q_len, fresh, intermediates: bool = True,
              delta_rule: bool = True):
    """Padded-dense rows as in `gdn_recurrent`; any T. Returns (o, h_pool). With intermediates
    False only the final state is written (the `gdn_chunked` contract)."""
    num_slots, positions = h_pool.shape[:2]
    hv = v.shape[2]
    r = hv // q.shape[2]
    q, k = jnp.repeat(q, r, axis=2), jnp.repeat(k, r, axis=2)
    live = (q_len > 0) & (slot < num_slots)
    s0 = h_pool[jnp.where(live, slot, 0), read_idx]                               # [B, Hv, Dk, Dv]
    s = jnp.where((live & ~fresh)[:, None, None, None], s0, 0.0)
    outs = []
    for t in range(q.shape[1]):
        on = (t < q_len)[:, None]
        s = s * jnp.exp(jnp.where(on, g[:, t], 0.0))[..., None, None]
        correction = jnp.einsum("bhkv,bhk->bhv", s, k[:, t], precision=_HI) if delta_rule else 0.0
        delta = (v[:, t] - correction) * jnp.where(on, beta[:, t], 0.0)[..., None]
        s = s + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append(jnp.where(on[..., None], jnp.einsum("bhkv,bhk->bhv", s, q[:, t], precision=_HI), 0.0))
        write = live & (t < q_len) & (((t < positions - 1) & intermediates) | (t == q_len - 1))
        h_pool = h_pool.at[jnp.where(write, slot, num_slots), min(t, positions - 1)].set(s, mode="drop")
    return jnp.stack(outs, axis=1), h_pool
