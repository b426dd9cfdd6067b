"""MoE: every dispatch (blocked scan, per-pair gather, sorted ragged_dot, the Pallas grouped
matmul interpreted, the CPU custom call on packed experts) equals a dense reference that runs every expert on every token and masks by
the routing; the grouped-matmul kernel against its einsum reference over many shapes."""
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from budget import examples
from hypothesis import example, given, settings
from hypothesis import strategies as st

from atlas_jax import cpu_kernels
from atlas_jax.kernels import CPU, Kernels
from atlas_jax.layers import mlp as mlp_mod
from atlas_jax.layers import moe as moe_mod
from pallas_kernels import grouped_matmul

INTERPRET = os.environ.get("ATLAS_JAX_PALLAS_COMPILED") != "1"


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
            hidden = (silu(x[n] @ ex["gate"]) * (x[n] @ ex["up"]) if "gate" in ex
                      else np.maximum(x[n] @ ex["up"], 0) ** 2)
            y[n] += we * (hidden @ ex["down"])
    if "shared" in p:
        s = {name: np.asarray(a, np.float64) for name, a in p["shared"].items()}
        gate = 1 / (1 + np.exp(-(x @ np.asarray(p["shared_gate"], np.float64))))
        hidden = silu(x @ s["gate"]) * (x @ s["up"]) if "gate" in s else np.maximum(x @ s["up"], 0) ** 2
        y += gate * (hidden @ s["down"])
    return y


@pytest.mark.parametrize("n,k,renorm,shared", [(1, 2, True, True), (3, 2, True, False), (5, 3, False, True),
                                               (40, 2, True, True), (17, 1, False, False)])
def test_moe_matches_dense_reference(n, k, renorm, shared):
    p = _params(n, shared=shared)
    x = jax.random.normal(jax.random.PRNGKey(100 + n), (n, 16))
    ref = _dense_reference(p, x, k, renorm)
    spec = moe_mod.MoeSpec(k, renorm, shared=shared, shared_gate=shared)
    out = jax.jit(lambda p, x: moe_mod.moe(p, x, spec))(p, x)
    np.testing.assert_allclose(out, ref, atol=1e-4, rtol=1e-4)


def test_variant_is_the_configs_not_the_params():
    """The variant comes from the spec (the config), never from which params exist: a param the spec does
    not name is ignored, and one it names that the params lack is an error, not another variant."""
    p = _params(3, shared=True)
    x = jax.random.normal(jax.random.PRNGKey(3), (5, 16))
    gated = moe_mod.moe(p, x, moe_mod.MoeSpec(2, shared=True, shared_gate=True))
    np.testing.assert_allclose(gated, _dense_reference(p, x, 2, True), atol=1e-4, rtol=1e-4)
    routed = moe_mod.moe(p, x, moe_mod.MoeSpec(2))                           # shared expert params ignored
    without = {k: v for k, v in p.items() if k not in ("shared", "shared_gate")}
    np.testing.assert_allclose(routed, _dense_reference(without, x, 2, True), atol=1e-4, rtol=1e-4)
    ungated = moe_mod.moe(p, x, moe_mod.MoeSpec(2, shared=True))             # shared_gate present, not named
    np.testing.assert_allclose(ungated - routed, mlp_mod.swiglu(p["shared"], x), atol=1e-4, rtol=1e-4)
    with pytest.raises(KeyError):
        moe_mod.moe(without, x, moe_mod.MoeSpec(2, shared=True))
    s = p["shared"]                                                          # has a gate; relu2 ignores it
    np.testing.assert_allclose(mlp_mod.mlp(s, x, "relu2"), jnp.square(jax.nn.relu(x @ s["up"])) @ s["down"],
                               atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="activation"):
        mlp_mod.mlp(s, x, "gelu")


@pytest.mark.parametrize("n,k,e", [(1, 1, 6), (1, 4, 6), (9, 2, 6), (64, 3, 6), (33, 2, 16), (300, 4, 6)])
def test_dispatches_agree(n, k, e):
    p = _params(n + k, e=e)
    x = jax.random.normal(jax.random.PRNGKey(1), (n, 16))
    w, ids = moe_mod.route(p["router"], x, k, True)
    a, b, c = (jax.jit(f, static_argnums=4)(p["experts"], x, w, ids, "silu")
               for f in (moe_mod._experts_ragged, moe_mod._experts_blocked, moe_mod._experts_gather))
    np.testing.assert_allclose(a, b, atol=1e-5)
    np.testing.assert_allclose(a, c, atol=1e-5)


@pytest.mark.parametrize("n,k", [(1, 2), (5, 3), (40, 2)])
def test_pallas_dispatch_matches_dense_reference(n, k):
    p = _params(n, h=32, f=16, e=6)
    x = jax.random.normal(jax.random.PRNGKey(7 + n), (n, 32))
    ref = _dense_reference(p, x, k, True)
    kernels = Kernels(pallas=True, interpret=INTERPRET)
    assert kernels.moe(n * k, 6, (32, 16)) == "pallas"
    spec = moe_mod.MoeSpec(k, shared=True, shared_gate=True)
    out = jax.jit(lambda p, x: moe_mod.moe(p, x, spec, kernels))(p, x)
    np.testing.assert_allclose(out, ref, atol=1e-4, rtol=1e-4)


