"""What every generating API surface shares: admission checks (size caps, fair per-client capacity),
one request's output stream (timeout, abort when its consumer leaves), several prompts merged into one
stream, disconnect watching from admission on (a request whose client left is aborted even while it
waits in the queue), SSE framing with an error event on failure, and the non-streaming aggregation
of delta outputs into choices (written once for completions and chat).

Capacity: `max_waiting` engine requests (prompts) in flight across clients. Past it, a client holding
less than its share (max_waiting / clients with requests in flight) is still admitted, up to half as
many again, so one client's flood cannot lock everyone else out; the client over its share gets 429.
`max_requests_per_client` caps one client's requests in flight (429 + Retry-After past it). A client is
its API key when the server has several, else its peer address (Guard sets it)."""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import time

from ..engine.client import FINISHED
from ..errors import EngineDeadError, RequestFailedError, UnknownAdapterError
from .guard import APIError, error_body, read_json

log = logging.getLogger("atlas_jax.server")
DISCONNECT_POLL_S = 0.25            # how often a request checks that its client is still there
LOGPROB_CHUNK = 256                 # prompt_logprobs entries converted per worker-pool call


@dataclasses.dataclass
class Choice:
    """One completion's output, accumulated from its deltas."""
    text: str = ""
    token_ids: list = dataclasses.field(default_factory=list)
    logprobs: list | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list | None = None


