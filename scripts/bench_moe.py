"""MoE expert dispatch on this backend, each candidate in isolation, side by side in one run.

    python scripts/bench_moe.py [--tokens 1,8,32,128,512] [--experts 16] [--top-k 4] [--hidden 1024] [--inter 512]

Prints one JSON object: per token count, the median ms of each dispatch over the same routed input and
its useful GFLOP/s (FLOPs of the k chosen experts only), plus the dense GEMM rate at the same width for scale.
Every candidate's output is checked against the per-pair gather reference first.
"""
import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from atlas_jax.layers import moe as moe_mod


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
    report = {"backend": jax.default_backend(), "experts": e, "top_k": k, "hidden": h, "inter": f, "rows": []}
    for n in (int(t) for t in args.tokens.split(",")):
        x = jnp.asarray(rng.standard_normal((n, h), np.float32))
        weights, ids = moe_mod.route(router, x, k, True)
        ref = moe_mod._experts_gather(p, x, weights, ids)
        row = {"tokens": n}
        useful = 2 * 3 * n * k * h * f
        for name in moe_mod.CPU_DISPATCHES:
            fn = jax.jit(lambda p, x, w, i, name=name: moe_mod.CPU_DISPATCHES[name](p, x, w, i))
            out = fn(p, x, weights, ids)
            err = float(jnp.max(jnp.abs(out - ref)))
            assert err < 1e-3, (name, n, err)
            ms = _median_ms(fn, p, x, weights, ids)
            row[name] = {"ms": round(ms, 3), "useful_gflops": round(useful / ms / 1e6, 1)}
        w_dense = jnp.asarray(rng.standard_normal((h, 2 * f * k), np.float32))
        ms = _median_ms(jax.jit(lambda x, w: x @ w), x, w_dense)
        row["dense_gemm_same_flops_ms"] = round(ms * 1.5, 3)       # [n, H] @ [H, 2kF] is 2/3 of the useful FLOPs
        report["rows"].append(row)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
