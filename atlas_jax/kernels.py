"""The op table: which implementation each op runs — the pure-XLA layers (the reference, and the GPU
fallback), the Pallas kernels in `pallas_kernels/` (compiled on GPU; interpreted on CPU, so tests can run
the whole model through them), or on CPU the C++ custom calls of `atlas_jax.cpu_kernels`.

A `Kernels` value is resolved once per engine (`resolve_kernels`: backend, kernels setting, whether the CPU
kernels build) and is static: part of every compiled step's identity. Layers ask it (`attention`, `gdn`,
`gdn_fused`, `moe`, `packs_*`) with their static shapes and dtypes; they never probe the backend or the
compiler themselves. `describe` gives the model's choices for the start-up log.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels import gdn as pallas_gdn
from pallas_kernels import grouped_matmul as pallas_gmm
from pallas_kernels import paged_attention as pallas_attention

KERNELS = ("auto", "xla", "pallas")
CPU_ATTENTION_TOKENS = 8     # the CPU attention kernel takes segments of up to this many tokens a row (decode, verify)
MIN_PACKED_OUT = 64          # projections narrower than this stay plain arrays (layers/linear.py)


@dataclasses.dataclass(frozen=True)
class Kernels:
    pallas: bool = False
    interpret: bool = False     # Pallas interpret mode (CPU)
    cpu: bool = False           # XLA layers + the CPU custom calls (built: resolve_kernels checks)
    platform: str | None = None  # "cpu" | "gpu" | "tpu"; None only in ad-hoc layer calls: jax's default backend
    expert_mesh: object = None   # expert parallel: the Mesh whose "tp" axis splits the routed experts by expert
    data_parallel: int = 1       # > 1: the layers run per dp rank (manual "dp" axis); the experts span every rank
    section_tiles: int = 1       # sectioned params (Mamba2 in_proj / conv) stored in this many tiles (layers/sections.py)

    @property
    def name(self) -> str:
        if self.pallas:
            return "pallas-interpret" if self.interpret else "pallas"
        return "cpu" if self.cpu else "xla"

    @property
    def on_cpu(self) -> bool:
        return (self.platform or jax.default_backend()) == "cpu"

    def attention(self, page_size: int, head_dim: int, tokens: int, kv_dtype) -> str:
        """Paged attention of a segment with `tokens` new tokens a row: pallas | cpu | xla."""
        if self.pallas and (self.interpret or pallas_attention.supported(page_size, head_dim)):
            return "pallas"
        if self.cpu and tokens <= CPU_ATTENTION_TOKENS and kv_dtype == jnp.float32:
            return "cpu"
        return "xla"

    def attention_static_blocks(self) -> bool:
        """The XLA attention walks every block of the table (off CPU) or a run-time trip count (CPU)."""
        return not self.on_cpu

    def gdn(self, key_dim: int, value_dim: int, state_dtype) -> str:
        """The GDN / Mamba2 recurrence of one segment: pallas | cpu | xla."""
        if self.pallas and (self.interpret or pallas_gdn.supported(key_dim, value_dim)):
            return "pallas"
        if self.cpu and state_dtype == jnp.float32:
            return "cpu"
        return "xla"

    def gdn_fused(self, *dtypes) -> bool:
        """The whole GDN layer (conv, gates, recurrence, gated norm) as one CPU call (fp32 activations and state)."""
        return self.cpu and all(d == jnp.float32 for d in dtypes)

    def fuses_norm(self, *dtypes) -> bool:
        """RMSNorm (and the residual add before it) as one CPU call (fp32)."""
        return self.cpu and all(d == jnp.float32 for d in dtypes)

    def moe(self, num_pairs: int = 1, num_experts: int = 1, dims: tuple[int, int] = (16, 16)) -> str:
        """Routed experts on the checkpoint's [E, H, F] layout (dims = (hidden, expert intermediate)):
        pallas | blocked (XLA:CPU scan) | gather (few pairs per expert) | ragged (ragged_dot)."""
        if self.pallas and pallas_gmm.supported(*dims):
            return "pallas"
        if self.on_cpu:
            return "blocked"
        return "gather" if num_pairs <= num_experts else "ragged"

    def packs_experts(self, dtype) -> bool:
        """MoE experts of this dtype packed for the CPU kernel (which then runs them: dispatch "cpu")."""
        return self.cpu and dtype == jnp.float32

    def packs_linear(self, w) -> bool:
        """A projection packed for the CPU linear kernel (layers/linear.py picks which keys are projections)."""
        return self.cpu and w.ndim == 2 and w.dtype == jnp.float32 and w.shape[1] >= MIN_PACKED_OUT

    def describe(self, cfg, dtype, page_size: int) -> dict[str, str]:
        """This model's choices (decode shapes), for the start-up log."""
        dtype = jnp.dtype(dtype)
        out = {"table": self.name, "platform": self.platform or jax.default_backend(),
               "attention (decode)": self.attention(page_size, cfg.head_dim, 1, dtype),
               "attention (prefill)": self.attention(page_size, cfg.head_dim, 64, dtype)}
        if cfg.recurrent_layers:
            out["recurrence"] = "cpu-fused" if self.gdn_fused(dtype, jnp.float32) else \
                self.gdn(cfg.linear_key_head_dim or 64, cfg.linear_value_head_dim or 64, jnp.float32)
        if cfg.num_experts:
            out["moe"] = "cpu" if self.packs_experts(dtype) else self.moe(
                cfg.num_experts_per_tok, cfg.num_experts, (cfg.hidden_size, cfg.moe_intermediate_size))
            if self.expert_mesh is not None:
                out["moe"] += f", expert-parallel over {self.expert_mesh.size} devices"
                if self.data_parallel > 1:
                    out["moe"] += f" (tokens of {self.data_parallel} data-parallel ranks)"
        out["linear"] = "cpu-packed" if self.cpu and dtype == jnp.float32 else "xla"
        return out


XLA = Kernels()
CPU = Kernels(cpu=True)


def resolve_kernels(choice: str | Kernels) -> Kernels:
    """'auto' = Pallas on GPU, the CPU custom calls on CPU (pure XLA where they cannot be built);
    'xla' = the pure-XLA layers everywhere; 'pallas' off GPU runs the kernels interpreted. The result
    names its platform, so no layer asks jax which backend it is traced for."""
    backend = jax.default_backend()
    if isinstance(choice, Kernels):
        table = choice
    elif choice not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, got {choice!r}")
    elif choice == "auto" and backend == "cpu":
        from . import cpu_kernels
        table = CPU if cpu_kernels.available() else XLA
    elif choice == "xla" or (choice == "auto" and backend != "gpu"):
        table = XLA
    else:
        table = Kernels(pallas=True, interpret=backend != "gpu")
    if table.cpu:
        from . import cpu_kernels
        if not cpu_kernels.available():
            raise ValueError(f"the CPU kernels are not available: {cpu_kernels.unavailable_reason()}")
    return dataclasses.replace(table, platform=table.platform or backend)