@dataclasses.dataclass
class ServerContext:
    """What the routes of every API surface see."""
    engine: object                      # an EngineClient (engine/client.py): AsyncLLM, or a test double
    metrics: object                     # metrics.Metrics
    model_name: str
    template: object                    # chat.ChatTemplate
    tool_format: str
    reasoning: str
    request_timeout: float | None = None
    max_waiting: int = 256
    max_requests_per_client: int | None = None
    max_seqs_per_request: int = 256          # prompts x n
    max_request_tokens: int | None = 1 << 20  # prompts x n x max_tokens (max_model_len when unset)
    in_flight: collections.Counter = dataclasses.field(default_factory=collections.Counter)   # client -> requests

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def loras(self):
        """The engine's LoRAManager (engine/lora.py), or None when it serves no adapters."""
        return self.engine.loras

    def check_model(self, model) -> str | None:
        """The LoRA adapter a request's `model` names (None: the base model); 404 for anything else."""
        if model in (None, self.model_name):
            return None
        if self.loras is not None and any(r.lora_name == model for r in self.loras.names()):
            return model
        raise APIError(404, f"model {model!r} does not exist; this server serves {self.model_name!r}"
                       + (" and its LoRA adapters" if self.loras is not None else ""),
                       param="model", code="model_not_found")

    def check_serving(self) -> None:
        """503 unless the engine is running, warmed up and not draining (capacity: `reserve`)."""
        e = self.engine
        if e.is_draining:
            raise APIError(503, "server is shutting down; retry later", "service_unavailable",
                           headers={"Retry-After": "5"})
        if not e.is_running:
            raise APIError(503, f"engine is not running: {e.errored!r}", "service_unavailable")
        if not e.is_ready:
            raise APIError(503, "engine is warming up; retry later", "service_unavailable", headers={"Retry-After": "5"})

    async def admit(self, request, body_cls):
        """A generating request's (body, LoRA adapter name or None): parsed strictly, for this model or one
        of its adapters, with the engine serving."""
        body = await read_json(request, body_cls, self.engine.offload)
        lora = self.check_model(body.model)
        self.check_serving()
        return body, lora

    def check_size(self, num_prompts: int, params) -> None:
        """Per-request caps: sequences (prompts x n) and requested tokens; 400 naming the field."""
        seqs = num_prompts * params.n
        if seqs > self.max_seqs_per_request:
            raise APIError(400, f"this request asks for {seqs} sequences (prompts x n); the server allows at most "
                                f"{self.max_seqs_per_request} per request", param="n")
        if self.max_request_tokens is not None:
            each = params.max_tokens if params.max_tokens is not None else self.engine.max_model_len
            if seqs * each > self.max_request_tokens:
                raise APIError(400, f"this request asks for up to {seqs * each} tokens ({seqs} sequences x {each}); "
                                    f"the server allows at most {self.max_request_tokens} per request",
                               param="max_tokens")

    def reserve(self, client: str, k: int) -> "_Reservation":
        """Room for k engine requests of `client` (module docstring), or 429 / 503 + Retry-After."""
        mine, total = self.in_flight[client], sum(self.in_flight.values())
        cap = self.max_requests_per_client
        most = min(cap if cap is not None else k, max(1, self.max_waiting))
        if k > most:                                     # could never be admitted: not a matter of retrying
            raise APIError(400, f"this request has {k} prompts; this server takes at most {most} requests in "
                                "flight per client", param="prompt")
        if cap is not None and mine + k > cap:
            raise APIError(429, f"this client has {mine} request(s) in flight and asks for {k} more; at most {cap}",
                           "rate_limit_exceeded", code="rate_limit_exceeded", headers={"Retry-After": "1"})
        if total + k > self.max_waiting:
            share = max(1, self.max_waiting // len({c for c, n in self.in_flight.items() if n > 0} | {client}))
            if mine + k > share:
                raise APIError(429, f"the server is at capacity and this client holds {mine} of the {total} requests "
                               "in flight; retry when some finish", "rate_limit_exceeded", code="rate_limit_exceeded",
                               headers={"Retry-After": "1"})
            if total + k > self.max_waiting + self.max_waiting // 2:
                raise APIError(503, "server is at capacity; retry later", "service_unavailable",
                               headers={"Retry-After": "1"})
        return _Reservation(self.in_flight, client, k)

    def prompt_logprobs(self, entries) -> list | None:
        """vLLM's JSON form: None for the first token, then {"token id": {"logprob", "decoded_token"}}."""
        if entries is None:
            return None
        return [None if e is None else {str(t): {"logprob": logprob(v), "decoded_token": self.token_text(t)}
                                        for t, v in e.items()} for e in entries]

    async def prompt_logprobs_async(self, entries) -> list | None:
        """prompt_logprobs in JSON form, converted on the worker pool in chunks (a long prompt's [T, 20]
        entries would stall the event loop for seconds)."""
        if entries is None:
            return None
        out = []
        for i in range(0, len(entries), LOGPROB_CHUNK):
            out += await self.engine.offload(self.prompt_logprobs, entries[i:i + LOGPROB_CHUNK])
        return out

    def token_text(self, t: int) -> str:
        tok = self.tokenizer
        return tok.decode([t], skip_special_tokens=False) if tok else str(t)

    # ---- streams of outputs ------------------------------------------------------------------
    async def outputs(self, prompt, params, rid, lora=None, client=None):
        """Delta RequestOutputs of one request, ending with a finished one; aborts on exit or timeout."""
        engine = self.engine
        try:
            _, stream = await engine.add_request_async(prompt, params, rid, lora, client=client)
        except EngineDeadError as e:
            raise APIError(503, str(e), "service_unavailable", headers={"Retry-After": "5"}) from None
        except ValueError as e:
            raise refusal(e) from None
        except RequestFailedError as e:             # e.g. its adapter's files no longer load
            raise APIError(500, f"request failed: {e}", "internal_server_error") from None
        deadline = None if self.request_timeout is None else time.monotonic() + self.request_timeout
        done = False
        try:
            while True:
                wait = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    item = await asyncio.wait_for(stream.get(), wait)
                except asyncio.TimeoutError:
                    engine.abort_nowait(rid, "timeout")
                    deadline = None
                    continue
                if item is FINISHED:
                    done = True
                    return
                if isinstance(item, BaseException):
                    done = True
                    if isinstance(item, ValueError):               # refused when the engine thread queued it
                        raise refusal(item)
                    if isinstance(item, EngineDeadError):
                        raise APIError(503, f"request failed: {item}", "service_unavailable", headers={"Retry-After": "5"})
                    raise APIError(500, f"request failed: {item}", "internal_server_error")
                yield item
        finally:
            if not done:
                engine.abort_nowait(rid)

    async def merged(self, prompts, params, base_id, lora=None, reservation=None):
        """(prompt index, delta output) across all prompts of a request, as they come; each prompt's
        engine request gives its place in `reservation` back when it ends."""
        queue: asyncio.Queue = asyncio.Queue()
        client = reservation.client if reservation is not None else None

        async def pump(i, prompt):
            try:
                async for out in self.outputs(prompt, params, f"{base_id}-{i}", lora, client):
                    await queue.put((i, out))
            except BaseException as e:      # noqa: BLE001 — handed to the consumer
                await queue.put((i, e))
            finally:
                await queue.put((i, None))
        tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(prompts)]
        if reservation is not None:
            for t in tasks:
                t.add_done_callback(lambda _: reservation.release(1))
        live = len(tasks)
        try:
            while live:
                i, item = await queue.get()
                if item is None:
                    live -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()

    async def started(self, request, prompts, params, base_id, lora=None):
        """`merged`, checked against the caps and the client's capacity and already run to its first item,
        so that a refused request becomes an HTTP error status rather than an error inside a 200 stream;
        ended (and its requests aborted) as soon as the client disconnects, queued or not. Items pass
        through the metrics."""
        self.check_size(len(prompts), params)
        reservation = self.reserve(client_of(request), len(prompts))
        try:
            gen = self.until_disconnect(request, self.merged(prompts, params, base_id, lora, reservation))
            try:
                first = await gen.__anext__()
            except StopAsyncIteration:
                first = None
        except BaseException:
            reservation.release(reservation.left)     # (its engine requests, if any, were aborted)
            raise

        async def items():
            last = time.monotonic()
            pending = [first] if first is not None else []
            try:
                while True:
                    if pending:
                        item = pending.pop()
                    else:
                        try:
                            item = await gen.__anext__()
                        except StopAsyncIteration:
                            return
                    now = time.monotonic()
                    self.metrics.itl.observe(now - last)
                    last = now
                    self.metrics.observe(item[1])
                    yield item
            finally:
                await gen.aclose()                    # a consumer that stops early aborts what is left now
        return items()

    async def until_disconnect(self, request, items):
        """`items`, ended early when the client goes away (closing it aborts the requests): nobody is left
        to read the answer. Checked every DISCONNECT_POLL_S while waiting for the next item."""
        it = items.__aiter__()
        checked = time.monotonic()
        nxt = None
        try:
            while True:
                nxt = asyncio.ensure_future(it.__anext__())
                while True:
                    done, _ = await asyncio.wait({nxt}, timeout=DISCONNECT_POLL_S)
                    if time.monotonic() - checked >= DISCONNECT_POLL_S:
                        checked = time.monotonic()
                        if await request.is_disconnected():
                            raise APIError(499, "client disconnected", "client_closed_request")
                    if done:
                        break
                try:
                    item = nxt.result()
                except StopAsyncIteration:
                    return
                yield item
        finally:
            if nxt is not None and not nxt.done():
                nxt.cancel()
                await asyncio.gather(nxt, return_exceptions=True)      # its generator unwinds: aborts
            await it.aclose()

    async def collect(self, items, n: int) -> tuple[dict[int, Choice], list]:
        """A non-streaming response's choices (index = prompt index * n + completion index) and its
        prompts' (tokens, cached tokens), from the delta outputs."""
        choices: dict[int, Choice] = {}
        prompt_tokens: dict[int, tuple[int, int]] = {}
        scored: dict[int, list] = {}
        async for i, out in items:
            prompt_tokens[i] = prompt_count(out)
            if out.prompt_logprobs is not None and i not in scored:
                scored[i] = await self.prompt_logprobs_async(out.prompt_logprobs)
            for c in out.outputs:
                ch = choices.setdefault(i * n + c.index, Choice())
                if i in scored:
                    ch.prompt_logprobs = scored[i]
                ch.text += c.text
                ch.token_ids += c.token_ids
                if c.logprobs is not None:
                    ch.logprobs = (ch.logprobs or []) + c.logprobs
                if c.finished:
                    ch.finish_reason, ch.stop_reason = c.finish_reason, c.stop_reason
        return dict(sorted(choices.items())), list(prompt_tokens.values())


