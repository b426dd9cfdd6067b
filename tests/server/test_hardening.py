"""Hardening of the HTTP server against hostile or careless clients (issue 37), on real sockets
(uvicorn in a thread over the shared tiny engine): every route but /health behind the key (constant-time,
one Authorization header), JSON-only POSTs, Host allow-list, per-request caps and per-client capacity
(429), a flooding client vs a canary from another address, clients that leave while queued, slowloris
sockets and the connection cap, prompt_logprobs converted off the event loop, and the self-repairing
compile cache."""
import asyncio
import contextlib
import os
import socket
import threading
import time

import httpx
import numpy as np
import pytest

from conftest import serving

from atlas_jax.engine.async_llm import AsyncLLM
from atlas_jax.engine.client import FINISHED
from atlas_jax.engine.outputs import CompletionOutput, RequestOutput
from atlas_jax.server.app import build_app
from atlas_jax.server.connections import protocol_class

KEY = "k-hardening"
AUTH = {"Authorization": f"Bearer {KEY}"}
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(default_llm):
    e = AsyncLLM.from_llm(default_llm)
    yield e
    e.shutdown()


@contextlib.contextmanager
def server(engine, http=None, **kw):
    """The app over `engine` on a loopback port; yields its base URL (the app: `server.app`)."""
    config = {"http": http} if http is not None else {}
    server.app = build_app(engine, served_model_name="tiny", **kw)
    with serving(server.app, **config) as port:
        yield f"http://127.0.0.1:{port}"


def idle(engine, default_llm, timeout=20.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if engine.num_in_flight == 0 and not default_llm.engine.requests \
                and default_llm.blocks.num_free == default_llm.num_pages:
            return True
        time.sleep(0.02)
    return False


def error(r, status):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


# ---- access --------------------------------------------------------------------------------------
def test_every_route_but_health_needs_the_key(engine):
    app_paths = {r.path for r in build_app(engine, served_model_name="tiny", api_key=KEY).routes}
    assert {"/health", "/metrics", "/tokenize", "/detokenize", "/v1/models", "/v1/completions"} <= app_paths
    with server(engine, api_key=KEY) as base, httpx.Client(base_url=base, timeout=30) as c:
        for path in sorted(app_paths - {"/health"}):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                            {"Authorization": f"Bearer {KEY}x"}):
                r = c.get(path, headers=headers) if path in ("/metrics", "/v1/models") else \
                    c.post(path, json={}, headers=headers)
                assert error(r, 401)["type"] == "authentication_error", (path, headers)
        assert c.get("/health").status_code == 200
        assert c.get("/metrics", headers=AUTH).status_code == 200
        assert c.post("/tokenize", json={"prompt": "hi"}, headers={"authorization": f"bearer {KEY}"}).status_code == 200
        # two Authorization headers, whichever comes first and even if both are right: refused
        right, wrong = ("authorization", f"Bearer {KEY}"), ("authorization", "Bearer wrong")
        for two in ([wrong, right], [right, wrong], [right, right]):
            error(c.post("/tokenize", json={"prompt": "hi"}, headers=two), 401)
    with server(engine, api_key=KEY, public_metrics=True) as base:
        assert httpx.get(base + "/metrics").status_code == 200
        error(httpx.get(base + "/v1/models"), 401)


def test_several_keys_are_several_clients(engine, default_llm):
    """Two keys from one address are two clients: each may hold its one request in flight; a second
    request on k1 is 429 while k2's first is admitted."""
    with server(engine, api_key=["k1", "k2"], max_requests_per_client=1) as base, stalled(default_llm):
        error(httpx.get(base + "/v1/models", headers={"Authorization": "Bearer k3"}), 401)
        socks = [_raw_request(base, b'{"prompt": "x", "max_tokens": 2}', key=key) for key in ("k1", "k2")]
        end = time.monotonic() + 10
        while engine.num_in_flight < 2 and time.monotonic() < end:
            time.sleep(0.02)
        assert engine.num_in_flight == 2 and dict(server.app.state.ctx.in_flight) == {"key:0": 1, "key:1": 1}
        r = httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                       headers={"Authorization": "Bearer k1"}, timeout=10)
        assert error(r, 429)["code"] == "rate_limit_exceeded"
        for s in socks:
            s.close()
        end = time.monotonic() + 5
        while server.app.state.ctx.in_flight and time.monotonic() < end:
            time.sleep(0.02)
        assert not server.app.state.ctx.in_flight
    assert idle(engine, default_llm)


