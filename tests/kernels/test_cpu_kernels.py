"""The CPU custom calls (atlas_jax/cpu_kernels): the GDN / Mamba2 recurrence against the Pallas
kernels' jnp reference (the contract both implement) over many shapes, its pool updated in place,
dense projections vs float64, and the engine choosing them by default on CPU. The MoE kernel's tests are in
test_moe.py."""
import dataclasses
import re
import shutil
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from budget import examples
from hypothesis import example, given, settings
from hypothesis import strategies as st
from helpers import gdn_inputs, gdn_rows

from atlas_jax import cpu_kernels
from atlas_jax.batch import StepBatch
from atlas_jax.kernels import CPU, XLA, resolve_kernels
from atlas_jax.layers import gdn, linear
from pallas_kernels import gdn as pallas_gdn

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler for the CPU kernels")
TOL = dict(atol=2e-5, rtol=2e-5)
recurrent = jax.jit(cpu_kernels.gdn_recurrent, static_argnames="delta_rule")
reference = jax.jit(pallas_gdn.reference, static_argnames=("intermediates", "delta_rule"))


def test_built_where_a_compiler_is_and_chosen_by_default():
    if shutil.which("g++") or shutil.which("c++"):
        assert cpu_kernels.available(), cpu_kernels.unavailable_reason()
    assert resolve_kernels("auto") == dataclasses.replace(CPU, platform="cpu")
    assert resolve_kernels("xla") == dataclasses.replace(XLA, platform="cpu")


@settings(max_examples=examples(18), deadline=None)
@given(t=st.sampled_from([1, 2, 5, 16, 37, 128]), ratio=st.sampled_from([1, 2, 4]), dk=st.sampled_from([8, 16, 64]),
       dv=st.sampled_from([8, 24, 64]), positions=st.sampled_from([1, 2, 4]), b=st.integers(1, 6),
       delta_rule=st.booleans(), seed=st.integers(0, 10_000))
@example(t=128, ratio=2, dk=64, dv=64, positions=2, b=3, delta_rule=True, seed=5)   # a prefill chunk
def test_recurrence_matches_reference(t, ratio, dk, dv, positions, b, delta_rule, seed):
    """Decode (t = 1), verify and prefill chunks, rows that are padding (q_len 0, slot out of range), fresh or
    reading a later state position, GQA ratios; outputs and every pool position."""
    rng = np.random.default_rng(seed)
    num_slots, hk = 7, 2
    q, k, v, g, beta, pool = gdn_inputs(rng, b, t, hk, hk * ratio, dk, dv, num_slots, positions)
    rows = gdn_rows(rng, b, t, num_slots, positions)
    o_ref, pool_ref = reference(q, k, v, g, beta, pool.copy(), *rows, delta_rule=delta_rule)
    o, pool_out = recurrent(q, k, v, g, beta, pool.copy(), *rows, delta_rule=delta_rule)
    np.testing.assert_allclose(o, o_ref, **TOL)
    np.testing.assert_allclose(pool_out, pool_ref, **TOL)


def test_live_slot_with_no_tokens_keeps_its_state():
    rng = np.random.default_rng(3)
    q, k, v, g, beta, pool = gdn_inputs(rng, 2, 3, 1, 2, 8, 8, 4, 2)
    rows = (jnp.array([1, 2]), jnp.array([1, 0]), jnp.array([0, 3]), jnp.array([False, False]))
    o, out = recurrent(q, k, v, g, beta, pool.copy(), *rows)
    np.testing.assert_array_equal(out[1], pool[1])
    assert np.all(np.asarray(o[0]) == 0)
    assert not np.allclose(out[2], pool[2])


def test_pool_updated_in_place():
    """Donated, the pool is aliased through the custom call: no copy of it in the compiled program."""
    rng = np.random.default_rng(4)
    q, k, v, g, beta, pool = gdn_inputs(rng, 3, 1, 2, 4, 16, 16, 64, 1)
    rows = gdn_rows(rng, 3, 1, 64, 1)
    step = jax.jit(lambda pool, *a: cpu_kernels.gdn_recurrent(*a[:5], pool, *a[5:])[::-1], donate_argnums=0)
    text = step.lower(pool, q, k, v, g, beta, *rows).compile().as_text()
    shape = "f32[64,1,4,16,16]"
    assert not [ln for ln in text.splitlines() if re.search(r"= " + re.escape(shape) + r"\S* copy\(", ln)]
    pool_ptr = pool.unsafe_buffer_pointer()
    new_pool, _ = step(pool, q, k, v, g, beta, *rows)
    assert new_pool.unsafe_buffer_pointer() == pool_ptr


