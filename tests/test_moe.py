"""MoE: both dispatches (per-token gather, sorted grouped ragged_dot) equal a dense
reference that runs every expert on every token and masks by the routing."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from atlas_jax.layers import moe as moe_mod


def _params(seed, h=16, f=8, e=6, shared=True):
    ks = jax.random.split(jax.random.PRNGKey(seed), 7)
    p = {"router": jax.random.normal(ks[0], (h, e)),
         "experts": {"gate": jax.random.normal(ks[1], (e, h, f)) * 0.3, "up": jax.random.normal(ks[2], (e, h, f)) * 0.3,
                     "down": jax.random.normal(ks[3], (e, f, h)) * 0.3}}
    if shared:
        p["shared"] = {"gate": jax.random.normal(ks[4], (h, 12)) * 0.3, "up": jax.random.normal(ks[5], (h, 12)) * 0.3,
                       "down": jax.random.normal(ks[6], (12, h)) * 0.3}
        p["shared_gate"] = jax.random.normal(ks[0], (h, 1))
    return p


def _dense_reference(p, x, k, renorm):
    x = np.asarray(x, np.float64)
    logits = x @ np.asarray(p["router"], np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    y = np.zeros_like(x)
    silu = lambda a: a / (1 + np.exp(-a))
    for n in range(x.shape[0]):
        top = np.argsort(-probs[n])[:k]
        w = probs[n, top] / (probs[n, top].sum() if renorm else 1.0)
        for e, we in zip(top, w):
            ex = {name: np.asarray(a[e], np.float64) for name, a in p["experts"].items()}
            y[n] += we * ((silu(x[n] @ ex["gate"]) * (x[n] @ ex["up"])) @ ex["down"])
    if "shared" in p:
        s = {name: np.asarray(a, np.float64) for name, a in p["shared"].items()}
        gate = 1 / (1 + np.exp(-(x @ np.asarray(p["shared_gate"], np.float64))))
        y += gate * ((silu(x @ s["gate"]) * (x @ s["up"])) @ s["down"])
    return y


@pytest.mark.parametrize("n,k,renorm,shared", [(1, 2, True, True), (3, 2, True, False), (5, 3, False, True),
                                               (40, 2, True, True), (17, 1, False, False)])
def test_moe_matches_dense_reference(n, k, renorm, shared):
    p = _params(n, shared=shared)
    x = jax.random.normal(jax.random.PRNGKey(100 + n), (n, 16))
    ref = _dense_reference(p, x, k, renorm)
    out = jax.jit(lambda p, x: moe_mod.moe(p, x, k, renorm))(p, x)
    np.testing.assert_allclose(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("n,k,e", [(1, 1, 6), (1, 4, 6), (9, 2, 6), (64, 3, 6), (33, 2, 16), (300, 4, 6)])
def test_dispatches_agree(n, k, e):
    p = _params(n + k, e=e)
    x = jax.random.normal(jax.random.PRNGKey(1), (n, 16))
    w, ids = moe_mod.route(p["router"], x, k, True)
    a = jax.jit(moe_mod._experts_ragged)(p["experts"], x, w, ids)
    b = jax.jit(moe_mod._experts_blocked)(p["experts"], x, w, ids)
    np.testing.assert_allclose(a, b, atol=1e-5)


def test_blocked_dispatch_work_scales_with_top_k():
    """Decode (1 token) runs k single-row blocks: the k chosen experts, not all E."""
    assert moe_mod.block_rows(1 * 10, 512) == 1
    assert moe_mod.block_rows(4096 * 10, 512) == 64
    assert moe_mod.dispatch_for("cpu") == "blocked" and moe_mod.dispatch_for("gpu") == "ragged"
