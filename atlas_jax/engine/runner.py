"""ModelRunner: owns the params and the device state, and runs compiled steps.

Steps are compiled ahead of time (`jit(...).lower(...).compile()`) per shape bucket and
kept in `self._executables`; `num_compiles` counts every compilation, so a recompile in
steady-state serving is visible. Buckets (the only shapes ever compiled):
  B = rows, next power of two;  T = tokens per row, next power of two;
  P = block-table width in pages, next power of two capped at max_pages_per_seq.
Padding rows and columns are inert (see batch.StepBatch). Only sampled token ids (or, for
`prompt_logits`, the logits the caller asked for) come back to the host.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..batch import StepBatch
from ..config import ModelConfig
from ..models.decoder import forward
from ..state.cache import init_state
from .sampler import SamplingBatch, sample


@dataclasses.dataclass
class RowInput:
    """One sequence's share of a step (host side)."""
    tokens: list[int]          # new tokens, len >= 1
    start: int                 # tokens of this sequence already in the cache
    block_table: list[int]     # its pages, covering at least start + len(tokens) tokens
    slot: int                  # its recurrent-state slot (0 for models without GDN layers)
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    step: int = 0              # tokens this request has sampled so far


def bucket(n: int, cap: int | None = None) -> int:
    b = 1 << max(0, (n - 1).bit_length())
    return min(b, cap) if cap else b


def _step(cfg, params, state, batch, sampling):
    logits, _, state = forward(params, state, batch, cfg)
    return sample(logits, sampling), state


def _logits_step(cfg, params, state, batch):
    logits, _, state = forward(params, state, batch, cfg, all_logits=True)
    return logits, state


class ModelRunner:
    def __init__(self, cfg: ModelConfig, params, *, num_pages: int, page_size: int, num_slots: int,
                 max_pages_per_seq: int, dtype):
        self.cfg = cfg
        self.params = params
        self.page_size = page_size
        self.num_slots = num_slots
        self.max_pages_per_seq = max_pages_per_seq
        self.state = init_state(cfg, num_pages, page_size, num_slots, dtype)
        self._jitted = {
            "step": jax.jit(functools.partial(_step, cfg), donate_argnums=(1,)),
            "logits": jax.jit(functools.partial(_logits_step, cfg), donate_argnums=(1,)),
        }
        self._executables: dict[tuple, object] = {}
        self.num_compiles = 0

    # ---- host -> device metadata -----------------------------------------------------------
    def _batch(self, rows: list[RowInput], t_bucket: int | None = None) -> StepBatch:
        b = bucket(len(rows))
        t = t_bucket or bucket(max(len(r.tokens) for r in rows))
        need = max(-(-(r.start + len(r.tokens)) // self.page_size) for r in rows)
        p = bucket(need, self.max_pages_per_seq)
        tokens = np.zeros((b, t), np.int32)
        q_len = np.zeros((b,), np.int32)
        start = np.zeros((b,), np.int32)
        table = np.zeros((b, p), np.int32)
        slot = np.full((b,), self.num_slots, np.int32)          # padding rows: out of range
        for i, r in enumerate(rows):
            n = len(r.tokens)
            if not 1 <= n <= t:
                raise ValueError(f"row {i} has {n} new tokens for a {t}-token bucket")
            tokens[i, :n] = r.tokens
            q_len[i], start[i], slot[i] = n, r.start, r.slot
            table[i, :len(r.block_table[:p])] = r.block_table[:p]
        return StepBatch(tokens=jnp.asarray(tokens), q_len=jnp.asarray(q_len), start=jnp.asarray(start),
                         block_table=jnp.asarray(table), slot=jnp.asarray(slot))

    def _sampling(self, rows: list[RowInput], b: int) -> SamplingBatch:
        pad = b - len(rows)
        col = lambda f, dt: jnp.asarray(np.array([getattr(r, f) for r in rows] + [0] * pad, dt))
        return SamplingBatch(temperature=col("temperature", np.float32), top_k=col("top_k", np.int32),
                             top_p=jnp.asarray(np.array([r.top_p for r in rows] + [1.0] * pad, np.float32)),
                             seed=col("seed", np.uint32), step=col("step", np.int32))

    def _run(self, kind: str, *args):
        key = (kind,) + tuple((a.shape, str(a.dtype)) for a in jax.tree.leaves(args))
        exe = self._executables.get(key)
        if exe is None:
            exe = self._jitted[kind].lower(self.params, self.state, *args).compile()
            self._executables[key] = exe
            self.num_compiles += 1
        out, self.state = exe(self.params, self.state, *args)
        return out

    # ---- steps ------------------------------------------------------------------------------
    def step(self, rows: list[RowInput]) -> np.ndarray:
        """Run one forward over `rows` and sample one token per row -> [len(rows)] int32."""
        batch = self._batch(rows)
        tokens = self._run("step", batch, self._sampling(rows, batch.tokens.shape[0]))
        return np.asarray(tokens)[:len(rows)]

    def prompt_logits(self, rows: list[RowInput]) -> list[np.ndarray]:
        """Like `step`, but returns the fp32 logits of every new token: one [len(tokens), V] per row."""
        logits = np.asarray(self._run("logits", self._batch(rows)))
        return [logits[i, :len(r.tokens)] for i, r in enumerate(rows)]