def test_posts_must_be_json_and_hosts_allowed(engine):
    with server(engine, allowed_hosts=["localhost", "127.0.0.1", "::1"]) as base, \
            httpx.Client(base_url=base, timeout=30) as c:
        body = b'{"prompt": "hi"}'
        for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
            headers = {"content-type": ctype} if ctype else {}
            assert error(c.post("/tokenize", content=body, headers=headers), 415)
        assert c.post("/tokenize", content=body, headers={"content-type": "application/json; charset=utf-8"}).status_code == 200
        port = base.rsplit(":", 1)[1]
        for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example", "localhost.:80"):
            error(c.get("/health", headers={"host": host}), 400)
        for host in (f"localhost:{port}", "127.0.0.1", f"[::1]:{port}"):
            assert c.get("/health", headers={"host": host}).status_code == 200, host


def test_default_allowed_hosts():
    from atlas_jax.serve import default_allowed_hosts
    assert set(default_allowed_hosts("127.0.0.1")) == set(default_allowed_hosts("localhost")) \
        == set(default_allowed_hosts("::1")) == {"localhost", "127.0.0.1", "::1"}
    assert default_allowed_hosts("0.0.0.0") == default_allowed_hosts("10.1.2.3") == ["*"]


# ---- caps and fairness -----------------------------------------------------------------------------
def test_per_request_caps(engine):
    with server(engine, max_seqs_per_request=8, max_request_tokens=100, max_requests_per_client=2) as base, \
            httpx.Client(base_url=base, timeout=60) as c:
        r = c.post("/v1/completions", json={"prompt": ["a", "b", "c"], "max_tokens": 2})   # never admissible: 400
        assert "at most 2 requests in flight" in error(r, 400)["message"] and r.json()["error"]["param"] == "prompt"
        r = c.post("/v1/completions", json={"prompt": ["a", "b", "c"], "n": 3, "max_tokens": 2})
        assert "9 sequences" in error(r, 400)["message"] and r.json()["error"]["param"] == "n"
        r = c.post("/v1/completions", json={"prompt": ["a", "b"], "n": 2, "max_tokens": 30})
        assert error(r, 400)["param"] == "max_tokens"
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})   # 128 > 100
        assert error(r, 400)["param"] == "max_tokens"
        r = c.post("/v1/completions", json={"prompt": ["a", "b"], "n": 2, "max_tokens": 20, **GREEDY})
        assert r.status_code == 200 and len(r.json()["choices"]) == 4


@contextlib.contextmanager
def stalled(default_llm):
    """The engine steps without progress (requests stay queued; commands are still handled)."""
    core = default_llm.engine
    core.step = lambda: (time.sleep(0.005), [])[1]
    try:
        yield
    finally:
        del core.step


def _raw_request(base, body: bytes, path="/v1/completions", key=None) -> socket.socket:
    host, port = base.rsplit("/", 1)[1].split(":")
    s = socket.create_connection((host, int(port)))
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{auth}"
              f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return s


def test_per_client_cap_is_429_and_clients_that_leave_while_queued_are_aborted(engine, default_llm):
    """Requests queued behind a stalled engine: a client past its cap gets 429 + Retry-After; when the
    clients of the queued requests (streaming and not) disconnect, every one is aborted within 2 s, with
    no token ever produced for them."""
    with server(engine, max_requests_per_client=6) as base, stalled(default_llm):
        socks = [_raw_request(base, b'{"prompt": "def f(x):", "max_tokens": 8, "stream": %s}' % s)
                 for s in (b"true", b"false") * 3]
        end = time.monotonic() + 10                  # streams registered, then queued by the engine thread
        while (engine.num_in_flight < 6 or len(default_llm.engine.requests) < 6) and time.monotonic() < end:
            time.sleep(0.02)
        assert engine.num_in_flight == 6 and len(default_llm.engine.requests) == 6
        r = httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
        assert error(r, 429)["code"] == "rate_limit_exceeded" and r.headers["retry-after"] == "1"
        for s in socks:
            s.close()
        t = time.monotonic()
        while (engine.num_in_flight or default_llm.engine.requests) and time.monotonic() - t < 2.0:
            time.sleep(0.02)
        assert engine.num_in_flight == 0 and not default_llm.engine.requests, time.monotonic() - t
        assert not server.app.state.ctx.in_flight                 # the client's places were given back
    assert idle(engine, default_llm)


