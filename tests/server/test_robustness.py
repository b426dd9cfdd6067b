"""One bad request never takes the service down: bounds on every field (SamplingParams and the HTTP
API), step containment (a request whose own inputs break a step fails alone), no 5xx for client
errors, a usable connection after a 500, the body limit while reading, a responsive event loop, and a
hypothesis fuzz of both APIs. The HTTP tests run uvicorn in a thread on the shared engine (real
sockets, no extra compiles)."""
import http.client
import json
import time

import httpx
import numpy as np
import pytest

from conftest import random_prompts, serving
from helpers import fuzz

from atlas_jax import SamplingParams
from atlas_jax.errors import InvalidRequestError

GREEDY = dict(temperature=0.0, ignore_eos=True)


# ---- SamplingParams and make_request: every field bounded before it reaches the device ----------
@pytest.mark.parametrize("field,value", [
    ("top_k", 10**12), ("top_k", -2), ("top_k", 2.0), ("seed", 2**64), ("seed", True), ("n", 10**6), ("n", True),
    ("max_tokens", 0), ("max_tokens", 2**70), ("max_tokens", "8"), ("temperature", "0.5"), ("temperature", float("nan")),
    ("logprobs", 21), ("logprobs", True), ("stop", ["x"] * 100), ("stop", "x" * 10_000), ("stop", [""]), ("stop", [3]),
    ("stop_token_ids", [10**30]), ("stop_token_ids", [-1]), ("stop_token_ids", [1.5]), ("stop_token_ids", [True]),
    ("repetition_penalty", float("inf")), ("ignore_eos", 1), ("top_p", 0.0), ("min_p", 1.5),
    ("logit_bias", {5: 101.0}), ("logit_bias", {-1: 1.0}), ("logit_bias", {"5": 1.0}), ("logit_bias", {5: float("nan")}),
    ("logit_bias", {i: 1.0 for i in range(129)}), ("logit_bias", [1, 2]),
])
def test_sampling_params_refuse_out_of_bounds(field, value):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field and field in str(e.value)


def test_sampling_params_accept_the_edges():
    p = SamplingParams(top_k=2**31 - 1, seed=-2**63, n=128, stop=["x"] * 16, stop_token_ids=[np.int64(3)],
                       max_tokens=None)
    assert p.stop_token_ids == (3,) and type(p.stop_token_ids[0]) is int and SamplingParams(top_k=-1).top_k == 0


def test_make_request_bounds_against_the_model(default_llm):
    eng, room = default_llm.engine, default_llm.engine.max_model_len - 3
    prompt = [1, 2, 3]
    assert eng.make_request(prompt, SamplingParams(max_tokens=room)).seqs[0].max_len == eng.max_model_len
    assert eng.make_request(prompt, SamplingParams(max_tokens=None)).seqs[0].max_len == eng.max_model_len
    for params, param in [(SamplingParams(max_tokens=room + 1), "max_tokens"),
                          (SamplingParams(stop_token_ids=[eng.cfg.vocab_size]), "stop_token_ids"),
                          (SamplingParams(logit_bias={eng.cfg.vocab_size: 1.0}), "logit_bias")]:
        with pytest.raises(InvalidRequestError) as e:
            eng.make_request(prompt, params)
        assert e.value.param == param
    for bad in ([1, True], [1, 2.0], [1, -1], [10**30], "x\udc00y", None):
        with pytest.raises(InvalidRequestError) as e:
            eng.make_request(bad, SamplingParams())
        assert e.value.param == "prompt"


# ---- step containment ---------------------------------------------------------------------------
def poisoned(**kw) -> SamplingParams:
    """Params that passed validation and then went bad (top_k no int32 holds): what a validation gap
    lets through. The step that packs this row raises OverflowError on the host."""
    p = SamplingParams(**kw)
    object.__setattr__(p, "top_k", 10**12)
    return p


