"""RMSNorm variants. Computed in fp32, returned in the input dtype."""
import jax
import jax.numpy as jnp


def rms_norm(x, w, eps: float, zero_centred: bool = False):
    """x * rsqrt(mean(x^2) + eps) * w; with zero_centred the scale is (1 + w) (Qwen3-Next)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    scale = (1.0 + w.astype(jnp.float32)) if zero_centred else w.astype(jnp.float32)
    return (xf * scale).astype(x.dtype)


def rms_norm_gated(x, gate, w, eps: float):
    """GDN output norm: rmsnorm(x) * w * silu(gate), fp32 inside (HF Qwen3NextRMSNormGated)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    y = w.astype(jnp.float32) * xf.astype(x.dtype).astype(jnp.float32)
    return (y * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


def l2_normalize(x, eps: float = 1e-6):
    """x * rsqrt(sum(x^2) + eps) over the last axis (fla / HF l2norm)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)