def test_a_flooding_client_cannot_lock_out_a_canary(engine, default_llm):
    """One client (127.0.0.1) holds the server at capacity with long streams (its next request: 429); a
    canary from another address (127.0.0.2) is admitted past the cap and served within seconds, the
    engine's fair admission giving it a slot the flood holds."""
    flood_body = {"prompt": "def f(x):", "n": 4, "max_tokens": 100, "stream": True, **GREEDY}
    with server(engine, max_waiting=6) as base:
        stop = threading.Event()

        def flood_stream():
            with httpx.Client(timeout=120) as c, c.stream("POST", base + "/v1/completions", json=flood_body) as r:
                for _ in r.iter_lines():
                    if stop.is_set():
                        return
        threads = [threading.Thread(target=flood_stream, daemon=True) for _ in range(6)]
        for t in threads:
            t.start()
        end = time.monotonic() + 30
        while engine.num_in_flight < 6 and time.monotonic() < end:
            time.sleep(0.02)
        assert engine.num_in_flight == 6
        error(httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10), 429)
        canary = httpx.Client(base_url=base, timeout=60, transport=httpx.HTTPTransport(local_address="127.0.0.2"))
        t0 = time.monotonic()
        r = canary.post("/v1/completions", json={"prompt": "def g(y):", "max_tokens": 8, **GREEDY})
        latency = time.monotonic() - t0
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8, r.text
        assert latency < 5.0, latency
        assert engine.num_in_flight == 6                      # the flood was still running
        stop.set()
        for t in threads:
            t.join(60)
    assert idle(engine, default_llm, 60)


# ---- connections ----------------------------------------------------------------------------------
def test_slowloris_sockets_are_closed_and_connections_capped(engine):
    with server(engine, http=protocol_class(header_timeout=0.5, max_connections=4)) as base:
        host, port = base.rsplit("/", 1)[1].split(":")
        port = int(port)
        slow = socket.create_connection((host, port))
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")         # headers never finished
        silent = socket.create_connection((host, port))                     # never sends a byte
        for s in (slow, silent):
            s.settimeout(5)
            t = time.monotonic()
            assert s.recv(100) == b"" and time.monotonic() - t < 3          # closed by the server
            s.close()
        # a request that sends its headers in time is served, however slowly it is answered
        assert httpx.get(base + "/health", timeout=10).status_code == 200
        # a kept-alive connection whose next request dribbles in is closed too
        with socket.create_connection((host, port)) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            reply = b""
            while not reply.endswith(b'{"status":"ok"}'):
                reply += s.recv(4096)
            assert b"200 OK" in reply
            s.sendall(b"GET /health HTTP/1.1\r\n")
            s.settimeout(5)
            assert s.recv(100) == b""
        # at the cap a new connection gets 503 at once, even one that has sent its request already
        held = [socket.create_connection((host, port)) for _ in range(4)]
        extra = socket.create_connection((host, port))
        extra.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.1)
        extra.settimeout(5)
        reply = extra.recv(4096)
        assert reply.startswith(b"HTTP/1.1 503") and b"too many open connections" in reply
        for s in held + [extra]:
            s.close()
        time.sleep(0.2)
        assert httpx.get(base + "/health", timeout=10).status_code == 200


def test_one_address_cannot_hold_every_connection_and_slow_bodies_time_out(engine):
    with server(engine, http=protocol_class(None, 10, max_connections_per_client=3), body_timeout=0.5) as base:
        host, port = base.rsplit("/", 1)[1].split(":")
        port = int(port)
        held = [socket.create_connection((host, port)) for _ in range(3)]
        extra = socket.create_connection((host, port))
        extra.settimeout(5)
        assert extra.recv(4096).startswith(b"HTTP/1.1 503")
        other = httpx.Client(base_url=base, timeout=10, transport=httpx.HTTPTransport(local_address="127.0.0.2"))
        assert other.get("/health").status_code == 200            # another address still gets in
        for s in held + [extra]:
            s.close()
        time.sleep(0.2)
        with socket.create_connection((host, port)) as s:           # a body that never completes: 408
            s.sendall(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"prompt\": ")
            s.settimeout(5)
            t = time.monotonic()
            reply = s.recv(4096)
            assert reply.startswith(b"HTTP/1.1 408") and time.monotonic() - t < 3, reply
        assert other.post("/tokenize", json={"prompt": "hi"}).status_code == 200    # bodies in time are fine


