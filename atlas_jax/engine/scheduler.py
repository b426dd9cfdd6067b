"""Scheduler: which sequences run in the next step, and with how many tokens. Host only.

Queues: `waiting` (FCFS; recompute-preempted sequences go back to its front), `running`
(in arrival order, at most max_num_seqs, each holding a slot), `swapped` (state on the host).
Each step: first swapped sequences come back, then every decoding sequence gets its next token,
then running sequences still in prefill get a chunk of <= max_prefill_chunk, and then waiting
sequences are admitted while slots, prefill rows, the token budget and pages (above a watermark)
allow. Rows of one token form the decode segment, longer chunks the prefill segment of the same
mixed step. The budget (max_num_batched_tokens) bounds the prefill segment only: the decode segment
is padded to a compiled bucket of its own (runner.mixed_decode_buckets), so counting decode rows would
only cut a chunk short, pad it back to the same shape and add a step.

Pages are allocated as a sequence grows. When a running sequence needs a page and none is
free, the running sequence with the least progress (fewest cached tokens; latest arrival on a
tie) is preempted, the asking one included: by swap (its pages, slot and penalty history saved to host memory, freed,
restored bit-exactly later) or by recompute (freed; re-prefilled from its prompt and the
tokens it already produced). A request that could never fit was refused at admission.

Prefix caching (`cache`, state/prefix_cache.py): admission starts a sequence at its longest
cached prefix (shared pages retained, a partly used page copied, the recurrent state loaded from
a snapshot); each step registers the pages it filled; a sequence snapshots its recurrent state at
its snap points (a prefill chunk is cut to end there), every `snapshot_interval` tokens, and when
it gives up its pages (finished, aborted, preempted), which it then only releases: registered
pages stay cached (idle, evictable) until memory is needed, and idle pages are reclaimed before
anything is preempted. With n > 1 the siblings wait until the first has prefilled the prompt up to
its last token and then start from that cached state (a fork: pages shared, state copied).

Clients (`Sequence.client`: an API key or peer address, set by the server): admission takes waiting
sequences client by client, the client with the fewest running sequences first (one client's in queue
order), so one client's flood cannot starve another's requests. When every slot is taken and a
waiting client runs fewer than its share (max_num_seqs / active clients) while another runs more,
one sequence of the client with the most (least progress first) is preempted by recompute per step
(back to waiting, its cached prefix kept when prefix caching is on). With one client (LLM, or every
request from one address) this is plain first come, first served.

LoRA (`adapters`, engine/lora.py): a sequence under an adapter holds a reference on the adapter's
device slot while it holds a recurrent slot (admission or swap-in to its release). When no adapter
slot can be had (all hold adapters in use) it stays queued, and so does every later sequence that
needs an adapter (first come, first served: the slots drain and it gets one); base-model sequences
go on being admitted. A promotion is a LoadAdapter op in the plan; an adapter with no host copy is
recorded in `failed` (the engine fails that request) and never raised out of `schedule`.
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections import Counter, deque

from ..state.allocator import BlockAllocator, SlotAllocator
from ..state.prefix_cache import PrefixCache
from .plan import LoadPrefix, SchedulerOutput, Snapshot, StateOp, SwapIn, SwapOut
from .sequence import Sequence, Status
from .speculative import draft_caps, wants_drafts

PREEMPTION_MODES = ("swap", "recompute")


_ADMITTED, _NO_ADAPTER, _STOP = "admitted", "no adapter slot", "stop"   # _admit_one's outcomes


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_prefill_chunk: int
    max_prefill_rows: int
    preemption_mode: str = "swap"
    swap_space_bytes: int = 4 << 30
    watermark_pages: int = 1
    page_bytes: int = 0              # host bytes of one page swapped out (every KV pool)
    slot_bytes: int = 0              # host bytes of one slot swapped out (recurrent state + penalty history)
    num_drafts: int = 0              # speculative drafts per decode row (0: no speculation)
    mtp_drafts: int = 0              # drafts the MTP head makes per row and step (0: no MTP head)
    max_model_len: int = 0           # the MTP head drafts only within it
    device_ngram: bool = False       # ngram drafts made on the device from every row that samples (no pages)


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockAllocator, slots: SlotAllocator,
                 cache: PrefixCache | None = None, adapters=None):
        if config.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {config.preemption_mode!r}")
        self.config = config
        self.blocks = blocks
        self.slots = slots
        self.ops: list[StateOp] = []                         # queued for the next plan (state changes in order)
        self.cache = cache
        self.adapters = adapters                       # LoRAManager (acquire(uid) -> (slot, op) | None, release)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.swap_bytes = 0
        self.num_preemptions = {"swap": 0, "recompute": 0, "fairness": 0}
        self.failed: list[tuple[Sequence, Exception]] = []   # adapter acquisitions that raised (engine fails them)
        self._fairness_head: Sequence | None = None          # the waiting sequence the last fairness victim was for

    # ---- queue changes ------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def remove(self, seq: Sequence, keep: bool = True) -> None:
        """Take a finished or aborted sequence out of every queue and free what it holds
        (keep: its cached prefix stays in the prefix cache; False after an engine error)."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.swapped:
            self.swapped.remove(seq)
            self.swap_bytes -= self._swap_size(seq)
            seq.swapped_state = None
        seq.fork_ready = True                           # never leave siblings waiting on a finished leader
        self._release(seq, snapshot=keep, register=keep)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def _release(self, seq: Sequence, snapshot: bool = True, register: bool = True) -> None:
        """Free seq's pages (cached ones stay in the cache, idle) and slot; first register its
        prefix and snapshot its recurrent state (while its slot still holds it)."""
        if self.cache is not None and seq.slot is not None and seq.num_cached > 0 and register:
            if snapshot:
                self._snapshot(seq)
            else:
                self.cache.cover(seq)
        seq.nodes = []
        if seq.pages:
            self.blocks.free(seq.pages)
            seq.pages = []
        if seq.slot is not None:
            self.slots.free([seq.slot])
            seq.slot = None
        if seq.adapter_slot is not None:
            if self.adapters is not None:
                self.adapters.release(seq.adapter_slot)
            seq.adapter_slot = None

    def _take_adapter(self, seq: Sequence) -> bool:
        """seq's adapter slot (a reference on it); False when every adapter slot is busy."""
        if self.adapters is None or seq.lora_name is None:
            seq.adapter_slot = 0
            return True
        try:
            got = self.adapters.acquire(seq.cache_key)
        except Exception as e:                          # noqa: BLE001 — contained: the engine fails this request
            got = None
            if all(f is not seq for f, _ in self.failed):
                self.failed.append((seq, e))
        if got is None:
            seq.adapter_slot = None
            return False
        seq.adapter_slot, load = got
        if load is not None:
            self.ops.append(load)                       # the promotion's device update, before the step
        return True

    # ---- one step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """The next step's rows, with every state operation queued since the last plan (the scheduler
        never touches the device: swaps, snapshots and prefix loads are ops the runner applies)."""
        cfg = self.config
        chosen: dict[Sequence, int] = {}
        self._swap_in()
        decoding = [s for s in self.running if s.num_uncached == 1]       # decode rows first: 1 token each
        for seq in decoding + [s for s in self.running if s.num_uncached > 1]:
            if seq not in self.running or (seq.pending and seq.num_tokens + seq.slack >= seq.max_len):
                continue                                      # preempted while making room for another, or
                                                              # its row in flight may reach its end (async)
            n = self._chunk(seq, seq.num_cached, self._budget(chosen))
            if n < 1 or (n > 1 and self._prefill_rows(chosen) >= cfg.max_prefill_rows):
                continue
            if self._grow(seq, seq.num_cached + seq.slack + n, chosen):
                chosen[seq] = n
        self._admit(chosen)
        plan = SchedulerOutput(decode=[s for s, n in chosen.items() if n == 1],
                               prefill=[(s, n) for s, n in chosen.items() if n > 1])
        self._draft_lookahead(plan)
        plan.ops, self.ops = self.ops, []
        return plan

    def _draft_lookahead(self, plan: SchedulerOutput) -> None:
        """Pages for drafts, from free pages only (never preempting): per decode row the drafts it may
        verify (speculative.draft_caps), and the rows the device drafts from: (MTP) where their pages cover
        what the head writes (the fed tokens and mtp_drafts - 1 more), (device ngram) every row that samples."""
        cfg = self.config
        if cfg.num_drafts:
            plan.draft_caps = dict(zip(plan.decode, draft_caps(plan.decode, cfg.num_drafts, self.lookahead)))
        if not (cfg.mtp_drafts or cfg.device_ngram):
            return
        for seq, n in [(s, 1) for s in plan.decode] + plan.prefill:
            if seq.num_cached + n == seq.num_tokens and wants_drafts(seq):
                if cfg.device_ngram:                    # prompt lookup writes no KV
                    plan.draft_ok.add(seq)
                    continue
                fed = n + min(plan.draft_caps.get(seq, 0), seq.device_drafts)   # MTP verifies the device's drafts
                need = seq.num_cached + seq.slack + fed + cfg.mtp_drafts - 1
                if need <= cfg.max_model_len and self.lookahead(seq, need) >= need:
                    plan.draft_ok.add(seq)

    def _chunk(self, seq: Sequence, start: int, budget: int) -> int:
        """Tokens seq feeds next from position `start`: up to the chunk size, the budget and its next snap point."""
        n = min(seq.num_tokens - start, self.config.max_prefill_chunk, budget)
        ahead = [p - start for p in seq.snap_points if p > start]
        return min([n] + ahead)

    def _budget(self, chosen) -> int:
        """Prefill tokens this step can still take (a chunk of 1 joins the decode segment)."""
        return self.config.max_num_batched_tokens - sum(n for n in chosen.values() if n > 1)

    @staticmethod
    def _prefill_rows(chosen) -> int:
        return sum(1 for n in chosen.values() if n > 1)

    def _grow(self, seq: Sequence, num_tokens: int, chosen: dict) -> bool:
        """Give seq pages for num_tokens, preempting others if needed. False if seq cannot run this step
        (preempted itself, or only sequences with a verify row in flight could make room)."""
        need = self.blocks.pages_for(num_tokens) - len(seq.pages)
        while need > self.blocks.num_free:
            # The least progress loses, the asking sequence included: a new prefill chunk never
            # evicts a long decode with more work done. Between clients, the one running the most loses
            # first (with one client: the least progress of all). A sequence with slack is never a
            # victim: its length is not known until its verify row resolves.
            load = Counter(s.client for s in self.running)
            settled = [s for s in self.running if not s.slack]
            if not settled:
                return False
            victim = min(settled, key=lambda s: (-load[s.client], s.num_cached, -s.order))
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
        """Moves waiting sequences to running (slot, pages, adapter, prefix-cache hit) while slots, pages,
        the token budget and prefill rows last; order is _admission_order's, fairness-preempting first."""
        cfg = self.config
        if not self.waiting or self.swapped:
            return
        adapters_blocked = False
        for seq in self._fair_order(chosen):
            if self.swapped or len(self.running) >= cfg.max_num_seqs or not self.slots.num_free:
                return
            if (seq.fork_leader is not None and not seq.fork_leader.fork_ready) or seq.pending or \
                    (adapters_blocked and seq.lora_name is not None) or any(f is seq for f, _ in self.failed):
                continue                                  # a sibling waits for the shared prompt to be cached
                                                          # (or an earlier sequence for an adapter slot; or a
                                                          # preempted one for its last token to reach the host)
            outcome = self._admit_one(seq, chosen)
            if outcome is _STOP:
                return
            adapters_blocked |= outcome is _NO_ADAPTER

    def _fair_order(self, chosen: dict):
        """_admission_order; when no slot is free, the first admissible sequence preempts for fairness first."""
        order = self._admission_order()
        if len(self.running) >= self.config.max_num_seqs or not self.slots.num_free:
            seen = []
            for seq in order:
                seen.append(seq)
                if (seq.fork_leader is None or seq.fork_leader.fork_ready) and not seq.pending:
                    self._preempt_for_fairness(seq, chosen)
                    break
            order = itertools.chain(seen, order)
        return order

    def _admit_one(self, seq, chosen: dict):
        """Admits seq with its first chunk: _ADMITTED, _NO_ADAPTER (every adapter slot busy; it waits), or
        _STOP (no budget, prefill rows or pages left: admission ends this step)."""
        cfg = self.config
        budget = self._budget(chosen)
        hit = self._lookup(seq) if budget > 0 else None
        start = hit.length if hit is not None else 0
        n = self._chunk(seq, start, budget)
        if n < 1 or (n > 1 and self._prefill_rows(chosen) >= cfg.max_prefill_rows):
            return _STOP
        shared = hit.pages if hit is not None else []
        keep = shared + ([hit.cow_page] if hit is not None and hit.cow_page is not None else [])
        self.blocks.retain(keep)                          # out of eviction's reach from here on
        need = self.blocks.pages_for(start + n) - len(shared)
        if self.blocks.num_free < need + (cfg.watermark_pages if self.running else 0):
            self.blocks.free(keep)
            return _STOP
        if not self._take_adapter(seq):
            self.blocks.free(keep)
            return _NO_ADAPTER
        self.waiting.remove(seq)
        if seq is self._fairness_head:
            self._fairness_head = None
        if hit is not None:
            self.cache.record(seq.num_tokens, hit)
            if seq.num_prefix_cached is None:
                seq.num_prefix_cached = hit.length
        seq.slot = self.slots.allocate(1)[0]
        seq.pages = shared + self.blocks.allocate(need)
        if start:
            self._start_from(seq, hit)
        if hit is not None and hit.cow_page is not None:
            self.blocks.free([hit.cow_page])
        seq.status = Status.RUNNING
        self._insert_running(seq)
        chosen[seq] = n
        return _ADMITTED

    def _admission_order(self):
        """Waiting sequences (a generator, consumed as far as admission goes) in the order admission
        considers them: clients interleaved, the one with the fewest running (counting those already
        yielded) first; each client's own in queue order."""
        first = self.waiting[0].client
        if all(s.client == first for s in self.waiting):
            yield from list(self.waiting)
            return
        queues: dict[str | None, deque] = {}
        for s in self.waiting:
            queues.setdefault(s.client, deque()).append(s)
        load = Counter(s.client for s in self.running)
        heap = [(load[c], q[0].order, c) for c, q in queues.items()]      # orders are unique: no ties on c
        heapq.heapify(heap)
        while heap:
            n, _, client = heapq.heappop(heap)
            queue = queues[client]
            yield queue.popleft()
            if queue:
                heapq.heappush(heap, (n + 1, queue[0].order, client))

    def _share(self) -> tuple[Counter, int]:
        """(running sequences per client, a client's share of max_num_seqs among the active clients)."""
        load = Counter(s.client for s in self.running)
        active = set(load) | {s.client for s in self.waiting} | {s.client for s in self.swapped}
        return load, max(1, self.config.max_num_seqs // max(1, len(active)))

    def _preempt_for_fairness(self, head: Sequence, chosen: dict) -> None:
        """Every slot taken and `head` (the first admissible waiting sequence) from a client below its
        share: free a slot from the client running the most sequences above it (its least-progress
        sequence, by recompute). Once per head: a head that still is not admitted (its adapter slots
        busy, pages short) gets no second victim until it is."""
        load, share = self._share()
        if not load or head is self._fairness_head:
            return
        heavy, most = max(load.items(), key=lambda kv: kv[1])
        if load[head.client] >= share or most <= share or heavy == head.client:
            return
        victim = min((s for s in self.running if s.client == heavy and not s.slack),
                     key=lambda s: (s.num_cached, -s.order), default=None)
        if victim is None:
            return
        chosen.pop(victim, None)
        self.num_preemptions["fairness"] += 1
        self._fairness_head = head
        self._preempt(victim, mode="recompute")

    def _lookup(self, seq: Sequence):
        """seq's cached prefix (None without a cache), and its snap points (branch point, fork point,
        end of prompt) for the prefill ahead."""
        if self.cache is None:
            return None
        tokens = seq.all_tokens()
        hit = self.cache.match(tokens, seq.num_tokens - 1, seq.cache_key)
        p = len(seq.prompt_ids)
        points = {p}
        if hit.matched > hit.length and self.cache.recurrent:
            points.add(hit.matched)                       # a branch point: the next request like it starts here
        if any(s.fork_leader is seq for s in self.waiting):
            points.add(p - 1)                             # the fork point of its n > 1 siblings
        seq.snap_points = sorted(x for x in points if hit.length < x <= seq.num_tokens)
        seq.fork_ready = seq.fork_ready or hit.length >= p - 1
        return hit

    def _start_from(self, seq: Sequence, hit) -> None:
        """seq resumes at the cached prefix: its pages hold it (shared, or copied), and its slot
        gets the snapshot's recurrent state and the prefix's penalty history."""
        cow = (hit.cow_page, seq.pages[hit.length // self.blocks.page_size]) if hit.cow_page is not None else None
        self.ops.append(LoadPrefix(seq.slot, hit.snapshot, cow, tuple(seq.tokens_between(0, hit.length)),
                                   len(seq.prompt_ids)))
        seq.num_cached, seq.state_idx = hit.length, 0
        seq.nodes = list(hit.nodes)
        seq.last_snapshot = hit.length

    def progressed(self, seq: Sequence) -> None:
        """After a step advanced seq's num_cached: register its filled pages and take the
        snapshots due (a snap point reached, or snapshot_interval tokens since the last)."""
        if self.cache is None:
            return
        self.cache.commit(seq)
        due = bool(seq.snap_points) and seq.snap_points[0] <= seq.num_cached
        seq.snap_points = [p for p in seq.snap_points if p > seq.num_cached]
        if due or seq.num_cached - seq.last_snapshot >= self.cache.snapshot_interval:
            self._snapshot(seq)
        if seq.num_cached >= len(seq.prompt_ids) - 1:
            seq.fork_ready = True

    def _snapshot(self, seq: Sequence) -> None:
        """Cache seq's prefix up to num_cached: its partly filled page, and (recurrent models) its state."""
        seq.last_snapshot = seq.num_cached
        sid = self.cache.new_snapshot(seq)
        if sid is not None:
            self.ops.append(Snapshot(seq.slot, seq.state_idx, sid))
        elif not self.cache.recurrent:
            self.cache.cover(seq)

    def _insert_running(self, seq: Sequence) -> None:
        i = next((i for i, s in enumerate(self.running) if s.order > seq.order), len(self.running))
        self.running.insert(i, seq)

    # ---- preemption ---------------------------------------------------------------------------
    def _preempt(self, seq: Sequence, mode: str | None = None) -> None:
        self.running.remove(seq)
        seq.metrics.num_preemptions += 1
        cached_pages = seq.pages[:self.blocks.pages_for(seq.num_cached)]
        if (mode or self.config.preemption_mode) == "swap" and seq.num_cached > 0:
            size = len(cached_pages) * self.config.page_bytes + self.config.slot_bytes
            if self.swap_bytes + size <= self.config.swap_space_bytes:
                self.num_preemptions["swap"] += 1
                self.ops.append(SwapOut(seq, tuple(cached_pages), seq.slot))
                self._release(seq, snapshot=False)
                seq.status = Status.SWAPPED
                self.swap_bytes += size
                i = next((i for i, s in enumerate(self.swapped) if s.order > seq.order), len(self.swapped))
                self.swapped.insert(i, seq)
                return
        if mode is None:
            self.num_preemptions["recompute"] += 1
        self._release(seq)
        seq.num_cached = seq.state_idx = 0
        seq.device_drafts = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def _swap_size(self, seq: Sequence) -> int:
        """Host bytes of a swapped-out seq's copy (its cached pages and its slot)."""
        return self.blocks.pages_for(seq.num_cached) * self.config.page_bytes + self.config.slot_bytes

    def _swap_in(self) -> None:
        cfg = self.config
        while self.swapped and len(self.running) < cfg.max_num_seqs and self.slots.num_free:
            load = Counter(s.client for s in self.running)      # the least-served client's oldest first
            ready = [s for s in self.swapped if not s.pending]  # (async: its last token read)
            if not ready:
                return
            seq = min(ready, key=lambda s: (load[s.client], s.order))
            need = self.blocks.pages_for(seq.num_cached)
            headroom = cfg.watermark_pages + 1 if self.running else 0
            if self.blocks.num_free < need + headroom or not self._take_adapter(seq):
                return
            self.swapped.remove(seq)
            seq.slot = self.slots.allocate(1)[0]
            seq.pages = self.blocks.allocate(need)
            self.ops.append(SwapIn(seq, tuple(seq.pages), seq.slot))
            self.swap_bytes -= self._swap_size(seq)
            seq.status = Status.RUNNING
            self._insert_running(seq)


def default_watermark(num_pages: int) -> int:
    return max(1, math.ceil(0.01 * num_pages))
