"""Which implementation runs the attention and GDN mixers: the pure-XLA layers or the Pallas
kernels in `pallas_kernels/` (interpreted on CPU, so tests can run the whole model through them).

A `Kernels` value is static: it is part of every compiled step's identity.
"""
from __future__ import annotations

import dataclasses

import jax

KERNELS = ("auto", "xla", "pallas")


@dataclasses.dataclass(frozen=True)
class Kernels:
    pallas: bool = False
    interpret: bool = False     # Pallas interpret mode (CPU)

    @property
    def name(self) -> str:
        return ("pallas-interpret" if self.interpret else "pallas") if self.pallas else "xla"


XLA = Kernels()


def resolve_kernels(choice: str | Kernels) -> Kernels:
    """'auto' = Pallas on GPU, XLA elsewhere; 'pallas' off GPU runs the kernels interpreted."""
    if isinstance(choice, Kernels):
        return choice
    if choice not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, got {choice!r}")
    gpu = jax.default_backend() == "gpu"
    if choice == "xla" or (choice == "auto" and not gpu):
        return XLA
    return Kernels(pallas=True, interpret=not gpu)
