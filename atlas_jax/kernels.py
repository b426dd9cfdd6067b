"""Which implementation runs the attention and GDN mixers and the MoE experts: the pure-XLA layers,
the Pallas kernels in `pallas_kernels/` (interpreted on CPU, so tests can run the whole model through
them), or on CPU the C++ custom calls of `atlas_jax.cpu_kernels` beside the XLA layers.

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
    cpu: bool = False           # XLA layers + the CPU custom calls (GDN recurrence, MoE experts)

    @property
    def name(self) -> str:
        if self.pallas:
            return "pallas-interpret" if self.interpret else "pallas"
        return "cpu" if self.cpu else "xla"


XLA = Kernels()
CPU = Kernels(cpu=True)


def resolve_kernels(choice: str | Kernels) -> Kernels:
    """'auto' = Pallas on GPU, the CPU custom calls on CPU (pure XLA where they cannot be built);
    'xla' = the pure-XLA layers everywhere; 'pallas' off GPU runs the kernels interpreted."""
    if isinstance(choice, Kernels):
        return choice
    if choice not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, got {choice!r}")
    backend = jax.default_backend()
    if choice == "auto" and backend == "cpu":
        from . import cpu_kernels
        return CPU if cpu_kernels.available() else XLA
    if choice == "xla" or (choice == "auto" and backend != "gpu"):
        return XLA
    return Kernels(pallas=True, interpret=backend != "gpu")
