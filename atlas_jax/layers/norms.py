"""RMSNorm variants. Computed in fp32, returned in the input dtype. With the CPU table (fp32) `rms_norm` and
`add_rms_norm` are one custom call each (cpu_kernels/rms_norm.cc); the XLA form is the reference."""
import jax
import jax.numpy as jnp

from .. import cpu_kernels
from ..kernels import XLA, Kernels


def rms_norm(x, w, eps: float, zero_centred: bool = False, kernels: Kernels = XLA):
    """x * rsqrt(mean(x^2) + eps) * w; with zero_centred the scale is (1 + w) (Qwen3-Next)."""
    if kernels.fuses_norm(x.dtype, w.dtype):
        return cpu_kernels.rms_norm(x, w, eps, zero_centred)
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    scale = (1.0 + w.astype(jnp.float32)) if zero_centred else w.astype(jnp.float32)
    return (xf * scale).astype(x.dtype)


def add_rms_norm(x, h, w, eps: float, zero_centred: bool = False, kernels: Kernels = XLA):
    """The pre-norm residual step: (x + h, rms_norm(x + h))."""
    if kernels.fuses_norm(x.dtype, h.dtype, w.dtype):
        return cpu_kernels.add_rms_norm(x, h, w, eps, zero_centred)
    x = x + h
    return x, rms_norm(x, w, eps, zero_centred)


def rms_norm_gated(x, gate, w, eps: float):
    """GDN output norm: rmsnorm(x) * w * silu(gate), fp32 inside (HF Qwen3NextRMSNormGated)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    y = w.astype(jnp.float32) * xf.astype(x.dtype).astype(jnp.float32)
    return (y * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


def l2_normalize(x, eps: float = 1e-6):
    """x * rsqrt(sum(x^2) + eps) over the last axis (fla / HF l2norm)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def rms_norm_gated_grouped(x, gate, w, eps: float, groups: int):
    """Mamba2 output norm (gate first): rmsnorm over each of `groups` equal slices of
    x * silu(gate), times w; fp32 inside (HF NemotronHRMSNormGated). x, gate [..., C] -> [..., C] fp32."""
    y = x.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))
    g = y.reshape(*y.shape[:-1], groups, y.shape[-1] // groups)
    g = g * jax.lax.rsqrt(jnp.mean(g * g, axis=-1, keepdims=True) + eps)
    return g.reshape(y.shape) * w.astype(jnp.float32)
