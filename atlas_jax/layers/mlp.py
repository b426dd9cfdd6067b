"""Dense feed-forward: SwiGLU down(silu(x @ gate) * (x @ up)) (Qwen), or relu2 down(relu(x @ up)^2)
(Nemotron-H); which one by the params present. slot: per-token LoRA adapter slots (layers/lora.py)."""
import jax
import jax.numpy as jnp

from .lora import project


def swiglu(p, x, slot=None):
    """p: {gate [H, F], up [H, F], down [F, H]}; x [N, H] -> [N, H]."""
    return project(jax.nn.silu(project(x, p, "gate", slot)) * project(x, p, "up", slot), p, "down", slot)


def relu2(p, x, slot=None):
    """p: {up [H, F], down [F, H]}; x [N, H] -> [N, H]."""
    return project(jnp.square(jax.nn.relu(project(x, p, "up", slot))), p, "down", slot)


def mlp(p, x, slot=None):
    return swiglu(p, x, slot) if "gate" in p else relu2(p, x, slot)
