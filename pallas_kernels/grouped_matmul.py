"""Grouped matmul for MoE experts: rows in blocks, each block multiplied by its own expert's weights.

x [NB * TB, K] holds the routed (token, expert) pairs sorted by expert, each expert's run padded to
whole blocks of TB rows (`atlas_jax.layers.moe.block_layout`); block i belongs to expert
block_expert[i], and blocks past the last used one are skipped (zeros). A program computes one
[TB, BN] tile: it walks K in BK steps, reading x's rows and its expert's [BK, BN] weight tile from
global memory — only the routed experts' weights are read, unlike XLA:GPU's ragged_dot, which
expands to dense matmuls over every expert. Grid (block, N tile).

Reference: `reference` (a gather of each block's expert and an einsum).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import GPU_PARAMS, whole

MIN_BLOCK_ROWS = 16            # Triton's smallest dot


def _tile(n: int, cap: int) -> int | None:
    """The largest power of two <= cap dividing n, at least 16 (None: no such tile)."""
    t = cap
    while t >= 16:
        if n % t == 0:
            return t
        t //= 2
    return None


def supported(k: int, n: int) -> bool:
    return _tile(k, 64) is not None and _tile(n, 128) is not None


def _kernel(expert_ref, used_ref, x_ref, w_ref, o_ref, *, block_k):
    i, j = pl.program_id(0), pl.program_id(1)
    rows, cols = o_ref.shape
    expert = expert_ref[i]
    prec = jax.lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else jax.lax.Precision.DEFAULT
    row_ds, col_ds = pl.ds(i * rows, rows), pl.ds(j * cols, cols)

    def step(kk, acc):
        depth = pl.ds(pl.multiple_of(kk * block_k, block_k), block_k)
        return acc + jnp.dot(x_ref[row_ds, depth], w_ref[expert, depth, col_ds], precision=prec,
                             preferred_element_type=jnp.float32)

    steps = jnp.where(used_ref[i] != 0, x_ref.shape[1] // block_k, 0)
    acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((rows, cols), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_rows", "interpret"))
def grouped_matmul(x, w, block_expert, block_used, *, block_rows: int, interpret: bool = False):
    """x [NB * TB, K]; w [E, K, N]; block_expert, block_used [NB] int32 -> [NB * TB, N] in x.dtype."""
    rows, k = x.shape
    _, _, n = w.shape
    bk, bn = _tile(k, 64), _tile(n, 128)
    if bk is None or bn is None or block_rows < MIN_BLOCK_ROWS or rows % block_rows:
        raise ValueError(f"grouped matmul needs K, N multiples of 16 and blocks of >= 16 rows, "
                         f"got K {k}, N {n}, {block_rows}-row blocks of {rows} rows")
    nb = rows // block_rows
    return pl.pallas_call(
        functools.partial(_kernel, block_k=bk),
        grid=(nb, n // bn),
        in_specs=[whole((nb,)), whole((nb,)), whole(x.shape), whole(w.shape)],
        out_specs=pl.BlockSpec((block_rows, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((rows, n), x.dtype),
        compiler_params=GPU_PARAMS, interpret=interpret,
    )(block_expert.astype(jnp.int32), block_used.astype(jnp.int32), x, w.astype(x.dtype))


def reference(x, w, block_expert, block_used, *, block_rows: int):
    xb = x.reshape(-1, block_rows, x.shape[1]).astype(jnp.float32)
    y = jnp.einsum("btk,bkn->btn", xb, w[block_expert].astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    y = jnp.where(block_used[:, None, None] != 0, y, 0.0)
    return y.reshape(x.shape[0], w.shape[2]).astype(x.dtype)