def test_a_request_that_breaks_its_step_fails_alone(default_llm):
    prompts = random_prompts(default_llm.cfg.vocab_size, [7, 40, 12, 90], seed=17)
    good = [SamplingParams(max_tokens=10, **GREEDY), SamplingParams(max_tokens=14, temperature=0.8, seed=3)]
    ref = [o.outputs[0].token_ids for o in default_llm.generate([prompts[0], prompts[2]], good)]
    compiles, eng = default_llm.num_compiles, default_llm.engine
    failed_before = eng.num_failed_requests
    outs = default_llm.generate(prompts, [good[0], poisoned(max_tokens=8), good[1], poisoned(max_tokens=5, n=2)])
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == ref
    for bad in (outs[1], outs[3]):
        assert all(c.finish_reason == "error" for c in bad.outputs) and "OverflowError" in bad.error
    assert eng.num_failed_requests == failed_before + 2
    assert default_llm.blocks.num_free == default_llm.num_pages and default_llm.slots.num_free == default_llm.max_num_seqs
    assert default_llm.num_compiles == compiles
    assert default_llm.generate(prompts[0], good[0])[0].outputs[0].token_ids == ref[0]       # still serving


def test_a_fault_that_consumed_the_state_is_raised(default_llm, monkeypatch):
    """Only a failure after the device took the donated state kills the engine (nothing to contain)."""
    import jax
    runner = default_llm.engine.runner
    backup = jax.tree.map(lambda x: x.copy(), runner.state)
    real = runner.exes.get

    def faulty(kind, args):
        exe = real(kind, args)

        def run(params, state, *a):
            exe(params, state, *a)            # takes (donates) the state, then "faults"
            raise RuntimeError("device fault")
        return run
    monkeypatch.setattr(runner.exes, "get", faulty)
    try:
        with pytest.raises(RuntimeError, match="device fault"):
            default_llm.generate([1, 2, 3], SamplingParams(max_tokens=2))
        assert runner.state_lost()
    finally:
        monkeypatch.undo()
        runner.state = backup
    assert default_llm.blocks.num_free == default_llm.num_pages
    assert default_llm.generate([1, 2, 3], SamplingParams(max_tokens=2))[0].outputs[0].finish_reason == "length"


# ---- over HTTP: uvicorn in a thread on the shared engine ----------------------------------------
KEY = "k"
BODY_LIMIT = 1 << 20


