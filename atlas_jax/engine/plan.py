"""One step's plan: the rows the scheduler chose and the state operations the runner applies, in order,
before the step runs (ModelRunner.apply). Host only: the scheduler builds plans without touching the device."""
from __future__ import annotations

import dataclasses

from .sequence import Sequence


@dataclasses.dataclass(frozen=True)
class SwapOut:
    """seq.swapped_state := a host copy of `pages` (its cached KV), `slot`'s recurrent state and penalty history."""
    seq: Sequence
    pages: tuple[int, ...]
    slot: int


@dataclasses.dataclass(frozen=True)
class SwapIn:
    """`pages` and `slot` := seq.swapped_state (bit-exact); the host copy is dropped."""
    seq: Sequence
    pages: tuple[int, ...]
    slot: int


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """Snapshot `snap` := `slot`'s recurrent state at position state_idx."""
    slot: int
    state_idx: int
    snap: int
    rank: int = 0              # data parallel: the rank whose slot and snapshot these are (local ids)


@dataclasses.dataclass(frozen=True)
class LoadPrefix:
    """`slot` starts on a cached prefix: recurrent state from snapshot `snap` (None: none), page cow[1] :=
    page cow[0] (copy-on-write of a partly used page), penalty history rebuilt from `tokens`."""
    slot: int
    snap: int | None
    cow: tuple[int, int] | None
    tokens: tuple[int, ...]
    prompt_len: int
    rank: int = 0              # data parallel: the rank whose slot, snapshot and pages these are (local ids)


@dataclasses.dataclass(frozen=True)
class LoadAdapter:
    """Adapter pool slot `slot` := registration `uid`'s weights {param path: (A [in, R], B [R, out])}.
    Failure: the sequences holding `slot` under `uid` fail, the slot is left empty (EngineCore._apply)."""
    slot: int
    uid: int
    weights: dict = dataclasses.field(repr=False)


StateOp = SwapOut | SwapIn | Snapshot | LoadPrefix | LoadAdapter


@dataclasses.dataclass
class SchedulerOutput:
    """One step's plan. The engine applies `ops` in order before the forward (EngineCore._apply -> state_ops.py)."""
    decode: list[Sequence]                     # one token each
    prefill: list[tuple[Sequence, int]]        # (sequence, chunk length > 1)
    ops: list[StateOp] = dataclasses.field(default_factory=list)   # state operations queued since the last plan
    draft_caps: dict[Sequence, int] = dataclasses.field(default_factory=dict)   # decode row -> drafts it may verify
    draft_ok: set[Sequence] = dataclasses.field(default_factory=set)   # rows the MTP head may draft from

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill
