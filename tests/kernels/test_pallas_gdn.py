"""The GDN Pallas kernels (interpret mode on CPU, or compiled with ATLAS_JAX_PALLAS_COMPILED=1 on
a GPU) against the token-by-token reference, which is itself checked against the engine's XLA
recurrence (tested against HF in test_hf_parity) and, without the delta rule, against Mamba2's SSD
written out directly. Shapes: q_len 0 (padding) / 1 / K <= 8 / prefill lengths around chunk
boundaries, GQA ratios 1 and 2, Dv split into column blocks, state positions R = 1 (plain) and
R = T (verify intermediates), fresh and carried states, with and without the delta rule."""
import os

import jax.numpy as jnp
import numpy as np
from budget import examples
from helpers import gdn_inputs, gdn_rows
from hypothesis import given, settings
from hypothesis import strategies as st

from atlas_jax.layers import gdn as xla_gdn
from atlas_jax.layers.norms import l2_normalize
from pallas_kernels import gdn as kernels

INTERPRET = os.environ.get("ATLAS_JAX_PALLAS_COMPILED") != "1"
TOL = dict(atol=2e-4, rtol=2e-4)


def test_reference_matches_engine_recurrence():
    rng = np.random.default_rng(0)
    q, k, v, g, beta, pool = gdn_inputs(rng, 3, 6, 2, 4, 8, 12, 5, 1)
    slot, read_idx = jnp.array([4, 0, 2]), jnp.zeros(3, jnp.int32)
    o, pool2 = kernels.reference(q, k, v, g, beta, pool, slot, read_idx, jnp.full(3, 6), jnp.zeros(3, bool))
    o_x, s_x = xla_gdn.recurrent(jnp.repeat(q, 2, 2), jnp.repeat(k, 2, 2), v, g, beta, pool[slot, 0])
    np.testing.assert_allclose(o, o_x, **TOL)
    np.testing.assert_allclose(pool2[slot, 0], s_x, **TOL)


