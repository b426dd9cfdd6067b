"""Sparse MoE FFN: softmax router -> top-k (optionally renormalised) -> SwiGLU experts,
plus an optional shared expert behind a sigmoid gate (Qwen3-Next).

Cost grows with top-k, not with the number of experts. Two dispatches, chosen from static
shapes in `dispatch_for` (the one place the choice is made):
  * "gather": tokens * k <= experts (decode-sized batches). Each (token, choice) pair indexes
    its expert's weights and runs a GEMV; only the chosen experts are read.
  * "grouped": (token, choice) pairs sorted by expert and run through `jax.lax.ragged_dot`,
    a grouped GEMM whose work is proportional to tokens * k. (XLA:CPU lowers ragged_dot
    densely; on CPU this path serves prefill-sized batches of tiny models only.)
"""
import jax
import jax.numpy as jnp

from .mlp import swiglu


def dispatch_for(num_tokens: int, top_k: int, num_experts: int) -> str:
    return "gather" if num_tokens * top_k <= num_experts else "grouped"


def route(router_w, x, top_k: int, renormalise: bool):
    """x [N, H] -> (weights [N, k] fp32, expert ids [N, k] int32)."""
    logits = (x @ router_w).astype(jnp.float32)                  # [N, E]
    probs = jax.nn.softmax(logits, axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if renormalise:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids


def _experts_gather(p, x, weights, ids):
    # p["gate"|"up"] [E, H, F], p["down"] [E, F, H]; x [N, H]; ids, weights [N, k]
    g = jnp.take(p["gate"], ids, axis=0)                            # [N, k, H, F]
    u = jnp.take(p["up"], ids, axis=0)
    d = jnp.take(p["down"], ids, axis=0)                            # [N, k, F, H]
    h = jax.nn.silu(jnp.einsum("nh,nkhf->nkf", x, g)) * jnp.einsum("nh,nkhf->nkf", x, u)
    y = jnp.einsum("nkf,nkfh->nkh", h, d)
    return jnp.einsum("nkh,nk->nh", y.astype(jnp.float32), weights).astype(x.dtype)


def _experts_grouped(p, x, weights, ids):
    n, k = ids.shape
    num_experts = p["gate"].shape[0]
    flat_ids = ids.reshape(-1)                                       # [N*k]
    order = jnp.argsort(flat_ids, stable=True)
    token_of = order // k                                            # source token of each sorted pair
    xs = jnp.take(x, token_of, axis=0)                               # [N*k, H]
    group_sizes = jnp.bincount(flat_ids, length=num_experts).astype(jnp.int32)
    h = jax.nn.silu(jax.lax.ragged_dot(xs, p["gate"], group_sizes)) * jax.lax.ragged_dot(xs, p["up"], group_sizes)
    y = jax.lax.ragged_dot(h, p["down"], group_sizes).astype(jnp.float32)   # [N*k, H]
    y = y * jnp.take(weights.reshape(-1), order)[:, None]
    return jnp.zeros((n, x.shape[-1]), jnp.float32).at[token_of].add(y).astype(x.dtype)


def moe(p, x, top_k: int, renormalise: bool):
    """p: {router [H, E], experts: {gate, up, down}, optional shared: swiglu params,
    shared_gate [H, 1]}; x [..., H] -> [..., H]."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    weights, ids = route(p["router"], x2, top_k, renormalise)
    experts = p["experts"]
    if dispatch_for(x2.shape[0], top_k, experts["gate"].shape[0]) == "gather":
        y = _experts_gather(experts, x2, weights, ids)
    else:
        y = _experts_grouped(experts, x2, weights, ids)
    if "shared" in p:
        gate = jax.nn.sigmoid((x2 @ p["shared_gate"]).astype(jnp.float32))
        y = y + (gate * swiglu(p["shared"], x2).astype(jnp.float32)).astype(x.dtype)
    return y.reshape(shape)
