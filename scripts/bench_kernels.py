"""Microbenchmarks of the Pallas kernels against their XLA counterparts. Prints one JSON object.

    python scripts/bench_kernels.py [--quick] [--interpret]

Cases (Qwen3-Next-80B shapes: attention 16 q / 2 KV heads, head dim 256; GDN 16 key / 32 value
heads, Dk = Dv = 128; MoE hidden 2048, 512 experts of 512, top 10):
  - paged decode attention, batch 32, contexts 4k and 32k, bf16, page 16: achieved GB/s over
    the KV bytes read; verify (K = 4) at 4k; prefill (4 x 1024 new tokens): TFLOP/s;
  - GDN decode step (batch 1 and 32, one token): achieved GB/s over the state bytes read + written;
  - GDN chunked prefill (8 sequences x 4096 tokens): tokens/s;
  - MoE experts at decode (32 tokens): the Pallas grouped matmul vs XLA's gather and ragged_dot,
    GB/s over the routed experts' weight bytes.
Each with the XLA path timed in the same run, and the device's copy bandwidth (a large array
copied, read + write bytes) for scale. Timing dispatches every iteration and blocks once (a
per-call block adds host latency comparable to the kernels); donated state is chained through
the iterations. A case that fails reports its error instead of a number.
--quick shrinks every case (a CPU smoke run of the script; numbers meaningless there).
"""
import argparse
import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from atlas_jax.batch import StepBatch  # noqa: E402
from atlas_jax.layers import attention as xla_attention  # noqa: E402
from atlas_jax.layers import gdn as xla_gdn  # noqa: E402
from atlas_jax.layers import moe as xla_moe  # noqa: E402
from pallas_kernels import gdn as pallas_gdn  # noqa: E402
from pallas_kernels import paged_attention as pallas_attention  # noqa: E402


def timed(fn, *args, iters=20):
    """Seconds per call of fn(*args): a warm-up call (compile), then `iters` calls dispatched
    back to back and one block at the end."""
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    outs = [fn(*args) for _ in range(iters)]
    jax.block_until_ready(outs)
    return (time.perf_counter() - t0) / iters


def timed_chain(fn, state, iters=20):
    """Seconds per call of state = fn(state) (state donated: each call consumes the last one's output)."""
    state = jax.block_until_ready(fn(state))
    t0 = time.perf_counter()
    for _ in range(iters):
        state = fn(state)
    jax.block_until_ready(state)
    return (time.perf_counter() - t0) / iters


