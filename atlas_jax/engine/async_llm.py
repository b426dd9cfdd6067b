"""AsyncLLM: the streaming interface the server uses.

The EngineCore runs its step loop in one background thread and is touched by no other
thread; callers talk to it through a command queue (add / abort) and get outputs back
through one asyncio.Queue per request, filled with `loop.call_soon_threadsafe`.

    llm = AsyncLLM.from_llm(LLM(...))      # or AsyncLLM(model, **LLM kwargs)
    async for out in llm.generate(prompt, SamplingParams(...), request_id="r1"):
        ...                                # RequestOutput, cumulative / delta / final_only
    await llm.abort("r1")

Leaving the `async for` early (client gone, task cancelled) aborts the request and frees its
pages. A request the engine fails alone (EngineCore's step containment) ends its stream with
RequestFailedError; the others go on. Only a step that consumed the device state kills the engine:
every in-flight request then fails with EngineDeadError and the engine accepts no more (`errored`
says why). Validation and tokenization run on a small worker pool, off the caller's event loop.
`drain()` stops accepting; `fail_all(msg)` ends what is in flight with an error (graceful shutdown).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from typing import AsyncIterator

from .client import FINISHED as _Finished
from .core import EngineCore
from .request import Request
from ..errors import EngineDeadError, RequestFailedError
from .outputs import RequestOutput
from .sampling_params import SamplingParams

log = logging.getLogger("atlas_jax.engine")
PREP_WORKERS = 4        # threads that validate / tokenize / template requests (tokenizers releases the GIL)


class AsyncLLM:
    def __init__(self, model: str | None = None, **llm_kwargs):
        from .llm import LLM
        self._init(LLM(model, **llm_kwargs))

    @classmethod
    def from_llm(cls, llm, warmup: bool | str = False) -> "AsyncLLM":
        """warmup=True: the engine thread compiles every step shape before it takes requests; "background":
        the largest shapes (they run any batch), then it serves while a thread compiles the rest
        (executables.py). Until then `is_ready` is False (the server answers 503) and add_request refuses."""
        self = cls.__new__(cls)
        self._init(llm, warmup)
        return self

    def _init(self, llm, warmup: bool | str = False) -> None:
        self.llm = llm
        self.engine: EngineCore = llm.engine
        self.tokenizer = llm.tokenizer
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.errored: BaseException | None = None
        self._warmup = warmup
        self._draining = False
        self._prep = concurrent.futures.ThreadPoolExecutor(PREP_WORKERS, thread_name_prefix="atlas_jax-prep")
        self._ready = threading.Event()
        if not warmup:
            self._ready.set()
        self._thread = threading.Thread(target=self._loop, name="atlas_jax-engine", daemon=True)
        self._thread.start()

    # ---- caller side (EngineClient, engine/client.py) ------------------------------------------
    model_path = property(lambda self: self.llm.model_path)
    max_model_len = property(lambda self: self.engine.max_model_len)
    vocab_size = property(lambda self: self.engine.cfg.vocab_size)
    num_pages = property(lambda self: self.engine.num_pages)
    num_slots = property(lambda self: self.engine.slots.capacity)
    loras = property(lambda self: self.engine.lora)

    def stats(self) -> dict:
        """EngineCore.stats() and, with speculation, its acceptance summary under "spec"."""
        spec = self.engine.spec_stats.summary() if self.engine.speculative is not None else None
        return {**self.engine.stats(), "spec": spec}

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self.errored is None and not self._stop.is_set()

    @property
    def is_draining(self) -> bool:
        return self._draining

    @property
    def is_ready(self) -> bool:
        """Running and warmed up: requests are served without compiling."""
        return self.is_running and self._ready.is_set()

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout) and self.is_running

    @property
    def num_in_flight(self) -> int:
        """Requests added and not yet finished (their streams are open)."""
        return len(self._streams)

    def add_request(self, prompt, params: SamplingParams, request_id: str | None = None,
                    lora_request=None, client: str | None = None) -> tuple[Request, asyncio.Queue]:
        """Validate (InvalidRequestError, a ValueError) and queue a request on the caller's thread;
        returns it and its output queue. Servers use `add_request_async` (validation off the loop).
        lora_request: a LoRARequest, a registered adapter's name, or None (the base model); client: who
        sent it (admission is fair between clients)."""
        self._check_accepting()
        return self._enqueue(self.engine.make_request(prompt, params, request_id, lora_request, client))

    async def add_request_async(self, prompt, params: SamplingParams, request_id: str | None = None,
                                lora_request=None, client: str | None = None) -> tuple[Request, asyncio.Queue]:
        """add_request with validation and tokenization on the worker pool."""
        self._check_accepting()
        req = await self.offload(self.engine.make_request, prompt, params, request_id, lora_request, client)
        self._check_accepting()
        return self._enqueue(req)

    async def offload(self, fn, *args):
        """Run fn(*args) on the worker pool (heavy host work: templates, tokenization, decoding)."""
        return await asyncio.get_running_loop().run_in_executor(self._prep, fn, *args)

    def _check_accepting(self) -> None:
        if self.errored is not None:
            raise EngineDeadError(f"engine failed: {self.errored!r}")
        if self._stop.is_set() or self._draining:
            raise EngineDeadError("engine is shutting down")
        if not self._ready.is_set():
            raise EngineDeadError("engine is still warming up")

    def _enqueue(self, req: Request) -> tuple[Request, asyncio.Queue]:
        """Register the request's stream and queue it. The accepting check and the registration are one
        step under the lock the engine thread takes to fail or shut down every stream: a stream is
        either refused here or seen (and ended) by that fan-out, never left waiting."""
        stream: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._check_accepting()
            if req.request_id in self._streams:
                raise ValueError(f"request id {req.request_id!r} is already in flight")
            self._streams[req.request_id] = (asyncio.get_running_loop(), stream)
        self._commands.put(("add", req))
        return req, stream

    async def generate(self, prompt, params: SamplingParams, request_id: str | None = None,
                       lora_request=None, client: str | None = None) -> AsyncIterator[RequestOutput]:
        req, stream = await self.add_request_async(prompt, params, request_id, lora_request, client)
        finished = False
        try:
            while True:
                item = await stream.get()
                if item is _Finished:
                    finished = True
                    return
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
        finally:
            if not finished:
                self._commands.put(("abort", req.request_id, "abort"))

    async def abort(self, request_id: str, reason: str = "abort") -> None:
        self._commands.put(("abort", str(request_id), reason))

    def abort_nowait(self, request_id: str, reason: str = "abort") -> None:
        self._commands.put(("abort", str(request_id), reason))

    def drain(self) -> None:
        """Accept no new requests; those in flight go on."""
        self._draining = True

    def fail_all(self, message: str) -> None:
        """End every in-flight request with EngineDeadError(message) (their pages are freed)."""
        self._commands.put(("fail_all", message))

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the loop after aborting whatever is still in flight."""
        with self._lock:
            self._draining = True
            self._stop.set()
        self._prep.shutdown(wait=False, cancel_futures=True)
        self._commands.put(("wake",))
        self._thread.join(timeout)
        self.engine.runner.exes.close()       # a background warm-up stops after its current compile

    # ---- engine thread -----------------------------------------------------------------------
    def _push(self, request_id: str, item) -> None:
        with self._lock:
            entry = self._streams.get(request_id)
            if entry is not None and (item is _Finished or isinstance(item, BaseException)):
                del self._streams[request_id]
        if entry is not None:
            loop, stream = entry
            try:
                loop.call_soon_threadsafe(stream.put_nowait, item)
            except RuntimeError:            # the caller's loop is closed
                pass

    def _emit(self, req: Request) -> None:
        if req.error is not None:                   # failed by the engine, or ended by fail_all
            self._push(req.request_id, RequestFailedError(req.error))
            return
        if req.params.output_kind != "final_only" or req.finished:
            self._push(req.request_id, req.take_delta() if req.params.output_kind == "delta" else req.output())
        if req.finished:
            self._push(req.request_id, _Finished)

    def _handle(self, cmd) -> None:
        """One command from the callers; a failure in it is logged and ends only the request it names."""
        try:
            self._command(cmd)
        except Exception as e:               # noqa: BLE001 — host bookkeeping of one request: keep the loop
            log.exception("engine command %s failed", cmd[:2] if cmd[0] != "add" else ("add", cmd[1].request_id))
            if cmd[0] in ("add", "abort"):
                rid = cmd[1].request_id if cmd[0] == "add" else cmd[1]
                self.engine.requests.pop(rid, None)
                self._push(rid, RequestFailedError(f"the engine failed this request: {e!r}"))

    def _command(self, cmd) -> None:
        if cmd[0] == "add":
            req = cmd[1]
            try:
                self.engine.submit(req)
            except Exception as e:           # noqa: BLE001 — refuse this request, keep the loop
                self._push(req.request_id, e if isinstance(e, ValueError) else RequestFailedError(repr(e)))
        elif cmd[0] == "abort":
            req = self.engine.abort(cmd[1], reason=cmd[2])
            if req is not None:
                self._emit(req)
        elif cmd[0] == "fail_all":
            for rid in list(self.engine.requests):
                self.engine.abort(rid, reason="abort", error=cmd[1])
                self._push(rid, EngineDeadError(cmd[1]))

    def _loop(self) -> None:
        try:
            if self._warmup:
                self.llm.num_warmup_compiles += self.engine.warmup(progress=False,
                                                                   background=self._warmup == "background")
                self._ready.set()
            while not self._stop.is_set():
                self._drain_commands(block=not self.engine.has_unfinished())
                if self.engine.has_unfinished():
                    for req in self.engine.step():
                        self._emit(req)
        except BaseException as e:           # noqa: BLE001 — the engine is dead; fail everyone loudly
            self._fail_all(e)
            return
        self._shut_down()

    def _drain_commands(self, block: bool) -> None:
        """Handles every queued command; waits up to 0.1 s for the first when the engine is idle."""
        try:
            self._handle(self._commands.get(block=block, timeout=0.1 if block else None))
            while True:
                self._handle(self._commands.get_nowait())
        except queue.Empty:
            pass

    def _fail_all(self, e: BaseException) -> None:
        """The engine died: every request in flight and every stream not yet submitted fails with
        EngineDeadError; `errored` makes later submissions fail at once."""
        log.critical("the engine died: its step running request(s) %s raised; every request in flight "
                     "fails and no more are accepted", self.engine.step_requests[:32], exc_info=e)
        with self._lock:
            self.errored = e
        err = EngineDeadError(f"engine step failed: {e!r}")
        for rid in list(self.engine.requests):
            try:
                self.engine.abort(rid, reason="error", error=str(err))
            except Exception:            # noqa: BLE001 — host bookkeeping only; keep failing the rest
                self.engine.requests.pop(rid, None)
            self._push(rid, err)
        with self._lock:
            pending = list(self._streams)
        for rid in pending:
            self._push(rid, err)

    def _shut_down(self) -> None:
        """Aborts what is left (their streams end), drops the step in flight, fails "add" commands never handled."""
        for rid in list(self.engine.requests):
            req = self.engine.abort(rid)
            if req is not None:
                self._emit(req)
        self.engine.drain()
        with self._lock:
            unsubmitted = list(self._streams)
        for rid in unsubmitted:
            self._push(rid, EngineDeadError("engine is shutting down"))

FINISHED = _Finished     # the end-of-stream sentinel on a request's queue (engine/client.py)
