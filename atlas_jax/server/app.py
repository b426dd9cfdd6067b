"""FastAPI app: OpenAI-compatible routes over AsyncLLM.

Every response carries x-request-id; errors use OpenAI's shape {"error": {message, type, param,
code}}; /v1/* needs the API key when one is set. Streams are server-sent events ending with
`data: [DONE]`. A client that goes away aborts its request (the stream generator is closed, which
aborts it on the engine thread). --request-timeout ends a request with finish_reason "timeout".
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from ..engine.async_llm import FINISHED, AsyncLLM
from ..engine.errors import EngineDeadError, InvalidRequestError
from ..engine.outputs import CompletionOutput
from ..tokenizer import check_unicode
from .chat import ChatTemplate
from .guard import JSON, APIError, Guard, error_body, error_response, error_type, read_json
from .parsers import (THINK_END, THINK_START, Delta, OutputParser, forced_opening, resolve_reasoning_parser,
                      resolve_tool_parser)
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

log = logging.getLogger("atlas_jax.server")


class Metrics:
    def __init__(self, engine: AsyncLLM):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("atlas_requests", "Finished HTTP requests", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("atlas_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("atlas_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("atlas_time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60))
        self.itl = Histogram("atlas_inter_token_latency_seconds", "Time between streamed outputs", registry=r,
                             buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5))
        gauge = lambda name, doc, key: Gauge(name, doc, registry=r).set_function(lambda: engine.engine.stats()[key])
        gauge("atlas_running_requests", "Sequences running", "running")
        gauge("atlas_waiting_requests", "Sequences waiting", "waiting")
        gauge("atlas_swapped_requests", "Sequences swapped to host", "swapped")
        gauge("atlas_free_kv_pages", "Free KV pages", "free_pages")
        gauge("atlas_free_state_slots", "Free recurrent-state slots", "free_slots")
        gauge("atlas_failed_requests", "Requests the engine failed alone (step containment)", "num_failed_requests")
        gauge("atlas_num_compiles", "Compiled executables (constant after warm-up)", "num_compiles")
        Gauge("atlas_kv_pages", "KV pages in the pool", registry=r).set(engine.engine.num_pages)
        Gauge("atlas_state_slots", "Recurrent-state slots", registry=r).set(engine.engine.slots.capacity)
        Gauge("atlas_aborted_requests", "Requests ended before their finish (client gone: abort)", registry=r
              ).set_function(lambda: engine.engine.stats()["num_aborted"].get("abort", 0))
        Gauge("atlas_kv_usage_ratio", "Share of KV pages in use", registry=r).set_function(
            lambda: 1 - engine.engine.stats()["free_pages"] / engine.engine.num_pages)
        if engine.engine.speculative is not None:
            spec = lambda key: engine.engine.spec_stats.summary()[key] or 0.0
            for key, doc in (("drafted", "Draft tokens verified"), ("accepted", "Draft tokens accepted"),
                             ("verify_steps", "Target steps that verified drafts"),
                             ("acceptance_rate", "Accepted / drafted tokens"),
                             ("mean_accepted_length", "Tokens emitted per verified row (1 + accepted drafts)"),
                             ("tokens_per_target_step", "Tokens per decoding row per target step")):
                Gauge(f"atlas_spec_{key}", doc, registry=r).set_function(lambda key=key: spec(key))


def build_app(engine: AsyncLLM, *, served_model_name: str, api_key: str | None = None, chat_template: str | None = None,
              request_timeout: float | None = None, max_waiting: int = 256, max_body_bytes: int = 1 << 22,
              tool_call_parser: str = "auto", reasoning_parser: str = "auto") -> FastAPI:
    app = FastAPI(title="atlas_jax", docs_url=None, redoc_url=None, openapi_url=None, default_response_class=JSON)
    metrics = Metrics(engine)
    template = ChatTemplate.for_model(engine.llm.model_path, chat_template)
    tool_format = resolve_tool_parser(tool_call_parser, template.source)
    reasoning = resolve_reasoning_parser(reasoning_parser, template.source)
    app.state.tool_format, app.state.reasoning = tool_format, reasoning
    tokenizer = engine.tokenizer
    vocab_size = engine.engine.cfg.vocab_size
    app.state.engine, app.state.metrics = engine, metrics
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes, is_draining=lambda: engine.is_draining,
                       on_response=lambda path, status: metrics.requests.labels(_path_label(path), str(status)).inc())

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return error_response(e.status, e.message, e.type, e.param, e.code, e.headers)

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(request, e: InvalidRequestError):
        return error_response(400, str(e), "invalid_request_error", e.param)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        return error_response(e.status_code, str(e.detail), error_type(e.status_code), headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, e: RequestValidationError):
        err = e.errors()[0] if e.errors() else {"msg": "invalid request", "loc": ()}
        param = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or None
        return error_response(400, f"{param}: {err.get('msg')}", "invalid_request_error", param)

    def check_model(model):
        if model not in (None, served_model_name):
            raise APIError(404, f"model {model!r} does not exist; this server serves {served_model_name!r}",
                           param="model", code="model_not_found")

    def check_capacity():
        if engine.is_draining:
            raise APIError(503, "server is shutting down; retry later", "service_unavailable",
                           headers={"Retry-After": "5"})
        if not engine.is_running:
            raise APIError(503, f"engine is not running: {engine.errored!r}", "service_unavailable")
        if not engine.is_ready:
            raise APIError(503, "engine is warming up; retry later", "service_unavailable", headers={"Retry-After": "5"})
        if engine.num_in_flight >= max_waiting:
            raise APIError(503, "server is at capacity; retry later", "service_unavailable", headers={"Retry-After": "1"})

    async def outputs(prompt, params, rid):
        """Delta RequestOutputs of one request, ending with a finished one; aborts on exit or timeout."""
        try:
            req, stream = await engine.add_request_async(prompt, params, rid)
        except EngineDeadError as e:
            raise APIError(503, str(e), "service_unavailable", headers={"Retry-After": "5"}) from None
        except InvalidRequestError as e:
            raise APIError(400, str(e), param=e.param) from None
        except ValueError as e:
            raise APIError(400, str(e)) from None
        deadline = None if request_timeout is None else time.monotonic() + request_timeout
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
                    if isinstance(item, EngineDeadError):
                        raise APIError(503, f"request failed: {item}", "service_unavailable", headers={"Retry-After": "5"})
                    raise APIError(500, f"request failed: {item}", "internal_server_error")
                yield item
        finally:
            if not done:
                engine.abort_nowait(rid)

    async def merged(prompts, params, base_id):
        """(prompt index, delta output) across all prompts of a request, as they come."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i, prompt):
            try:
                async for out in outputs(prompt, params, f"{base_id}-{i}"):
                    await queue.put((i, out))
            except BaseException as e:      # noqa: BLE001 — handed to the consumer
                await queue.put((i, e))
            finally:
                await queue.put((i, None))
        tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(prompts)]
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

    async def started(prompts, params, base_id):
        """`merged`, already run to its first item, so that a refused request becomes an HTTP error
        status rather than an error inside a 200 stream."""
        gen = merged(prompts, params, base_id)
        try:
            first = await gen.__anext__()
        except StopAsyncIteration:
            first = None

        async def items():
            if first is not None:
                yield first
            async for item in gen:
                yield item
        return items()

    async def until_disconnect(request, items):
        """`items` for a non-streaming response, ended early when the client goes away (closing it
        aborts the requests): nobody is left to read the answer."""
        it = items.__aiter__()
        checked = time.monotonic()
        while True:
            nxt = asyncio.ensure_future(it.__anext__())
            while True:
                done, _ = await asyncio.wait({nxt}, timeout=DISCONNECT_POLL_S)
                if time.monotonic() - checked >= DISCONNECT_POLL_S:
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        nxt.cancel()
                        await asyncio.gather(nxt, return_exceptions=True)      # its generator unwinds: aborts
                        await it.aclose()
                        raise APIError(499, "client disconnected", "client_closed_request")
                if done:
                    break
            try:
                item = nxt.result()
            except StopAsyncIteration:
                return
            yield item

    def sse(obj) -> str:
        return f"data: {json.dumps(obj, allow_nan=False)}\n\n"

    async def guarded(events):
        """A stream that fails midway ends with an OpenAI error event and [DONE], never silently."""
        try:
            async for chunk in events:
                yield chunk
        except APIError as e:
            yield sse(error_body(e.message, e.type, e.param, e.code))
            yield "data: [DONE]\n\n"
        except Exception as e:                     # noqa: BLE001 — a bug; the client still gets a clean end
            log.exception("stream failed")
            yield sse(error_body(f"internal error: {e!r}", "internal_server_error"))
            yield "data: [DONE]\n\n"

    # ---- routes ------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if engine.is_draining:
            return error_response(503, "draining: finishing the requests in flight, accepting none",
                                  "service_unavailable", headers={"Retry-After": "5"})
        if not engine.is_running:
            return error_response(503, f"engine not running: {engine.errored!r}", "service_unavailable")
        if not engine.is_ready:
            return error_response(503, "warming up (compiling step buckets)", "service_unavailable",
                                  headers={"Retry-After": "5"})
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "atlas_jax", "max_model_len": engine.engine.max_model_len}]}

    def need_tokenizer():
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer.json")

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await read_json(request, TokenizeRequest, engine.offload)
        need_tokenizer()
        if body.messages is not None:
            text = await engine.offload(render_chat, body)
        elif body.prompt is not None:
            text = body.prompt
        else:
            raise APIError(400, "tokenize needs 'prompt' (a string) or 'messages'", param="prompt")
        ids = await engine.offload(tokenizer.encode, text)
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await read_json(request, DetokenizeRequest, engine.offload)
        need_tokenizer()
        return {"prompt": await engine.offload(tokenizer.decode_checked, body.tokens, vocab_size)}

    def render_chat(body):
        for i, m in enumerate(body.messages):
            check_unicode(m.text(), f"messages.{i}.content")
        inputs = body.template_inputs()
        return template.render(inputs.pop("messages"), **inputs)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_json(request, CompletionRequest, engine.offload)
        check_model(body.model)
        check_capacity()
        prompts = body.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise APIError(400, "prompt is empty", param="prompt")
        if len(prompts) > MAX_PROMPTS:
            raise APIError(400, f"at most {MAX_PROMPTS} prompts per request", param="prompt")
        params = body.sampling_params(16 if body.max_tokens is None else body.max_tokens, body.logprobs)
        rid = f"cmpl-{uuid.uuid4().hex}"             # x-request-id stays a header: clients may repeat it
        created, n = int(time.time()), body.n
        items = await started(prompts, params, rid)

        def choice_logprobs(c):
            if c.logprobs is None:
                return None
            toks = [tokenizer.decode([t], skip_special_tokens=False) if tokenizer else str(t) for t in c.token_ids]
            return {"tokens": toks, "token_logprobs": [_logprob(lp[t]) for lp, t in zip(c.logprobs, c.token_ids)],
                    "top_logprobs": [{(tokenizer.decode([k], skip_special_tokens=False) if tokenizer else str(k)):
                                      _logprob(v) for k, v in lp.items()} for lp in c.logprobs], "text_offset": None}

        if body.stream:
            async def events():
                usage = {"prompt": {}, "completion": 0}
                last = time.monotonic()
                async for i, out in items:
                    now = time.monotonic()
                    metrics.itl.observe(now - last)
                    last = now
                    usage["prompt"][i] = len(out.prompt_token_ids)
                    for c in out.outputs:
                        if not c.text and not c.finished and not c.token_ids:
                            continue
                        usage["completion"] += len(c.token_ids)
                        yield sse({"id": rid, "object": "text_completion", "created": created, "model": served_model_name,
                                   "choices": [{"index": i * n + c.index, "text": c.text, "logprobs": choice_logprobs(c),
                                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]})
                    _observe(out)
                if body.stream_options and body.stream_options.include_usage:
                    p = sum(usage["prompt"].values())
                    yield sse({"id": rid, "object": "text_completion", "created": created, "model": served_model_name,
                               "choices": [], "usage": _usage(p, usage["completion"])})
                yield "data: [DONE]\n\n"
            return StreamingResponse(guarded(events()), media_type="text/event-stream")

        texts, ids, lps, finish, stop_reason, prompt_len = {}, {}, {}, {}, {}, {}
        async for i, out in until_disconnect(request, items):
            prompt_len[i] = len(out.prompt_token_ids)
            for c in out.outputs:
                k = i * n + c.index
                texts[k] = texts.get(k, "") + c.text
                ids[k] = ids.get(k, []) + c.token_ids
                if c.logprobs is not None:
                    lps[k] = lps.get(k, []) + c.logprobs
                if c.finished:
                    finish[k], stop_reason[k] = c.finish_reason, c.stop_reason
            _observe(out)

        def body_of_completion():
            choices = []
            for k in sorted(texts):
                lp = None
                if k in lps:
                    lp = choice_logprobs(CompletionOutput(k, texts[k], ids[k], finish[k], logprobs=lps[k]))
                choices.append({"index": k, "text": texts[k], "logprobs": lp, "finish_reason": finish.get(k),
                                "stop_reason": stop_reason.get(k)})
            p, c = sum(prompt_len.values()), sum(len(v) for v in ids.values())
            return {"id": rid, "object": "text_completion", "created": created, "model": served_model_name,
                    "choices": choices, "usage": _usage(p, c)}
        return await engine.offload(body_of_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_json(request, ChatCompletionRequest, engine.offload)
        check_model(body.model)
        check_capacity()
        top = (body.top_logprobs or 0) if body.logprobs else None
        cap = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = body.sampling_params(cap, top)
        prompt = await engine.offload(render_chat, body)
        fmt = tool_format if body.tools and body.tool_choice != "none" else "none"
        if fmt == "none" and body.tool_choice not in (None, "none", "auto"):
            raise APIError(400, "this model's chat template has no tool-call format; start the server with "
                                "--tool-call-parser to force tool calls", param="tool_choice")
        opened = reasoning != "none" and prompt.rstrip().endswith(THINK_START)
        head = forced_opening(fmt, body.tool_choice)
        if head and opened:
            head, opened = THINK_END + "\n\n" + head, True
        prompt += head

        def parser():
            return OutputParser(fmt, body.tools, reasoning, opened, prefix=head)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        items = await started([prompt], params, rid)

        def tok(t):
            s = tokenizer.decode([t], skip_special_tokens=False) if tokenizer else str(t)
            return {"token": s, "bytes": list(s.encode())}

        def chat_logprobs(c):
            if c.logprobs is None:
                return None
            return {"content": [{**tok(t), "logprob": _logprob(lp[t]),
                                 "top_logprobs": [{**tok(k), "logprob": _logprob(v)} for k, v in
                                                  sorted(lp.items(), key=lambda kv: -kv[1])[:body.top_logprobs or 0]]}
                                for lp, t in zip(c.logprobs, c.token_ids)]}

        if body.stream:
            async def events():
                sent_role, completion, prompt_len = set(), 0, 0
                parsers, calls = {}, {}
                last = time.monotonic()
                async for _, out in items:
                    now = time.monotonic()
                    metrics.itl.observe(now - last)
                    last = now
                    prompt_len = len(out.prompt_token_ids)
                    for c in out.outputs:
                        completion += len(c.token_ids)
                        p = parsers.setdefault(c.index, parser())
                        parsed = p.feed(c.text)
                        if c.finished:
                            tail = p.finish()
                            parsed = Delta(parsed.content + tail.content, parsed.reasoning + tail.reasoning,
                                           parsed.tool_calls + tail.tool_calls)
                        delta = {}
                        if c.index not in sent_role:
                            delta["role"] = "assistant"
                            sent_role.add(c.index)
                        if parsed.reasoning:
                            delta["reasoning_content"] = parsed.reasoning
                        if parsed.content:
                            delta["content"] = parsed.content
                        made = calls.setdefault(c.index, [])
                        new = parsed.tool_calls[:max(0, 1 - len(made))] if not body.parallel_tool_calls \
                            else parsed.tool_calls
                        if new:
                            delta["tool_calls"] = [{"index": len(made) + j, **call.to_openai()} for j, call in enumerate(new)]
                            made += new
                        if not delta and not c.finished and c.logprobs is None:
                            continue
                        yield sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                                   "model": served_model_name,
                                   "choices": [{"index": c.index, "delta": delta, "logprobs": chat_logprobs(c),
                                                "finish_reason": _chat_finish(c.finish_reason, made),
                                                "stop_reason": c.stop_reason}]})
                    _observe(out)
                if body.stream_options and body.stream_options.include_usage:
                    yield sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                               "model": served_model_name, "choices": [],
                               "usage": _usage(prompt_len, completion)})
                yield "data: [DONE]\n\n"
            return StreamingResponse(guarded(events()), media_type="text/event-stream")

        texts, ids, lps, finish, stop_reason, prompt_len = {}, {}, {}, {}, {}, 0
        async for _, out in until_disconnect(request, items):
            prompt_len = len(out.prompt_token_ids)
            for c in out.outputs:
                texts[c.index] = texts.get(c.index, "") + c.text
                ids[c.index] = ids.get(c.index, []) + c.token_ids
                if c.logprobs is not None:
                    lps[c.index] = lps.get(c.index, []) + c.logprobs
                if c.finished:
                    finish[c.index], stop_reason[c.index] = c.finish_reason, c.stop_reason
            _observe(out)

        def message(text):
            d = parser().parse(text)
            calls = d.tool_calls if body.parallel_tool_calls else d.tool_calls[:1]
            msg = {"role": "assistant", "content": d.content if d.content or not calls else None}
            if reasoning != "none":
                msg["reasoning_content"] = d.reasoning or None
            if calls:
                msg["tool_calls"] = [call.to_openai() for call in calls]
            return msg, calls

        def body_of_chat():
            choices = []
            for i in sorted(texts):
                msg, calls = message(texts[i])
                choices.append({"index": i, "message": msg, "logprobs": chat_logprobs(
                    CompletionOutput(i, texts[i], ids[i], finish.get(i), logprobs=lps[i])) if i in lps else None,
                    "finish_reason": _chat_finish(finish.get(i), calls), "stop_reason": stop_reason.get(i)})
            c = sum(len(v) for v in ids.values())
            return {"id": rid, "object": "chat.completion", "created": created, "model": served_model_name,
                    "choices": choices, "usage": _usage(prompt_len, c)}
        return await engine.offload(body_of_chat)

    def _observe(out):
        """Per delta output: new tokens of every completion (all n); at the finish: prompt tokens, TTFT."""
        metrics.generation_tokens.inc(sum(len(c.token_ids) for c in out.outputs))
        if out.finished and out.metrics is not None:
            metrics.prompt_tokens.inc(out.metrics.num_prompt_tokens)
            if out.metrics.time_to_first_token is not None:
                metrics.ttft.observe(out.metrics.time_to_first_token)

    return app


MAX_PROMPTS = 64                    # prompts in one /v1/completions request
DISCONNECT_POLL_S = 0.25            # how often a non-streaming request checks that its client is still there
_ROUTES = {"/health", "/metrics", "/v1/models", "/tokenize", "/detokenize", "/v1/completions", "/v1/chat/completions"}


def _usage(prompt: int, completion: int) -> dict:
    """OpenAI's usage object (no prefix cache yet: no prompt token is served from cache)."""
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": 0}}


def _chat_finish(reason, calls):
    """OpenAI reports a reply that ends in tool calls as finish_reason "tool_calls"."""
    return "tool_calls" if calls and reason == "stop" else reason


def _path_label(path: str) -> str:
    """Metrics label: known routes by name, anything else as "other" (bounded label set)."""
    return path if path in _ROUTES else "other"


def _logprob(v: float) -> float:
    """JSON has no -inf: a token the sampler masked out reports -9999.0 (as vLLM)."""
    return max(float(v), -9999.0) if v == v else -9999.0
