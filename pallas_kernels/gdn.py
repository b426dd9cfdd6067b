"""Gated DeltaNet kernels as portable `pallas_call`s: the recurrent / verify step and chunked prefill.

State layout shared by both (and by speculative rollback): a pool `h [S, R, Hv, Dk, Dv]` fp32, R
state positions per slot. A row reads its initial state at (slot, read_idx) — zeros when `fresh` —
and writes the state after its token t at (slot, t) for t < R - 1, and its final state at
(slot, min(q_len - 1, R - 1)). With R = 1 that is a plain per-slot state updated in place; with
R = K the verify step leaves the state after every draft position, so a rollback to accepted
position j is "read index j next step", with no copy.

Per token (value head h, key head h // r, q already l2-normed and scaled, k l2-normed):
    S = S * exp(g);  S = S + k (beta (v - S^T k))^T;  o = S^T q
Value columns of S are independent, so programs split Dv into blocks (grid row x head x v-block),
which keeps a program's state small and gives a batch-1 decode enough programs.

A padding row (q_len 0 or slot >= S) writes nothing and returns zeros.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

CHUNK = 64
_HI = jax.lax.Precision.HIGHEST


def _block_v(dv: int) -> int:
    return 64 if dv % 64 == 0 and dv > 64 else dv


def _whole(shape):
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def _dot(a, b):
    return jnp.dot(a, b, precision=_HI, preferred_element_type=jnp.float32)


def _dot_t(a, b):   # a @ b.T
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=_HI, preferred_element_type=jnp.float32)


def _tdot(a, b):    # a.T @ b
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=_HI, preferred_element_type=jnp.float32)


# ---------------------------------------------------------------------------------------------
# Recurrent / verify: T (small) tokens per row, one at a time.

def _recurrent_kernel(meta_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, h_in, o_ref, h_out, *, block_v):
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
        k = k_ref[0, t, 0, :][None, :]                                   # [1, Dk]
        q = q_ref[0, t, 0, :][None, :]
        v = v_ref[0, t, 0, :][None, :]                                   # [1, BV]
        on = t < q_len
        g = jnp.where(on, g_ref[0, t, 0], 0.0)
        beta = jnp.where(on, beta_ref[0, t, 0], 0.0)
        s = s * jnp.exp(g)
        delta = (v - _dot(k, s)) * beta                                  # [1, BV]
        s = s + _tdot(k, delta)                                          # k^T delta: [Dk, BV]
        o_ref[0, t, 0, :] = jnp.where(on, _dot(q, s)[0], 0.0).astype(o_ref.dtype)

        @pl.when(live & on & ((t < positions - 1) | (t == q_len - 1)))
        def _():
            h_out[slot, jnp.minimum(t, positions - 1), head, :, cols] = s
        return s

    jax.lax.fori_loop(0, t_max, token, s0)


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnames=("h_pool",))
def gdn_recurrent(q, k, v, g, beta, h_pool, slot, read_idx, q_len, fresh, *, interpret: bool = False):
    """q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv] (fp32); h_pool [S, R, Hv, Dk, Dv];
    slot, read_idx, q_len [B] int32; fresh [B] bool. Returns (o [B, T, Hv, Dv] fp32, h_pool)."""
    b, t, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    r = hv // hk
    bv = _block_v(dv)
    meta = jnp.stack([slot, read_idx, q_len, fresh.astype(jnp.int32)], axis=1)
    return pl.pallas_call(
        functools.partial(_recurrent_kernel, block_v=bv),
        grid=(b, hv, dv // bv),
        in_specs=[_whole(meta.shape),
                  pl.BlockSpec((1, t, 1, dk), lambda i, h, j: (i, 0, h // r, 0)),
                  pl.BlockSpec((1, t, 1, dk), lambda i, h, j: (i, 0, h // r, 0)),
                  pl.BlockSpec((1, t, 1, bv), lambda i, h, j: (i, 0, h, j)),
                  pl.BlockSpec((1, t, 1), lambda i, h, j: (i, 0, h)),
                  pl.BlockSpec((1, t, 1), lambda i, h, j: (i, 0, h)),
                  _whole(h_pool.shape)],
        out_specs=[pl.BlockSpec((1, t, 1, bv), lambda i, h, j: (i, 0, h, j)), _whole(h_pool.shape)],
        out_shape=[jax.ShapeDtypeStruct(v.shape, jnp.float32), jax.ShapeDtypeStruct(h_pool.shape, h_pool.dtype)],
        input_output_aliases={6: 1},
        interpret=interpret,
    )(meta, q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
      g.astype(jnp.float32), beta.astype(jnp.float32), h_pool)


# ---------------------------------------------------------------------------------------------
# Chunked prefill: the WY form, CHUNK tokens at a time, sequences packed on one token axis.

def _unit_lower_inverse(a, c: int):
    """(I + a)^-1 for strictly lower-triangular a [C, C]: a is nilpotent, so the inverse is
    sum_k (-a)^k = (I - a)(I + a^2)(I + a^4)... — log2(C) squarings, all matmuls."""
    eye = (jax.lax.broadcasted_iota(jnp.int32, (c, c), 0) == jax.lax.broadcasted_iota(jnp.int32, (c, c), 1))
    eye = eye.astype(jnp.float32)
    inv = eye - a
    p = a
    span = 2
    while span < c:
        p = _dot(p, p)
        inv = _dot(inv, eye + p)
        span *= 2
    return inv


def _chunked_kernel(meta_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, h_in, o_ref, h_out, *, block_v, ratio):
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

    row = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
    incl = (row >= col).astype(jnp.float32)                               # lower triangle incl. diagonal

    def chunk(i, s):
        rows = pl.ds(pl.multiple_of(offset + i * c, c), c)
        on = (i * c + jax.lax.broadcasted_iota(jnp.int32, (c, 1), 0)) < length   # [C, 1]
        q = q_ref[rows, kh, :]                                            # [C, Dk]
        k = jnp.where(on, k_ref[rows, kh, :], 0.0)
        v = v_ref[rows, head, cols]                                       # [C, BV]
        g = jnp.where(on, g_ref[rows, head][:, None], 0.0)                # [C, 1]
        beta = jnp.where(on, beta_ref[rows, head][:, None], 0.0)
        gc = _dot(incl, g)                                                # cumulative log decay [C, 1]
        gc_row = _tdot(g, incl.T)                                         # the same as a row [1, C]
        decay = jnp.exp(jnp.where(row >= col, gc - gc_row, -jnp.inf))      # [C, C]
        kb = k * beta
        a = jnp.where(row > col, _dot_t(kb, k) * decay, 0.0)
        inv = _unit_lower_inverse(a, c)
        u = _dot(inv, v * beta)                                           # [C, BV]
        w = _dot(inv, kb * jnp.exp(gc))                                   # [C, Dk]
        v_new = u - _dot(w, s)
        o = _dot(q * jnp.exp(gc), s) + _dot(_dot_t(q, k) * decay, v_new)
        o_ref[rows, head, cols] = o.astype(o_ref.dtype)
        g_last = gc[c - 1:c, :]                                           # [1, 1]
        return s * jnp.exp(g_last) + _tdot(k * jnp.exp(g_last - gc), v_new)

    s = jax.lax.fori_loop(0, (length + c - 1) // c, chunk, s0)

    @pl.when(live)
    def _():
        h_out[slot, jnp.minimum(length - 1, positions - 1), head, :, cols] = s


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnames=("h_pool",))
def gdn_chunked(q, k, v, g, beta, h_pool, offset, length, slot, read_idx, fresh, *, interpret: bool = False):
    """Chunk-aligned packed layout: q, k [N, Hk, Dk]; v [N, Hv, Dv]; g, beta [N, Hv], N a multiple
    of CHUNK; sequence b owns tokens offset[b] .. offset[b] + length[b] - 1, offset[b] a multiple of
    CHUNK, and the rows up to the next CHUNK boundary (their inputs are ignored, their outputs
    unspecified). Only the final state is written (at min(length - 1, R - 1)). Returns (o [N, Hv, Dv] fp32, h_pool)."""
    n, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    if n % CHUNK:
        raise ValueError(f"token axis {n} is not a multiple of {CHUNK}")
    bv = _block_v(dv)
    meta = jnp.stack([offset, length, slot, read_idx, fresh.astype(jnp.int32)], axis=1)
    f32 = lambda x: x.astype(jnp.float32)
    return pl.pallas_call(
        functools.partial(_chunked_kernel, block_v=bv, ratio=hv // hk),
        grid=(offset.shape[0], hv, dv // bv),
        in_specs=[_whole(meta.shape), _whole(q.shape), _whole(k.shape), _whole(v.shape), _whole(g.shape),
                  _whole(beta.shape), _whole(h_pool.shape)],
        out_specs=[_whole(v.shape), _whole(h_pool.shape)],
        out_shape=[jax.ShapeDtypeStruct(v.shape, jnp.float32), jax.ShapeDtypeStruct(h_pool.shape, h_pool.dtype)],
        input_output_aliases={6: 1},
        interpret=interpret,
    )(meta, f32(q), f32(k), f32(v), f32(g), f32(beta), h_pool)


def align_offsets(lengths, chunk: int = CHUNK):
    """Chunk-aligned start of each sequence when packed one after another (exclusive cumsum of
    lengths rounded up to chunks)."""
    padded = (lengths + chunk - 1) // chunk * chunk
    return jnp.cumsum(padded) - padded


def gdn_chunked_prefill(q, k, v, g, beta, h_pool, cu_seqlens, slot, read_idx, fresh, *, interpret: bool = False):
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
                            read_idx, fresh, interpret=interpret)
    return o[dest], h_pool


# ---------------------------------------------------------------------------------------------
# Pure-jnp reference for both: token-by-token, per row (independent of the WY algebra above).

def reference(q, k, v, g, beta, h_pool, slot, read_idx, q_len, fresh, intermediates: bool = True):
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
        delta = (v[:, t] - jnp.einsum("bhkv,bhk->bhv", s, k[:, t], precision=_HI)) * jnp.where(on, beta[:, t], 0.0)[..., None]
        s = s + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append(jnp.where(on[..., None], jnp.einsum("bhkv,bhk->bhv", s, q[:, t], precision=_HI), 0.0))
        write = live & (t < q_len) & (((t < positions - 1) & intermediates) | (t == q_len - 1))
        h_pool = h_pool.at[jnp.where(write, slot, num_slots), min(t, positions - 1)].set(s, mode="drop")
    return jnp.stack(outs, axis=1), h_pool
