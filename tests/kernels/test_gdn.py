"""The GDN chunked (WY) form against the token-by-token recurrence, and the conv / state
carry across chunks. The recurrence itself is checked against HF in test_hf_parity."""
import jax
import jax.numpy as jnp
import numpy as np
from budget import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from atlas_jax.layers import gdn
from atlas_jax.layers.norms import l2_normalize


def _inputs(seed, b, t, h, dk, dv, with_state):
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    q = l2_normalize(jax.random.normal(ks[0], (b, t, h, dk))) * dk ** -0.5
    k = l2_normalize(jax.random.normal(ks[1], (b, t, h, dk)))
    v = jax.random.normal(ks[2], (b, t, h, dv))
    g = -jax.nn.softplus(jax.random.normal(ks[3], (b, t, h)))          # log decay <= 0
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, h)))
    s0 = jax.random.normal(ks[5], (b, h, dk, dv)) if with_state else jnp.zeros((b, h, dk, dv))
    return q, k, v, g, beta, s0


recurrent = jax.jit(gdn.recurrent, static_argnames=("all_states", "delta_rule"))
chunked = jax.jit(gdn.chunked, static_argnames=("chunk", "delta_rule"))


@settings(max_examples=examples(8), deadline=None)
@given(t=st.integers(1, 150), h=st.integers(1, 3), dk=st.sampled_from([4, 8, 12]), dv=st.sampled_from([4, 8, 20]),
       with_state=st.booleans(), delta_rule=st.booleans(), chunk=st.sampled_from([16, 64]), seed=st.integers(0, 1000))
def test_chunked_equals_recurrent(t, h, dk, dv, with_state, delta_rule, chunk, seed):
    """The chunked form (WY with the delta rule; Mamba2's SSD without, at its config's chunk size)
    equals the token scan."""
    args = _inputs(seed, 2, t, h, dk, dv, with_state)
    o_r, s_r = recurrent(*args, delta_rule=delta_rule)
    o_c, s_c = chunked(*args, chunk=chunk, delta_rule=delta_rule)
    np.testing.assert_allclose(o_c, o_r, atol=2e-4, rtol=2e-4)
    np.testing.assert_allclose(s_c, s_r, atol=2e-4, rtol=2e-4)


def test_padding_tokens_leave_state_unchanged():
    q, k, v, g, beta, s0 = _inputs(0, 1, 70, 2, 8, 8, True)
    g = g.at[:, 40:].set(0.0)
    beta = beta.at[:, 40:].set(0.0)
    _, s_full = chunked(q, k, v, g, beta, s0)
    _, s_40 = recurrent(q[:, :40], k[:, :40], v[:, :40], g[:, :40], beta[:, :40], s0)
    np.testing.assert_allclose(s_full, s_40, atol=2e-4)


def test_split_sequence_carries_state():
    q, k, v, g, beta, s0 = _inputs(1, 2, 100, 2, 8, 12, True)
    o_all, s_all = chunked(q, k, v, g, beta, s0)
    o1, s1 = chunked(q[:, :37], k[:, :37], v[:, :37], g[:, :37], beta[:, :37], s0)
    o2, s2 = recurrent(q[:, 37:], k[:, 37:], v[:, 37:], g[:, 37:], beta[:, 37:], s1)
    np.testing.assert_allclose(jnp.concatenate([o1, o2], 1), o_all, atol=2e-4)
    np.testing.assert_allclose(s2, s_all, atol=2e-4)


def _conv_reference(x_full, w):
    """Causal depthwise conv over the whole sequence with zero history, then SiLU (numpy)."""
    t, c = x_full.shape
    kw = w.shape[1]
    pad = np.concatenate([np.zeros((kw - 1, c), np.float32), x_full])
    y = sum(pad[j:j + t] * w[:, j] for j in range(kw))
    return y / (1 + np.exp(-y))


def test_causal_conv_chunks_and_state():
    rng = np.random.default_rng(0)
    c, kw, t = 6, 4, 23
    x = rng.standard_normal((t, c)).astype(np.float32)
    w = rng.standard_normal((c, kw)).astype(np.float32)
    ref = _conv_reference(x, w)
    state = jnp.zeros((1, c, kw))
    outs = []
    for lo, hi in [(0, 1), (1, 3), (3, 10), (10, 23)]:   # chunks shorter and longer than the kernel
        chunk = np.zeros((1, 8 if hi - lo <= 8 else 16, c), np.float32)
        chunk[0, :hi - lo] = x[lo:hi]
        y, state = gdn.causal_conv(jnp.asarray(chunk), state, jnp.asarray(w), jnp.array([hi - lo]))
        outs.append(np.asarray(y)[0, :hi - lo])
    np.testing.assert_allclose(np.concatenate(outs), ref, atol=1e-5)
    # a row with q_len 0 keeps its state
    _, same = gdn.causal_conv(jnp.zeros((1, 4, c)), state, jnp.asarray(w), jnp.array([0]))
    np.testing.assert_array_equal(same, state)


def test_unit_lower_inverse():
    """On the matrices the WY form builds: A = strictly_lower(beta k k^T * decay), |k| = 1."""
    rng = np.random.default_rng(0)
    k = rng.standard_normal((3, 64, 16))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    beta = rng.uniform(0, 1, (3, 64, 1))
    gc = np.cumsum(-rng.uniform(0, 0.1, (3, 64)), axis=-1)
    a = np.tril(beta * (k @ np.swapaxes(k, 1, 2)) * np.exp(gc[:, :, None] - gc[:, None, :]), -1)
    t = np.asarray(gdn.unit_lower_inverse(jnp.asarray(a, jnp.float32)))
    np.testing.assert_allclose(t, np.linalg.inv(np.eye(64) + a), atol=1e-4 * np.abs(t).max())


def test_chunked_gradient_equals_recurrent_gradient():
    """Training differentiates the chunked form (scripts/train_tiny.py): its gradient (through
    unit_lower_inverse's analytic VJP) equals the token scan's, for every input and the initial state."""
    args = _inputs(7, 2, 100, 2, 8, 12, True)
    weights = jax.random.normal(jax.random.PRNGKey(1), (2, 100, 2, 12))

    def loss(core):
        def f(*a):
            o, s = core(*a)
            return jnp.sum(o * weights) + jnp.sum(s ** 2)
        return jax.jit(jax.grad(f, argnums=tuple(range(6))))
    for g_c, g_r in zip(loss(gdn.chunked)(*args), loss(gdn.recurrent)(*args)):
        np.testing.assert_allclose(g_c, g_r, atol=2e-3 * float(jnp.abs(g_r).max()), rtol=1e-3)
