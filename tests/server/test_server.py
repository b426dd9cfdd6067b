"""`python -m atlas_jax.serve` as a real process on a loopback port, driven with the official
openai client and raw httpx: completions and chat (streaming and not), usage, stop strings, n,
logprobs, greedy parity with LLM.generate, OpenAI-format errors, API key, request ids, a client
that disconnects mid-stream, /health latency while a 10 MB body is refused, a hypothesis fuzz of
both APIs, and the SIGTERM drain (last: it ends the server)."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from atlas_jax import SamplingParams

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
from load_test import stream_end  # noqa: E402  (the load test's own classification of stream endings)

KEY = "test-key"
SHUTDOWN_TIMEOUT = 3.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(default_llm, tiny_model_path, tmp_path_factory):
    """Same engine shape as the shared default engine, so its compiled steps come from the cache.
    Its output goes to a file (a pipe nobody reads would block the server once full)."""
    port = _free_port()
    cmd = [sys.executable, "-m", "atlas_jax.serve", "--model", tiny_model_path, "--port", str(port), "--api-key", KEY, "--page-size", "8",
           "--max-num-seqs", "8", "--max-model-len", "128", "--max-prefill-chunk", "64",
           "--max-num-batched-tokens", "128", "--dtype", "float32", "--served-model-name", "tiny",
           "--log-level", "warning", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT), "--enable-prefix-caching"]
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, env=dict(os.environ), stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            raise RuntimeError(log_path.read_text()[-3000:])
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    else:
        proc.kill()
        raise RuntimeError("server did not become healthy")
    for _ in range(1200):          # the background warm-up ends (its compiles come from the cache)
        if _metric((base, proc), "atlas_warmup_pending") == 0:
            break
        time.sleep(0.1)
    yield base, proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    log.close()
    print(log_path.read_text()[-3000:])
    assert proc.returncode == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0)


def post(server, path, body, key=KEY, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if isinstance(body, (bytes, str)):
        return httpx.post(server[0] + path, content=body, headers={**headers, "content-type": "application/json"},
                          timeout=60, **kw)
    return httpx.post(server[0] + path, json=body, headers=headers, timeout=60, **kw)


def test_greedy_completion_equals_llm_generate(client, default_llm):
    prompt = "def fibonacci(n):"
    ref = default_llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].outputs[0]
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == ref.text and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 12
    assert out.usage.prompt_tokens == len(default_llm.tokenizer.encode(prompt))
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12


def test_streaming_matches_non_streaming(client):
    kw = dict(model="tiny", max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(messages=[{"role": "user", "content": "Hello"}], **kw)
    chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": "Hello"}], stream=True,
                                                 stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10 == whole.usage.completion_tokens
    comp = list(client.completions.create(prompt="Hello", stream=True, **kw))
    assert "".join(c.choices[0].text for c in comp) == client.completions.create(prompt="Hello", **kw).choices[0].text


def test_prefix_cache_over_http(client, server):
    """A second turn reuses the first turn's prompt: usage says how many prompt tokens came from the
    cache (OpenAI's prompt_tokens_details.cached_tokens), /metrics counts them."""
    kw = dict(model="tiny", max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    msgs = [{"role": "user", "content": "A prime?"}]
    first = client.chat.completions.create(messages=msgs, **kw)
    msgs += [{"role": "assistant", "content": "7"}, {"role": "user", "content": "Ok"}]
    second = client.chat.completions.create(messages=msgs, **kw)
    assert 0 < second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens // 2
    assert _metric(server, "atlas_prefix_cache_hit_tokens") >= second.usage.prompt_tokens_details.cached_tokens
    assert _metric(server, "atlas_prefix_cache_snapshots") > 0


def test_stop_n_and_logprobs(client):
    kw = dict(model="tiny", prompt="def add(a, b):", temperature=0, extra_body={"ignore_eos": True})
    free = client.completions.create(max_tokens=20, **kw).choices[0].text
    stop = next(free[i:i + 2] for i in range(3, len(free) - 2) if free[i:i + 2].strip() and "\ufffd" not in free[i:i + 2])
    cut = client.completions.create(max_tokens=20, stop=[stop], **kw).choices[0]
    assert cut.text == free[:free.find(stop)] and cut.finish_reason == "stop"
    many = client.completions.create(model="tiny", prompt="Hello", max_tokens=6, n=3, temperature=1.0, seed=3)
    assert sorted(c.index for c in many.choices) == [0, 1, 2] and many.usage.completion_tokens <= 18
    lp = client.completions.create(max_tokens=4, logprobs=3, **kw).choices[0].logprobs
    assert len(lp.token_logprobs) == 4 and all(v <= 0 for v in lp.token_logprobs)
    assert all(len(t) >= 3 for t in lp.top_logprobs)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          logprobs=True, top_logprobs=2, temperature=0)
    assert len(chat.choices[0].logprobs.content) == 3
    assert all(len(t.top_logprobs) == 2 for t in chat.choices[0].logprobs.content)


@pytest.mark.parametrize("body,status,param", [
    (b'{"prompt": "hi", "max_tokens": ', 400, None),                    # malformed JSON
    ({"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),          # wrong type
    ({"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    ({"prompt": "hi", "model": "gpt-9"}, 404, "model"),
    ({"prompt": [5] * 500, "max_tokens": 4}, 400, None),                 # over-long
    ({"prompt": []}, 400, "prompt"),
])
def test_bad_completion_requests(server, body, status, param):
    r = post(server, "/v1/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param:
        assert err["param"] == param
    if body == {"prompt": [5] * 500, "max_tokens": 4}:
        assert "max_model_len is 128" in err["message"]
    assert post(server, "/v1/completions", {"prompt": "ok", "max_tokens": 2}).status_code == 200   # still serving


def test_bad_chat_and_auth(server):
    assert post(server, "/v1/chat/completions", {"messages": []}).status_code == 400
    assert post(server, "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}).status_code == 400
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, key="wrong")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server[0] + "/v1/models").status_code == 401
    models = httpx.get(server[0] + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert models.json()["data"][0]["id"] == "tiny" and models.headers["x-request-id"]
    assert httpx.get(server[0] + "/health").status_code == 200
    assert httpx.get(server[0] + "/health", headers={"x-request-id": "abc"}).headers["x-request-id"] == "abc"


def test_tokenize_detokenize(server, default_llm):
    ids = post(server, "/tokenize", {"prompt": "Hello, world!"}).json()["tokens"]
    assert ids == default_llm.tokenizer.encode("Hello, world!")
    assert post(server, "/detokenize", {"tokens": ids}).json()["prompt"] == "Hello, world!"


def _metric(server, name):
    text = httpx.get(server[0] + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text   # keyed like the rest
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def test_disconnect_mid_stream_frees_pages(server):
    """Leaving after two chunks aborts the request on the engine (counted) and frees its pages."""
    aborted = _metric(server, "atlas_aborted_requests")
    body = {"prompt": "Hello", "max_tokens": 120, "stream": True, "ignore_eos": True, "temperature": 0}
    got = []
    with httpx.stream("POST", server[0] + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                got.append(json.loads(line[6:]))
            if len(got) >= 2:
                break                              # leaving the `with` closes the connection mid-stream
    assert all(c["choices"][0]["finish_reason"] is None for c in got)
    for _ in range(100):
        if _metric(server, "atlas_aborted_requests") > aborted:
            break
        time.sleep(0.05)
    assert _metric(server, "atlas_aborted_requests") == aborted + 1
    for _ in range(100):
        if _metric(server, "atlas_free_kv_pages") == _metric(server, "atlas_kv_pages") \
                and _metric(server, "atlas_running_requests") == 0:
            break
        time.sleep(0.1)
    assert _metric(server, "atlas_free_kv_pages") == _metric(server, "atlas_kv_pages")
    assert _metric(server, "atlas_num_compiles") > 0
    assert "atlas_time_to_first_token_seconds_bucket" in httpx.get(server[0] + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text


def test_timeout_and_engine_failure_in_process(default_llm):
    """The app in-process on the shared engine: --request-timeout ends a request with finish_reason
    "timeout" (not a silent "length"); a full queue answers 503 + Retry-After; an engine failing
    mid-stream ends the stream with an error event, then /health and /v1 answer 503."""
    from fastapi.testclient import TestClient

    from atlas_jax.engine.async_llm import AsyncLLM
    from atlas_jax.server.app import build_app
    engine = AsyncLLM.from_llm(default_llm)
    real_step = default_llm.engine.step
    try:
        with TestClient(build_app(engine, served_model_name="tiny", request_timeout=0.05)) as c:
            r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 120, "ignore_eos": True})
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "timeout"
            assert r.json()["usage"]["completion_tokens"] < 120
        with TestClient(build_app(engine, served_model_name="tiny", max_waiting=0)) as c:     # queue "full"
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
            assert r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["type"] == "service_unavailable"
        with TestClient(build_app(engine, served_model_name="tiny")) as c:
            def breaks_after_two_tokens():        # the stream has sent tokens when the engine dies
                if any(len(s.output_ids) >= 2 for r in default_llm.engine.requests.values() for s in r.seqs):
                    raise RuntimeError("device on fire")
                return real_step()
            default_llm.engine.step = breaks_after_two_tokens
            r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 50, "stream": True, "ignore_eos": True})
            events = [line for line in r.text.splitlines() if line.startswith("data: ")]
            assert r.status_code == 200 and events[-1] == "data: [DONE]"
            assert "device on fire" in json.loads(events[-2][6:])["error"]["message"]   # not a silent cut
            assert "choices" in json.loads(events[0][6:])
            assert c.get("/health").status_code == 503
            assert c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4}).status_code == 503
    finally:
        default_llm.engine.step = real_step
        engine.shutdown()
    assert default_llm.blocks.num_free == default_llm.num_pages and not default_llm.engine.requests


UPLOAD = """
import sys, httpx
def chunks():
    yield b'{"prompt": "'
    for _ in range(160):
        yield b"a b " * (1 << 14)
    yield b'"}'
r = httpx.post(sys.argv[1] + "/v1/completions", content=chunks(), timeout=60,
               headers={"content-type": "application/json", "Authorization": "Bearer " + sys.argv[2]})
print(r.status_code, r.json()["error"]["message"])
"""


def test_health_stays_fast_while_a_10mb_body_is_refused(server):
    """A 10 MB chunked body (from another process) is refused with 413 while it is read; /health
    answers in under 100 ms throughout."""
    uploader = subprocess.Popen([sys.executable, "-c", UPLOAD, server[0], KEY], stdout=subprocess.PIPE, text=True)
    latencies = []
    with httpx.Client(base_url=server[0], timeout=10) as c:
        while uploader.poll() is None:
            t = time.perf_counter()
            assert c.get("/health").status_code == 200
            latencies.append(time.perf_counter() - t)
            time.sleep(0.005)
    out = uploader.stdout.read()
    assert out.startswith("413") and "request body over" in out, out
    assert len(latencies) >= 3 and max(latencies) < 0.1, sorted(latencies)[-5:]


def test_fuzz_real_server(server):
    """The hypothesis bodies of test_robustness against the server process: no 5xx; afterwards an
    ordinary request is served, every KV page is free and nothing was compiled."""
    from helpers import fuzz
    compiles = _metric(server, "atlas_num_compiles")
    with httpx.Client(base_url=server[0], headers={"Authorization": f"Bearer {KEY}",
                                                   "content-type": "application/json"}, timeout=60) as c:
        fuzz(lambda path, raw: c.post(path, content=raw), max_examples=60)
    assert post(server, "/v1/completions", {"prompt": "ok", "max_tokens": 2}).status_code == 200
    for _ in range(100):
        if _metric(server, "atlas_free_kv_pages") == _metric(server, "atlas_kv_pages"):
            break
        time.sleep(0.05)
    assert _metric(server, "atlas_free_kv_pages") == _metric(server, "atlas_kv_pages")
    assert _metric(server, "atlas_free_state_slots") == _metric(server, "atlas_state_slots")
    assert _metric(server, "atlas_running_requests") == 0 and _metric(server, "atlas_num_compiles") == compiles
    assert _metric(server, "atlas_failed_requests") == 0


def test_sigterm_drains(server):
    """Last in this module: SIGTERM with 240 streams sent (the server takes 256 in flight): 8 running and
    >= 200 waiting at the signal, ~30 waves of 80-120 tokens (~3000 steps), far more than --shutdown-timeout
    allows even at 1 ms a step, while the first wave (~120 steps) ends inside it up to ~25 ms a step. New
    requests get 503 + Retry-After and /health 503 during the drain; the running streams finish; what is
    left at the timeout ends with an error event and [DONE] (or, never started, a 503 + Retry-After);
    nothing is cut; the process exits 0.
    The lengths differ so that rows finish at different steps: with equal lengths whole waves end
    together, and a timeout that fell between a wave's last step and the next wave's first left no
    started stream to end with an error."""
    import asyncio
    base, proc = server

    async def go():
        async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                                     limits=httpx.Limits(max_connections=300)) as http:
            async def metric(name):
                text = (await http.get("/metrics")).text
                return next(float(line.split()[1]) for line in text.splitlines() if line.startswith(name + " "))

            async def stream(max_tokens):
                body = {"prompt": "Hello", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        ok = r.status_code == 503 and r.headers.get("retry-after")
                        return "503" if ok else f"status {r.status_code}"
                    return stream_end([line[6:] async for line in r.aiter_lines() if line.startswith("data: ")])
            tasks = [asyncio.create_task(stream(80 + 37 * i % 41)) for i in range(240)]
            for _ in range(1000):                 # all 8 slots taken and most requests queued before the signal
                running, waiting = await metric("atlas_running_requests"), await metric("atlas_waiting_requests")
                if running == 8 and waiting >= 200:
                    break
                await asyncio.sleep(0.01)
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.2)
            refused = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            health = await http.get("/health")
            return (running, waiting), refused, health, await asyncio.gather(*tasks)
    t0 = time.monotonic()
    at_signal, refused, health, ends = asyncio.run(go())
    assert at_signal[0] == 8 and at_signal[1] >= 200, at_signal
    assert refused.status_code == 503 and refused.headers["retry-after"], refused.text
    assert refused.json()["error"]["type"] == "service_unavailable"
    assert health.status_code == 503 and "draining" in health.json()["error"]["message"]
    assert set(ends) <= {"finished", "error", "503"}, ends
    assert ends.count("finished") >= 8 and ends.count("error") >= 1, ends      # an error: the timeout cut streams
    assert proc.wait(30) == 0
    assert time.monotonic() - t0 < SHUTDOWN_TIMEOUT + 30