def test_cpu_kernels_build_where_a_compiler_is():
    """CI machines have g++: the CPU kernel must build there, or every CPU test below would skip."""
    if shutil.which("g++") or shutil.which("c++"):
        assert cpu_kernels.available(), cpu_kernels.unavailable_reason()


cpu_kernel = pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler for the CPU kernels")


@cpu_kernel
@settings(max_examples=examples(18), deadline=None)
@given(n=st.integers(1, 70), h=st.sampled_from([16, 24, 64, 72, 136]), f=st.sampled_from([8, 24, 32, 48, 96, 160]),
       e=st.integers(1, 12), k=st.integers(1, 4), glu=st.booleans(), shared=st.booleans(), seed=st.integers(0, 999))
@example(n=70, h=136, f=160, e=2, k=2, glu=True, shared=False, seed=1)   # > 48 pairs an expert, 2 chunks of H and F
def test_cpu_kernel_matches_dense_reference(n, h, f, e, k, glu, shared, seed):
    """Packed experts through the custom call, over dims that are and are not whole panels (tails are
    zero padding), rows that fill and do not fill the row tiles, SwiGLU and relu2 experts."""
    k = min(k, e)
    p = _params(seed, h=h, f=f, e=e, shared=shared)
    if not glu:                                      # relu2 experts (and shared expert)
        del p["experts"]["gate"]
        p.get("shared", {}).pop("gate", None)
    x = jax.random.normal(jax.random.PRNGKey(seed + 1), (n, h))
    ref = _dense_reference(p, x, k, True)
    packed = moe_mod.pack_params(p, [("experts",)])
    assert set(packed["experts"]) == {"gate_up", "down"}
    spec = moe_mod.MoeSpec(k, act="silu" if glu else "relu2", shared=shared, shared_gate=shared)
    out = jax.jit(lambda p, x: moe_mod.moe(p, x, spec, CPU))(packed, x)
    # relu2 outputs reach ~100 here: fp32 rounding of an output is relative to that scale, not to its own size
    scale = float(np.max(np.abs(ref)))
    np.testing.assert_allclose(out, ref, atol=1e-4 + 4e-6 * scale, rtol=1e-4)


@cpu_kernel
def test_pack_params_packs_the_moe_layers_it_is_given():
    layer = {"moe": _params(0), "input_norm": jnp.ones(16)}
    params = {"embed": jnp.ones((8, 16)), "layers": [layer, {"mlp": _params(1)["shared"]}],
              "mtp": {"layers": [layer]}}
    paths = [("layers", 0, "moe", "experts"), ("mtp", "layers", 0, "moe", "experts")]
    packed = moe_mod.pack_params(params, paths)
    for lay in (packed["layers"][0], packed["mtp"]["layers"][0]):
        assert set(lay["moe"]["experts"]) == {"gate_up", "down"}
        assert lay["moe"]["router"] is layer["moe"]["router"] and lay["input_norm"] is layer["input_norm"]
    assert packed["layers"][1]["mlp"] == params["layers"][1]["mlp"]
    bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    assert set(moe_mod.pack_params(bf16, paths)["layers"][0]["moe"]["experts"]) == {"gate", "up", "down"}


def test_dispatch_choice():
    """Decode (1 token) runs k single-row blocks: the k chosen experts, not all E; on GPU without
    Pallas, few pairs gather their experts rather than ragged_dot's dense expansion."""
    assert moe_mod.block_rows(1 * 10, 512) == 1
    assert moe_mod.block_rows(4096 * 10, 512) == 64
    cpu, gpu = Kernels(platform="cpu"), Kernels(platform="gpu")
    assert cpu.moe() == "blocked"
    assert gpu.moe(320, 512) == "gather" and gpu.moe(5120, 512) == "ragged"
    compiled = Kernels(pallas=True, platform="gpu")
    assert compiled.moe(10, 512, (2048, 512)) == "pallas"
    assert compiled.moe(10, 512, (2048, 24)) == "gather"     # tile-less shape: XLA


@settings(max_examples=examples(8), deadline=None)
@given(blocks=st.integers(1, 5), tb=st.sampled_from([16, 32]), k=st.sampled_from([16, 48, 64, 192]),
       n=st.sampled_from([16, 96, 128, 384]), e=st.integers(1, 4), bf16=st.booleans(), seed=st.integers(0, 999))
