"""Host packing of one step's rows into the compiled step's arguments, and their abstract form.

`InputBatch.pack` turns RowInputs into numpy arrays (segments, sampling input, prompt lengths, MTP
inputs) that the executable's own call transfers; `InputBatch.abstract` gives the same arguments as
ShapeDtypeStructs for a shape bucket (what warm-up lowers). Both live here so that they cannot drift.
Padding rows are inert: no tokens (q_len 0), the out-of-range slot, greedy sampling, no logprobs.

The persistent batch: sampling parameters live per slot on the device (EngineState.sampling). `held` mirrors
what each device slot holds (the row's params object, seed and logit adjustments); a row whose slot holds
something else is sent as an update, the rest send only (slot, step). A pack's mirror changes take effect
when the runner `commit`s them after the step was dispatched; `forget` marks every slot unknown.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ..batch import StepBatch
from .sampler import FLOAT_COLUMNS, INERT, INT_COLUMNS, SamplingInput, SlotSampling
from .row import RowInput
from .sampling_params import BIAS_COLUMNS, NO_BIAS

@dataclasses.dataclass
class InputBatch:
    max_pages_per_seq: int
    page_size: int
    num_slots: int             # the padding rows' (out-of-range) slot
    lora: bool                 # segments carry an adapter column
    mtp: bool                  # steps take MTP inputs
    held: list = dataclasses.field(init=False)       # per slot: (params, seed, logit_adjust) on the device, or None
    _pending: list = dataclasses.field(init=False, default_factory=list)   # (slot, key) of the last pack
    _no_update: dict = dataclasses.field(init=False, default_factory=dict)   # rows b -> device-resident empty update

    def __post_init__(self):
        self.forget()

    def forget(self) -> None:
        self.held = [None] * self.num_slots
        self._pending = []

    def commit(self) -> None:
        """The last pack's updates reached the device (its step was dispatched)."""
        for slot, key in self._pending:
            self.held[slot] = key
        self._pending = []

    # ---- host arrays ---------------------------------------------------------------------------
    def segment(self, rows: list[RowInput], b: int, t: int) -> StepBatch:
        p = self.max_pages_per_seq
        tokens = np.zeros((b, t), np.int32)
        q_len, start, state_idx, adapter = (np.zeros((b,), np.int32) for _ in range(4))
        table = np.zeros((b, p), np.int32)
        slot = np.full((b,), self.num_slots, np.int32)
        for i, r in enumerate(rows):
            n = len(r.tokens)
            if not 1 <= n <= t:
                raise ValueError(f"row {i} has {n} new tokens for a {t}-token bucket")
            if -(-(r.start + n) // self.page_size) > min(len(r.block_table), p):
                raise ValueError(f"row {i} needs pages for {r.start + n} tokens; it has {len(r.block_table)}")
            tokens[i, :n] = r.tokens
            q_len[i], start[i], slot[i], state_idx[i], adapter[i] = n, r.start, r.slot, r.state_idx, r.adapter
            table[i, :len(r.block_table)] = r.block_table
        return StepBatch(tokens=tokens, q_len=q_len, start=start, block_table=table, slot=slot, state_idx=state_idx,
                         adapter=adapter if self.lora else None)

    def sampling(self, rows: list[RowInput | None], b: int) -> SamplingInput:
        """The sampling input for b rows: `rows` in order (None = a padding row), then padding rows."""
        slot = np.full((b,), self.num_slots, np.int32)
        step = np.zeros((b,), np.int32)
        changed: list[RowInput] = []
        self._pending = []
        for i, r in enumerate(rows):
            if r is None:
                continue
            slot[i], step[i] = r.slot, r.step
            held = self.held[r.slot]
            if held is None or held[0] is not r.params or held[1] != r.seed or held[2] != r.logit_adjust:
                changed.append(r)
                self._pending.append((r.slot, (r.params, r.seed, r.logit_adjust)))
        if not changed:
            if b not in self._no_update:
                self._no_update[b] = jax.device_put(self.updates([], b))
            return SamplingInput(slot, step, *self._no_update[b])
        return SamplingInput(slot, step, *self.updates(changed, b))

    def updates(self, rows: list[RowInput], b: int) -> tuple[np.ndarray, SlotSampling]:
        """(update_slot [b], columns [b]) rewriting the slots of `rows`; the other entries drop (slot S + 1)."""
        slot = np.full((b,), self.num_slots + 1, np.int32)
        floats = np.tile(np.array([INERT[c] for c in FLOAT_COLUMNS], np.float32), (b, 1))
        ints = np.tile(np.array([INERT[c] for c in INT_COLUMNS], np.int32), (b, 1))
        for i, r in enumerate(rows):
            p = r.params
            slot[i] = r.slot
            floats[i] = (p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty,
                         p.frequency_penalty)
            ints[i] = (p.top_k, INERT["num_logprobs"] if p.logprobs is None else p.logprobs,
                       np.uint32(r.seed).view(np.int32), 0)
        filler = RowInput(tokens=[0], start=0, block_table=[], slot=self.num_slots + 1)
        bias = bias_columns(rows + [filler] * (b - len(rows)))
        ints[:, INT_COLUMNS.index("bias_only")] = bias["bias_only"]
        return slot, SlotSampling(floats, ints, bias["bias_ids"], bias["bias"])

    @staticmethod
    def prompt_lens(segments, groups) -> tuple:
        """Per segment [B] prompt lengths of its rows (0 for padding rows)."""
        return tuple(np.array([r.prompt_len for r in rows] + [0] * (s.tokens.shape[0] - len(rows)), np.int32)
                     for s, rows in zip(segments, groups))

    def mtp_in(self, segments, groups, sampling_rows, verify: bool = False):
        """MTP inputs (steps.py): per segment the token after each fed position ([B, T], -1 where it is
        the token the step emits), and draft_ok per row. None without MTP. A verify segment's next tokens
        come from its acceptance on the device (steps.verify_step): zeros here."""
        if not self.mtp:
            return None
        next_tokens = []
        for j, (seg, rows) in enumerate(zip(segments, groups)):
            nt = np.zeros(seg.tokens.shape, np.int32)
            for i, r in enumerate(rows if not (verify and j == 0) else ()):
                nt[i, :len(r.tokens)] = list(r.tokens[1:]) + [r.next_token]
            next_tokens.append(nt)
        ok = np.zeros((sum(s.tokens.shape[0] for s in segments),), bool)
        ok[:len(sampling_rows)] = [r is not None and r.draft_ok for r in sampling_rows]
        return tuple(next_tokens), ok

    def pack(self, groups: tuple[list[RowInput], ...], shape, sampling_rows: list[RowInput | None],
             verify: bool = False) -> tuple:
        """(segments, sampling, prompt_lens, mtp_in): a step's / (verify) verify step's arguments for `groups`
        (one row list per segment) padded to `shape`; sampling_rows = every sampling row in order, None
        for a padding row between segments."""
        segments = tuple(self.segment(rows, *seg) for rows, seg in zip(groups, shape))
        b = sum(s.tokens.shape[0] for s in segments)
        return (segments, self.sampling(sampling_rows, b), self.prompt_lens(segments, groups),
                self.mtp_in(segments, groups, sampling_rows, verify))

    # ---- abstract form (warm-up) -----------------------------------------------------------------
    def abstract(self, kind: str, shape) -> tuple:
        """ShapeDtypeStructs of a step / verify / draft / logits executable's arguments after (params,
        state) for one shape bucket: what `pack` produces for it."""
        i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)

        def segment(b, t):
            return StepBatch(i32(b, t), i32(b), i32(b), i32(b, self.max_pages_per_seq), i32(b), i32(b),
                             i32(b) if self.lora else None)
        if kind == "draft":
            b = shape[0][0]
            return segment(b, 1), i32(b), i32(b)
        if kind == "logits":
            return (tuple(segment(b, t) for b, t in shape),)
        if kind == "score":
            return tuple(segment(b, t) for b, t in shape), i32(*shape[0])
        segs = tuple(segment(b, t) for b, t in shape)
        b = sum(bb for bb, _ in shape)
        columns = SlotSampling(jax.ShapeDtypeStruct((b, len(FLOAT_COLUMNS)), jnp.float32), i32(b, len(INT_COLUMNS)),
                               i32(b, BIAS_COLUMNS), jax.ShapeDtypeStruct((b, BIAS_COLUMNS), jnp.float32))
        sampling = SamplingInput(i32(b), i32(b), i32(b), columns)
        mtp = (tuple(i32(*s) for s in shape), jax.ShapeDtypeStruct((b,), jnp.bool_)) if self.mtp else None
        args = (segs, sampling, tuple(i32(bb) for bb, _ in shape))
        return args + ((i32(*shape[0]), i32(shape[0][0])) if kind == "verify" else ()) + (mtp,)