# ---- prompt_logprobs off the event loop -------------------------------------------------------------
class ScoringEngine:
    """An EngineClient (engine/client.py) answering every request at once with a long prompt's
    prompt_logprobs (4095 x 20 entries): what the server does with them is under test."""

    def __init__(self, llm):
        self.model_path, self.tokenizer = llm.model_path, llm.tokenizer
        self.max_model_len, self.vocab_size, self.num_pages, self.num_slots, self.loras = \
            8192, llm.engine.cfg.vocab_size, 1, 1, None
        self.stats = lambda: {**llm.engine.stats(), "spec": None}
        self.is_draining, self.is_running, self.is_ready, self.errored, self.num_in_flight = False, True, True, None, 0
        self._pool = __import__("concurrent.futures").futures.ThreadPoolExecutor(4)
        ids = (np.arange(4096)[:, None] * 7 + np.arange(20)[None]) % llm.engine.cfg.vocab_size   # 20 distinct a row
        self.scored = [None] + [{int(t): -float(j) for j, t in enumerate(row)} for row in ids[1:]]

    async def offload(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def abort_nowait(self, request_id, reason="abort"):
        pass

    async def add_request_async(self, prompt, params, request_id=None, lora_request=None, client=None):
        queue = asyncio.Queue()
        out = [CompletionOutput(0, "x", [1], "length")]
        queue.put_nowait(RequestOutput(request_id, None, list(range(4096)), out, True, prompt_logprobs=self.scored))
        queue.put_nowait(FINISHED)
        return None, queue


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_logprobs_leave_health_fast(default_llm, stream):
    fake = ScoringEngine(default_llm)
    with serving(build_app(fake, served_model_name="tiny")) as port:
        base, latencies, done = f"http://127.0.0.1:{port}", [], threading.Event()

        def probe():
            with httpx.Client(timeout=30) as c:
                while not done.is_set():
                    t = time.monotonic()
                    assert c.get(base + "/health").status_code == 200
                    latencies.append(time.monotonic() - t)
                    time.sleep(0.01)
        prober = threading.Thread(target=probe)
        prober.start()
        time.sleep(0.2)
        body = {"prompt": [1, 2, 3], "max_tokens": 1, "prompt_logprobs": 20, "stream": stream}
        for _ in range(2):
            r = httpx.post(base + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200
            if stream:
                assert r.text.count('"logprob"') == 4095 * 20
            else:
                scored = r.json()["choices"][0]["prompt_logprobs"]
                assert len(scored) == 4096 and scored[0] is None and len(scored[5]) == 20
        done.set()
        prober.join()
    assert len(latencies) > 10 and max(latencies) < 0.5, max(latencies)     # (2 busy cores: pauses of 0.2 s)


# ---- compile cache --------------------------------------------------------------------------------
def test_a_corrupt_compile_cache_entry_is_replaced():
    """A truncated persistent-cache entry is dropped when it fails to load and the fresh compile is
    written in its place (atomically), so the next load succeeds."""
    import jax
    import jax.numpy as jnp
    from jax._src import compilation_cache as cc

    from atlas_jax.engine.compile_cache import default_compile_cache_dir
    cache_dir = default_compile_cache_dir()
    salt = float(time.time_ns() % 1000003)

    def compile_once():
        jax.clear_caches()
        return jax.jit(lambda x: jnp.sin(x) * salt + 1.0).lower(np.ones(7, np.float32)).compile()

    def entries():
        return {f for f in os.listdir(cache_dir) if f.startswith("jit__lambda") and f.endswith("-cache")}
    before = entries()
    compile_once()
    new = entries() - before
    assert len(new) == 1, new
    path = os.path.join(cache_dir, new.pop())
    whole = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(whole // 2)
    compile_once()                                   # fails to load, recompiles, rewrites
    assert os.path.getsize(path) > whole // 2
    hits = []
    real = cc.get_executable_and_time

    def counted(*a, **k):
        out = real(*a, **k)
        hits.append(out[0] is not None)
        return out
    cc.get_executable_and_time = counted
    try:
        compile_once()
    finally:
        cc.get_executable_and_time = real
    assert hits == [True]                            # the rewritten entry loads
    assert not [f for f in os.listdir(cache_dir) if f.endswith(".tmp")]