def test_reference_without_delta_rule_is_mamba2():
    """delta_rule=False is Mamba2's selective state update (state [P, N] per head, HF's layout):
    s = s exp(dt A) + dt x B^T; y = s C, with q = C, k = B (per group), v = x, g = dt A, beta = dt."""
    rng = np.random.default_rng(1)
    b, t, groups, heads, n, p = 2, 5, 2, 4, 8, 6
    x = rng.standard_normal((b, t, heads, p))
    bm, cm = rng.standard_normal((b, t, groups, n)), rng.standard_normal((b, t, groups, n))
    dt, a = np.log1p(np.exp(rng.standard_normal((b, t, heads)))), -np.exp(rng.standard_normal(heads))
    s = rng.standard_normal((b, heads, p, n))
    pool = jnp.asarray(np.swapaxes(s, -1, -2)[:, None], jnp.float32)                # [slots, 1, H, N, P]
    f32 = lambda z: jnp.asarray(z, jnp.float32)
    o, pool_out = kernels.reference(f32(cm), f32(bm), f32(x), f32(dt * a), f32(dt), pool, jnp.arange(b),
                                    jnp.zeros(b, jnp.int32), jnp.full(b, t), jnp.zeros(b, bool), delta_rule=False)
    group = np.arange(heads) // (heads // groups)
    ys = []
    for i in range(t):
        s = (s * np.exp(dt[:, i] * a)[..., None, None]
             + (dt[:, i, :, None] * x[:, i])[..., None] * bm[:, i][:, group, None, :])
        ys.append(np.einsum("bhpn,bhn->bhp", s, cm[:, i][:, group]))
    np.testing.assert_allclose(o, np.stack(ys, 1), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(pool_out[:, 0], np.swapaxes(s, -1, -2), atol=1e-4, rtol=1e-4)


@settings(max_examples=examples(8), deadline=None)
@given(t=st.sampled_from([1, 2, 5, 8]), ratio=st.sampled_from([1, 2]), dk=st.sampled_from([16, 32]),
       dv=st.sampled_from([16, 128]), verify=st.booleans(), delta_rule=st.booleans(), seed=st.integers(0, 10_000))
def test_recurrent_kernel_matches_reference(t, ratio, dk, dv, verify, delta_rule, seed):
    rng = np.random.default_rng(seed)
    b, hk, num_slots = 4, 2, 6
    positions = t if verify else 1
    q, k, v, g, beta, pool = gdn_inputs(rng, b, t, hk, hk * ratio, dk, dv, num_slots, positions)
    rows = gdn_rows(rng, b, t, num_slots, positions)
    o_ref, pool_ref = kernels.reference(q, k, v, g, beta, pool, *rows, delta_rule=delta_rule)
    o, pool_out = kernels.gdn_recurrent(q, k, v, g, beta, pool.copy(), *rows, interpret=INTERPRET,
                                        delta_rule=delta_rule)
    np.testing.assert_allclose(o, o_ref, **TOL)
    np.testing.assert_allclose(pool_out, pool_ref, **TOL)
    padding = np.asarray(rows[2]) == 0
    assert np.all(np.asarray(o)[padding] == 0)


def test_verify_intermediates_equal_one_token_at_a_time():
    """A K-token verify with R = K positions leaves, at position t, exactly the state that feeding
    the same tokens one decode step at a time leaves after token t."""
    rng = np.random.default_rng(7)
    t, hk, hv, dk, dv = 6, 1, 2, 16, 128
    q, k, v, g, beta, pool = gdn_inputs(rng, 2, t, hk, hv, dk, dv, 3, t)
    slot, read_idx, q_len, fresh = jnp.array([2, 0]), jnp.array([3, 0]), jnp.array([6, 4]), jnp.array([False, True])
    _, verified = kernels.gdn_recurrent(q, k, v, g, beta, pool.copy(), slot, read_idx, q_len, fresh, interpret=INTERPRET)
    single = pool[:, :1]
    for row in range(2):
        state = single.at[slot[row], 0].set(pool[slot[row], read_idx[row]])
        for i in range(int(q_len[row])):
            cut = lambda x: x[row:row + 1, i:i + 1]
            _, state = kernels.gdn_recurrent(cut(q), cut(k), cut(v), cut(g), cut(beta), state, slot[row:row + 1],
                                             jnp.zeros(1, jnp.int32), jnp.ones(1, jnp.int32),
                                             fresh[row:row + 1] & (i == 0), interpret=INTERPRET)
            np.testing.assert_allclose(verified[slot[row], i], state[slot[row], 0], **TOL)
    np.testing.assert_array_equal(verified[1], pool[1])          # a slot no row owns is untouched


def _packed(rng, lengths, hk, hv, dk, dv):
    n = sum(lengths)
    q, k, v, g, beta, _ = gdn_inputs(rng, 1, n, hk, hv, dk, dv, 1, 1)
    return tuple(x[0] for x in (q, k, v, g, beta))


@settings(max_examples=examples(6), deadline=None)
@given(lengths=st.lists(st.sampled_from([0, 1, 17, 63, 64, 65, 130]), min_size=1, max_size=4),
       ratio=st.sampled_from([1, 2]), dv=st.sampled_from([16, 128]), delta_rule=st.booleans(),
       seed=st.integers(0, 10_000))
def test_chunked_prefill_matches_reference(lengths, ratio, dv, delta_rule, seed):
    rng = np.random.default_rng(seed)
    hk, dk, num_slots, positions = 1, 16, 6, 2
    hv = hk * ratio
    q, k, v, g, beta = _packed(rng, lengths, hk, hv, dk, dv)
    pool = jnp.asarray(rng.standard_normal((num_slots, positions, hv, dk, dv)), jnp.float32)
    b = len(lengths)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    slot = jnp.asarray(np.where(np.array(lengths) > 0, rng.permutation(num_slots)[:b], num_slots), jnp.int32)
    read_idx = jnp.asarray(rng.integers(0, positions, b), jnp.int32)
    fresh = jnp.asarray(rng.random(b) < 0.3)
    o, pool_out = kernels.gdn_chunked_prefill(q, k, v, g, beta, pool.copy(), cu, slot, read_idx, fresh,
                                              interpret=INTERPRET, delta_rule=delta_rule)
    # reference: the same sequences as padded-dense rows
    t = max(max(lengths), 1)
    dense = lambda x: jnp.stack([jnp.pad(x[cu[i]:cu[i + 1]], [(0, t - lengths[i])] + [(0, 0)] * (x.ndim - 1))
                                 for i in range(b)])
    o_ref, pool_ref = kernels.reference(*(dense(x) for x in (q, k, v, g, beta)), pool, slot, read_idx,
                                        jnp.asarray(lengths, jnp.int32), fresh, intermediates=False,
                                        delta_rule=delta_rule)
    for i in range(b):
        np.testing.assert_allclose(o[cu[i]:cu[i + 1]], o_ref[i, :lengths[i]], atol=1e-3, rtol=1e-3)
    np.testing.assert_allclose(pool_out, pool_ref, atol=1e-3, rtol=1e-3)


def test_chunked_prefill_nearly_parallel_keys():
    """Keys that are nearly parallel make the chunk's triangular system ill-suited to a power series
    ((I + A)^-1 = sum (-A)^k overflows: A's powers grow like binomial coefficients); forward
    substitution stays bounded and matches the token-by-token reference."""
    rng = np.random.default_rng(3)
    n, hk, hv, dk, dv = 2 * kernels.CHUNK, 1, 2, 16, 32
    base = rng.standard_normal(dk)
    k = l2_normalize(jnp.asarray(base + 1e-3 * rng.standard_normal((n, hk, dk)), jnp.float32))
    q = l2_normalize(jnp.asarray(rng.standard_normal((n, hk, dk)), jnp.float32)) * dk ** -0.5
    v = jnp.asarray(rng.standard_normal((n, hv, dv)), jnp.float32)
    g = jnp.full((n, hv), -1e-3, jnp.float32)                      # almost no decay
    beta = jnp.full((n, hv), 0.99, jnp.float32)
    pool = jnp.zeros((1, 1, hv, dk, dv), jnp.float32)
    args = (jnp.array([0]), jnp.array([0]))
    o, pool_out = kernels.gdn_chunked_prefill(q, k, v, g, beta, pool.copy(), jnp.array([0, n], jnp.int32), *args,
                                              jnp.array([True]), interpret=INTERPRET)
    o_ref, pool_ref = kernels.reference(*(x[None] for x in (q, k, v, g, beta)), pool, *args,
                                        jnp.array([n], jnp.int32), jnp.array([True]), intermediates=False)
    assert np.all(np.isfinite(np.asarray(o)))
    np.testing.assert_allclose(o, o_ref[0], atol=2e-3, rtol=2e-3)
    np.testing.assert_allclose(pool_out, pool_ref, atol=2e-3, rtol=2e-3)