@pytest.fixture(scope="module")
def live(default_llm):
    from atlas_jax.engine.async_llm import AsyncLLM
    from atlas_jax.server.app import build_app
    engine = AsyncLLM.from_llm(default_llm)
    app = build_app(engine, served_model_name="tiny", api_key=KEY, max_body_bytes=BODY_LIMIT)
    with serving(app) as port, httpx.Client(base_url=f"http://127.0.0.1:{port}",
                                            headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as client:
        yield client, engine, port
    engine.shutdown()


def idle(engine, default_llm, timeout=10.0):
    """Wait for the engine to finish what is in flight; True when every page and slot is free."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if engine.num_in_flight == 0 and default_llm.blocks.num_free == default_llm.num_pages \
                and default_llm.slots.num_free == default_llm.max_num_seqs:
            return True
        time.sleep(0.02)
    return False


def assert_openai_error(r, status, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def ok(client, path="/v1/completions"):
    r = client.post(path, json={"prompt": "def f(x):", "max_tokens": 3, **GREEDY})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "top_k": 10**12}, "top_k"),
    ("/v1/completions", {"prompt": "x\udc00y", "max_tokens": 2}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800b\udfffc"}]}, "messages.0.content"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**9}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2**70}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [10**30]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [1, True]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "stop": ["s"] * 100}, "stop"),
    ("/v1/completions", {"prompt": "hi", "n": True}, "n"),
    ("/v1/completions", {"prompt": "hi", "seed": True}, "seed"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**70}, "seed"),
    ("/v1/completions", {"prompt": "hi", "temperature": "0.5"}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "8"}, "max_tokens"),
    ("/v1/completions", {"prompt": [1, True]}, "prompt"),
    ("/v1/completions", {"prompt": [[1], [10**30]]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 10**12}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"x5": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 1000}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"99999999": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(129)}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages"),
    ("/tokenize", {"prompt": "x\udc00"}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/detokenize", {"tokens": [1000000000000]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": [1.0]}, "tokens"),
])
def test_client_errors_are_400_in_openai_format(live, path, body, param):
    client = live[0]
    raw = json.dumps(body)                      # \\udXXX escapes: lone surrogates, as a client sends them
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert_openai_error(r, 400, param)


def test_logit_bias_over_http(live, default_llm):
    client = live[0]
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "logit_bias": {"7": 100}, **GREEDY})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == default_llm.tokenizer.decode([7, 7, 7])


def test_the_top_k_request_leaves_the_server_serving(live, default_llm):
    client, engine, _ = live
    streams = [client.build_request("POST", "/v1/completions", json={"prompt": f"{i}", "max_tokens": 30, "stream": True,
                                                                     **GREEDY}) for i in range(4)]
    with httpx.Client(base_url=client.base_url, headers=client.headers, timeout=60) as other:
        sent = [other.send(s, stream=True) for s in streams]
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                                      "top_k": 1000000000000})
        assert_openai_error(r, 400, "top_k")
        for s in sent:
            lines = [line for line in s.iter_lines() if line.startswith("data: ")]
            assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
            s.close()
    assert client.get("/health").status_code == 200
    ok(client)


def test_malformed_bodies(live):
    client = live[0]
    h = {"content-type": "application/json"}
    err = assert_openai_error(client.post("/v1/completions", content=b'{"prompt": "\xff\xfe"}', headers=h), 400)
    assert "UTF-8" in err["message"]
    assert_openai_error(client.post("/v1/completions", content=b'{"prompt": "hi", "temperature": NaN}', headers=h), 400)
    assert_openai_error(client.post("/v1/completions", content=b"[" * 100_000 + b"]" * 100_000, headers=h), 400)
    assert_openai_error(client.post("/v1/completions", content=b'{"prompt": ', headers=h), 400)
    assert_openai_error(client.post("/v1/completions", content=b"", headers=h), 400)
    assert_openai_error(client.post("/v1/completions", content=b'"just a string"', headers=h), 400)
    assert_openai_error(client.post("/v1/completions", content=b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}",
                                    headers=h), 400)
    assert_openai_error(client.get("/v1/nothing-here"), 404)
    assert_openai_error(client.get("/v1/completions"), 405)
    ok(client)


def test_an_unexpected_error_is_a_500_that_keeps_the_connection(live, default_llm, monkeypatch):
    """A bug in a route answers 500 in OpenAI's format and the keep-alive connection goes on."""
    client, engine, port = live

    def broken(*a, **k):
        raise RuntimeError("tokenizer exploded")
    monkeypatch.setattr(default_llm.engine.inputs, "encode", broken)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    headers = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 2}), headers)
    r = conn.getresponse()
    body = json.loads(r.read())
    assert r.status == 500 and "tokenizer exploded" in body["error"]["message"]
    assert body["error"]["type"] == "internal_server_error" and r.getheader("connection") != "close"
    sock = conn.sock
    monkeypatch.undo()
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 2}), headers)
    r = conn.getresponse()
    assert r.status == 200 and json.loads(r.read())["usage"]["completion_tokens"] == 2
    assert conn.sock is sock                    # the same connection served both
    conn.close()


