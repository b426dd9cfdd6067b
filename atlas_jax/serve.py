"""`python -m atlas_jax.serve`: an OpenAI-compatible HTTP server on the engine.

    python -m atlas_jax.serve [--model PATH] [--host 127.0.0.1] [--port 8000] [...]
With no --model it serves the embedded default model. The port opens at once; the engine thread
compiles every step shape first, and /health answers 503 (Retry-After) until that is done, so a
200 means serving compiles nothing more.
Access: with --api-key every route but /health needs the key (/metrics too unless --public-metrics);
bound to a loopback address, only loopback Host names are served (--allowed-hosts); POST bodies must
be JSON; adapters load / unload at runtime only with --allow-runtime-lora-updating.
Connections: request headers must arrive within --header-timeout seconds and bodies within
--body-timeout (408); an idle keep-alive connection closes after --timeout-keep-alive seconds; past
--max-connections open connections (or --max-connections-per-client from one address) a new one gets 503.
Fairness: --max-seqs-per-request and --max-request-tokens cap one request,
--max-requests-per-client caps one client's requests in flight (429), and the engine admits waiting
requests client by client (a client = its API key when several are given, else its address).
SIGINT / SIGTERM: drain — new requests get 503 + Retry-After (and /health 503), requests in flight
run to their end for up to --shutdown-timeout seconds, then the rest end with an error (streams: an
error event and `data: [DONE]`); exit 0. A second signal ends the drain at once.
"""
from __future__ import annotations

import argparse
import logging
import os
import time

from .engine.args import EngineArgs


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m atlas_jax.serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    EngineArgs.add_cli_args(ap)
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    ap.add_argument("--served-model-name", default=None, help="model id clients use (default: the checkpoint dir name)")
    env_keys = os.environ.get("ATLAS_JAX_API_KEY")
    ap.add_argument("--api-key", nargs="+", default=env_keys.split(",") if env_keys else None, metavar="KEY",
                    help="require 'Authorization: Bearer KEY' on every route but /health; several keys = several "
                         "clients, admitted fairly (default: $ATLAS_JAX_API_KEY, comma-separated, else none)")
    ap.add_argument("--public-metrics", action="store_true", help="serve /metrics without the API key")
    ap.add_argument("--allowed-hosts", nargs="+", default=None, metavar="HOST",
                    help="Host header names served, '*' = any (default: the loopback names when bound to a loopback "
                         "address, else any)")
    ap.add_argument("--allow-runtime-lora-updating", action="store_true",
                    help="allow /v1/load_lora_adapter and /v1/unload_lora_adapter (off: 403)")
    ap.add_argument("--chat-template", default=None, help="jinja2 chat template: a file or the template text")
    ap.add_argument("--tool-call-parser", default="auto",
                    help="tool-call format in replies: auto (from the chat template), qwen3_json (hermes), llama3_json, "
                         "qwen3_xml (qwen3_coder), none")
    ap.add_argument("--reasoning-parser", default="auto",
                    help="split <think>...</think> into reasoning_content: auto (when the template has it), qwen3, none")
    ap.add_argument("--request-timeout", type=float, default=None, help="seconds; a request running longer ends "
                    "with finish_reason 'timeout'")
    ap.add_argument("--max-waiting", type=int, default=256, help="requests in flight before 503 + Retry-After "
                    "(a client below its share of them is still admitted, up to half as many again)")
    ap.add_argument("--max-requests-per-client", type=int, default=None,
                    help="one client's requests (prompts) in flight before 429 + Retry-After (default: no cap)")
    ap.add_argument("--max-seqs-per-request", type=int, default=256, help="sequences (prompts x n) one request may "
                    "ask for (default 256)")
    ap.add_argument("--max-request-tokens", type=int, default=1 << 20, help="tokens one request may ask for: "
                    "prompts x n x max_tokens (default 1048576)")
    ap.add_argument("--header-timeout", type=float, default=10.0, help="seconds a connection may take to send its "
                    "request headers before it is closed (default 10)")
    ap.add_argument("--timeout-keep-alive", type=float, default=5.0, help="seconds an idle keep-alive connection "
                    "stays open (default 5)")
    ap.add_argument("--max-connections", type=int, default=None, help="open connections before a new one gets 503 "
                    "(default: 1024, within the open-file limit)")
    ap.add_argument("--max-connections-per-client", type=int, default=None, help="open connections from one address "
                    "before its next one gets 503 (default: half of --max-connections)")
    ap.add_argument("--body-timeout", type=float, default=30.0, help="seconds a request body may take to arrive "
                    "after its headers before the request is refused with 408 (default 30)")
    ap.add_argument("--max-body-bytes", type=int, default=1 << 22, help="largest request body (default 4 MiB); "
                    "larger ones are refused with 413 while being read")
    ap.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds requests in flight may take to "
                    "finish after SIGTERM / SIGINT before they are ended with an error (default 30)")
    ap.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                    help="LoRA adapters (PEFT directories) served from the start, each chosen by a request's "
                         "'model' field: name=path, or a JSON object {\"name\": ..., \"path\": ...} (needs --enable-lora)")
    ap.add_argument("--full-warmup", action="store_true", help="compile every step shape before /health turns "
                    "200 (default: the largest shapes, which run any batch; the rest compile in the background "
                    "while serving, and batches of those shapes run padded until then)")
    ap.add_argument("--log-level", default="info")
    return ap.parse_args(argv)


