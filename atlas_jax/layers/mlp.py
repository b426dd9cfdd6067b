"""Dense feed-forward: SwiGLU down(silu(x @ gate) * (x @ up)) (Qwen), or relu2 down(relu(x @ up)^2)
(Nemotron-H); which one by the config's `mlp_act`. slot: per-token LoRA adapter slots (layers/lora.py)."""
import jax
import jax.numpy as jnp

from .lora import project

ACTIVATIONS = ("silu", "relu2")


def swiglu(p, x, slot=None):
    """p: {gate [H, F], up [H, F], down [F, H]}; x [N, H] -> [N, H]."""
    return project(jax.nn.silu(project(x, p, "gate", slot)) * project(x, p, "up", slot), p, "down", slot)


def relu2(p, x, slot=None):
    """p: {up [H, F], down [F, H]}; x [N, H] -> [N, H]."""
    return project(jnp.square(jax.nn.relu(project(x, p, "up", slot))), p, "down", slot)


def mlp(p, x, act: str, slot=None):
    """act: ModelConfig.mlp_act (silu: SwiGLU; relu2)."""
    if act == "silu":
        return swiglu(p, x, slot)
    if act == "relu2":
        return relu2(p, x, slot)
    raise ValueError(f"unknown mlp activation {act!r}; known: {ACTIVATIONS}")
