"""FastAPI app: OpenAI-compatible routes over AsyncLLM, wired from the server's modules:
guard.py (middleware, error shapes), streams.py (request plumbing shared by the API surfaces),
serving_completions.py and serving_chat.py (the generating routes), metrics.py (prometheus).

Every response carries x-request-id; errors use OpenAI's shape {"error": {message, type, param,
code}}; every route but /health needs the API key when one is set (guard.py). Loading / unloading
LoRA adapters at runtime is refused (403) unless allow_runtime_lora_updating. Streams are server-sent
events ending with `data: [DONE]`. A client that goes away aborts its request (the stream generator is closed, which
aborts it on the engine thread). --request-timeout ends a request with finish_reason "timeout".
"""
from __future__ import annotations

import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from ..engine.client import LoRARequest
from ..errors import InvalidRequestError, LoRAError, UnknownAdapterError
from ..frontend.chat import ChatTemplate
from ..frontend.parsers import resolve_reasoning_parser, resolve_tool_parser
from . import serving_chat, serving_completions
from .guard import JSON, APIError, Guard, error_response, error_type, read_json
from .metrics import Metrics, path_label
from .protocol import DetokenizeRequest, LoadLoRAAdapterRequest, TokenizeRequest, UnloadLoRAAdapterRequest
from .streams import ServerContext


def build_app(engine, *, served_model_name: str, api_key: str | list[str] | None = None,
              chat_template: str | None = None, request_timeout: float | None = None, max_waiting: int = 256,
              max_body_bytes: int = 1 << 22, tool_call_parser: str = "auto", reasoning_parser: str = "auto",
              public_metrics: bool = False, allowed_hosts: list[str] | None = None,
              allow_runtime_lora_updating: bool = False, max_requests_per_client: int | None = None,
              max_seqs_per_request: int = 256, max_request_tokens: int | None = 1 << 20,
              body_timeout: float | None = 30.0) -> FastAPI:
    """The app over an AsyncLLM; the keywords are serve.py's flags (their help says what each does)."""
    app = FastAPI(title="atlas_jax", docs_url=None, redoc_url=None, openapi_url=None, default_response_class=JSON)
    metrics = Metrics(engine)
    template = ChatTemplate.for_model(engine.model_path, chat_template)
    ctx = ServerContext(engine, metrics, served_model_name, template,
                        resolve_tool_parser(tool_call_parser, template.source),
                        resolve_reasoning_parser(reasoning_parser, template.source), request_timeout, max_waiting,
                        max_requests_per_client, max_seqs_per_request, max_request_tokens)
    app.state.engine, app.state.metrics, app.state.ctx = engine, metrics, ctx
    app.state.tool_format, app.state.reasoning = ctx.tool_format, ctx.reasoning
    app.state.allow_runtime_lora_updating = allow_runtime_lora_updating
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes, is_draining=lambda: engine.is_draining,
                       on_response=lambda path, status: metrics.requests.labels(path_label(path), str(status)).inc(),
                       public_metrics=public_metrics, allowed_hosts=allowed_hosts, body_timeout=body_timeout)
    _add_error_handlers(app)
    _add_service_routes(app, ctx)
    serving_completions.add_routes(app, ctx)
    serving_chat.add_routes(app, ctx)
    return app


def _add_error_handlers(app: FastAPI) -> None:
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


def _add_service_routes(app: FastAPI, ctx: ServerContext) -> None:
    """Health, metrics, models, tokenize / detokenize."""
    engine = ctx.engine

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
        return Response(generate_latest(ctx.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        now, max_len = int(time.time()), engine.max_model_len
        data = [{"id": ctx.model_name, "object": "model", "created": now, "owned_by": "atlas_jax",
                 "root": ctx.model_name, "parent": None, "max_model_len": max_len}]
        for r in ctx.loras.names() if ctx.loras is not None else ():
            data.append({"id": r.lora_name, "object": "model", "created": now, "owned_by": "atlas_jax",
                         "root": r.lora_path, "parent": ctx.model_name, "max_model_len": max_len})
        return {"object": "list", "data": data}

    def need_loras(request: Request):
        if ctx.loras is None:
            raise APIError(400, "this server serves no LoRA adapters (start it with --enable-lora)")
        if not request.app.state.allow_runtime_lora_updating:
            raise APIError(403, "loading and unloading LoRA adapters at runtime is off; start the server with "
                                "--allow-runtime-lora-updating", "permission_error")
        ctx.check_serving()                     # never report success to a client of a dead engine
        return ctx.loras

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        loras = need_loras(request)
        body = await read_json(request, LoadLoRAAdapterRequest, engine.offload)
        if body.lora_name == ctx.model_name or any(r.lora_name == body.lora_name for r in loras.names()):
            raise APIError(400, f"the LoRA adapter {body.lora_name!r} has already been loaded", param="lora_name")
        try:
            await engine.offload(loras.register, LoRARequest(body.lora_name, loras.next_int_id(), body.lora_path))
        except LoRAError as e:
            raise APIError(400, str(e), param="lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        loras = need_loras(request)
        body = await read_json(request, UnloadLoRAAdapterRequest, engine.offload)
        try:
            loras.unregister(body.lora_name)
        except UnknownAdapterError as e:
            raise APIError(404, str(e), param="lora_name", code="model_not_found") from None
        except LoRAError as e:                  # in use: refused, the requests running under it are untouched
            raise APIError(409, str(e), param="lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    def need_tokenizer():
        if ctx.tokenizer is None:
            raise APIError(400, "this model has no tokenizer.json")

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await read_json(request, TokenizeRequest, engine.offload)
        need_tokenizer()
        if body.messages is not None:
            text = await engine.offload(serving_chat.render_chat, ctx, body)
        elif body.prompt is not None:
            text = body.prompt
        else:
            raise APIError(400, "tokenize needs 'prompt' (a string) or 'messages'", param="prompt")
        ids = await engine.offload(ctx.tokenizer.encode, text)
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await read_json(request, DetokenizeRequest, engine.offload)
        need_tokenizer()
        return {"prompt": await engine.offload(ctx.tokenizer.decode_checked, body.tokens, engine.vocab_size)}
