"""EngineCore: the synchronous engine — requests in, one scheduled step at a time, outputs out.

Owns the ModelRunner (device state, compiled steps) and the Scheduler (host queues, pages,
slots). `LLM` drives it in a loop; `AsyncLLM` drives it from a background thread. Requests
are validated in `add_request` before they touch any state, so a bad request is refused with
a ValueError and never disturbs the ones in flight.
"""
from __future__ import annotations

import logging
import time

from ..config import ModelConfig
from ..errors import AdapterUnavailableError
from ..kernels import XLA, Kernels
from ..state.allocator import BlockAllocator, SlotAllocator
from ..state.cache import snapshot_slots
from ..state.prefix_cache import PrefixCache
from .lora import LoRAManager, LoRARequest
from .input_processor import InputProcessor
from .request import Request
from .input_batch import RowInput
from .introspection import EngineIntrospection
from .plan import LoadAdapter, SchedulerOutput
from .runner import ModelRunner
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerConfig, default_watermark
from .sequence import Sequence
from .speculative import SpecStats, SpeculativeConfig, make_proposer

log = logging.getLogger("atlas_jax.engine")


class EngineCore(EngineIntrospection):
    def __init__(self, cfg: ModelConfig, params, tokenizer, *, dtype, page_size: int, num_pages: int | None,
                 max_num_seqs: int, max_model_len: int, max_prefill_chunk: int, max_num_batched_tokens: int | None,
                 max_prefill_rows: int, preemption_mode: str, swap_space_gb: float, seed: int, kernels: Kernels = XLA,
                 speculative: SpeculativeConfig | None = None, draft_token_ids=None, enable_prompt_logprobs: bool = False,
                 enable_prefix_caching: bool = False, prefix_snapshot_bytes: int | None = None,
                 lora: dict | None = None):
        """lora: None, or {"max_loras", "max_lora_rank", "max_cpu_loras"} (multi-LoRA serving, engine/lora.py).
        draft_token_ids: the MTP head's draft vocabulary (speculative.load_token_map), None: all tokens."""
        for name, v in (("page_size", page_size), ("max_num_seqs", max_num_seqs), ("max_model_len", max_model_len),
                        ("max_prefill_chunk", max_prefill_chunk), ("max_prefill_rows", max_prefill_rows)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        self.cfg, self.tokenizer = cfg, tokenizer
        self.max_model_len = max_model_len
        max_pages_per_seq = -(-max_model_len // page_size)
        self.num_pages = int(num_pages or max_num_seqs * max_pages_per_seq)
        # prompt_logprobs scores prompts on pages and a slot of their own (beyond the serving pools).
        scratch_pages = max_pages_per_seq if enable_prompt_logprobs else 0
        self.blocks = BlockAllocator(self.num_pages, page_size)
        self.slots = SlotAllocator(max_num_seqs)
        self._score = (list(range(self.num_pages, self.num_pages + scratch_pages)), max_num_seqs) \
            if enable_prompt_logprobs else None
        self.runner = ModelRunner(cfg, params, num_pages=self.num_pages + scratch_pages, page_size=page_size,
                                  num_slots=max_num_seqs + bool(enable_prompt_logprobs),
                                  max_pages_per_seq=max_pages_per_seq, dtype=dtype, max_num_seqs=max_num_seqs,
                                  max_prefill_chunk=max_prefill_chunk, max_prefill_rows=max_prefill_rows,
                                  kernels=kernels,
                                  max_verify_tokens=1 + speculative.num_drafts if speculative else 1,
                                  mtp_drafts=speculative.num_drafts if speculative and speculative.method == "mtp" else 0,
                                  mtp_layers=len(params.get("mtp", {}).get("layers", ())),
                                  mtp_token_ids=draft_token_ids,
                                  self_drafts=bool(speculative) and speculative.method == "self",
                                  num_snapshots=snapshot_slots(cfg, dtype, enable_prefix_caching,
                                                               prefix_snapshot_bytes, max_num_seqs),
                                  lora_slots=lora["max_loras"] if lora else 0,
                                  lora_rank=lora["max_lora_rank"] if lora else 0)
        self.lora = LoRAManager(cfg, lora["max_loras"], lora["max_lora_rank"], lora.get("max_cpu_loras")) \
            if lora else None
        self.speculative = speculative
        self.proposer = make_proposer(speculative, self) if speculative else None
        self.spec_stats = SpecStats()
        budget = max_num_batched_tokens or max(512, max_prefill_chunk)
        if budget < 1:
            raise ValueError(f"max_num_batched_tokens ({budget}) must be >= 1 (prefill tokens per step)")
        page_bytes, slot_bytes = self.runner.state_ops.swap_bytes()
        self.sched_config = SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_prefill_chunk=max_prefill_chunk,
            max_prefill_rows=max_prefill_rows, preemption_mode=preemption_mode,
            swap_space_bytes=int(swap_space_gb * 2**30), watermark_pages=default_watermark(self.num_pages),
            page_bytes=page_bytes, slot_bytes=slot_bytes, num_drafts=speculative.num_drafts if speculative else 0,
            mtp_drafts=self.runner.mtp_drafts, max_model_len=max_model_len)
        self.prefix_cache = PrefixCache(
            self.blocks, lookahead=self.runner.mtp_drafts > 0, num_snapshots=self.runner.num_snapshots,
            recurrent=bool(cfg.recurrent_layers)) if enable_prefix_caching else None
        self.scheduler = Scheduler(self.sched_config, self.blocks, self.slots, self.prefix_cache, self.lora)
        self.requests: dict[str, Request] = {}
        self.inputs = InputProcessor(tokenizer, vocab_size=cfg.vocab_size, eos_token_ids=cfg.eos_token_ids,
                                     max_model_len=max_model_len, page_size=page_size, num_pages=self.num_pages,
                                     prompt_logprobs=enable_prompt_logprobs, lora=self.lora, seed=seed)
        self.num_steps = 0
        self.step_requests: list[str] = []           # request ids of the step being run (named if it kills the engine)
        self.num_failed_requests = 0                 # failed alone by step containment
        self.num_aborted: dict[str, int] = {}        # requests ended early, by reason (abort, timeout, error)

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
            req.prompt_logprobs = self.runner.score_prompt(req.prompt_ids, *self._score,
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

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- one step ---------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Schedule and run one step. Returns the requests that got tokens, finished or failed.

        A step that raises is contained: while the device state survived (the failure came before
        the device ran: host-side inputs), every scheduled sequence runs again alone, and a request
        whose own step raises fails alone (finish_reason "error", `Request.error`); the rest make
        their progress. Only a failure that consumed the donated state is raised (the engine is
        then dead). Host work after the device ran is contained per row (`_contain`)."""
        self.step_requests = []
        plan = self.scheduler.schedule()
        failed = self._apply(plan)                   # swaps, prefix / adapter loads, snapshots: before the step
        self.step_requests = sorted({s.request_id for s in plan.decode + [s for s, _ in plan.prefill]})
        if plan.empty:
            if self.scheduler.has_work() and not failed:
                raise RuntimeError("scheduler could not schedule any sequence (a bug: admission guarantees fit)")
            return failed
        try:
            return failed + self._run(plan, speculate=True)
        except Exception as e:
            if self.runner.state_lost():
                raise
            log.warning("step failed before the device ran (%r); running its %d sequences one by one",
                        e, len(plan.decode) + len(plan.prefill))
            return failed + self._isolate(plan)

    def _apply(self, plan: SchedulerOutput) -> list[Request]:
        """Apply the plan's state ops in order. Contained: an adapter that could not be acquired while
        scheduling, or whose LoadAdapter op raises (before the device ran), fails the requests that
        asked for it; their siblings leave the plan with them. Anything else, or a lost state, raises."""
        failures, self.scheduler.failed = list(self.scheduler.failed), []
        for op in plan.ops:
            try:
                self.runner.state_ops.apply(op)
            except Exception as e:
                if not isinstance(op, LoadAdapter) or self.runner.state_lost():
                    raise
                self.lora.load_failed(op.slot, op.uid)
                error = AdapterUnavailableError(f"adapter slot {op.slot} could not be loaded: {e!r}")
                failures += [(s, error) for s in self.scheduler.running
                             if s.adapter_slot == op.slot and s.cache_key == op.uid]
        touched = {}
        for seq, e in failures:
            if seq.request.request_id in self.requests:
                touched[seq.request.request_id] = self._fail(seq.request, e)
        plan.decode = [s for s in plan.decode if not s.finished]
        plan.prefill = [(s, n) for s, n in plan.prefill if not s.finished]
        return list(touched.values())

    def _run(self, plan: SchedulerOutput, speculate: bool) -> list[Request]:
        """One forward: a plain step, or a verify step when a decoding row has drafts."""
        now, nd = time.monotonic(), len(plan.decode)
        work = [(s, 1) for s in plan.decode] + plan.prefill
        for s, _ in work:
            if s.metrics.first_scheduled_time is None:
                s.metrics.first_scheduled_time = now
        drafts = self._drafts(plan) if speculate and self.proposer is not None and nd else [[]] * nd
        rows = [self.row(s, n, s in plan.draft_ok) for s, n in work]
        if any(drafts):
            emitted, out = self.runner.verify(rows[:nd], drafts, rows[nd:])
            self.spec_stats.verify_steps += 1
        else:
            out, emitted = self.runner.step(rows[:nd], rows[nd:]), None
        self._keep_drafts([s for s, _ in work], rows)
        self.num_steps += 1
        if nd and self.proposer is not None:
            self.spec_stats.record_decode(nd, sum(map(len, emitted)) if emitted else nd)
        touched = {}
        for i, (seq, n) in enumerate(work):
            if i < nd and drafts[i]:
                self._contain(seq, touched, lambda: self._accept(seq, drafts[i], emitted[i], touched))
            else:
                self._contain(seq, touched, lambda: self._advance(seq, n, out, i, touched))
        return self._finish_step(touched)

    def _isolate(self, plan: SchedulerOutput) -> list[Request]:
        """Run each sequence of a failed plan alone; fail the requests whose own step raises."""
        touched = {}
        for seq, n in [(s, 1) for s in plan.decode] + plan.prefill:
            if seq.finished or seq not in self.scheduler.running:
                continue                                  # failed with a sibling, or preempted
            solo = SchedulerOutput(decode=[seq] if n == 1 else [], prefill=[] if n == 1 else [(seq, n)],
                                   draft_ok=plan.draft_ok)
            try:
                touched.update((r.request_id, r) for r in self._run(solo, speculate=False))
            except Exception as e:
                if self.runner.state_lost():
                    raise
                touched[seq.request.request_id] = self._fail(seq.request, e)
        return list(touched.values())

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

    def _advance(self, seq: Sequence, n: int, out: dict, i: int, touched: dict) -> None:
        """After a plain row of n tokens: cache progress, and the sampled token when the row reached the end."""
        seq.num_cached += n
        seq.state_idx = min(n, self.runner.state_positions) - 1
        if seq.num_uncached:
            self.scheduler.progressed(seq)
            return                                        # a prompt chunk that did not reach the end
        seq.append(int(out["tokens"][i]), self._logprobs(seq, out, i))
        touched[seq.request.request_id] = seq.request
        if seq.finished:
            self.scheduler.remove(seq)
        else:
            self.scheduler.progressed(seq)

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

    def row(self, seq: Sequence, n: int, draft_ok: bool = False) -> RowInput:
        """seq's next n tokens as a row (draft_ok: the MTP head drafts from it, SchedulerOutput.draft_ok)."""
        end = seq.num_cached + n
        return RowInput(tokens=seq.next_tokens(n), start=seq.num_cached, block_table=seq.pages, slot=seq.slot,
                        params=seq.params, seed=seq.seed, step=len(seq.output_ids), prompt_len=len(seq.prompt_ids),
                        state_idx=seq.state_idx, next_token=seq.token_at(end) if end < seq.num_tokens else -1,
                        logit_adjust=seq.logit_adjustments() if seq.params.adjusts_logits else ({}, False),
                        adapter=seq.adapter_slot or 0, draft_ok=draft_ok)

    def _keep_drafts(self, seqs: list[Sequence], rows: list[RowInput]) -> None:
        """MTP: the drafts this step made for each row, to verify next step."""
        drafts = self.runner.last_drafts
        for i, (seq, row) in enumerate(zip(seqs, rows)):
            seq.pending_drafts = [int(t) for t in drafts[i]] if drafts is not None and row.draft_ok else []

    # ---- speculative decoding ---------------------------------------------------------------
    def _drafts(self, plan: SchedulerOutput) -> list[list[int]]:
        """Drafts per decoding sequence, within the plan's draft caps."""
        caps = [plan.draft_caps.get(s, 0) for s in plan.decode]
        drafts = self.proposer.propose(plan.decode, caps)
        return [[int(t) for t in d][:c] for d, c in zip(drafts, caps)]

    def _accept(self, seq: Sequence, drafts: list[int], toks: list[int], touched: dict) -> None:
        """After a verify row with drafts: its accepted drafts and the target's token, appended one by one
        (rows with drafts ask for no logprobs: speculative.wants_drafts)."""
        accepted = len(toks) - 1
        self.spec_stats.record(len(drafts), accepted)
        seq.num_cached += 1 + accepted              # the fed token and the accepted drafts are cached
        seq.state_idx = accepted                    # ... and their recurrent state is at this position
        for tok in toks:
            seq.append(tok, None)
            if seq.finished:
                break
        touched[seq.request.request_id] = seq.request
        if seq.finished:
            self.scheduler.remove(seq)
        else:
            self.scheduler.progressed(seq)

    @staticmethod
    def _logprobs(seq: Sequence, out, i: int) -> dict[int, float] | None:
        k = seq.params.logprobs
        if k is None:
            return None
        lp = {int(t): float(v) for t, v in zip(out["top_ids"][i][:k], out["top_logprobs"][i][:k])}
        lp[int(out["tokens"][i])] = float(out["logprob"][i])
        return lp

    def warmup(self, progress: bool = True, background: bool = False) -> int:
        """Compile the serving executables (background: the largest shapes now, the rest in a thread)."""
        return self.runner.warmup(swap=self.sched_config.preemption_mode == "swap", progress=progress,
                                  score=self._score is not None, prefix=self.prefix_cache is not None,
                                  background=background)
