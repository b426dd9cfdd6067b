"""Grouped-query attention over the paged KV cache (pure-XLA path).

The chunk's K/V are written into their pages first; every query row then attends to
its sequence's pages [0, start + q_len) with a causal limit at its own position. That is
"earlier pages plus causal inside the chunk" in one masked pass.
"""
import jax
import jax.numpy as jnp

from .norms import rms_norm
from .rope import apply_rope

_MASKED = -1e30  # finite, so an all-masked padding row stays NaN-free


def write_kv(pages, new, batch):
    """pages [P, S, Hkv, D]; new [B, T, Hkv, D] -> pages with valid tokens scattered in.
    Padding tokens get an out-of-range index and are dropped."""
    num_pages, page_size = pages.shape[:2]
    pos = batch.positions                                                  # [B, T]
    page = jnp.take_along_axis(batch.block_table, pos // page_size, axis=1, mode="clip")
    flat = page * page_size + pos % page_size
    flat = jnp.where(batch.valid, flat, num_pages * page_size)
    out = pages.reshape(num_pages * page_size, *pages.shape[2:])
    out = out.at[flat.reshape(-1)].set(new.reshape(-1, *new.shape[2:]).astype(pages.dtype), mode="drop")
    return out.reshape(pages.shape)


def paged_attention(q, k_pages, v_pages, batch, scale: float):
    """q [B, T, H, D]; pages [P, S, Hkv, D] already holding this chunk -> out [B, T, H, D]."""
    b, t, h, d = q.shape
    hkv = k_pages.shape[2]
    k = k_pages[batch.block_table].reshape(b, -1, hkv, d)                    # [B, L, Hkv, D]
    v = v_pages[batch.block_table].reshape(b, -1, hkv, d)
    qg = q.reshape(b, t, hkv, h // hkv, d)
    s = jnp.einsum("btkgd,blkd->bkgtl", qg, k, preferred_element_type=jnp.float32) * scale
    kv_pos = jnp.arange(k.shape[1], dtype=jnp.int32)
    limit = jnp.minimum(batch.positions, (batch.start + batch.q_len - 1)[:, None])   # [B, T]
    mask = kv_pos[None, None, :] <= limit[:, :, None]                               # [B, T, L]
    s = jnp.where(mask[:, None, None], s, _MASKED)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgtl,blkd->btkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(b, t, h, d).astype(q.dtype)


def attention_layer(p, x, kv, batch, cos, sin, cfg):
    """Full-attention mixer. p: q/k/v/o projections ([in, out]), optional biases, q_norm,
    k_norm; kv = (k_pages, v_pages). x [B, T, H] -> ([B, T, H], kv)."""
    b, t, _ = x.shape
    hd = cfg.head_dim
    q = x @ p["q"] + p["q_bias"] if "q_bias" in p else x @ p["q"]
    k = x @ p["k"] + p["k_bias"] if "k_bias" in p else x @ p["k"]
    v = x @ p["v"] + p["v_bias"] if "v_bias" in p else x @ p["v"]
    if cfg.attn_output_gate:
        q, gate = jnp.split(q.reshape(b, t, cfg.num_heads, 2 * hd), 2, axis=-1)
        gate = gate.reshape(b, t, cfg.num_heads * hd)
    else:
        q = q.reshape(b, t, cfg.num_heads, hd)
    k = k.reshape(b, t, cfg.num_kv_heads, hd)
    v = v.reshape(b, t, cfg.num_kv_heads, hd)
    q = apply_rope(rms_norm(q, p["q_norm"], cfg.rms_norm_eps, cfg.zero_centred_norm), cos, sin)
    k = apply_rope(rms_norm(k, p["k_norm"], cfg.rms_norm_eps, cfg.zero_centred_norm), cos, sin)
    k_pages = write_kv(kv[0], k, batch)
    v_pages = write_kv(kv[1], v, batch)
    o = paged_attention(q, k_pages, v_pages, batch, hd ** -0.5).reshape(b, t, -1)
    if cfg.attn_output_gate:
        o = (o.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(x.dtype)
    o = o @ p["o"] + p["o_bias"] if "o_bias" in p else o @ p["o"]
    return o, (k_pages, v_pages)
