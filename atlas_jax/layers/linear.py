"""Dense projections through the CPU custom call (cpu_kernels/linear.cc) over packed weights.

`PackedLinear` stands in for a [K, N] weight in the param tree: `x @ w` (every projection is written
that way: layers/lora.project, the lm_head, MTP's fc) dispatches to it through `__rmatmul__`, so the
layers stay unchanged. `pack_linears` packs the projections of every layer and the lm_head once, in
the ModelRunner under Kernels.cpu; weights of other shapes or dtypes stay plain arrays.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .. import cpu_kernels
from ..kernels import CPU, Kernels

PANEL = cpu_kernels.LINEAR_PANEL
# param keys that are [in, out] projections applied as x @ w (layers/*, models/mtp.py, decoder.lm_head)
PROJECTIONS = frozenset({"q", "k", "v", "o", "qkvz", "qkv", "z", "out", "in_proj", "gate", "up", "down",
                         "latent_in", "latent_out", "fc", "lm_head"})


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


def packs(key, w, kernels: Kernels = CPU) -> bool:
    return key in PROJECTIONS and isinstance(w, jax.Array) and kernels.packs_linear(w)


def replace_params(params, applies, replace):
    """params with every dict entry (key, value) for which applies(key, value) holds replaced by
    replace(value) (not descended into); the rest of the tree rebuilt around the same leaves."""
    def walk(node):
        if isinstance(node, dict):
            return {k: replace(v) if applies(k, v) else walk(v) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return type(node)(walk(v) for v in node)
        return node
    return walk(params)


def pack_linears(params, kernels: Kernels = CPU):
    """params with every projection packed (see `packs`); the packed arrays replace the originals."""
    return replace_params(params, lambda k, w: packs(k, w, kernels), jax.jit(pack_linear))
