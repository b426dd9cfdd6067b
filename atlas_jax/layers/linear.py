"""Dense projections through the CPU custom call (cpu_kernels/linear.cc) over packed weights.

`PackedLinear` stands in for a [K, N] weight in the param tree: `x @ w` (every projection is written
that way: layers/lora.project, the lm_head, MTP's fc) dispatches to it through `__rmatmul__`, so the
layers stay unchanged. `pack_linears` packs the projections the param specs name (roles proj and head,
models/layout.py) once, in the ModelRunner under Kernels.cpu; weights the op table does not pack (too
narrow, not fp32) stay plain arrays.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .. import cpu_kernels
from ..kernels import CPU, Kernels
from ..param_tree import get_path, replace_at

PANEL = cpu_kernels.LINEAR_PANEL


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedLinear:
    panels: jax.Array                            # [ceil(N / 64), 64 / DN_SUB, K, DN_SUB], zero-padded
    out_features: int = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int]:
        return (self.panels.shape[2], self.out_features)

    @property
    def dtype(self):
        return self.panels.dtype

    @property
    def ndim(self) -> int:
        return 2

    def __rmatmul__(self, x):
        y = cpu_kernels.linear(x.reshape(-1, x.shape[-1]).astype(jnp.float32), self.panels, self.out_features)
        return y.reshape(*x.shape[:-1], self.out_features).astype(x.dtype)


def pack_linear(w) -> PackedLinear:
    """w [K, N] -> panels of 64 output columns, each in strips of DN_SUB columns (cpu_kernels.strips)."""
    n = w.shape[1]
    padded = -(-n // PANEL) * PANEL
    padded_w = jnp.pad(w, ((0, 0), (0, padded - n)))
    return PackedLinear(cpu_kernels.strip_panels(padded_w, PANEL, cpu_kernels.strips()[1]), n)


def pack_linears(params, paths, kernels: Kernels = CPU):
    """params with the [in, out] projection at each of `paths` packed where the op table packs it
    (Kernels.packs_linear); the packed arrays replace the originals."""
    pack = jax.jit(pack_linear)
    return replace_at(params, [p for p in paths if kernels.packs_linear(get_path(params, p))], pack)