def bias_columns(rows) -> dict:
    """logit_bias / allowed / bad-word adjustments as BIAS_COLUMNS (id, added logit) pairs per row."""
    ids = np.full((len(rows), BIAS_COLUMNS), NO_BIAS, np.int32)
    bias = np.zeros((len(rows), BIAS_COLUMNS), np.float32)
    only = np.zeros((len(rows),), bool)
    for i, r in enumerate(rows):
        adjust, only[i] = r.logit_adjust
        for j, (t, v) in enumerate(list(adjust.items())[:BIAS_COLUMNS]):
            ids[i, j], bias[i, j] = t, v
    return {"bias_ids": ids, "bias": bias, "bias_only": only}


class RankedBatch:
    """Data parallel: one InputBatch per dp rank (its own slots' mirror), whose packs go end to end on axis 0
    (parallel/data_parallel.py: rank d's block of every argument is a one-rank step's)."""

    def __init__(self, batches: list[InputBatch]):
        self.batches = batches

    def forget(self) -> None:
        for b in self.batches:
            b.forget()

    def commit(self) -> None:
        for b in self.batches:
            b.commit()

    def pack(self, groups, shape, sampling_rows, verify: bool = False) -> tuple:
        """`InputBatch.pack` per rank (groups[d], sampling_rows[d]: rank d's), concatenated."""
        parts = [b.pack(g, shape, rows, verify) for b, g, rows in zip(self.batches, groups, sampling_rows)]
        return jax.tree.map(lambda *xs: np.concatenate([np.asarray(x) for x in xs]), *parts)

    def segments(self, groups, b: int, t: int):
        """One [b, t] segment per rank of its rows (groups[d] = (rows,)), end to end (the self-draft step's)."""
        parts = [batch.segment(rows, b, t) for batch, (rows,) in zip(self.batches, groups)]
        return jax.tree.map(lambda *xs: np.concatenate(xs), *parts)

    def abstract(self, kind: str, shape) -> tuple:
        ranks = len(self.batches)
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct((a.shape[0] * ranks,) + a.shape[1:], a.dtype),
                            self.batches[0].abstract(kind, shape))
