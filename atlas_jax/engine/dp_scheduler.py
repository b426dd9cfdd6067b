"""Data-parallel attention on the host: D ranks, each a Scheduler with its own pages, slots and prefix cache
(ids local to the rank), seen by EngineCore as one scheduler (parallel/data_parallel.py is the device side).

A sequence is placed on a rank when it is added and stays there (`Sequence.dp_rank`; its rows carry it,
RowInput.rank): the rank whose prefix cache holds the longest usable prefix of it, else the least loaded one;
an n > 1 fork goes where its leader is. Each step every rank schedules its own rows within its own budget
(max_num_seqs, the token budget and prefill rows are per rank); the plans are joined, their state operations
tagged with their rank. Read-outs (free pages, slots, cache stats) are the ranks' sums.
"""
from __future__ import annotations

import dataclasses
from .plan import SchedulerOutput
from .scheduler import Scheduler
from .sequence import Sequence


class DataParallelScheduler:
    def __init__(self, ranks: list[Scheduler]):
        self.ranks = ranks
        self._caches = [r.cache for r in ranks]

    # ---- Scheduler's interface -----------------------------------------------------------------
    @property
    def cache(self):
        """The ranks' prefix caches as one (None when off; setting None turns every rank's off)."""
        return None if self.ranks[0].cache is None else PooledCache(self._caches)

    @cache.setter
    def cache(self, value) -> None:
        for r, c in zip(self.ranks, self._caches):
            r.cache = None if value is None else c

    running = property(lambda self: [s for r in self.ranks for s in r.running])
    waiting = property(lambda self: [s for r in self.ranks for s in r.waiting])
    swapped = property(lambda self: [s for r in self.ranks for s in r.swapped])
    num_preemptions = property(lambda self: _summed([r.num_preemptions for r in self.ranks]))

    @property
    def failed(self) -> list:
        return [f for r in self.ranks for f in r.failed]

    @failed.setter
    def failed(self, value: list) -> None:
        if value:
            raise ValueError("only clearing the failed adapter acquisitions is supported")
        for r in self.ranks:
            r.failed = []

    def add(self, seq: Sequence) -> None:
        seq.dp_rank = self._place(seq)
        self.ranks[seq.dp_rank].add(seq)

    def remove(self, seq: Sequence, keep: bool = True) -> None:
        self.ranks[seq.dp_rank].remove(seq, keep)

    def has_work(self) -> bool:
        return any(r.has_work() for r in self.ranks)

    def progressed(self, seq: Sequence) -> None:
        self.ranks[seq.dp_rank].progressed(seq)

    def schedule(self) -> SchedulerOutput:
        plan = SchedulerOutput(decode=[], prefill=[])
        for k, r in enumerate(self.ranks):
            p = r.schedule()
            plan.decode += p.decode
            plan.prefill += p.prefill
            plan.ops += [dataclasses.replace(op, rank=k) for op in p.ops]
            plan.draft_caps.update(p.draft_caps)
            plan.draft_ok |= p.draft_ok
        return plan

    # ---- placement --------------------------------------------------------------------------
    def _place(self, seq: Sequence) -> int:
        if seq.fork_leader is not None:
            return seq.fork_leader.dp_rank
        tokens = seq.all_tokens()

        def score(k: int):
            r = self.ranks[k]
            hit = r.cache.match(tokens, seq.num_tokens - 1, seq.cache_key).length if r.cache is not None else 0
            return hit, -(len(r.running) + len(r.waiting) + len(r.swapped)), -k
        return max(range(len(self.ranks)), key=score)


class Pooled:
    """Several ranks' allocators (BlockAllocator / SlotAllocator) read as one: counts summed."""

    def __init__(self, parts: list):
        self.parts = parts

    num_free = property(lambda self: sum(p.num_free for p in self.parts))
    capacity = property(lambda self: sum(p.capacity for p in self.parts))
    page_size = property(lambda self: self.parts[0].page_size)

    def take_back(self, ids) -> None:
        if list(ids):
            raise ValueError("pages of a data-parallel engine go back to their own rank's allocator")


class PooledCache:
    """The ranks' prefix caches read as one (stats summed); reset empties each into its own rank's pages."""

    def __init__(self, caches: list):
        self.caches = caches

    @property
    def stats(self) -> dict:
        return _summed([c.stats for c in self.caches])

    num_idle = property(lambda self: sum(c.num_idle for c in self.caches))
    num_snapshots_used = property(lambda self: sum(c.num_snapshots_used for c in self.caches))
    num_snapshots = property(lambda self: sum(c.num_snapshots for c in self.caches))

    def num_nodes(self) -> int:
        return sum(c.num_nodes() for c in self.caches)

    def reset(self) -> list:
        for c in self.caches:
            c.blocks.take_back(c.reset())
        return []


def _summed(dicts: list[dict]) -> dict:
    return {key: sum(d[key] for d in dicts) for key in dicts[0]}