def parse_lora_modules(specs: list[str]) -> list:
    """--lora-modules entries -> LoRARequests (ids 1, 2, ... in order); ValueError names a bad entry."""
    import json

    from .engine.lora import LoRARequest
    out = []
    for spec in specs:
        if spec.lstrip().startswith("{"):
            try:
                obj = json.loads(spec)
                name, path = obj["name"], obj["path"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"--lora-modules: {spec!r} is not a JSON object with 'name' and 'path'") from None
        else:
            name, sep, path = spec.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules: {spec!r} is not NAME=PATH")
        if any(r.lora_name == name for r in out):
            raise ValueError(f"--lora-modules: adapter name {name!r} is given twice")
        out.append(LoRARequest(name, len(out) + 1, path))
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    try:
        engine_args = EngineArgs.from_cli(args)
        lora_modules = parse_lora_modules(args.lora_modules)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if lora_modules and not engine_args.enable_lora:
        raise SystemExit("--lora-modules needs --enable-lora")
    import uvicorn

    from .engine.async_llm import AsyncLLM
    from .engine.llm import LLM
    from .server.app import build_app
    from .server.connections import protocol_class, raise_fd_limit

    _configure_logging(args.log_level)
    llm = LLM.from_engine_args(engine_args, warmup=False)
    if not llm.dist.leader:
        return _follow(llm)
    from .weights.lora import LoRAError
    for req in lora_modules:
        try:
            llm.add_lora(req)
        except LoRAError as e:
            raise SystemExit(f"--lora-modules {req.lora_name}={req.lora_path}: {e}") from None
    engine = AsyncLLM.from_llm(llm, warmup=True if args.full_warmup else "background")   # /health 503 until ready
    name = args.served_model_name or os.path.basename(os.path.normpath(llm.model_path))
    app = build_app(engine, served_model_name=name, api_key=args.api_key, chat_template=args.chat_template,
                    request_timeout=args.request_timeout, max_waiting=args.max_waiting,
                    max_body_bytes=args.max_body_bytes, tool_call_parser=args.tool_call_parser,
                    reasoning_parser=args.reasoning_parser, public_metrics=args.public_metrics,
                    allowed_hosts=args.allowed_hosts or default_allowed_hosts(args.host),
                    allow_runtime_lora_updating=args.allow_runtime_lora_updating,
                    max_requests_per_client=args.max_requests_per_client,
                    max_seqs_per_request=args.max_seqs_per_request, max_request_tokens=args.max_request_tokens,
                    body_timeout=args.body_timeout)
    fd_limit = raise_fd_limit()
    max_connections = args.max_connections or max(16, min(1024, fd_limit - 128))
    per_client = args.max_connections_per_client or max(1, max_connections // 2)

    logging.getLogger("atlas_jax").info("serving %s on http://%s:%d (warming up; /health is 503 until ready)",
                                        name, args.host, args.port)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5, timeout_keep_alive=args.timeout_keep_alive,
                            http=protocol_class(args.header_timeout, max_connections, per_client))
    server = _DrainingServer(config, engine, args.shutdown_timeout)
    try:
        server.run()          # returns after the drain that SIGINT / SIGTERM starts
    finally:
        engine.shutdown()     # abort whatever is still in flight, stop the engine thread
        llm.close()           # multi-host: the other ranks stop too


