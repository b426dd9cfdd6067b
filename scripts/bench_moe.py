"""MoE expert dispatch on this backend, each candidate in isolation, side by side in one run.

    python scripts/bench_moe.py [--tokens 1,8,32,128,512] [--experts 16] [--top-k 4] [--hidden 1024] [--inter 512]

Prints one JSON object: per token count, the median ms of each dispatch over the same routed input and
its useful GFLOP/s (FLOPs of the k chosen experts only), plus the dense GEMM rate at the same width for scale.
Every candidate's output is checked against the per-pair gather reference first.
"""
import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from atlas_jax.kernels import resolve_kernels
from atlas_jax.layers import moe as moe_mod


# ---- candidates measured beside the engine's dispatches (the blocked scan, the CPU kernel); the capacity
# grid is not used by the engine: slower here, see ../shared/reference/cpu-performance.md ----
def capacity_layout(ids, weights, num_experts: int, capacity: int):
    """The pairs grouped by expert into a static [E, C] grid (rows past C dropped: callers pick C >= the
    largest group). Returns (token [E*C] source row per cell (N = empty), weight [E*C] fp32)."""
    n, k = ids.shape
    order, expert, sizes = moe_mod._sort_pairs(ids, num_experts)
    pos = jnp.arange(n * k) - (jnp.cumsum(sizes) - sizes)[expert]          # rank of each sorted pair in its group
    cell = jnp.where(pos < capacity, expert * capacity + pos, num_experts * capacity)
    token = jnp.full((num_experts * capacity,), n, jnp.int32).at[cell].set(order // k, mode="drop")
    weight = jnp.zeros((num_experts * capacity,), jnp.float32).at[cell].set(weights.reshape(-1)[order], mode="drop")
    return token, weight, jnp.max(sizes)


def _capacity_mlp(p, x, token, weight, capacity):
    """One batched matmul per projection over the [E, C, H] grid: each expert's weights are read in place."""
    e, h_dim = p["up"].shape[:2]
    xs = jnp.take(x, token, axis=0, mode="fill", fill_value=0).reshape(e, capacity, h_dim)
    proj = lambda a, w: jnp.einsum("ech,ehf->ecf", a, w)
    act = moe_mod._act(proj(xs, p["gate"]), proj(xs, p["up"])).astype(x.dtype)      # SwiGLU experts
    return moe_mod._combine(proj(act, p["down"]).reshape(e * capacity, h_dim), token, weight, x.shape[0])


def capacity_sizes(num_tokens: int, num_pairs: int, num_experts: int) -> tuple[int, int]:
    """(C_small, C_full): C_full = N holds any routing (an expert gets each token at most once); C_small,
    twice the mean group rounded up to 8 rows, holds a balanced routing at a fraction of the FLOPs."""
    twice_mean = -(-2 * num_pairs // num_experts)
    return min(num_tokens, -(-twice_mean // 8) * 8), num_tokens


def _experts_capacity(p, x, weights, ids, act: str):
    """Static capacity grid: C_small when every group fits it (checked on device), else C_full = N."""
    n, k = ids.shape
    e = p["up"].shape[0]
    small, full = capacity_sizes(n, n * k, e)
    token, weight, largest = capacity_layout(ids, weights, e, small)
    if small == full:
        return _capacity_mlp(p, x, token, weight, small).astype(x.dtype)

    def overflow(_):
        token_f, weight_f, _ = capacity_layout(ids, weights, e, full)
        return _capacity_mlp(p, x, token_f, weight_f, full)
    y = jax.lax.cond(largest <= small, lambda _: _capacity_mlp(p, x, token, weight, small), overflow, None)
    return y.astype(x.dtype)




# name -> (experts fn, whether it takes the packed experts)
DISPATCHES = {"blocked": (moe_mod._experts_blocked, False), "capacity": (_experts_capacity, False),
              "cpu_kernel": (moe_mod._experts_cpu, True)}


def _median_ms(fn, *args, reps=7):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,8,32,128,512")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=512)
    args = ap.parse_args()
    e, k, h, f = args.experts, args.top_k, args.hidden, args.inter
    rng = np.random.default_rng(0)
    p = {name: jnp.asarray(rng.standard_normal(shape, np.float32) * 0.03)
         for name, shape in (("gate", (e, h, f)), ("up", (e, h, f)), ("down", (e, f, h)))}
    router = jnp.asarray(rng.standard_normal((h, e), np.float32))
    packed = jax.jit(moe_mod.pack_experts)(p) if resolve_kernels("auto").packs_experts(p["up"].dtype) else None
    report = {"backend": jax.default_backend(), "experts": e, "top_k": k, "hidden": h, "inter": f, "rows": []}
    for n in (int(t) for t in args.tokens.split(",")):
        x = jnp.asarray(rng.standard_normal((n, h), np.float32))
        weights, ids = moe_mod.route(router, x, k, True)
        ref = moe_mod._experts_gather(p, x, weights, ids, "silu")
        row = {"tokens": n}
        useful = 2 * 3 * n * k * h * f
        for name, (experts, takes_packed) in DISPATCHES.items():
            if takes_packed and packed is None:
                continue                              # the CPU kernel does not apply here (backend, compiler)
            fn = functools.partial(jax.jit(experts, static_argnums=4), packed if takes_packed else p)
            out = fn(x, weights, ids, "silu")
            err = float(jnp.max(jnp.abs(out - ref)))
            assert err < 1e-3, (name, n, err)
            ms = _median_ms(fn, x, weights, ids, "silu")
            row[name] = {"ms": round(ms, 3), "useful_gflops": round(useful / ms / 1e6, 1)}
        w_dense = jnp.asarray(rng.standard_normal((h, 2 * f * k), np.float32))
        ms = _median_ms(jax.jit(lambda x, w: x @ w), x, w_dense)
        row["dense_gemm_same_flops_ms"] = round(ms * 1.5, 3)       # [n, H] @ [H, 2kF] is 2/3 of the useful FLOPs
        report["rows"].append(row)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
