"""Sparse MoE FFN: softmax router -> top-k (optionally renormalised) -> SwiGLU experts,
plus an optional shared expert behind a sigmoid gate (Qwen3-Next).

Cost grows with top-k, not with the number of experts. The N*k (token, expert) pairs are
sorted by expert; two grouped dispatches then run them, chosen in `dispatch_for` (the one
place the choice is made):
  * "ragged"  (GPU/TPU): `jax.lax.ragged_dot`, a grouped GEMM over the sorted pairs.
  * "blocked" (CPU, where ragged_dot lowers densely): each expert's run of pairs is padded
    to a multiple of a block of `tb` rows; a scan walks the blocks, indexing one expert's
    weights per block (no copy) for a [tb, H] @ [H, F] matmul; empty blocks are skipped.
    Blocks <= ceil((N*k + min(E, N*k) * (tb - 1)) / tb), so decode (tb = 1) reads only the
    k chosen experts and prefill work is ~N*k rows.
"""
import jax
import jax.numpy as jnp

from .mlp import swiglu


def dispatch_for(backend: str) -> str:
    return "blocked" if backend == "cpu" else "ragged"


def block_rows(num_pairs: int, num_experts: int) -> int:
    """Rows per block: a power of two in [1, 64] at about twice the mean group size, so most groups
    fit one block (every block re-reads its expert's weights; padding rows only cost FLOPs)."""
    if num_pairs <= num_experts:
        return 1                       # decode: every pair is its own expert's only row, more or less
    return min(64, 1 << (2 * num_pairs // num_experts - 1).bit_length())


def route(router_w, x, top_k: int, renormalise: bool):
    """x [N, H] -> (weights [N, k] fp32, expert ids [N, k] int32)."""
    logits = (x @ router_w).astype(jnp.float32)                  # [N, E]
    probs = jax.nn.softmax(logits, axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if renormalise:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids


def _sort_pairs(ids, num_experts):
    """Sorted view of the N*k pairs: (order, expert of each sorted pair, group sizes [E])."""
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    return order, flat[order], jnp.bincount(flat, length=num_experts).astype(jnp.int32)


def _experts_ragged(p, x, weights, ids):
    n, k = ids.shape
    order, _, sizes = _sort_pairs(ids, p["gate"].shape[0])
    token_of = order // k
    xs = jnp.take(x, token_of, axis=0)                               # [N*k, H]
    h = jax.nn.silu(jax.lax.ragged_dot(xs, p["gate"], sizes)) * jax.lax.ragged_dot(xs, p["up"], sizes)
    y = jax.lax.ragged_dot(h, p["down"], sizes).astype(jnp.float32)  # [N*k, H]
    y = y * jnp.take(weights.reshape(-1), order)[:, None]
    return jnp.zeros((n, x.shape[-1]), jnp.float32).at[token_of].add(y).astype(x.dtype)


def _experts_blocked(p, x, weights, ids):
    n, k = ids.shape
    e, h_dim = p["gate"].shape[:2]
    pairs = n * k
    tb = block_rows(pairs, e)
    nb = -(-(pairs + min(e, pairs) * (tb - 1)) // tb)
    order, expert, sizes = _sort_pairs(ids, e)
    padded = -(-sizes // tb) * tb
    group_start = jnp.cumsum(sizes) - sizes
    padded_start = jnp.cumsum(padded) - padded
    dest = padded_start[expert] + jnp.arange(pairs) - group_start[expert]   # row of each sorted pair
    rows = nb * tb
    token = jnp.full((rows,), n, jnp.int32).at[dest].set(order // k)        # n = padding row
    weight = jnp.zeros((rows,), jnp.float32).at[dest].set(weights.reshape(-1)[order])
    xs = jnp.take(x, token, axis=0, mode="fill", fill_value=0).reshape(nb, tb, h_dim)
    block_expert = jnp.minimum(jnp.searchsorted(jnp.cumsum(padded), jnp.arange(nb) * tb, side="right"), e - 1)
    block_used = jnp.arange(nb) * tb < jnp.sum(padded)

    def block(_, xs_b):
        xb, eb, used = xs_b
        def run(xb):
            w = {name: jax.lax.dynamic_index_in_dim(a, eb, 0, keepdims=False) for name, a in p.items()}
            return swiglu(w, xb)
        return None, jax.lax.cond(used, run, jnp.zeros_like, xb)
    _, y = jax.lax.scan(block, None, (xs, block_expert, block_used))
    y = y.reshape(rows, h_dim).astype(jnp.float32) * weight[:, None]
    return jnp.zeros((n + 1, h_dim), jnp.float32).at[token].add(y)[:n].astype(x.dtype)


def moe(p, x, top_k: int, renormalise: bool):
    """p: {router [H, E], experts: {gate [E, H, F], up [E, H, F], down [E, F, H]}, optional
    shared: swiglu params, shared_gate [H, 1]}; x [..., H] -> [..., H]."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    weights, ids = route(p["router"], x2, top_k, renormalise)
    experts = _experts_blocked if dispatch_for(jax.default_backend()) == "blocked" else _experts_ragged
    y = experts(p["experts"], x2, weights, ids)
    if "shared" in p:
        gate = jax.nn.sigmoid((x2 @ p["shared_gate"]).astype(jnp.float32))
        y = y + (gate * swiglu(p["shared"], x2).astype(jnp.float32)).astype(x.dtype)
    return y.reshape(shape)