def _gdn_case(rng, grouped, hk, ratio, dk, dv, width, num_slots, positions, shapes):
    """A GDN layer's params (grouped qkvz / ba or Qwen3.5's split projections), state pools and segments of the
    given [B, T] shapes: rows that decode, are padding (q_len 0, slot out of range), start fresh or read a
    later state position."""
    hv, conv_k = hk * ratio, 4
    c = 2 * hk * dk + hv * dv
    n = lambda *s, scale=1.0: jnp.asarray(rng.standard_normal(s) * scale, jnp.float32)
    p = {"conv": n(c, conv_k, scale=0.5), "A_log": n(hv, scale=0.5), "dt_bias": n(hv), "norm": n(dv),
         "out": n(hv * dv, width, scale=0.2)}
    if grouped:
        p |= {"qkvz": n(width, hk * (2 * dk + 2 * ratio * dv), scale=0.3), "ba": n(width, 2 * hv, scale=0.3)}
    else:
        p |= {"qkv": n(width, c, scale=0.3), "z": n(width, hv * dv, scale=0.3), "b": n(width, hv), "a": n(width, hv)}
    ssm = (n(num_slots, positions, hv, dk, dv, scale=0.3), n(num_slots, positions, c, conv_k))
    slots = iter(rng.permutation(num_slots))
    segments = []
    for b, t in shapes:
        q_len = rng.integers(0, t + 1, b).astype(np.int32)
        q_len[rng.integers(b)] = t                                  # a full row in every segment
        slot = np.array([next(slots) if q else num_slots for q in q_len], np.int32)
        start = np.where(rng.random(b) < 0.3, 0, rng.integers(1, 50, b)).astype(np.int32)
        segments.append(StepBatch(tokens=jnp.zeros((b, t), jnp.int32), q_len=jnp.asarray(q_len),
                                  start=jnp.asarray(start), block_table=jnp.zeros((b, 1), jnp.int32),
                                  slot=jnp.asarray(slot),
                                  state_idx=jnp.asarray(rng.integers(0, positions, b), jnp.int32)))
    cfg = types.SimpleNamespace(linear_num_key_heads=hk, linear_num_value_heads=hv, linear_key_head_dim=dk,
                                linear_value_head_dim=dv, rms_norm_eps=1e-6,
                                gdn_grouped=grouped)
    x = n(sum(b * t for b, t in shapes), width)
    return p, x, ssm, tuple(segments), cfg


@settings(max_examples=examples(18), deadline=None)
@given(grouped=st.booleans(), hk=st.sampled_from([1, 2]), ratio=st.sampled_from([1, 2, 4]),
       dk=st.sampled_from([8, 16]), dv=st.sampled_from([8, 24]), decode_rows=st.integers(0, 4),
       chunk=st.sampled_from([None, (2, 3), (3, 16), (2, 37)]), positions=st.sampled_from([1, 3]),
       seed=st.integers(0, 10_000))