def test_a_request_failed_by_the_engine_gets_500_and_the_rest_go_on(live, default_llm, monkeypatch):
    """Step containment over HTTP: a row whose packing raises (seed 666 here) fails its request alone."""
    client, engine, _ = live
    runner = default_llm.engine.runner
    real = runner.batch.sampling

    def sampling(rows, b):
        if any(r is not None and r.seed == 666 for r in rows):
            raise OverflowError("bad column")
        return real(rows, b)
    monkeypatch.setattr(runner.batch, "sampling", sampling)
    with httpx.Client(base_url=client.base_url, headers=client.headers, timeout=60) as other:
        good = other.send(client.build_request("POST", "/v1/completions", json={
            "prompt": "abc", "max_tokens": 40, "stream": True, **GREEDY}), stream=True)
        bad = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 5, "seed": 666, "temperature": 1.0})
        err = assert_openai_error(bad, 500)
        assert "OverflowError" in err["message"]
        bad_stream = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 5, "seed": 666, "stream": True})
        assert bad_stream.status_code == 500
        lines = [line for line in good.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
        good.close()
    monkeypatch.undo()
    assert client.get("/health").status_code == 200
    assert idle(engine, default_llm)
    ok(client)


def test_body_limit_while_reading(live):
    """A 10 MB chunked body (no Content-Length) is cut off at the limit with 413; one just under the
    limit is parsed and tokenized off the event loop and refused as too long. (The latency of /health
    meanwhile is measured against a server process in test_server.py.)"""
    client = live[0]

    def chunks():
        yield b'{"prompt": "'
        for _ in range(10 * 16):
            yield b"a b " * (1 << 14)
        yield b'", "max_tokens": 2}'
    t = time.monotonic()
    r = client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert_openai_error(r, 413)
    assert time.monotonic() - t < 10
    assert_openai_error(client.post("/v1/completions", content=b"x" * (BODY_LIMIT + 1)), 413)     # Content-Length
    big = {"prompt": "def f(x): return x\n" * (BODY_LIMIT // 20 - 10), "max_tokens": 2}
    assert_openai_error(client.post("/v1/completions", json=big), 400, "prompt")
    ok(client)


def test_fuzz_in_process(live, default_llm):
    """Hypothesis bodies against the app in-process (TestClient, on the module's AsyncLLM: one engine
    thread only): no 5xx, OpenAI-format errors; after, an ordinary request is served, every page and
    slot is free and nothing was compiled."""
    from fastapi.testclient import TestClient

    from atlas_jax.server.app import build_app
    engine = live[1]
    compiles = default_llm.num_compiles
    with TestClient(build_app(engine, served_model_name="tiny")) as c:
        fuzz(lambda path, raw: c.post(path, content=raw, headers={"content-type": "application/json"}), 150)
        ok(c)
        assert idle(engine, default_llm)
    assert default_llm.num_compiles == compiles


def test_non_streaming_request_is_aborted_when_its_client_leaves(live, default_llm, monkeypatch):
    client, engine, _ = live
    aborted = []
    real = engine.abort_nowait
    monkeypatch.setattr(engine, "abort_nowait", lambda rid, reason="abort": (aborted.append(rid), real(rid, reason)))
    step = engine.engine.step
    # paced: 16 x 120 tokens at 8 rows take >= 240 steps (>= 7 s), so the client leaves first however fast
    monkeypatch.setattr(engine.engine, "step", lambda: (time.sleep(0.03), step())[1])
    with pytest.raises(httpx.ReadTimeout):
        client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 120, "n": 16, **GREEDY}, timeout=0.5)
    assert idle(engine, default_llm, timeout=10)
    assert any(rid.startswith("cmpl-") for rid in aborted), aborted          # aborted, not run to the end
    ok(client)


def test_a_repeated_x_request_id_does_not_collide(live):
    """The client's x-request-id is echoed, never used as the engine's id: two requests with the same
    trace id run side by side."""
    client = live[0]
    body = {"prompt": "def f(x):", "max_tokens": 20, "stream": True, **GREEDY}
    headers = {"x-request-id": "same-trace"}
    with httpx.Client(base_url=client.base_url, headers=client.headers, timeout=60) as other:
        first = other.send(other.build_request("POST", "/v1/completions", json=body, headers=headers), stream=True)
        second = client.post("/v1/completions", json={**body, "stream": False}, headers=headers)
        assert second.status_code == 200 and second.headers["x-request-id"] == "same-trace", second.text
        assert first.status_code == 200 and [line for line in first.iter_lines() if line][-1] == "data: [DONE]"
        first.close()
