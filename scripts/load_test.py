"""Bounded load test of a running atlas_jax server (loopback only). Prints one JSON object.

    python -m atlas_jax.serve --port 8000 &           # or let this script start one: --start
    python scripts/load_test.py [--url http://127.0.0.1:8000] [--clients 64] [--duration 60] [--start]
    python scripts/load_test.py --start --chaos [--clients 32] [--duration 30]

Each of --clients concurrent clients sends streaming chat completions back to back until
--duration seconds have passed (then finishes its current request and stops). Reports requests,
failures (non-200, a stream without `data: [DONE]`, or an empty reply), time-to-first-token p50/p99,
request latency p50/p99 and throughput in output tokens/s (from stream_options usage).

--chaos (needs --start: it signals the server): a quarter of the clients disconnect early (after
the first chunk) and another quarter send malformed requests (bad JSON, invalid UTF-8, wrong
types, extreme numbers, lone surrogates, over-long prompts, an oversized chunked body), which must
all be answered 4xx. Then it checks the engine went idle (every KV page free, nothing compiled), opens
--drain-streams streams and sends SIGTERM: reports how each in-flight stream ended (finished,
error event + [DONE], or cut), whether new requests got 503, the exit code and the drain time.

--flood: one client (127.0.0.1) floods — --flood-streams long streams back to back and one maximal batch
request (64 prompts x n at the per-request cap) — while a canary client from another address
(127.0.0.2) sends short requests one after another and a prober polls /health every 50 ms. Reports the
canary's latency p50 / p99 (target < 5 s), /health's p50 / p99 (target < 200 ms), the flood's answers by
status (429 past its share), and whether the engine is still healthy after.
"""
import argparse
import asyncio
import json
import random
import signal
import subprocess
import sys
import time

import httpx

MALFORMED = [  # (body bytes, what it is): each must get a 4xx, never a 5xx
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": ', "truncated JSON"),
    (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', "invalid UTF-8"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "top_k": 1000000000000}', "top_k overflow"),
    (b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "lone surrogate"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000000000}', "max_tokens over the context"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": "0.5"}', "string for a number"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "n": true}', "bool for an int"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "seed": 1e400}', "infinite seed"),
    (b'{"messages": []}', "no messages"),
    (b'[' * 50000 + b']' * 50000, "deep nesting"),
    (b'{"messages": [{"role": "user", "content": "' + b"word " * 200000 + b'"}]}', "over-long prompt"),
]

PROMPTS = ["Hello", "def add(a, b):", "What is the capital of France?", "The quick brown fox",
           "class Stack:", "0 1 2 3 4", "Tell me about linear attention."]


