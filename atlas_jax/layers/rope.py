"""Rotary position embedding (rotate_half convention), full or partial."""
import jax.numpy as jnp


def rope_cos_sin(positions, rotary_dim: int, theta: float):
    """positions [...] int -> (cos, sin) [..., rotary_dim] fp32."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq           # [..., rotary_dim/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x, cos, sin):
    """x [..., H, D]; cos/sin [..., R] with R <= D: rotate the first R dims, pass the rest."""
    r = cos.shape[-1]
    xr, xp = x[..., :r].astype(jnp.float32), x[..., r:]
    c, s = cos[..., None, :], sin[..., None, :]
    half = r // 2
    rotated = jnp.concatenate([-xr[..., half:], xr[..., :half]], axis=-1)
    out = (xr * c + rotated * s).astype(x.dtype)
    return jnp.concatenate([out, xp], axis=-1) if xp.shape[-1] else out