class _Reservation:
    """k places in ServerContext.in_flight for one client, given back one by one as requests end."""

    def __init__(self, counts: collections.Counter, client: str, k: int):
        self.counts, self.client, self.left = counts, client, k
        counts[client] += k

    def release(self, n: int) -> None:
        n = min(n, self.left)
        self.left -= n
        self.counts[self.client] -= n
        if self.counts[self.client] <= 0:
            del self.counts[self.client]


def client_of(request) -> str:
    """Who sent a request (Guard's scope state: its API key's name, else its peer address)."""
    state = request.scope.get("state") or {}
    if state.get("client"):
        return state["client"]
    peer = request.scope.get("client")
    return peer[0] if peer else "unknown"


def refusal(e: ValueError) -> APIError:
    """A request the engine refused: 404 for an adapter that is not loaded, else 400."""
    if isinstance(e, UnknownAdapterError):
        return APIError(404, str(e), param="model", code="model_not_found")
    return APIError(400, str(e), param=getattr(e, "param", None))


def sse(obj) -> str:
    return f"data: {json.dumps(obj, allow_nan=False)}\n\n"


DONE = "data: [DONE]\n\n"


async def guarded(events):
    """A stream that fails midway ends with an OpenAI error event and [DONE], never silently."""
    try:
        async for chunk in events:
            yield chunk
    except APIError as e:
        yield sse(error_body(e.message, e.type, e.param, e.code))
        yield DONE
    except Exception as e:                     # noqa: BLE001 — a bug; the client still gets a clean end
        log.exception("stream failed")
        yield sse(error_body(f"internal error: {e!r}", "internal_server_error"))
        yield DONE


def prompt_count(out) -> tuple[int, int]:
    """A request output's (prompt tokens, of which served from the prefix cache)."""
    return len(out.prompt_token_ids), out.num_cached_tokens


def usage(prompts, completion: int) -> dict:
    """OpenAI's usage object; prompts: (tokens, cached tokens) per prompt of the response."""
    prompt, cached = sum(p for p, _ in prompts), sum(c for _, c in prompts)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def logprob(v: float) -> float:
    """JSON has no -inf: a token the sampler masked out reports -9999.0 (as vLLM)."""
    return max(float(v), -9999.0) if v == v else -9999.0
