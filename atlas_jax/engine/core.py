"""EngineCore: the synchronous engine — requests in, one scheduled step at a time, outputs out.

Built from one EngineConfig (engine_config.py). Owns the ModelRunner (device state, compiled steps)
and the Scheduler (host queues, pages, slots). `LLM` drives it in a loop; `AsyncLLM` drives it from a background thread. Requests
are validated in `add_request` before they touch any state, so a bad request is refused with
a ValueError and never disturbs the ones in flight.
"""
from __future__ import annotations

import dataclasses
import logging
import time

from ..state.allocator import BlockAllocator, SlotAllocator
from ..state.prefix_cache import PrefixCache
from . import containment, spec_steps
from .engine_config import EngineConfig
from .input_processor import InputProcessor
from .introspection import EngineIntrospection
from .lora import LoRAManager, LoRARequest
from .plan import SchedulerOutput
from .request import Request
from .row import row_logprobs, row_of
from .runner import Launched, ModelRunner
from .sampling_params import SamplingParams
from .dp_scheduler import DataParallelScheduler, Pooled
from .scheduler import Scheduler
from .sequence import Sequence
from .speculative import SpecStats, make_proposer

log = logging.getLogger("atlas_jax.engine")


@dataclasses.dataclass
class InFlight:
    """A dispatched step: its outputs on the device, per row (seq, tokens fed, samples), and for a verify
    step the drafts each decode row fed (its first len(drafted) rows; None: a plain step)."""
    launched: Launched
    work: list[tuple[Sequence, int, bool]]
    drafted: list[int] | None = None


