"""Grouped-query attention over the paged KV cache (pure-XLA path).

Each segment's new K/V are written into their pages first; every query row then attends to
its sequence's pages [0, start + q_len) with a causal limit at its own position: "earlier
pages plus causal inside the chunk" in one masked pass. The KV axis is walked in blocks of
KV_BLOCK_TOKENS with an online softmax. On CPU the trip count is set at run time by the longest
sequence in the step, so the compiled step does not depend on context length; elsewhere it is the
block table's static length (XLA:GPU synchronises with the host on every iteration of a loop whose
trip count lives on the device), with blocks past a row's end masked.
"""
import jax
import jax.numpy as jnp

from pallas_kernels import paged_attention as pallas_attention

from .. import cpu_kernels
from ..batch import join_segments, split_segments
from ..kernels import XLA, Kernels
from .lora import project
from .norms import rms_norm
from .rope import apply_rope

KV_BLOCK_TOKENS = 256


def write_kv(pages, new, batch):
    """pages [P, S, Hkv, D]; new [B, T, Hkv, D] -> pages with valid tokens scattered in.
    Padding tokens get an out-of-range page and are dropped. (Scattering on the 4-D pool, not a
    flattened view, keeps one layout of the result for every reader: no pool copies.)"""
    num_pages, page_size = pages.shape[:2]
    pos = batch.positions                                                  # [B, T]
    page = jnp.take_along_axis(batch.block_table, pos // page_size, axis=1, mode="clip")
    page = jnp.where(batch.valid, page, num_pages)
    return pages.at[page.reshape(-1), (pos % page_size).reshape(-1)].set(
        new.reshape(-1, *new.shape[2:]).astype(pages.dtype), mode="drop")


def paged_attention(q, k_pages, v_pages, batch, scale: float, soft_cap: float | None = None,
                    window: int | None = None, static_blocks: bool | None = None):
    """q [B, T, H, D]; pages [P, S, Hkv, D] already holding this chunk -> (out [B, T, H, D],
    k_pages, v_pages) — the same pages, to be used in place of the inputs. A padding row gets zeros.
    soft_cap: scores -> cap * tanh(scores / cap). window: a query at position p sees KV positions
    p - window + 1 .. p only. static_blocks: walk every block of the table (default: off CPU)."""
    b, t, h, d = q.shape
    page_size, hkv = k_pages.shape[1], k_pages.shape[2]
    table = batch.block_table
    block_pages = max(1, min(table.shape[1], KV_BLOCK_TOKENS // page_size))
    if table.shape[1] % block_pages:
        table = jnp.pad(table, ((0, 0), (0, block_pages - table.shape[1] % block_pages)))
    blk = block_pages * page_size
    qg = q.reshape(b, t, hkv, h // hkv, d)
    limit = jnp.minimum(batch.positions, (batch.start + batch.q_len - 1)[:, None])     # [B, T]
    if static_blocks is None:
        static_blocks = XLA.attention_static_blocks()          # ad-hoc calls; layers pass their table's
    if not static_blocks:
        num_blocks = (jnp.max(batch.start + batch.q_len) + blk - 1) // blk
    else:
        num_blocks = table.shape[1] // block_pages

    def block(j, carry):
        m, l, acc, k_pages, v_pages = carry
        pages = jax.lax.dynamic_slice_in_dim(table, j * block_pages, block_pages, axis=1)
        k = k_pages[pages].reshape(b, blk, hkv, d)
        v = v_pages[pages].reshape(b, blk, hkv, d)
        s = jnp.einsum("btkgd,blkd->bkgtl", qg, k, preferred_element_type=jnp.float32) * scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        kv_pos = (j * blk + jnp.arange(blk, dtype=jnp.int32))[None, None, :]
        mask = kv_pos <= limit[:, :, None]                                              # [B, T, L]
        if window is not None:
            mask &= kv_pos > batch.positions[:, :, None] - window
        mask = mask[:, None, None]
        m_new = jnp.maximum(m, jnp.max(jnp.where(mask, s, -jnp.inf), axis=-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        corr = jnp.exp(m - m_new)
        l = l * corr + jnp.sum(p, axis=-1)
        acc = acc * corr[..., None] + jnp.einsum("bkgtl,blkd->bkgtd", p.astype(v.dtype), v,
                                                 preferred_element_type=jnp.float32)
        return m_new, l, acc, k_pages, v_pages

    shape = (b, hkv, h // hkv, t)
    # The pages ride in the loop carry and come back out, so the caller keeps using the loop's
    # output buffers: XLA then updates the donated pool in place instead of copying it around the loop.
    init = (jnp.full(shape, -1e30, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros(shape + (d,), jnp.float32), k_pages, v_pages)
    if table.shape[1] == block_pages:            # one block: no loop (XLA would hoist and re-fuse it anyway)
        _, l, acc, k_pages, v_pages = block(0, init)
    else:
        _, l, acc, k_pages, v_pages = jax.lax.fori_loop(0, num_blocks, block, init)
    o = acc / jnp.maximum(l, 1e-30)[..., None]                                          # [B, Hkv, G, T, D]
    return jnp.moveaxis(o, 3, 1).reshape(b, t, h, d).astype(q.dtype), k_pages, v_pages


def attention_layer(p, x, kv, segments, cos, sin, cfg, kernels: Kernels = XLA, slot=None):
    """Full-attention mixer. p: q/k/v/o projections ([in, out]), optional biases, optional q_norm,
    k_norm; kv = (k_pages, v_pages). x [N, H] flat over the segments; cos/sin [N, R].
    Returns ([N, H], kv). The KV write is XLA's scatter either way; `kernels` picks the attention
    (compiled Pallas only for shapes it takes; the CPU kernel for decode / verify segments; else XLA)."""
    n = x.shape[0]
    hd = cfg.head_dim
    q, k, v = (project(x, p, name, slot, cfg.attention_bias) for name in ("q", "k", "v"))
    if cfg.attn_output_gate:
        q, gate = jnp.split(q.reshape(n, cfg.num_heads, 2 * hd), 2, axis=-1)
        gate = gate.reshape(n, cfg.num_heads * hd)
    else:
        q = q.reshape(n, cfg.num_heads, hd)
    k = k.reshape(n, cfg.num_kv_heads, hd)
    v = v.reshape(n, cfg.num_kv_heads, hd)
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps, cfg.zero_centred_norm, kernels)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps, cfg.zero_centred_norm, kernels)
    if cfg.rotary_dim:                                   # Nemotron-H's attention has no positional encoding
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k_pages, v_pages = kv
    # Every segment's K / V is written before any segment attends: a write after another segment's read of
    # the pool would make XLA copy the whole pool (segments hold distinct sequences, so the order is free).
    for seg, k_s, v_s in zip(segments, *(split_segments(a, segments) for a in (k, v))):
        k_pages = write_kv(k_pages, k_s, seg)
        v_pages = write_kv(v_pages, v_s, seg)
    outs = []
    for seg, q_s in zip(segments, split_segments(q, segments)):
        impl = kernels.attention(k_pages.shape[1], hd, q_s.shape[1], k_pages.dtype)
        if impl == "pallas":
            o = pallas_attention.paged_attention(q_s, k_pages, v_pages, seg.block_table, seg.start, seg.q_len,
                                                 scale=hd ** -0.5, interpret=kernels.interpret)
        elif impl == "cpu":
            o = cpu_kernels.paged_attention(q_s, k_pages, v_pages, seg.block_table, seg.start, seg.q_len,
                                            hd ** -0.5).astype(q_s.dtype)
        else:
            o, k_pages, v_pages = paged_attention(q_s, k_pages, v_pages, seg, hd ** -0.5,
                                                  static_blocks=kernels.attention_static_blocks())
        outs.append(o)
    o = join_segments(outs).reshape(n, -1)
    if cfg.attn_output_gate:
        o = (o.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(x.dtype)
    o = project(o, p, "o", slot, cfg.attention_bias)
    return o, (k_pages, v_pages)
