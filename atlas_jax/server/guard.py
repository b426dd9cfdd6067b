"""What stands between the network and the routes: errors in OpenAI's shape, and `Guard`, a pure
ASGI middleware.

Guard, per HTTP request, in this order: the x-request-id header (echoed, or a fresh one); the Host
header against `allowed_hosts` (400: DNS rebinding); the API key on every route but /health (and
/metrics when public), compared in constant time, one Authorization header only (401); the body limit
(Content-Length over it: 413); a JSON content type on POST (415: a web page's cross-site "simple"
request cannot carry one); the body limit also enforced while the body is read (chunked: reading
stops at the limit with 413); 503 + Retry-After while the server drains; and a last-resort 500 in OpenAI's shape for any exception
a route lets through — answered here, so the connection stays usable (Starlette's own 500 path
re-raises to the server, which drops the keep-alive connection). A body that is not complete
`body_timeout` seconds after its headers is refused with 408. It names the request's client in
scope["state"]["client"]: its API key's index when the server has several keys, else its peer address.

`read_json(request, Model)` parses a body strictly: UTF-8, JSON without NaN / Infinity, then the
pydantic model; every failure is a 400 naming what is wrong.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

log = logging.getLogger("atlas_jax.server")

OFFLOAD_PARSE_BYTES = 1 << 16      # bodies above this are parsed on the worker pool, not the event loop


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code, self.headers = status, message, type_, param, code, headers


class BodyTooLarge(HTTPException):
    """Raised from `receive` while reading; an HTTPException so FastAPI's body reader re-raises it."""

    def __init__(self, limit: int):
        super().__init__(413, f"request body over {limit} bytes")


class BodyTooSlow(HTTPException):
    """Raised from `receive` when the body is not complete `timeout` seconds after its request arrived."""

    def __init__(self, timeout: float):
        super().__init__(408, f"request body not received within {timeout:g} s")


class JSON(JSONResponse):
    """JSON with non-ASCII escaped: text that is not valid Unicode (lone surrogates) still renders."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def error_body(message: str, type_: str, param=None, code=None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, type_: str, param=None, code=None, headers=None) -> JSON:
    return JSON(error_body(message, type_, param, code), status_code=status, headers=headers)


def error_type(status: int) -> str:
    return {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
            503: "service_unavailable"}.get(
        status, "internal_server_error" if status >= 500 else "invalid_request_error")


LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
OPEN_PATHS = ("/health",)                  # answered without the API key (load balancers' probes)


class Guard:
    def __init__(self, app, *, api_key: str | list[str] | tuple[str, ...] | None, max_body_bytes: int, is_draining,
                 on_response, public_metrics: bool = False, allowed_hosts: list[str] | tuple[str, ...] | None = None,
                 body_timeout: float | None = None):
        """api_key: one key, several (one client each), or None (no key); is_draining(): True while the
        server drains; on_response(path, status): metrics hook; allowed_hosts: Host header names served
        (None or "*": any); body_timeout: seconds a request's body may take to arrive (408 after)."""
        self.app, self.max_body_bytes, self.body_timeout = app, max_body_bytes, body_timeout
        keys = [api_key] if isinstance(api_key, str) else list(api_key or ())
        self.api_keys = [k.encode("utf-8") for k in keys]
        self.open_paths = OPEN_PATHS + (("/metrics",) if public_metrics else ())
        self.allowed_hosts = None if not allowed_hosts or "*" in allowed_hosts else \
            {h.lower().strip("[]") for h in allowed_hosts}
        self.is_draining, self.on_response = is_draining, on_response

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        raw = scope.get("headers") or []
        headers = dict(raw)
        rid = headers.get(b"x-request-id", b"").decode("latin-1")[:200] or uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"] = rid
        path = scope.get("path", "")
        sent = {"status": None}

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                sent["status"] = message["status"]
                message = {**message, "headers": list(message.get("headers", [])) + [(b"x-request-id", rid.encode("latin-1"))]}
            await send(message)

        refused = self._refusal(scope, path, headers, [v for k, v in raw if k == b"authorization"])
        if refused is not None:
            await refused(scope, receive, send_with_id)
        else:
            try:
                await self.app(scope, self._limited(receive), send_with_id)
            except Exception as e:                              # noqa: BLE001 — the last resort
                log.exception("unhandled error on %s", path)
                if sent["status"] is not None:
                    raise                                       # mid-response: the server must close it
                await error_response(500, f"internal error: {e!r}", "internal_server_error")(scope, receive, send_with_id)
        self.on_response(path, sent["status"] or 500)

    def _refusal(self, scope, path: str, headers: dict, authorization: list[bytes]):
        if self.allowed_hosts is not None and host_name(headers.get(b"host", b"")) not in self.allowed_hosts:
            return error_response(400, "Host header not allowed by this server (--allowed-hosts)", "invalid_request_error")
        if len(authorization) > 1:
            return error_response(401, "more than one Authorization header", "authentication_error",
                                  code="invalid_api_key")
        key = self._key_index(authorization[0] if authorization else b"")
        if self.api_keys and key is None and path not in self.open_paths:
            return error_response(401, "invalid API key", "authentication_error", code="invalid_api_key")
        peer = scope.get("client")
        scope["state"]["client"] = f"key:{key}" if key is not None and len(self.api_keys) > 1 else \
            (peer[0] if peer else "unknown")
        length = headers.get(b"content-length", b"0")
        if not length.isdigit():
            return error_response(400, "invalid Content-Length header", "invalid_request_error")
        if int(length) > self.max_body_bytes:
            return error_response(413, f"request body over {self.max_body_bytes} bytes", "invalid_request_error")
        if scope.get("method") == "POST" and not is_json_type(headers.get(b"content-type", b"")):
            return error_response(415, "request bodies must be JSON: send 'Content-Type: application/json'",
                                  "invalid_request_error")
        if self.is_draining() and (path.startswith("/v1/") and path != "/v1/models" or path in ("/tokenize", "/detokenize")):
            return error_response(503, "server is shutting down; retry on another replica or later",
                                  "service_unavailable", headers={"Retry-After": "5"})
        return None

    def _key_index(self, authorization: bytes) -> int | None:
        """Which API key the Authorization header carries (every key compared, in constant time each)."""
        scheme, _, token = authorization.strip().partition(b" ")
        if scheme.lower() != b"bearer":
            token = b""
        token = token.strip()
        found = None
        for i, k in enumerate(self.api_keys):
            if hmac.compare_digest(token, k) and found is None:
                found = i
        return found

    def _limited(self, receive):
        """receive() with the body limit and, until the body is complete, the body deadline."""
        limit, seen, timeout = self.max_body_bytes, [0], self.body_timeout
        deadline = [None if timeout is None else time.monotonic() + timeout]      # None once the body is in

        async def receive_limited():
            if deadline[0] is None:
                message = await receive()
            else:
                try:
                    message = await asyncio.wait_for(receive(), max(0.0, deadline[0] - time.monotonic()))
                except asyncio.TimeoutError:
                    raise BodyTooSlow(timeout) from None
            if message["type"] == "http.request":
                seen[0] += len(message.get("body", b""))
                if seen[0] > limit:
                    raise BodyTooLarge(limit)
                if not message.get("more_body", False):
                    deadline[0] = None
            else:
                deadline[0] = None
            return message
        return receive_limited


