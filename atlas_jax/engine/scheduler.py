"""Scheduler: which sequences run in the next step, and with how many tokens. Host only.

Queues: `waiting` (FCFS; recompute-preempted sequences go back to its front), `running`
(in arrival order, at most max_num_seqs, each holding a slot), `swapped` (state on the host).
Each step spends a token budget (max_num_batched_tokens): first swapped sequences come back,
then every decoding sequence gets its next token, then running sequences still in prefill
get a chunk of <= max_prefill_chunk, and then waiting sequences are admitted while slots,
prefill rows, budget and pages (above a watermark) allow. Rows of one token form the decode segment, longer
chunks the prefill segment of the same mixed step.

Pages are allocated as a sequence grows. When a running sequence needs a page and none is
free, the running sequence with the least progress (fewest cached tokens; latest arrival on a
tie) is preempted, the asking one included: by swap (its pages, slot and penalty history saved to host memory, freed,
restored bit-exactly later) or by recompute (freed; re-prefilled from its prompt and the
tokens it already produced). A request that could never fit was refused at admission.
"""
from __future__ import annotations

import dataclasses
import math
from collections import deque

from ..state.allocator import BlockAllocator, SlotAllocator
from .sequence import Sequence, Status

PREEMPTION_MODES = ("swap", "recompute")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_prefill_chunk: int
    max_prefill_rows: int
    preemption_mode: str = "swap"
    swap_space_bytes: int = 4 << 30
    watermark_pages: int = 1


@dataclasses.dataclass
class ScheduledStep:
    decode: list[Sequence]                     # one token each
    prefill: list[tuple[Sequence, int]]        # (sequence, chunk length > 1)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockAllocator, slots: SlotAllocator, swapper):
        """swapper: save(pages, slot) -> host state, restore(pages, slot, state), nbytes(state)."""
        if config.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {config.preemption_mode!r}")
        self.config = config
        self.blocks = blocks
        self.slots = slots
        self.swapper = swapper
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.swap_bytes = 0
        self.num_preemptions = {"swap": 0, "recompute": 0}

    # ---- queue changes ------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out of every queue and free what it holds."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.swapped:
            self.swapped.remove(seq)
            self.swap_bytes -= self.swapper.nbytes(seq.swapped_state)
            seq.swapped_state = None
        self._release(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def _release(self, seq: Sequence) -> None:
        if seq.pages:
            self.blocks.free(seq.pages)
            seq.pages = []
        if seq.slot is not None:
            self.slots.free([seq.slot])
            seq.slot = None

    # ---- one step ---------------------------------------------------------------------------
    def schedule(self) -> ScheduledStep:
        cfg = self.config
        chosen: dict[Sequence, int] = {}
        self._swap_in()
        decoding = [s for s in self.running if s.num_uncached == 1]       # decode rows first: 1 token each
        for seq in decoding + [s for s in self.running if s.num_uncached > 1]:
            if seq not in self.running:                       # preempted while making room for another
                continue
            budget = cfg.max_num_batched_tokens - sum(chosen.values())
            n = min(seq.num_uncached, cfg.max_prefill_chunk, budget)
            if n < 1 or (n > 1 and self._prefill_rows(chosen) >= cfg.max_prefill_rows):
                continue
            if self._grow(seq, seq.num_cached + n, chosen):
                chosen[seq] = n
        self._admit(chosen)
        return ScheduledStep(decode=[s for s, n in chosen.items() if n == 1],
                             prefill=[(s, n) for s, n in chosen.items() if n > 1])

    @staticmethod
    def _prefill_rows(chosen) -> int:
        return sum(1 for n in chosen.values() if n > 1)

    def _grow(self, seq: Sequence, num_tokens: int, chosen: dict) -> bool:
        """Give seq pages for num_tokens, preempting others if needed. False if seq itself was preempted."""
        need = self.blocks.pages_for(num_tokens) - len(seq.pages)
        while need > self.blocks.num_free:
            # The least progress loses, the asking sequence included: a new prefill chunk never
            # evicts a long decode with more work done.
            victim = min(self.running, key=lambda s: (s.num_cached, -s.order))
            chosen.pop(victim, None)
            self._preempt(victim)
            if victim is seq:
                return False
        if need > 0:
            seq.pages += self.blocks.allocate(need)
        return True

    def lookahead(self, seq: Sequence, num_tokens: int) -> int:
        """Pages for up to num_tokens (drafts) from free pages only, never preempting: returns how
        many tokens seq's pages now cover (>= what the step needs already)."""
        need = self.blocks.pages_for(num_tokens) - len(seq.pages)
        if need > 0:
            seq.pages += self.blocks.allocate(min(need, self.blocks.num_free))
        return min(num_tokens, len(seq.pages) * self.blocks.page_size)

    def _admit(self, chosen: dict) -> None:
        cfg = self.config
        while self.waiting and not self.swapped and len(self.running) < cfg.max_num_seqs and self.slots.num_free:
            budget = cfg.max_num_batched_tokens - sum(chosen.values())
            seq = self.waiting[0]
            n = min(seq.num_uncached, cfg.max_prefill_chunk, budget)
            if n < 1 or (n > 1 and self._prefill_rows(chosen) >= cfg.max_prefill_rows):
                return
            need = self.blocks.pages_for(n)
            if self.blocks.num_free < need + (cfg.watermark_pages if self.running else 0):
                return
            self.waiting.popleft()
            seq.slot = self.slots.allocate(1)[0]
            seq.pages = self.blocks.allocate(need)
            seq.status = Status.RUNNING
            self._insert_running(seq)
            chosen[seq] = n

    def _insert_running(self, seq: Sequence) -> None:
        i = next((i for i, s in enumerate(self.running) if s.order > seq.order), len(self.running))
        self.running.insert(i, seq)

    # ---- preemption ---------------------------------------------------------------------------
    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.metrics.num_preemptions += 1
        cached_pages = seq.pages[:self.blocks.pages_for(seq.num_cached)]
        if self.config.preemption_mode == "swap" and seq.num_cached > 0:
            state = self.swapper.save(cached_pages, seq.slot)
            size = self.swapper.nbytes(state)
            if self.swap_bytes + size <= self.config.swap_space_bytes:
                self.num_preemptions["swap"] += 1
                self._release(seq)
                seq.swapped_state, seq.status = state, Status.SWAPPED
                self.swap_bytes += size
                i = next((i for i, s in enumerate(self.swapped) if s.order > seq.order), len(self.swapped))
                self.swapped.insert(i, seq)
                return
        self.num_preemptions["recompute"] += 1
        self._release(seq)
        seq.num_cached = seq.state_idx = 0
        seq.pending_drafts = []
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def _swap_in(self) -> None:
        cfg = self.config
        while self.swapped and len(self.running) < cfg.max_num_seqs and self.slots.num_free:
            seq = self.swapped[0]
            need = self.blocks.pages_for(seq.num_cached)
            headroom = cfg.watermark_pages + 1 if self.running else 0
            if self.blocks.num_free < need + headroom:
                return
            self.swapped.pop(0)
            seq.slot = self.slots.allocate(1)[0]
            seq.pages = self.blocks.allocate(need)
            self.swapper.restore(seq.pages, seq.slot, seq.swapped_state)
            self.swap_bytes -= self.swapper.nbytes(seq.swapped_state)
            seq.swapped_state, seq.status = None, Status.RUNNING
            self._insert_running(seq)


def default_watermark(num_pages: int) -> int:
    return max(1, math.ceil(0.01 * num_pages))