async def client(url, key, deadline, rng, stats, mode="normal"):
    """mode: normal (streams to the end), disconnect (leaves after the first chunk), malformed."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(timeout=300, headers=headers) as http:
        while time.monotonic() < deadline:
            if mode == "malformed":
                await malformed(http, url, rng, stats)
                continue
            body = {"messages": [{"role": "user", "content": rng.choice(PROMPTS)}], "stream": True,
                    "max_tokens": rng.randint(4, 48), "temperature": rng.choice([0.0, 0.7, 1.0]),
                    "stream_options": {"include_usage": True}}
            t0 = time.monotonic()
            ttft, done, tokens, status = None, False, 0, None
            try:
                async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                    status = r.status_code
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        if line == "data: [DONE]":
                            done = True
                            continue
                        chunk = json.loads(line[6:])
                        if chunk.get("usage"):
                            tokens = chunk["usage"]["completion_tokens"]
                        for c in chunk.get("choices", []):
                            if c["delta"].get("content") and ttft is None:
                                ttft = time.monotonic() - t0
                        if mode == "disconnect":
                            break                     # leave mid-stream: the server must abort and free
            except httpx.HTTPError as e:
                stats["errors"].append(repr(e))
            stats["requests"] += 1
            stats["by_status"][str(status)] = stats["by_status"].get(str(status), 0) + 1
            if mode == "disconnect":
                stats["disconnected"] += 1
                continue
            ok = status == 200 and done and tokens > 0
            if not ok:
                stats["failed"] += 1
                stats["errors"].append(f"status={status} done={done} tokens={tokens}")
                continue
            stats["ttft"].append(ttft if ttft is not None else time.monotonic() - t0)
            stats["latency"].append(time.monotonic() - t0)
            stats["tokens"] += tokens


async def malformed(http, url, rng, stats):
    body, what = rng.choice(MALFORMED + [(None, "oversized chunked body")])
    try:
        if body is None:
            async def chunks():
                for _ in range(40):
                    yield b"x" * (1 << 18)              # 10 MB without a Content-Length
            r = await http.post(f"{url}/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
        else:
            r = await http.post(f"{url}/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        status = r.status_code
    except httpx.HTTPError as e:
        status = type(e).__name__
    stats["requests"] += 1
    stats["malformed"] += 1
    stats["by_status"][str(status)] = stats["by_status"].get(str(status), 0) + 1
    if not (isinstance(status, int) and 400 <= status < 500):
        stats["failed"] += 1
        stats["errors"].append(f"malformed ({what}): {status}")


def pct(xs, p):
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(p / 100 * len(xs)))], 4) if xs else None


async def run(url, key, clients, duration, chaos=False):
    stats = {"requests": 0, "failed": 0, "tokens": 0, "ttft": [], "latency": [], "errors": [], "by_status": {},
             "disconnected": 0, "malformed": 0}
    rng = random.Random(0)
    modes = ["normal"] * clients
    if chaos:
        q = max(1, clients // 4)
        modes = ["disconnect"] * q + ["malformed"] * q + ["normal"] * (clients - 2 * q)
    t0 = time.monotonic()
    await asyncio.gather(*(client(url, key, t0 + duration, random.Random(rng.random()), stats, mode) for mode in modes))
    wall = time.monotonic() - t0
    return {"clients": clients, "duration_s": duration, "wall_s": round(wall, 1), "requests": stats["requests"],
            "failed": stats["failed"], "by_status": stats["by_status"], "disconnected": stats["disconnected"],
            "malformed": stats["malformed"], "output_tokens": stats["tokens"],
            "output_tokens_per_s": round(stats["tokens"] / wall, 1), "requests_per_s": round(stats["requests"] / wall, 2),
            "ttft_p50_s": pct(stats["ttft"], 50), "ttft_p99_s": pct(stats["ttft"], 99),
            "latency_p50_s": pct(stats["latency"], 50), "latency_p99_s": pct(stats["latency"], 99),
            "first_errors": stats["errors"][:5]}


async def flood(url, key, duration, streams):
    """--flood (module docstring). The canary and the /health prober run in a child process (its own
    event loop and GIL), so the flood's client-side work does not inflate what they measure."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    deadline = time.monotonic() + duration
    statuses = {}
    long_body = {"prompt": "def f(x):", "n": 4, "max_tokens": 200, "stream": True, "ignore_eos": True}
    batch_body = {"prompt": ["def f(x):"] * 64, "n": 4, "max_tokens": 200, "ignore_eos": True}

    def count(status):
        statuses[str(status)] = statuses.get(str(status), 0) + 1

    async def flooder(http, body):
        while time.monotonic() < deadline:
            try:
                async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
                    count(r.status_code)
                    async for _ in r.aiter_lines():
                        if time.monotonic() > deadline:
                            break
                    if r.status_code != 200:
                        await asyncio.sleep(0.2)
            except httpx.HTTPError as e:
                count(type(e).__name__)

    probe = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--url", url, *(["--api-key", key] if key else []), "--probe-for",
        str(duration - 2.0), stdout=asyncio.subprocess.PIPE)
    async with httpx.AsyncClient(timeout=300, headers=headers,
                                 limits=httpx.Limits(max_connections=streams + 8)) as http:
        await asyncio.gather(*(flooder(http, long_body) for _ in range(streams)), flooder(http, batch_body))
    measured = json.loads((await probe.communicate())[0])
    return {"flood_streams": streams, "duration_s": duration, "flood_status": statuses, **measured,
            "health_after": httpx.get(url + "/health").status_code}


