"""The Pallas ragged paged attention kernel (interpret mode on CPU) against the pure-jnp reference
`layers.attention.paged_attention`, over KV lengths 0 / 1 / a page / page + 1 / long, q_len 1
(decode), 2..8 (verify), prefill chunks, GQA ratios 1..8, fp32 and bf16, random non-contiguous
block tables and padding rows (zeros out)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from atlas_jax.batch import StepBatch
from atlas_jax.layers.attention import paged_attention as reference
from pallas_kernels.paged_attention import paged_attention


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
    ([(0, 1), (7, 1), (8, 1), (9, 1), (40, 1)], 1, 4, 4, 64, 8),          # decode: KV 1 / page-1 / page / page+1 / long
    ([(5, 3), (16, 8), (0, 2)], 8, 8, 2, 64, 8),                           # verify K in 2..8, GQA 4
    ([(0, 16), (20, 9), (3, 0)], 16, 8, 1, 128, 16),                       # prefill chunks + a padding row, GQA 8
    ([(30, 5), (0, 7)], 8, 6, 3, 64, 32),                                  # GQA 2, page 32
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_kernel_matches_reference(case, dtype):
    rows, t, h, hkv, d, ps = CASES[case]
    q, k, v, table, start, q_len = _case(case, rows, t, h, hkv, d, ps, dtype)
    scale = d ** -0.5
    seg = StepBatch(tokens=jnp.zeros((len(rows), t), jnp.int32), q_len=q_len, start=start, block_table=table,
                    slot=jnp.zeros((len(rows),), jnp.int32))
    ref, _, _ = reference(q, k, v, seg, scale)
    out = paged_attention(q, k, v, table, start, q_len, scale=scale, interpret=True)
    valid = np.asarray(seg.valid)[..., None, None]
    tol = 2e-2 if dtype == jnp.bfloat16 else 2e-5
    np.testing.assert_allclose(np.where(valid, np.asarray(out, np.float32), 0),
                               np.where(valid, np.asarray(ref, np.float32), 0), atol=tol, rtol=tol)
    padding = np.asarray(q_len) == 0
    assert np.all(np.asarray(out, np.float32)[padding] == 0)
