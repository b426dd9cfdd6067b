"""Recurrent-state research API: drive one sequence by hand and checkpoint, restore, roll back and
inspect its state — the operations speculative decoding relies on, exposed for experiments.

    llm = LLM(path, speculative={"method": "ngram", "num_drafts": 3})   # R = 4 state positions per slot
    lab = StateLab(llm)
    seq = lab.start(prompt_ids)              # prefill; logits of the prompt
    logits = lab.feed(seq, [t1, t2, t3])     # a verify-sized feed (<= R tokens) keeps per-token states
    states = lab.intermediates(seq)          # [(h [T, Hv, Dk, Dv], conv [T, C, K]) per GDN layer]
    lab.rollback(seq, 2)                     # back to the state after t1: pick a position, no compute
    snap = lab.checkpoint(seq)               # host copy of (recurrent state, length, tokens)
    lab.restore(seq, snap)                   # ... written back into the sequence's slot
    lab.push_snapshot(seq); lab.restore_snapshot(seq, 0)   # a per-sequence ring of the last N snapshots
    lab.release(seq)

A Lab sequence owns a slot and pages of the engine (the engine must be idle while a Lab runs).
Invariant: the KV of positions < seq.num_cached and the recurrent state at (slot, state_idx) are
those of seq.tokens[:num_cached]. Rollback moves num_cached and state_idx back inside the last
feed; restore requires the snapshot's tokens to be a prefix of the sequence's (the KV of that
prefix is still in place).
"""
from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .engine.row import RowInput


@dataclasses.dataclass
class LabSequence:
    tokens: list[int]               # every token fed (the cache holds the first num_cached)
    slot: int
    pages: list[int]
    num_cached: int = 0
    state_idx: int = 0
    last_feed: int = 0              # tokens in the last feed (their states are at positions 0..last_feed-1)
    ring: collections.deque = None


@dataclasses.dataclass(frozen=True)
class Snapshot:
    num_cached: int
    tokens: tuple[int, ...]
    ssm: tuple                      # per recurrent (GDN / Mamba2) layer: (h [H, Dk, Dv], conv [C, K]) numpy


@jax.jit
def _read(ssm, slot, idx):
    return tuple((h[slot, idx], c[slot, idx]) for h, c in ssm)


@jax.jit
def _read_all(ssm, slot):
    return tuple((h[slot], c[slot]) for h, c in ssm)


@jax.jit
def _write(ssm, slot, values):
    return tuple((h.at[slot, 0].set(hv), c.at[slot, 0].set(cv)) for (h, c), (hv, cv) in zip(ssm, values))


