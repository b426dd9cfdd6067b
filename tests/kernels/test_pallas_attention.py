"""The Pallas ragged paged attention kernels (interpret mode on CPU; compiled with
ATLAS_JAX_PALLAS_COMPILED=1 on a GPU) against the pure-jnp reference
`layers.attention.paged_attention`, over KV lengths 0 / 1 / a page / page + 1 / long, q_len 1
(decode, split-KV with 1..many splits), 2..8 (verify), prefill chunks, GQA ratios 1..8, head dims
64..256, pages 16..64 (the compiled kernels' minimum is 16), fp32 and bf16, soft-cap and sliding window, random non-contiguous block tables
and padding rows (zeros out)."""
import os

import jax.numpy as jnp
import numpy as np
import pytest
from budget import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from atlas_jax.batch import StepBatch
from atlas_jax.layers.attention import paged_attention as reference
from pallas_kernels.paged_attention import paged_attention

INTERPRET = os.environ.get("ATLAS_JAX_PALLAS_COMPILED") != "1"


def _case(seed, rows, t, heads, kv_heads, d, page_size, dtype):
    """rows: [(start, q_len)]; a random page pool, block tables over random distinct pages."""
    rng = np.random.default_rng(seed)
    max_pages = max(-(-(s + n) // page_size) for s, n in rows) + 1
    num_pages = len(rows) * max_pages + 3
    perm = rng.permutation(num_pages)
    table = np.zeros((len(rows), max_pages), np.int32)
    for i in range(len(rows)):
        table[i] = perm[i * max_pages:(i + 1) * max_pages]
    k = jnp.asarray(rng.standard_normal((num_pages, page_size, kv_heads, d)), dtype)
    v = jnp.asarray(rng.standard_normal((num_pages, page_size, kv_heads, d)), dtype)
    q = jnp.asarray(rng.standard_normal((len(rows), t, heads, d)), dtype)
    start = jnp.asarray([s for s, _ in rows], jnp.int32)
    q_len = jnp.asarray([n for _, n in rows], jnp.int32)
    return q, k, v, jnp.asarray(table), start, q_len


CASES = [
    # rows (start, q_len), T, H, Hkv, D, page size
    ([(0, 1), (15, 1), (16, 1), (17, 1), (80, 1)], 1, 4, 4, 64, 16),      # decode: KV 1 / page-1 / page / page+1 / long
    ([(5, 3), (16, 8), (0, 2)], 8, 8, 2, 64, 16),                          # verify K in 2..8, GQA 4
    ([(0, 16), (20, 9), (3, 0)], 16, 8, 1, 128, 16),                       # prefill chunks + a padding row, GQA 8
    ([(30, 5), (0, 7)], 8, 6, 3, 64, 32),                                  # GQA 2, page 32
    ([(0, 40), (50, 33), (7, 0)], 40, 16, 2, 64, 16),                      # 3 query blocks of 16 tokens, GQA 8
    ([(3, 7)], 7, 10, 2, 128, 16),                                         # group of 5 (padded to 8), verify
]


def _check(rows, t, h, hkv, d, ps, dtype, seed=0, **opts):
    q, k, v, table, start, q_len = _case(seed, rows, t, h, hkv, d, ps, dtype)
    scale = d ** -0.5
    seg = StepBatch(tokens=jnp.zeros((len(rows), t), jnp.int32), q_len=q_len, start=start, block_table=table,
                    slot=jnp.zeros((len(rows),), jnp.int32), state_idx=jnp.zeros((len(rows),), jnp.int32))
    ref_opts = {key: opts[key] for key in ("soft_cap", "window") if key in opts}
    ref, _, _ = reference(q, k, v, seg, scale, **ref_opts)
    out = paged_attention(q, k, v, table, start, q_len, scale=scale, interpret=INTERPRET, **opts)
    valid = np.asarray(seg.valid)[..., None, None]
    tol = 2e-2 if dtype == jnp.bfloat16 else 2e-5
    np.testing.assert_allclose(np.where(valid, np.asarray(out, np.float32), 0),
                               np.where(valid, np.asarray(ref, np.float32), 0), atol=tol, rtol=tol)
    padding = np.asarray(q_len) == 0
    assert np.all(np.asarray(out, np.float32)[padding] == 0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_kernel_matches_reference(case, dtype):
    _check(*CASES[case], dtype, seed=case)


@pytest.mark.parametrize("splits", [1, 2, 3, 16])
def test_decode_split_kv(splits):
    """More splits than a row has pages leaves empty splits, which the combine must ignore."""
    _check([(0, 1), (15, 1), (16, 1), (140, 1), (3, 0)], 1, 8, 2, 64, 16, jnp.float32, num_splits=splits)


@pytest.mark.parametrize("t", [1, 4, 40])
def test_soft_cap_and_sliding_window(t):
    rows = [(0, 1 if t == 1 else t), (75, 1 if t == 1 else 3), (128, 1)]
    _check(rows, t, 4, 2, 64, 16, jnp.float32, soft_cap=5.0)
    _check(rows, t, 4, 2, 64, 16, jnp.float32, window=40)
    _check(rows, t, 4, 2, 64, 16, jnp.float32, soft_cap=30.0, window=18)


@settings(max_examples=examples(6), deadline=None)
@given(data=st.data(), t=st.sampled_from([1, 2, 5, 8, 16]), groups=st.sampled_from([1, 2, 4, 8]),
       hkv=st.sampled_from([1, 2]), d=st.sampled_from([64, 128, 256]), ps=st.sampled_from([16, 32, 64]),
       bf16=st.booleans())
def test_random_shapes(data, t, groups, hkv, d, ps, bf16):
    starts = data.draw(st.lists(st.sampled_from([0, 1, ps - 1, ps, ps + 1, 3 * ps + 5]), min_size=1, max_size=4))
    rows = [(s, data.draw(st.integers(0 if i else 1, t))) for i, s in enumerate(starts)]
    _check(rows, t, groups * hkv, hkv, d, ps, jnp.bfloat16 if bf16 else jnp.float32, seed=len(rows))


def test_reference_static_block_loop_equals_run_time_trip_count():
    """The XLA layer's GPU form (every block of the table, masked) equals its CPU form (trip count =
    the longest row's blocks) on rows far shorter than the table."""
    rows = [(0, 3), (300, 4), (5, 0)]
    q, k, v, table, start, q_len = _case(1, rows, 4, 8, 2, 64, 16, jnp.float32)
    table = jnp.pad(table, ((0, 0), (0, 64 - table.shape[1])))            # 1024 tokens of table
    seg = StepBatch(tokens=jnp.zeros((3, 4), jnp.int32), q_len=q_len, start=start, block_table=table,
                    slot=jnp.zeros((3,), jnp.int32), state_idx=jnp.zeros((3,), jnp.int32))
    dynamic, _, _ = reference(q, k, v, seg, 0.125, static_blocks=False)
    static, _, _ = reference(q, k, v, seg, 0.125, static_blocks=True)
    np.testing.assert_allclose(static, dynamic, atol=1e-6)
