"""What every kernel here shares: the backend choice and the block helpers.

Backend: Triton, chosen explicitly by passing Triton compiler params to every `pallas_call`.
Since jax 0.9 a `pallas_call` without them lowers through Mosaic GPU, which stages every
whole-array block in shared memory (<= 227 KB); our kernels index large pools (KV pages, recurrent
state) in global memory by run-time slot and page, which is Triton's pointer model. Triton's rules,
kept by every kernel body: each array has a power-of-two number of elements, no `lax.slice`
(index refs with `pl.ds` instead), dots only with every dimension >= 16 (outer products and
matrix-vector products are broadcasts + reductions). In interpret mode the params are ignored.
"""
from __future__ import annotations

from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

BACKEND = "triton"
GPU_PARAMS = pltriton.CompilerParams(num_warps=4, num_stages=2)
WIDE_PARAMS = pltriton.CompilerParams(num_warps=8, num_stages=2)    # bodies holding several 8K-element tiles


def pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def whole(shape):
    """A block that is the whole array (indexed in global memory by the kernel)."""
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))