class StateLab:
    def __init__(self, llm, ring_size: int = 8):
        self.llm = llm
        self.runner = llm.runner
        self.ring_size = ring_size
        self.max_len = llm.max_model_len

    # ---- sequence lifecycle -------------------------------------------------------------------
    def start(self, prompt: list[int], chunk: int | None = None) -> tuple[LabSequence, np.ndarray]:
        """Allocate a slot and pages and prefill the prompt (in chunks). Returns (seq, prompt logits)."""
        blocks, slots = self.llm.engine.blocks, self.llm.engine.slots
        pages = blocks.allocate(blocks.pages_for(self.max_len))
        slot = slots.allocate(1)
        if pages is None or slot is None:
            raise RuntimeError("no free pages / slot: the engine must be idle")
        seq = LabSequence(tokens=[], slot=slot[0], pages=pages, ring=collections.deque(maxlen=self.ring_size))
        chunk = chunk or self.llm.engine.sched_config.max_prefill_chunk
        logits = [self.feed(seq, list(prompt[i:i + chunk])) for i in range(0, len(prompt), chunk)]
        return seq, np.concatenate(logits)

    def release(self, seq: LabSequence) -> None:
        self.llm.engine.blocks.free(seq.pages)
        self.llm.engine.slots.free([seq.slot])
        seq.pages = []

    def feed(self, seq: LabSequence, tokens: list[int]) -> np.ndarray:
        """Append tokens (after any rollback, they replace what was beyond num_cached). Returns their
        logits [len, V]. A feed of 2 .. R tokens keeps the state after each (see `intermediates`)."""
        if seq.num_cached + len(tokens) > self.max_len:
            raise ValueError(f"{seq.num_cached + len(tokens)} tokens exceed max_model_len {self.max_len}")
        row = RowInput(tokens=list(tokens), start=seq.num_cached, block_table=seq.pages, slot=seq.slot,
                       state_idx=seq.state_idx)
        (logits,) = self.runner.scoring.logits([row])
        seq.tokens = seq.tokens[:seq.num_cached] + list(tokens)
        seq.num_cached += len(tokens)
        seq.state_idx = min(len(tokens), self.positions) - 1
        seq.last_feed = len(tokens)
        return logits

    @property
    def positions(self) -> int:
        """R: recurrent-state positions per slot (1 + the engine's num_drafts)."""
        return self.runner.state_positions

    # ---- state operations ---------------------------------------------------------------------
    def intermediates(self, seq: LabSequence) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per GDN layer (h [T, ...], conv [T, ...]): the state after each token of the last feed
        (T = its length; kept only when 1 < T <= R, or T = 1)."""
        t = seq.last_feed
        if not (t == 1 or 1 < t <= self.positions):
            raise ValueError(f"the last feed had {t} tokens; per-token states are kept for feeds of <= {self.positions}")
        states = jax.device_get(_read_all(self.runner.state.model.ssm, seq.slot))
        return [(h[:t], c[:t]) for h, c in states]

    def rollback(self, seq: LabSequence, n: int) -> None:
        """Forget the last n tokens of the last feed (n < its length): the state after token
        last_feed - 1 - n is already stored, so this only moves two numbers."""
        if not 0 <= n < seq.last_feed or (seq.last_feed > 1 and seq.last_feed > self.positions):
            raise ValueError(f"can roll back 0 .. {seq.last_feed - 1} tokens of a feed of <= {self.positions}")
        seq.num_cached -= n
        seq.state_idx -= n
        seq.last_feed -= n

    def checkpoint(self, seq: LabSequence) -> Snapshot:
        ssm = jax.device_get(_read(self.runner.state.model.ssm, seq.slot, seq.state_idx))
        return Snapshot(seq.num_cached, tuple(seq.tokens[:seq.num_cached]), tuple(ssm))

    def restore(self, seq: LabSequence, snap: Snapshot) -> None:
        if tuple(seq.tokens[:snap.num_cached]) != snap.tokens:
            raise ValueError("the snapshot's tokens are not a prefix of this sequence's: its KV is gone")
        model = self.runner.state.model
        ssm = _write(model.ssm, seq.slot, jax.tree.map(jnp.asarray, snap.ssm))
        self.runner.state = dataclasses.replace(self.runner.state, model=dataclasses.replace(model, ssm=ssm))
        seq.num_cached, seq.state_idx, seq.last_feed = snap.num_cached, 0, 0

    def push_snapshot(self, seq: LabSequence) -> int:
        """Checkpoint into the sequence's ring (the oldest drops out when full). Returns its size."""
        seq.ring.append(self.checkpoint(seq))
        return len(seq.ring)

    def restore_snapshot(self, seq: LabSequence, age: int = 0) -> None:
        """Restore the ring's snapshot `age` steps back (0 = most recent)."""
        if not 0 <= age < len(seq.ring):
            raise ValueError(f"the ring holds {len(seq.ring)} snapshots")
        self.restore(seq, seq.ring[-1 - age])

    def state(self, seq: LabSequence) -> list[tuple[np.ndarray, np.ndarray]]:
        """The current recurrent state per GDN layer (h, conv), on the host."""
        return list(self.checkpoint(seq).ssm)