def test_grouped_matmul_matches_reference(blocks, tb, k, n, e, bf16, seed):
    rng = np.random.default_rng(seed)
    dtype = jnp.bfloat16 if bf16 else jnp.float32
    x = jnp.asarray(rng.standard_normal((blocks * tb, k)), dtype)
    w = jnp.asarray(rng.standard_normal((e, k, n)) * 0.1, dtype)
    expert = jnp.asarray(np.sort(rng.integers(0, e, blocks)), jnp.int32)
    used = jnp.asarray(np.arange(blocks) < rng.integers(1, blocks + 1), jnp.int32)
    out = grouped_matmul.grouped_matmul(x, w, expert, used, block_rows=tb, interpret=INTERPRET)
    ref = grouped_matmul.reference(x, w, expert, used, block_rows=tb)
    tol = 3e-2 if bf16 else 1e-4
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=tol, rtol=tol)
    assert np.all(np.asarray(out, np.float32).reshape(blocks, tb, n)[np.asarray(used) == 0] == 0)


def _sigmoid_grouped_reference(p, x, k, n_group, topk_group, scaling):
    """Nemotron-H's MoE in float64 numpy: sigmoid scores, + correction bias for the choice only,
    experts restricted to the topk_group groups with the best top-2 sums, weights renormalised and
    scaled; relu2 experts in the latent width; a relu2 shared expert on the input."""
    f64 = lambda a: np.asarray(a, np.float64)
    x = f64(x)
    scores = 1 / (1 + np.exp(-(x @ f64(p["router"]))))
    choice = scores + f64(p["router_bias"])
    n, e = choice.shape
    relu2 = lambda a: np.maximum(a, 0) ** 2
    xl = x @ f64(p["latent_in"])
    y = np.zeros((n, xl.shape[1]))
    for t in range(n):
        groups = choice[t].reshape(n_group, -1)
        group_score = np.sort(groups, axis=1)[:, -2:].sum(1)
        keep = np.argsort(-group_score)[:topk_group]
        masked = np.where(np.isin(np.arange(e) // (e // n_group), keep), choice[t], -np.inf)
        top = np.argsort(-masked)[:k]
        w = scores[t, top] / scores[t, top].sum() * scaling
        for ex, we in zip(top, w):
            y[t] += we * (relu2(xl[t] @ f64(p["experts"]["up"][ex])) @ f64(p["experts"]["down"][ex]))
    s = {name: f64(a) for name, a in p["shared"].items()}
    return y @ f64(p["latent_out"]) + relu2(x @ s["up"]) @ s["down"]


@pytest.mark.parametrize("n,k,n_group,topk_group", [(1, 2, 4, 1), (7, 3, 4, 2), (33, 2, 1, 1)])
def test_sigmoid_grouped_moe_matches_reference(n, k, n_group, topk_group):
    """Every dispatch (blocked, gather, ragged; Pallas interpreted) on Nemotron-H's routing and relu2 experts."""
    ks = jax.random.split(jax.random.PRNGKey(n), 8)
    h, d, f, e = 16, 32, 16, 8                        # latent 32 x 16: a shape the grouped-matmul kernel takes
    p = {"router": jax.random.normal(ks[0], (h, e)), "router_bias": 0.5 * jax.random.normal(ks[1], (e,)),
         "latent_in": 0.3 * jax.random.normal(ks[2], (h, d)), "latent_out": 0.3 * jax.random.normal(ks[3], (d, h)),
         "experts": {"up": 0.3 * jax.random.normal(ks[4], (e, d, f)), "down": 0.3 * jax.random.normal(ks[5], (e, f, d))},
         "shared": {"up": 0.3 * jax.random.normal(ks[6], (h, 10)), "down": 0.3 * jax.random.normal(ks[7], (10, h))}}
    x = jax.random.normal(jax.random.PRNGKey(50 + n), (n, h))
    ref = _sigmoid_grouped_reference(p, x, k, n_group, topk_group, 2.5)
    routing = moe_mod.Routing("sigmoid", n_group, topk_group, 2.5)
    spec = moe_mod.MoeSpec(k, True, routing, act="relu2", latent=True, shared=True)
    out = jax.jit(lambda p, x: moe_mod.moe(p, x, spec))(p, x)
    np.testing.assert_allclose(out, ref, atol=1e-4, rtol=1e-4)
    w, ids = moe_mod.route(p["router"], x, k, True, routing, p["router_bias"])
    xl = x @ p["latent_in"]
    for dispatch in (moe_mod._experts_gather, moe_mod._experts_ragged):
        np.testing.assert_allclose(jax.jit(dispatch, static_argnums=4)(p["experts"], xl, w, ids, "relu2"),
                                   jax.jit(moe_mod._experts_blocked, static_argnums=4)(p["experts"], xl, w, ids, "relu2"),
                                   atol=1e-5, rtol=1e-5)
    kernels = Kernels(pallas=True, interpret=INTERPRET)
    assert kernels.moe(n * k, e, (d, f)) == "pallas"
    pallas = jax.jit(lambda p, x: moe_mod.moe(p, x, spec, kernels))
    np.testing.assert_allclose(pallas(p, x), ref, atol=1e-4, rtol=1e-4)