def copy_bandwidth_gbs(nbytes):
    x = jnp.ones((nbytes // 4,), jnp.float32)
    copy = jax.jit(lambda a: a * 1.0001)
    return 2 * x.nbytes / timed(copy, x) / 1e9


def attention_case(batch, context, quick, interpret, t=1):
    heads, kv_heads, d, page = (4, 1, 64, 16) if quick else (16, 2, 256, 16)
    pages_per_seq = context // page
    num_pages = batch * pages_per_seq + 1
    key = jax.random.PRNGKey(0)
    kp = jax.random.normal(key, (num_pages, page, kv_heads, d), jnp.bfloat16)
    vp = jax.random.normal(jax.random.fold_in(key, 1), (num_pages, page, kv_heads, d), jnp.bfloat16)
    q = jax.random.normal(jax.random.fold_in(key, 2), (batch, t, heads, d), jnp.bfloat16)
    table = jax.random.permutation(key, num_pages - 1)[:batch * pages_per_seq].reshape(batch, pages_per_seq)
    table = table.astype(jnp.int32)
    start = jnp.full((batch,), context - t, jnp.int32)
    q_len = jnp.full((batch,), t, jnp.int32)
    scale = d ** -0.5
    kernel = jax.jit(lambda q, k, v: pallas_attention.paged_attention(q, k, v, table, start, q_len, scale=scale,
                                                                      interpret=interpret))
    seg = StepBatch(tokens=jnp.zeros((batch, t), jnp.int32), q_len=q_len, start=start, block_table=table,
                    slot=jnp.zeros((batch,), jnp.int32), state_idx=jnp.zeros((batch,), jnp.int32))
    xla = jax.jit(lambda q, k, v: xla_attention.paged_attention(q, k, v, seg, scale)[0])
    kv_bytes = 2 * batch * context * kv_heads * d * 2
    t_k, t_x = timed(kernel, q, kp, vp), timed(xla, q, kp, vp)
    err = float(jnp.max(jnp.abs(kernel(q, kp, vp).astype(jnp.float32) - xla(q, kp, vp).astype(jnp.float32))))
    flops = 4 * batch * heads * d * t * (context - t / 2)                # QK^T and PV over the causal span
    out = {"pallas_ms": t_k * 1e3, "pallas_gbs": kv_bytes / t_k / 1e9, "xla_ms": t_x * 1e3,
           "xla_gbs": kv_bytes / t_x / 1e9, "pallas_tflops": flops / t_k / 1e12, "xla_tflops": flops / t_x / 1e12,
           "max_abs_diff": err}
    if t <= pallas_attention.SPLIT_MAX_T:
        out["splits"] = pallas_attention.decode_splits(batch, kv_heads, pages_per_seq)
    return out


def gdn_inputs(b, t, hk, hv, dk, dv, key):
    ks = jax.random.split(key, 5)
    q = xla_gdn.l2_normalize(jax.random.normal(ks[0], (b, t, hk, dk))) * dk ** -0.5
    k = xla_gdn.l2_normalize(jax.random.normal(ks[1], (b, t, hk, dk)))
    v = jax.random.normal(ks[2], (b, t, hv, dv))
    g = -jax.nn.softplus(jax.random.normal(ks[3], (b, t, hv)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, hv)))
    return q, k, v, g, beta


def gdn_decode_case(batch, quick, interpret):
    hk, hv, dk, dv = (2, 4, 32, 32) if quick else (16, 32, 128, 128)
    q, k, v, g, beta = gdn_inputs(batch, 1, hk, hv, dk, dv, jax.random.PRNGKey(3))
    pool = jnp.zeros((batch, 1, hv, dk, dv), jnp.float32)
    slot = jnp.arange(batch, dtype=jnp.int32)
    zeros, ones = jnp.zeros_like(slot), jnp.ones_like(slot)
    fresh = jnp.zeros((batch,), bool)
    kernel = jax.jit(lambda pool: pallas_gdn.gdn_recurrent(q, k, v, g, beta, pool, slot, zeros, ones, fresh,
                                                           interpret=interpret)[1], donate_argnums=0)
    r = hv // hk

    def xla(pool):
        _, s = xla_gdn.recurrent(jnp.repeat(q, r, 2), jnp.repeat(k, r, 2), v, g, beta, pool[:, 0])
        return pool.at[:, 0].set(s)
    xla = jax.jit(xla, donate_argnums=0)
    state_bytes = 2 * pool.size * 4
    t_k = timed_chain(kernel, pool)
    t_x = timed_chain(xla, jnp.zeros_like(pool))
    return {"pallas_us": t_k * 1e6, "pallas_gbs": state_bytes / t_k / 1e9, "xla_us": t_x * 1e6,
            "xla_gbs": state_bytes / t_x / 1e9, "block_v": pallas_gdn.block_v(batch, hv, dv)}


def gdn_prefill_case(seqs, length, quick, interpret):
    hk, hv, dk, dv = (2, 4, 32, 32) if quick else (16, 32, 128, 128)
    q, k, v, g, beta = gdn_inputs(seqs, length, hk, hv, dk, dv, jax.random.PRNGKey(4))
    flat = lambda x: x.reshape(seqs * length, *x.shape[2:])
    pool = jnp.zeros((seqs, 1, hv, dk, dv), jnp.float32)
    slot = jnp.arange(seqs, dtype=jnp.int32)
    offset = slot * length
    lengths = jnp.full((seqs,), length, jnp.int32)
    fresh = jnp.ones((seqs,), bool)
    args = tuple(flat(x) for x in (q, k, v, g, beta))
    kernel = jax.jit(lambda *a: pallas_gdn.gdn_chunked(*a, pool, offset, lengths, slot, jnp.zeros_like(slot), fresh,
                                                       interpret=interpret)[0])
    r = hv // hk
    xla = jax.jit(lambda q, k, v, g, beta: xla_gdn.chunked(jnp.repeat(q, r, 2), jnp.repeat(k, r, 2), v, g, beta,
                                                           jnp.zeros((seqs, hv, dk, dv)))[0])
    t_k, t_x = timed(kernel, *args, iters=3), timed(xla, q, k, v, g, beta, iters=3)
    tokens = seqs * length
    return {"pallas_tokens_per_s": tokens / t_k, "xla_tokens_per_s": tokens / t_x}


def moe_case(tokens, quick, interpret):
    h, f, e, k = (128, 64, 16, 4) if quick else (2048, 512, 512, 10)
    key = jax.random.PRNGKey(5)
    ks = jax.random.split(key, 4)
    p = {name: (jax.random.normal(kk, shape, jnp.bfloat16) * 0.02)
         for name, kk, shape in (("gate", ks[0], (e, h, f)), ("up", ks[1], (e, h, f)), ("down", ks[2], (e, f, h)))}
    x = jax.random.normal(ks[3], (tokens, h), jnp.bfloat16)
    ids = jax.random.randint(key, (tokens, k), 0, e)
    weights = jnp.full((tokens, k), 1.0 / k, jnp.float32)
    routed = int(np.unique(np.asarray(ids)).size)
    weight_bytes = routed * 3 * h * f * 2
    cases = {"pallas": jax.jit(lambda p, x: xla_moe._experts_pallas(p, x, weights, ids, "silu", interpret)),
             "xla_gather": jax.jit(lambda p, x: xla_moe._experts_gather(p, x, weights, ids, "silu")),
             "xla_ragged": jax.jit(lambda p, x: xla_moe._experts_ragged(p, x, weights, ids, "silu"))}
    out = {"routed_experts": routed}
    ref = None
    for name, fn in cases.items():
        t = timed(fn, p, x)
        out[f"{name}_us"], out[f"{name}_gbs"] = t * 1e6, weight_bytes / t / 1e9
        y = fn(p, x).astype(jnp.float32)
        ref = y if ref is None else ref
        out[f"{name}_max_abs_diff"] = float(jnp.max(jnp.abs(y - ref)))
    return out


def guarded(fn, *args):
    try:
        return fn(*args)
    except Exception as e:    # a failing case reports its error; the others still run
        traceback.print_exc(file=sys.stderr)
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--interpret", action="store_true", help="run the kernels in interpret mode (CPU)")
    args = ap.parse_args()
    quick, interp = args.quick, args.interpret or jax.default_backend() == "cpu"
    contexts = [256, 1024] if quick else [4096, 32768]
    batch = 4 if quick else 32
    out = {"backend": jax.default_backend(), "device": str(jax.devices()[0]), "jax": jax.__version__,
           "interpret": interp,
           "copy_gbs": guarded(copy_bandwidth_gbs, (64 if quick else 2048) * 2**20)}
    for ctx in contexts:
        out[f"decode_attention_b{batch}_ctx{ctx}"] = guarded(attention_case, batch, ctx, quick, interp)
    out[f"verify4_attention_b{batch}_ctx{contexts[0]}"] = guarded(attention_case, batch, contexts[0], quick, interp, 4)
    prefill_t = 64 if quick else 1024
    out[f"prefill_attention_4x{prefill_t}"] = guarded(attention_case, 4, 2 * prefill_t, quick, interp, prefill_t)
    for b in (1, batch):
        out[f"gdn_decode_b{b}"] = guarded(gdn_decode_case, b, quick, interp)
    seqs, length = (2, 128) if quick else (8, 4096)
    out[f"gdn_prefill_{seqs}x{length}"] = guarded(gdn_prefill_case, seqs, length, quick, interp)
    out[f"moe_experts_{batch}_tokens"] = guarded(moe_case, batch, quick, interp)
    copy = out["copy_gbs"]
    if isinstance(copy, float):
        for name, case in out.items():
            if isinstance(case, dict) and "pallas_gbs" in case:
                case["pallas_fraction_of_copy"] = case["pallas_gbs"] / copy
    print(json.dumps(_rounded(out)))


def _rounded(x):
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    return float(f"{x:.4g}") if isinstance(x, float) else x


if __name__ == "__main__":
    main()