async def probe(url, key, duration):
    """--probe-for: after 2 s, a canary from 127.0.0.2 sends short completions one after another and
    /health is polled every 50 ms, for `duration` seconds; their latencies."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    canary, health = [], []
    await asyncio.sleep(2.0)                             # the flood first
    deadline = time.monotonic() + duration

    async def canary_client():
        transport = httpx.AsyncHTTPTransport(local_address="127.0.0.2")
        async with httpx.AsyncClient(timeout=120, headers=headers, transport=transport) as http:
            while time.monotonic() < deadline:
                t = time.monotonic()
                r = await http.post(f"{url}/v1/completions", json={"prompt": "def g(y):", "max_tokens": 8})
                canary.append((time.monotonic() - t, r.status_code))
                await asyncio.sleep(0.5)

    async def prober():
        async with httpx.AsyncClient(timeout=30) as http:
            while time.monotonic() < deadline:
                t = time.monotonic()
                await http.get(f"{url}/health")
                health.append(time.monotonic() - t)
                await asyncio.sleep(0.05)

    await asyncio.gather(canary_client(), prober())
    ok = [t for t, st in canary if st == 200]
    return {"canary_requests": len(canary), "canary_ok": len(ok), "canary_p50_s": pct(ok, 50),
            "canary_p99_s": pct(ok, 99), "canary_max_s": round(max(ok), 3) if ok else None,
            "health_probes": len(health), "health_p50_s": pct(health, 50), "health_p99_s": pct(health, 99),
            "health_max_s": round(max(health), 3) if health else None}


def server_metrics(url, key=None) -> dict:
    out = {}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    for line in httpx.get(url + "/metrics", headers=headers).text.splitlines():
        if line.startswith(("atlas_num_compiles ", "atlas_free_kv_pages ", "atlas_kv_pages ", "atlas_running_requests ",
                            "atlas_waiting_requests ")):
            name, value = line.split()
            out[name] = float(value)
    return out


def wait_idle(url, key=None, timeout=30.0) -> dict:
    """Metrics once nothing runs or waits and every KV page is free (or at the timeout)."""
    end = time.monotonic() + timeout
    while True:
        m = server_metrics(url, key)
        idle = (m.get("atlas_running_requests") == 0 and m.get("atlas_waiting_requests") == 0
                and m.get("atlas_free_kv_pages") == m.get("atlas_kv_pages"))
        if idle or time.monotonic() > end:
            return {**m, "idle": idle}
        time.sleep(0.1)


def stream_end(events: list[str]) -> str:
    """How a stream ended, from its `data: ` payloads: "finished" (a finish_reason, then [DONE]),
    "error" (an error event, then [DONE]) or "cut" (anything else)."""
    if len(events) < 2 or events[-1] != "[DONE]":
        return "cut"
    last = json.loads(events[-2])
    if "error" in last:
        return "error"
    return "finished" if any(c.get("finish_reason") for c in last.get("choices", [])) else "cut"


async def sigterm_with_streams(url, key, proc, n_streams):
    """Open n streams, SIGTERM the server once all of them are in its engine (running or waiting),
    and report how each ended."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}

    async def one(http):
        # no max_tokens: as many as fit in max_model_len, to outlast a short --shutdown-timeout
        body = {"messages": [{"role": "user", "content": "Tell me a story"}], "stream": True, "ignore_eos": True}
        try:
            async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    return f"status {r.status_code}"
                events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
        except httpx.HTTPError as e:
            return f"cut ({type(e).__name__})"
        return stream_end(events)

    async with httpx.AsyncClient(timeout=300, headers=headers,
                                 limits=httpx.Limits(max_connections=n_streams + 8)) as http:
        tasks = [asyncio.create_task(one(http)) for _ in range(n_streams)]
        for _ in range(1200):
            m = await asyncio.to_thread(server_metrics, url, key)
            if m["atlas_running_requests"] + m["atlas_waiting_requests"] >= n_streams:
                break
            await asyncio.sleep(0.05)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        refused = await http.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        ends = await asyncio.gather(*tasks)
    code = await asyncio.to_thread(proc.wait, 120)
    counts = {}
    for e in ends:
        counts[e] = counts.get(e, 0) + 1
    return {"in_flight": n_streams, "running_at_signal": m["atlas_running_requests"],
            "waiting_at_signal": m["atlas_waiting_requests"], "ended": counts,
            "new_request_status_while_draining": refused.status_code, "exit_code": code,
            "exit_s": round(time.monotonic() - t0, 2)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--duration", type=float, default=60)
    ap.add_argument("--start", action="store_true", help="start `python -m atlas_jax.serve` (default model) first")
    ap.add_argument("--server-args", default="--max-num-seqs 16 --max-model-len 256 --page-size 8",
                    help="extra arguments for the started server")
    ap.add_argument("--chaos", action="store_true", help="early disconnects, malformed requests, SIGTERM at the end")
    ap.add_argument("--drain-streams", type=int, default=16, help="--chaos: streams in flight at the SIGTERM")
    ap.add_argument("--flood", action="store_true", help="one client floods, a canary from another address is timed")
    ap.add_argument("--flood-streams", type=int, default=260, help="--flood: the flooding client's concurrent streams")
    ap.add_argument("--probe-for", type=float, default=None, help=argparse.SUPPRESS)    # --flood's child process
    args = ap.parse_args()
    if args.probe_for is not None:
        print(json.dumps(asyncio.run(probe(args.url, args.api_key, args.probe_for))))
        return
    if not args.url.startswith(("http://127.0.0.1", "http://localhost")):
        raise SystemExit("load tests run against loopback only")
    if args.chaos and not args.start:
        raise SystemExit("--chaos signals the server: use it with --start")
    proc = None
    if args.start:
        port = args.url.rsplit(":", 1)[1]
        proc = subprocess.Popen([sys.executable, "-m", "atlas_jax.serve", "--port", port, "--log-level", "warning",
                                 *args.server_args.split()], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(1200):
            try:
                if httpx.get(args.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    try:
        compiles = server_metrics(args.url, args.api_key).get("atlas_num_compiles")
        if args.flood:
            result = asyncio.run(flood(args.url, args.api_key, args.duration, args.flood_streams))
        else:
            result = asyncio.run(run(args.url, args.api_key, args.clients, args.duration, args.chaos))
        result["idle_after"] = wait_idle(args.url, args.api_key)
        result["idle_after"]["compiles_during_load"] = result["idle_after"].get("atlas_num_compiles", 0) - (compiles or 0)
        if args.chaos:
            result["shutdown"] = asyncio.run(sigterm_with_streams(args.url, args.api_key, proc, args.drain_streams))
        print(json.dumps(result))
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            result_code = proc.wait(120)
            if result_code != 0:
                print(json.dumps({"server_exit_code": result_code}), file=sys.stderr)


if __name__ == "__main__":
    main()
