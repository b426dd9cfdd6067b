"""Dense feed-forward: SwiGLU down(silu(x @ gate) * (x @ up)) (Qwen), or relu2 down(relu(x @ up)^2)
(Nemotron-H); which one by the params present."""
import jax
import jax.numpy as jnp


def swiglu(p, x):
    """p: {gate [H, F], up [H, F], down [F, H]}; x [..., H] -> [..., H]."""
    return (jax.nn.silu(x @ p["gate"]) * (x @ p["up"])) @ p["down"]


def relu2(p, x):
    """p: {up [H, F], down [F, H]}; x [..., H] -> [..., H]."""
    return jnp.square(jax.nn.relu(x @ p["up"])) @ p["down"]


def mlp(p, x):
    return swiglu(p, x) if "gate" in p else relu2(p, x)


def hidden_act(p, x):
    """The expert / MLP hidden activation before `down`: [..., H] -> [..., F] (fp32 inside)."""
    if "gate" in p:
        return jax.nn.silu((x @ p["gate"]).astype(jnp.float32)) * (x @ p["up"]).astype(jnp.float32)
    return jnp.square(jax.nn.relu((x @ p["up"]).astype(jnp.float32)))