@example(grouped=True, hk=2, ratio=2, dk=16, dv=16, decode_rows=4, chunk=(2, 37), positions=1, seed=1)  # a mixed step
@example(grouped=False, hk=2, ratio=2, dk=8, dv=8, decode_rows=0, chunk=(3, 3), positions=3, seed=2)   # a verify step
def test_gdn_layer_matches_xla(grouped, hk, ratio, dk, dv, decode_rows, chunk, positions, seed):
    """The fused layer call (conv, gates, recurrence, gated norm; pools in place) against the XLA layer it
    replaces: every real token's output and both pools, over decode, verify and prefill segments of one step."""
    if chunk is not None and chunk[1] > 16 and positions > 1:
        positions = 1      # prefill chunks with R > 1: the XLA path keeps only the final state (both are valid)
    shapes = [s for s in ((decode_rows, 1), chunk) if s and s[0]] or [(1, 1)]
    rng = np.random.default_rng(seed)
    p, x, ssm, segments, cfg = _gdn_case(rng, grouped, hk, ratio, dk, dv, 24, 11, positions, shapes)
    run = lambda kernels: jax.jit(lambda *a: gdn.gdn_layer(*a, cfg, kernels))(p, x, ssm, segments)
    y_ref, (h_ref, conv_ref) = run(XLA)
    y, (h, conv) = run(CPU)
    real = np.concatenate([np.asarray(s.valid).reshape(-1) for s in segments])
    np.testing.assert_allclose(np.asarray(y)[real], np.asarray(y_ref)[real], atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(h, h_ref, **TOL)
    np.testing.assert_allclose(conv, conv_ref, **TOL)


def test_gdn_layer_pools_updated_in_place():
    """Donated, both pools are aliased through the fused call: no copy of either in the compiled step."""
    p, x, ssm, segments, cfg = _gdn_case(np.random.default_rng(5), True, 2, 2, 16, 16, 24, 64, 1, [(3, 1)])
    step = jax.jit(lambda ssm, p, x, seg: gdn.gdn_layer(p, x, ssm, seg, cfg, CPU)[1], donate_argnums=0)
    text = step.lower(ssm, p, x, segments).compile().as_text()
    for pool in ssm:
        shape = f"f32[{','.join(map(str, pool.shape))}]"
        assert not [ln for ln in text.splitlines() if re.search(r"= " + re.escape(shape) + r"\S* copy\(", ln)]
    pointers = [pool.unsafe_buffer_pointer() for pool in ssm]
    assert [pool.unsafe_buffer_pointer() for pool in step(ssm, p, x, segments)] == pointers


@settings(max_examples=examples(24), deadline=None)
@given(m=st.integers(1, 70), k=st.integers(1, 300), n=st.integers(64, 300), seed=st.integers(0, 10_000))
@example(m=70, k=300, n=200, seed=3)          # two row blocks, chunks of K with a tail, a run of panels
def test_linear_matches_float64(m, k, n, seed):
    """Rows that fill and do not fill the row tiles and blocks, output widths with a partial last panel."""
    rng = np.random.default_rng(seed)
    x, w = rng.standard_normal((m, k)), rng.standard_normal((k, n))
    packed = linear.pack_linear(jnp.asarray(w, jnp.float32))
    y = jax.jit(lambda x, w: x @ w)(jnp.asarray(x, jnp.float32), packed)
    assert y.shape == (m, n) and packed.shape == (k, n)
    np.testing.assert_allclose(y, x @ w, atol=1e-4 * np.sqrt(k), rtol=1e-4)


def test_pack_linears_packs_the_paths_it_is_given():
    p = {"embed": jnp.ones((10, 16)), "lm_head": jnp.ones((16, 100)),
         "layers": [{"attn": {"q": jnp.ones((16, 128)), "k": jnp.ones((16, 8)), "q_norm": jnp.ones(16)},
                     "moe": {"router": jnp.ones((16, 64)), "shared": {"up": jnp.ones((16, 64))}}}]}
    paths = [("lm_head",), ("layers", 0, "attn", "q"), ("layers", 0, "attn", "k"), ("layers", 0, "moe", "shared", "up")]
    packed = linear.pack_linears(p, paths)
    lay = packed["layers"][0]
    assert isinstance(packed["lm_head"], linear.PackedLinear) and isinstance(lay["attn"]["q"], linear.PackedLinear)
    assert isinstance(lay["moe"]["shared"]["up"], linear.PackedLinear)
    # k is too narrow for the kernel (Kernels.packs_linear); the rest was not named
    for kept in (packed["embed"], lay["attn"]["k"], lay["attn"]["q_norm"], lay["moe"]["router"]):
        assert isinstance(kept, jax.Array)
    assert lay["moe"]["router"] is p["layers"][0]["moe"]["router"]
    x = jnp.ones((2, 3, 16))
    np.testing.assert_array_equal(x @ lay["attn"]["q"], x @ p["layers"][0]["attn"]["q"])


def _attention_float64(q, k_pages, v_pages, table, start, q_len, scale):
    """Dense float64 attention: query t of row b sees its row's KV positions 0 .. start + t."""
    b, t, h, d = q.shape
    page_size, hkv = k_pages.shape[1], k_pages.shape[2]
    out = np.zeros((b, t, h, d))
    for r in range(b):
        for i in range(q_len[r]):
            pos = np.arange(start[r] + i + 1)
            pages = table[r, pos // page_size]
            k = k_pages[pages, pos % page_size].astype(np.float64)           # [L, Hkv, D]
            v = v_pages[pages, pos % page_size].astype(np.float64)
            for head in range(h):
                s = scale * k[:, head // (h // hkv)] @ q[r, i, head].astype(np.float64)
                p = np.exp(s - s.max())
                out[r, i, head] = p @ v[:, head // (h // hkv)] / p.sum()
    return out


@settings(max_examples=examples(24), deadline=None)
@given(b=st.integers(1, 5), t=st.sampled_from([1, 2, 3, 8]), hkv=st.sampled_from([1, 2]), group=st.sampled_from([1, 4]),
       d=st.sampled_from([8, 64, 128, 36]), page_size=st.sampled_from([4, 16]), seed=st.integers(0, 10_000))
@example(b=3, t=1, hkv=2, group=4, d=128, page_size=16, seed=1)     # the bench model's decode (Qwen3-Next head shapes)
def test_paged_attention_matches_float64(b, t, hkv, group, d, page_size, seed):
    """Decode / verify rows at random context lengths (several online-softmax blocks), padding rows
    (q_len 0: zeros), rows feeding fewer tokens than T, pages scattered over the pool, unused table
    entries pointing at page 0."""
    rng = np.random.default_rng(seed)
    max_pages, num_pages = 24, 64
    k_pages, v_pages = (rng.standard_normal((num_pages, page_size, hkv, d)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((b, t, hkv * group, d)).astype(np.float32)
    q_len = rng.integers(0, t + 1, b).astype(np.int32)
    q_len[0] = t
    start = rng.integers(0, max_pages * page_size - t, b).astype(np.int32)
    table = np.zeros((b, max_pages), np.int32)
    for r in range(b):
        used = -(-(start[r] + q_len[r]) // page_size)
        table[r, :used] = rng.choice(np.arange(1, num_pages), used, replace=False)
    scale = d ** -0.5
    o = jax.jit(cpu_kernels.paged_attention, static_argnames="scale")(q, k_pages, v_pages, table, start, q_len,
                                                                      scale=scale)
    np.testing.assert_allclose(o, _attention_float64(q, k_pages, v_pages, table, start, q_len, scale),
                               atol=2e-5, rtol=2e-5)


@settings(max_examples=examples(24), deadline=None)
@given(n=st.integers(1, 150), e=st.integers(1, 40), k=st.integers(1, 8), renormalise=st.booleans(),
       ties=st.booleans(), seed=st.integers(0, 10_000))
@example(n=3, e=8, k=2, renormalise=True, ties=True, seed=0)
def test_moe_route_matches_xla_routing(n, e, k, renormalise, ties, seed):
    """Softmax top-k + the stable sort of the pairs by expert, as layers/moe.route and its sort give them;
    with `ties` the logits are small integers, so equal probabilities must go to the lower expert id."""
    from atlas_jax.layers import moe
    k = min(k, e)
    rng = np.random.default_rng(seed)
    logits = rng.integers(-2, 3, (n, e)) if ties else rng.standard_normal((n, e)) * 3
    logits = jnp.asarray(logits, jnp.float32)
    token, weight, sizes = jax.jit(lambda l: cpu_kernels.moe_route(l, k, renormalise))(logits)
    weights, ids = moe.route(jnp.eye(e), logits, k, renormalise)
    order, _, want_sizes = moe._sort_pairs(ids, e)
    np.testing.assert_array_equal(sizes, want_sizes)
    np.testing.assert_array_equal(token, order // k)
    np.testing.assert_allclose(weight, weights.reshape(-1)[order], rtol=2e-6, atol=1e-7)


@settings(max_examples=examples(18), deadline=None)
@given(rows=st.integers(1, 700), d=st.sampled_from([1, 7, 16, 64, 100, 256]), zero_centred=st.booleans(),
       residual=st.booleans(), seed=st.integers(0, 10_000))
@example(rows=600, d=256, zero_centred=True, residual=True, seed=1)      # several row blocks, in parallel
def test_rms_norm_matches_xla(rows, d, zero_centred, residual, seed):
    from atlas_jax.layers import norms
    rng = np.random.default_rng(seed)
    x, h = (jnp.asarray(rng.standard_normal((rows, 1, d)) * 3, jnp.float32) for _ in range(2))
    w = jnp.asarray(rng.standard_normal(d), jnp.float32)
    if residual:
        got = jax.jit(lambda x, h, w: norms.add_rms_norm(x, h, w, 1e-6, zero_centred, CPU))(x, h, w)
        want = norms.add_rms_norm(x, h, w, 1e-6, zero_centred, XLA)
    else:
        got = (jax.jit(lambda x, w: norms.rms_norm(x, w, 1e-6, zero_centred, CPU))(x, w),)
        want = (norms.rms_norm(x, w, 1e-6, zero_centred, XLA),)
    for g, r in zip(got, want):
        assert g.shape == r.shape
        np.testing.assert_allclose(g, r, rtol=2e-6, atol=2e-6)
