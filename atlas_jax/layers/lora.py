"""Multi-adapter LoRA on one flat token axis: each token adds its own adapter's low-rank delta.

The pool for one projection holds every resident adapter: A [in, S, R], B [S, R, out] (scale folded
into B; slot 0 = zeros = the base model). Instead of gathering each token's adapter (punica's bgmv),
x is multiplied by every slot's A at once — one plain GEMM with A viewed as [in, S*R] — and the other
slots' columns are zeroed before the second GEMM with B viewed as [S*R, out]: one compiled shape for
any mix of adapters, and at the small S*R of a serving pool (e.g. 5 x 16) a few percent of the base
projection's work.
"""
import jax.numpy as jnp


def project(x, p, name: str, slot=None, bias: bool = False):
    """x @ p[name] (+ p[name + "_bias"] when the config says the projection has one), plus each token's
    adapter delta when the params carry this projection's adapter pool (p[name + "_lora"] = (A [in, S, R],
    B [S, R, out]), merged in by `with_pool` for the adapters' target modules) and slot [N] (each token's
    adapter slot) is given."""
    y = x @ p[name]
    if bias:
        y = y + p[f"{name}_bias"]
    if slot is not None and f"{name}_lora" in p:
        y = y + lora_delta(x, *p[f"{name}_lora"], slot)
    return y


def key_path(key: str) -> list:
    """'layers.3.attn.q_proj' -> ['layers', 3, 'attn', 'q_proj'] (the pool's keys are dotted param paths)."""
    return [int(k) if k.isdigit() else k for k in key.split(".")]


def param_at(params, key: str):
    for k in key_path(key):
        params = params[k]
    return params


def with_pool(params, pool: dict):
    """params with the adapter pool merged in: pool {param key: (A, B)} -> p[name + "_lora"] beside p[name]."""
    if not pool:
        return params
    params = dict(params)
    for key, ab in pool.items():
        path = key_path(key)
        node = params
        for key in path[:-1]:                           # copy the dicts / lists on the way down
            child = node[key]
            child = dict(child) if isinstance(child, dict) else list(child)
            node[key] = child
            node = child
        node[f"{path[-1]}_lora"] = ab
    return params


def lora_delta(x, a, b, slot):
    """x [N, in]; a [in, S, R]; b [S, R, out]; slot [N] int32 (0 = no adapter) -> [N, out] (x's dtype)."""
    d_in, s, r = a.shape
    xa = x @ a.reshape(d_in, s * r).astype(x.dtype)                                   # every slot's A
    own = (jnp.arange(s * r, dtype=jnp.int32) // r)[None, :] == slot[:, None]
    return jnp.where(own, xa, jnp.zeros((), xa.dtype)) @ b.reshape(s * r, -1).astype(x.dtype)