def _configure_logging(level: str) -> None:
    """The atlas_jax logger at `level` on stderr (its own handler: jax's imports leave the root logger
    configured at WARNING, so basicConfig alone would drop warm-up progress and rank messages)."""
    logging.basicConfig(level=level.upper())
    log = logging.getLogger("atlas_jax")
    log.setLevel(level.upper())
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)
        log.propagate = False


def _follow(llm) -> None:
    """A rank other than 0 (--node-rank R > 0): no HTTP; compile as rank 0 does, then run its steps until it
    stops (exit 0), or exit 1 with the error when rank 0 is lost."""
    log = logging.getLogger("atlas_jax")
    llm.engine.warmup(progress=False, background=True)
    log.info("rank %d of %d: following rank 0's steps", llm.dist.node_rank, llm.dist.nnodes)
    try:
        calls = llm.follow()
    except Exception as e:                    # noqa: BLE001 — the service is over for this rank
        log.error("rank %d: %s", llm.dist.node_rank, e)
        raise SystemExit(1) from None
    log.info("rank %d: rank 0 stopped after %d device calls", llm.dist.node_rank, calls)


def default_allowed_hosts(bind: str) -> list[str]:
    """Loopback names when bound to a loopback address (a web page cannot rebind a name to it), else any."""
    import ipaddress

    from .server.guard import LOOPBACK_HOSTS
    try:
        loopback = bind == "localhost" or ipaddress.ip_address(bind).is_loopback
    except ValueError:
        loopback = False
    return list(LOOPBACK_HOSTS) if loopback else ["*"]


def _DrainingServer(config, engine, shutdown_timeout: float):
    """uvicorn.Server whose SIGINT / SIGTERM drains (module docstring) and exits 0 (uvicorn
    re-raises a captured signal after its own shutdown, which would end the process by it)."""
    import uvicorn

    log = logging.getLogger("atlas_jax")
    grace = 3.0                                       # for error events to reach clients after fail_all

    class Server(uvicorn.Server):
        drain_deadline = None                         # monotonic time the drain ends; None: serving
        failed_at = None                              # when what was left got its error

        def handle_exit(self, sig, frame):
            self._captured_signals.clear()
            now = time.monotonic()
            if self.drain_deadline is None:
                log.warning("signal %d: draining %d request(s) in flight for up to %.0f s",
                            sig, engine.num_in_flight, shutdown_timeout)
                engine.drain()
                self.drain_deadline = now + shutdown_timeout
            else:
                self.drain_deadline = now             # a second signal: end the drain now

        async def on_tick(self, counter: int) -> bool:
            if await super().on_tick(counter):
                return True
            if self.drain_deadline is None:
                return False
            now = time.monotonic()
            if engine.num_in_flight == 0:
                return True
            if self.failed_at is None and now >= self.drain_deadline:
                log.warning("drain timed out: ending %d request(s) with an error", engine.num_in_flight)
                engine.fail_all("the server shut down before this request finished")
                self.failed_at = now
            return self.failed_at is not None and now >= self.failed_at + grace
    return Server(config)


if __name__ == "__main__":
    main()