def host_name(host: bytes) -> str:
    """A Host header's name without its port, lower case ('[::1]:8000' -> '::1')."""
    text = host.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1:text.find("]")] if "]" in text else text
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


def is_json_type(content_type: bytes) -> bool:
    """application/json or any +json media type, with or without parameters (charset)."""
    media = content_type.split(b";", 1)[0].strip().lower()
    return media == b"application/json" or (media.startswith(b"application/") and media.endswith(b"+json"))


def _reject_constant(name):
    raise ValueError(f"{name} is not valid JSON")


def parse_json(body: bytes):
    """bytes -> JSON value; APIError(400) for invalid UTF-8, malformed JSON, NaN / Infinity, depth."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"request body is not valid UTF-8 (byte {body[e.start]:#04x} at offset {e.start})") from None
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise APIError(400, f"malformed JSON body: {e.msg} at line {e.lineno} column {e.colno}") from None
    except (ValueError, RecursionError) as e:
        raise APIError(400, f"malformed JSON body: {str(e)[:200] or type(e).__name__}") from None


async def read_json(request, model: type[BaseModel], offload):
    """The request body validated as `model` (strict pydantic); 400 naming the first bad field."""
    body = await request.body()
    if not body:
        raise APIError(400, "request body is empty; send a JSON object")
    obj = await offload(parse_json, body) if len(body) > OFFLOAD_PARSE_BYTES else parse_json(body)
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise validation_error(e) from None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "json-or-python", "function-after", "union"}


def validation_error(e: ValidationError) -> APIError:
    err = e.errors(include_url=False)[0]
    loc = [str(p) for p in err.get("loc", ()) if not (isinstance(p, str) and (p in _TYPE_TAGS or "[" in p or "(" in p))]
    param = ".".join(loc) or None
    msg = str(err.get("msg", "invalid value"))
    return APIError(400, f"{param}: {msg}" if param else msg, param=loc[0] if loc else None)
