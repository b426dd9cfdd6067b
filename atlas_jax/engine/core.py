"""EngineCore: the synchronous engine — requests in, one scheduled step at a time, outputs out.

Owns the ModelRunner (device state, compiled steps) and the Scheduler (host queues, pages,
slots). `LLM` drives it in a loop; `AsyncLLM` drives it from a background thread. Requests
are validated in `add_request` before they touch any state, so a bad request is refused with
a ValueError and never disturbs the ones in flight.
"""
from __future__ import annotations

import logging
import time

import numpy as np

from ..config import ModelConfig
from ..kernels import XLA, Kernels
from ..state.allocator import BlockAllocator, SlotAllocator
from ..state.cache import snapshot_bytes
from ..state.prefix_cache import PrefixCache
from .lora import LoRAManager, LoRARequest
from .input_processor import InputProcessor
from .request import Request
from .runner import ModelRunner, RowInput
from .sampling_params import SamplingParams
from .scheduler import SchedulerOutput, Scheduler, SchedulerConfig, default_watermark
from .sequence import Sequence
from .speculative import SpecStats, SpeculativeConfig, draft_caps, make_proposer, wants_drafts

log = logging.getLogger("atlas_jax.engine")


class EngineCore:
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
                                  num_snapshots=self._num_snapshots(enable_prefix_caching, prefix_snapshot_bytes,
                                                                    dtype, max_num_seqs),
                                  lora_slots=lora["max_loras"] if lora else 0,
                                  lora_rank=lora["max_lora_rank"] if lora else 0)
        self.lora = LoRAManager(cfg, lora["max_loras"], lora["max_lora_rank"], lora.get("max_cpu_loras"),
                                self.runner.load_adapter) if lora else None
        self.speculative = speculative
        self.proposer = make_proposer(speculative, self) if speculative else None
        self.spec_stats = SpecStats()
        budget = max_num_batched_tokens or max(512, max_prefill_chunk)
        if budget < 1:
            raise ValueError(f"max_num_batched_tokens ({budget}) must be >= 1 (prefill tokens per step)")
        page_bytes, slot_bytes = self.runner.swap_bytes()
        self.sched_config = SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_prefill_chunk=max_prefill_chunk,
            max_prefill_rows=max_prefill_rows, preemption_mode=preemption_mode,
            swap_space_bytes=int(swap_space_gb * 2**30), watermark_pages=default_watermark(self.num_pages),
            page_bytes=page_bytes, slot_bytes=slot_bytes)
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

    def _num_snapshots(self, enabled: bool, budget: int | None, dtype, max_num_seqs: int) -> int:
        """Snapshot slots in `budget` bytes (default: 4 per running sequence, at least 16, within 2 GiB)."""
        size = snapshot_bytes(self.cfg, dtype)
        if not enabled or not size:
            return 0
        if budget is None:
            return max(1, min(max(16, 4 * max_num_seqs), (2 << 30) // size))
        if budget < size:
            raise ValueError(f"prefix_snapshot_bytes ({budget}) is below one snapshot of this model's recurrent "
                             f"state ({size} bytes)")
        return budget // size

    # ---- requests ---------------------------------------------------------------------------
    def encode(self, prompt) -> tuple[str | None, list[int]]:
        return self.inputs.encode(prompt)

    def make_request(self, prompt, params: SamplingParams, request_id: str | None = None,
                     lora_request: LoRARequest | str | None = None, client: str | None = None) -> Request:
        """Validate and build a request without queueing it (input_processor.py; any thread)."""
        return self.inputs.make_request(prompt, params, request_id, lora_request, client)

    def submit(self, req: Request) -> None:
        """Queue a request built by make_request (engine thread only)."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in flight")
        if req.params.prompt_logprobs is not None:
            req.prompt_logprobs = self._prompt_logprobs(req.prompt_ids, req.params.prompt_logprobs)
        if req.lora is not None:
            self.lora.use(*req.lora)                    # the adapter cannot be unloaded until it ends
        self.requests[req.request_id] = req
        for s in req.seqs:
            if self.scheduler.cache is not None and s is not req.seqs[0]:
                s.fork_leader = req.seqs[0]             # forks from the first one's cached prompt
            self.scheduler.add(s)

    def _prompt_logprobs(self, ids: list[int], top: int) -> list:
        """vLLM's prompt_logprobs: None for the first token, then per token {its id and the top `top`
        ids: logprob given the tokens before it}; scored in prefill chunks on the scratch pages / slot."""
        pages, slot = self._score
        if len(ids) < 2:
            return [None]
        logits = self.runner.chunked_logits(ids[:-1], pages, slot, self.sched_config.max_prefill_chunk, warmed=True)
        logp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)        # row j predicts ids[j + 1]
        best = np.argsort(-logp, axis=-1)[:, :top]
        return [None] + [{int(t): float(logp[j, t]) for t in (ids[j + 1], *best[j])} for j in range(len(ids) - 1)]

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
        self.runner.apply_ops(plan.ops)              # swaps, prefix loads, snapshots: before anything runs
        failed = self._scheduler_failures(plan)
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

    def _scheduler_failures(self, plan: SchedulerOutput) -> list[Request]:
        """Fail the requests whose adapter slot could not be loaded while scheduling (their siblings leave
        the plan with them); raised only if that load consumed the device state."""
        failures, self.scheduler.failed = self.scheduler.failed, []
        if not failures:
            return []
        if self.runner.state_lost():
            raise failures[0][1]
        touched = {}
        for seq, e in failures:
            if seq.request.request_id in self.requests:
                touched[seq.request.request_id] = self._fail(seq.request, e)
        plan.decode = [s for s in plan.decode if not s.finished]
        plan.prefill = [(s, n) for s, n in plan.prefill if not s.finished]
        return list(touched.values())

    def _run(self, plan: SchedulerOutput, speculate: bool) -> list[Request]:
        now = time.monotonic()
        if speculate and self.proposer is not None and plan.decode:
            drafts = self._drafts(plan.decode)
            if any(drafts):
                return self._verify_step(plan.decode, drafts, plan.prefill, now)
        work = [(s, 1) for s in plan.decode] + plan.prefill
        for s, _ in work:
            if s.metrics.first_scheduled_time is None:
                s.metrics.first_scheduled_time = now
        rows = [self.row(s, n) for s, n in work]
        out = self.runner.step(rows[:len(plan.decode)], rows[len(plan.decode):])
        self._keep_drafts([s for s, _ in work], rows)
        self.num_steps += 1
        touched = {}
        for i, (seq, n) in enumerate(work):
            self._contain(seq, touched, lambda: self._advance(seq, n, out, i, touched))
        if plan.decode and self.proposer is not None:
            self.spec_stats.record_decode(len(plan.decode), len(plan.decode))
        return self._finish_step(touched)

    def _isolate(self, plan: SchedulerOutput) -> list[Request]:
        """Run each sequence of a failed plan alone; fail the requests whose own step raises."""
        touched = {}
        for seq, n in [(s, 1) for s in plan.decode] + plan.prefill:
            if seq.finished or seq not in self.scheduler.running:
                continue                                  # failed with a sibling, or preempted
            solo = SchedulerOutput(decode=[seq] if n == 1 else [], prefill=[] if n == 1 else [(seq, n)])
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

    def row(self, seq: Sequence, n: int, fed: int | None = None) -> RowInput:
        """seq's next n tokens as a row; `fed` = tokens the row will really feed (n + drafts)."""
        end = seq.num_cached + n
        row = RowInput(tokens=seq.next_tokens(n), start=seq.num_cached, block_table=seq.pages, slot=seq.slot,
                       params=seq.params, seed=seq.seed, step=len(seq.output_ids), prompt_len=len(seq.prompt_ids),
                       state_idx=seq.state_idx, next_token=seq.token_at(end) if end < seq.num_tokens else -1,
                       logit_adjust=seq.logit_adjustments() if seq.params.adjusts_logits else ({}, False),
                       adapter=seq.adapter_slot or 0)
        k = self.runner.mtp_drafts
        if k and end == seq.num_tokens and wants_drafts(seq):
            need = seq.num_cached + (fed or n) + k - 1          # the MTP head writes KV up to the last draft
            row.draft_ok = need <= self.max_model_len and self.scheduler.lookahead(seq, need) >= need
        return row

    def _keep_drafts(self, seqs: list[Sequence], rows: list[RowInput]) -> None:
        """MTP: the drafts this step made for each row, to verify next step."""
        drafts = self.runner.last_drafts
        for i, (seq, row) in enumerate(zip(seqs, rows)):
            seq.pending_drafts = [int(t) for t in drafts[i]] if drafts is not None and row.draft_ok else []

    # ---- speculative decoding ---------------------------------------------------------------
    def _drafts(self, seqs: list[Sequence]) -> list[list[int]]:
        """Drafts per decoding sequence, within speculative.draft_caps."""
        caps = draft_caps(seqs, self.speculative.num_drafts, self.scheduler.lookahead)
        drafts = self.proposer.propose(seqs, caps)
        return [[int(t) for t in d][:c] for d, c in zip(drafts, caps)]

    def _verify_step(self, seqs: list[Sequence], drafts: list[list[int]], prefill: list[tuple[Sequence, int]],
                     now: float) -> list[Request]:
        for s in seqs + [s for s, _ in prefill]:
            if s.metrics.first_scheduled_time is None:
                s.metrics.first_scheduled_time = now
        rows = [self.row(s, 1, 1 + len(d)) for s, d in zip(seqs, drafts)]
        prefill_rows = [self.row(s, n) for s, n in prefill]
        emitted, out = self.runner.verify(rows, drafts, prefill_rows)
        self._keep_drafts(seqs + [s for s, _ in prefill], rows + prefill_rows)
        self.num_steps += 1
        self.spec_stats.verify_steps += 1
        self.spec_stats.record_decode(len(seqs), sum(len(e) for e in emitted))
        touched = {}
        for j, (seq, n) in enumerate(prefill):
            self._contain(seq, touched, lambda: self._advance(seq, n, out, len(seqs) + j, touched))
        for i, (seq, d, toks) in enumerate(zip(seqs, drafts, emitted)):
            self._contain(seq, touched, lambda: self._accept(seq, d, toks, out, i, touched))
        return self._finish_step(touched)

    def _accept(self, seq: Sequence, drafts: list[int], toks: list[int], out: dict, i: int, touched: dict) -> None:
        """After a verify row: its accepted drafts and the target token, appended one by one."""
        accepted = len(toks) - 1
        if drafts:
            self.spec_stats.record(len(drafts), accepted)
        seq.num_cached += 1 + accepted              # the fed token and the accepted drafts are cached
        seq.state_idx = accepted                    # ... and their recurrent state is at this position
        for tok in toks:
            seq.append(tok, None if drafts else self._logprobs(seq, out, i))
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

    # ---- introspection ----------------------------------------------------------------------
    @property
    def num_compiles(self) -> int:
        return self.runner.num_compiles

    def stats(self) -> dict:
        s = self.scheduler
        return {"running": len(s.running), "waiting": len(s.waiting), "swapped": len(s.swapped),
                "free_pages": self.blocks.num_free, "num_pages": self.num_pages, "free_slots": self.slots.num_free,
                "num_slots": self.slots.capacity, "num_preemptions": dict(s.num_preemptions),
                "num_compiles": self.num_compiles, "warmup_pending": self.runner.exes.pending,
                "num_steps": self.num_steps,
                "num_failed_requests": self.num_failed_requests, "num_aborted": dict(self.num_aborted),
                "prefix_cache": self.prefix_cache_stats(), "lora": self.lora_stats()}

    def lora_stats(self) -> dict | None:
        """Adapter slots (slot -> resident adapter name), their reference counts, promotions; None without LoRA."""
        if self.lora is None:
            return None
        return {"slots": self.lora.resident(), "refcounts": self.lora.refcount[1:],
                "num_promotions": self.lora.num_promotions, "adapters": [r.lora_name for r in self.lora.names()]}

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (idle pages back to the free list, snapshots dropped)."""
        if self.prefix_cache is not None:
            self.blocks.take_back(self.prefix_cache.reset())

    def set_prefix_caching(self, on: bool) -> None:
        """Turn lookups, registration and forks on or off on an engine built with prefix caching
        (A/B runs on one set of compiled steps: benchmarks, tests). Only while idle; the cache
        starts empty either way."""
        if self.prefix_cache is None:
            raise ValueError("this engine was built without enable_prefix_caching")
        if self.scheduler.has_work():
            raise RuntimeError("set_prefix_caching needs an idle engine")
        self.reset_prefix_cache()
        self.scheduler.cache = self.prefix_cache if on else None

    def prefix_cache_stats(self) -> dict | None:
        """Token hit rate, cached / idle pages, snapshots (count, bytes), evictions; None when off."""
        c = self.prefix_cache
        if c is None:
            return None
        st = dict(c.stats)
        st["hit_rate"] = st["hit_tokens"] / st["query_tokens"] if st["query_tokens"] else 0.0
        st.update(cached_pages=c.num_nodes(), idle_pages=c.num_idle, snapshots=c.num_snapshots_used,
                  snapshot_slots=c.num_snapshots,
                  snapshot_bytes=c.num_snapshots_used * snapshot_bytes(self.cfg, self.runner.dtype))
        return st

    def warmup(self, progress: bool = True, background: bool = False) -> int:
        """Compile the serving executables (background: the largest shapes now, the rest in a thread)."""
        return self.runner.warmup(swap=self.sched_config.preemption_mode == "swap", progress=progress,
                                  score=self._score is not None, prefix=self.prefix_cache is not None,
                                  background=background)