class EngineCore(EngineIntrospection):
    def __init__(self, config: EngineConfig, params, tokenizer, draft_token_ids=None):
        """draft_token_ids: the MTP head's draft vocabulary (speculative.load_token_map), None: all tokens."""
        self.config, self.cfg, self.tokenizer = config, config.model, tokenizer
        c = config.cache
        self.max_model_len, self.num_pages, self.speculative = config.max_model_len, c.num_pages, config.speculative
        # prompt_logprobs scores prompts on pages and a slot of their own (beyond the serving pools)
        self._score = (list(range(c.num_pages, c.num_pages + c.scratch_pages)), config.max_num_seqs) \
            if c.prompt_logprobs else None
        self.runner = ModelRunner(config, params, draft_token_ids)
        lora = config.lora
        self.lora = LoRAManager(self.cfg, lora.max_loras, lora.max_lora_rank, lora.max_cpu_loras) if lora else None
        self.proposer = make_proposer(config.speculative, self) if config.speculative else None
        self.spec_stats = SpecStats()
        page_bytes, slot_bytes = self.runner.state_ops.swap_bytes()
        self.sched_config = dataclasses.replace(config.scheduler, page_bytes=page_bytes, slot_bytes=slot_bytes)
        ranks = [self._rank_scheduler() for _ in range(config.data_parallel_size)]
        if len(ranks) == 1:
            self.scheduler = ranks[0]
            self.blocks, self.slots, self.prefix_cache = self.scheduler.blocks, self.scheduler.slots, self.scheduler.cache
        else:                                        # data parallel: D ranks seen as one (dp_scheduler.py)
            self.scheduler = DataParallelScheduler(ranks)
            self.blocks, self.slots = Pooled([r.blocks for r in ranks]), Pooled([r.slots for r in ranks])
            self.prefix_cache = self.scheduler.cache
            self.num_pages = c.num_pages * len(ranks)
        self.requests: dict[str, Request] = {}
        self.inputs = InputProcessor(tokenizer, vocab_size=self.cfg.vocab_size, eos_token_ids=self.cfg.eos_token_ids,
                                     max_model_len=config.max_model_len, page_size=c.page_size,
                                     num_pages=c.num_pages, prompt_logprobs=c.prompt_logprobs, lora=self.lora,
                                     seed=config.seed)
        self.num_steps = 0
        self.step_requests: list[str] = []           # request ids of the step being run (named if it kills the engine)
        self.num_failed_requests = 0                 # failed alone by step containment
        self.num_aborted: dict[str, int] = {}        # requests ended early, by reason (abort, timeout, error)
        # async scheduling: the dispatched step whose tokens the host has not read (None: none)
        self.async_scheduling = config.async_scheduling      # the setting; _overlaps() says where it applies
        self.inflight: InFlight | None = None
        self.num_overlapped = 0                      # steps dispatched before the previous one was resolved
        self.step_seconds = 0.0                      # in step(); less runner.wait_seconds: the host's own time

    def _rank_scheduler(self) -> Scheduler:
        """A scheduler over pages, slots and a prefix cache of its own (one per data-parallel rank)."""
        c = self.config.cache
        blocks, slots = BlockAllocator(c.num_pages, c.page_size), SlotAllocator(self.config.max_num_seqs)
        cache = PrefixCache(blocks, lookahead=self.config.mtp_drafts > 0, num_snapshots=c.num_snapshots,
                            recurrent=bool(self.cfg.recurrent_layers)) if c.prefix_caching else None
        return Scheduler(self.sched_config, blocks, slots, cache, self.lora)

    # ---- requests ---------------------------------------------------------------------------
    def make_request(self, prompt, params: SamplingParams, request_id: str | None = None,
                     lora_request: LoRARequest | str | None = None, client: str | None = None) -> Request:
        """Validate and build a request without queueing it (input_processor.py; any thread)."""
        return self.inputs.make_request(prompt, params, request_id, lora_request, client)

    def submit(self, req: Request) -> None:
        """Queue a request built by make_request (engine thread only)."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in flight")
        if req.params.prompt_logprobs is not None:
            req.prompt_logprobs = self.runner.scoring.score_prompt(req.prompt_ids, *self._score,
                                                           self.sched_config.max_prefill_chunk, req.params.prompt_logprobs)
        if req.lora is not None:
            self.lora.use(*req.lora)                    # the adapter cannot be unloaded until it ends
        self.requests[req.request_id] = req
        for s in req.seqs:
            if self.scheduler.cache is not None and s is not req.seqs[0]:
                s.fork_leader = req.seqs[0]             # forks from the first one's cached prompt
            self.scheduler.add(s)

    def add_request(self, prompt, params: SamplingParams, request_id: str | None = None,
                    lora_request: LoRARequest | str | None = None, client: str | None = None) -> Request:
        req = self.make_request(prompt, params, request_id, lora_request, client)
        self.submit(req)
        return req

    def abort(self, request_id: str, reason: str = "abort", error: str | None = None) -> Request | None:
        req = self.requests.pop(str(request_id), None)
        if req is not None:
            self._retired(req)
            self.num_aborted[reason] = self.num_aborted.get(reason, 0) + 1
            for s in req.seqs:
                s.finish(reason, error=error)
                self.scheduler.remove(s, keep=reason != "error")
            req.error = error
        return req

    def drain(self) -> list[Request]:
        """Resolve the step in flight, if any (rows of aborted or finished sequences drop their tokens)."""
        touched: dict[str, Request] = {}
        if self.inflight is not None:
            self._resolve(touched)
        return self._finish_step(touched)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self.inflight is not None

    # ---- one step ---------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Schedule and run one step. Returns the requests that got tokens, finished or failed.

        Async scheduling (the default; with a drafter where it drafts on the device, `_overlaps`): the
        step is dispatched and the step before it is resolved while the device runs it, so the host
        reads a step's tokens one step late (`Sequence.pending`; the device feeds them from
        `EngineState.last_tokens`). Outputs equal synchronous stepping: the host's bookkeeping that a
        step's ops depend on (cache progress, pages, prefix registration, snapshots) is exact at
        dispatch, only token ids wait; a sequence that turns out to have finished had one more row
        run, whose token is dropped.

        A step that raises is contained: while the device state survived (the failure came before
        the device ran: host-side inputs), every scheduled sequence runs again alone, and a request
        whose own step raises fails alone (finish_reason "error", `Request.error`); the rest make
        their progress. Only a failure that consumed the donated state is raised (the engine is
        then dead). Host work after the device ran is contained per row (`_contain`)."""
        t0 = time.perf_counter()
        try:
            return self._step()
        finally:
            self.step_seconds += time.perf_counter() - t0

    def _step(self) -> list[Request]:
        touched: dict[str, Request] = {}
        self.step_requests = []
        if self.inflight is not None and not self._may_overlap():
            self._resolve(touched)
        plan = self.scheduler.schedule()
        failed = containment.apply_ops(self, plan)                   # swaps, prefix / adapter loads, snapshots: before the step
        self.step_requests = sorted({s.request_id for s in plan.decode + [s for s, _ in plan.prefill]})
        if plan.empty:
            if self.inflight is not None:
                self._resolve(touched)
            elif self.scheduler.has_work() and not failed:
                raise RuntimeError("scheduler could not schedule any sequence (a bug: admission guarantees fit)")
            return failed + self._finish_step(touched)
        try:
            self._run(plan, touched, speculate=True)
        except Exception as e:
            if self.runner.state_lost():
                raise
            log.warning("step failed before the device ran (%r); running its %d sequences one by one",
                        e, len(plan.decode) + len(plan.prefill))
            if self.inflight is not None:
                self._resolve(touched)
            containment.isolate(self, plan, touched)
        return failed + self._finish_step(touched)

    def _may_overlap(self) -> bool:
        """The next step may be scheduled before the one in flight is resolved: async scheduling, and no
        running sequence whose next row's inputs need its pending token on the host (bad_words)."""
        return self._overlaps() and not any(s.pending and s.bad_word_ids for s in self.scheduler.running)

    def _overlaps(self) -> bool:
        """Async scheduling applies: no drafter, or one whose drafts are made on the device (MTP, self, device
        ngram: they never leave it) without the prefix cache (its snapshots need exact positions at dispatch)."""
        if not self.async_scheduling:
            return False
        return self.proposer is None or (self.proposer.on_device and self.scheduler.cache is None)

    def _run(self, plan: SchedulerOutput, touched: dict, speculate: bool) -> None:
        """One forward, dispatched: a verify step when a decoding row has drafts or is behind a verify row in
        flight, else a plain step; the step in flight before it is resolved meanwhile (or this one, when
        synchronous)."""
        now, nd = time.monotonic(), len(plan.decode)
        work = [(s, 1) for s in plan.decode] + plan.prefill
        for s, _ in work:
            if s.metrics.first_scheduled_time is None:
                s.metrics.first_scheduled_time = now
        drafts = spec_steps.drafts_for(self, plan) if speculate and self.proposer is not None and nd else [[]] * nd
        rows = [row_of(s, n, s in plan.draft_ok) for s, n in work]
        if spec_steps.needs_verify(plan, drafts):
            launched, drafted = spec_steps.launch_verify(self, plan, rows, drafts), [len(d) for d in drafts]
        else:
            launched, drafted = self.runner.launch(rows[:nd], rows[nd:]), None
            if nd and self.proposer is not None:
                self.spec_stats.record_decode(nd, nd)
        self.num_steps += 1
        flight = InFlight(launched, [(s, n, self._dispatched(s, n, r.draft_ok)) for (s, n), r in zip(work, rows)],
                          drafted)
        previous, self.inflight = self.inflight, flight
        if previous is not None:
            self.num_overlapped += 1
            self._resolve(touched, previous)
        if not self._overlaps():
            self._resolve(touched)
        for seq, _, _ in flight.work:                  # registration and snapshots once positions are exact
            if not seq.finished and not seq.slack:
                self._contain(seq, touched, lambda: self.scheduler.progressed(seq))

    def _dispatched(self, seq: Sequence, n: int, draft_ok: bool) -> bool:
        """Host bookkeeping of a row at dispatch: n more tokens cached, and (True) a pending sampled token
        when the row reached the last known one (with MTP drafts from it on the device when draft_ok)."""
        seq.num_cached += n
        seq.state_idx = min(n, self.runner.state_positions) - 1
        if seq.num_uncached:
            return False                                  # a prompt chunk that did not reach the end
        seq.pending += 1
        seq.device_drafts = self.config.device_drafts if draft_ok else 0
        return True

    def _resolve(self, touched: dict, flight: "InFlight | None" = None) -> None:
        """Wait for a dispatched step (default: the one in flight) and record its sampled tokens."""
        if flight is None:
            flight, self.inflight = self.inflight, None
        out = flight.launched.fetch()
        verify_rows = len(flight.drafted) if flight.drafted is not None else 0
        for i, (seq, _, samples) in enumerate(flight.work):
            if not samples or seq.finished:               # finished meanwhile: this row's tokens are dropped
                continue
            if i < verify_rows:
                self._contain(seq, touched, lambda: spec_steps.resolve_row(self, seq, flight.drafted[i], out, i,
                                                                           touched))
            else:
                self._contain(seq, touched, lambda: self._emit(seq, out, i, touched))

    def _emit(self, seq: Sequence, out: dict, i: int, touched: dict) -> None:
        """Row i's sampled token reached the host: append it (stop checks), retire seq if it finished."""
        seq.pending -= 1
        seq.append(int(out["tokens"][i]), row_logprobs(seq, out, i))
        touched[seq.request.request_id] = seq.request
        if seq.finished:
            self.scheduler.remove(seq)

    def _contain(self, seq: Sequence, touched: dict, fn) -> None:
        """Host bookkeeping of one row after the device ran: an exception fails that request only."""
        try:
            fn()
        except Exception as e:
            touched[seq.request.request_id] = self._fail(seq.request, e)

    def _fail(self, req: Request, e: Exception) -> Request:
        log.error("request %s failed in the engine: %r", req.request_id, e, exc_info=e)
        self.num_failed_requests += 1
        self.abort(req.request_id, reason="error", error=f"the engine failed this request: {e!r}")
        return req

    def _finish_step(self, touched: dict) -> list[Request]:
        for rid, req in touched.items():
            if req.finished and self.requests.pop(rid, None) is not None:
                self._retired(req)
        return list(touched.values())

    def _retired(self, req: Request) -> None:
        """req left the engine (finished or aborted): its adapter may be unloaded again (and its host copy
        dropped from the cache)."""
        if req.lora is not None:
            self.lora.done(req.lora[0])
            if req.lora_pin is not None:
                req.lora_pin()                                   # a finalize runs its callback once

    def warmup(self, progress: bool = True, background: bool = False) -> int:
        """Compile the serving executables (background: the largest shapes now, the rest in a thread)."""
        return self.runner.warmup(swap=self.sched_config.preemption_mode == "swap", progress=progress,
                                  score=self._score is not None, prefix=self.prefix_cache is not None,
                                  background=background)
