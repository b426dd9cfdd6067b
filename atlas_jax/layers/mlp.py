"""SwiGLU feed-forward: down(silu(x @ gate) * (x @ up))."""
import jax


def swiglu(p, x):
    """p: {gate [H, F], up [H, F], down [F, H]}; x [..., H] -> [..., H]."""
    return (jax.nn.silu(x @ p["gate"]) * (x @ p["up"])) @ p["down"]
