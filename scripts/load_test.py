"""Bounded load test of a running atlas_jax server (loopback only). Prints one JSON object.

    python -m atlas_jax.serve --port 8000 &           # or let this script start one: --start
    python scripts/load_test.py [--url http://127.0.0.1:8000] [--clients 64] [--duration 60] [--start]

Each of --clients concurrent clients sends streaming chat completions back to back until
--duration seconds have passed (then finishes its current request and stops). Reports requests,
failures (non-200, a stream without `data: [DONE]`, or an empty reply), time-to-first-token p50/p99,
request latency p50/p99 and throughput in output tokens/s (from stream_options usage).
"""
import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time

import httpx

PROMPTS = ["Hello", "def add(a, b):", "What is the capital of France?", "The quick brown fox",
           "class Stack:", "0 1 2 3 4", "Tell me about linear attention."]


async def client(url, key, deadline, rng, stats):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(timeout=300, headers=headers) as http:
        while time.monotonic() < deadline:
            body = {"messages": [{"role": "user", "content": rng.choice(PROMPTS)}], "stream": True,
                    "max_tokens": rng.randint(4, 48), "temperature": rng.choice([0.0, 0.7, 1.0]),
                    "stream_options": {"include_usage": True}}
            t0 = time.monotonic()
            ttft, done, tokens, content, status = None, False, 0, "", None
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
                            content += c["delta"].get("content") or ""
            except httpx.HTTPError as e:
                stats["errors"].append(repr(e))
            ok = status == 200 and done and tokens > 0
            stats["requests"] += 1
            if not ok:
                stats["failed"] += 1
                stats["errors"].append(f"status={status} done={done} tokens={tokens}")
                continue
            stats["ttft"].append(ttft if ttft is not None else time.monotonic() - t0)
            stats["latency"].append(time.monotonic() - t0)
            stats["tokens"] += tokens


def pct(xs, p):
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(p / 100 * len(xs)))], 4) if xs else None


async def run(url, key, clients, duration):
    stats = {"requests": 0, "failed": 0, "tokens": 0, "ttft": [], "latency": [], "errors": []}
    rng = random.Random(0)
    t0 = time.monotonic()
    await asyncio.gather(*(client(url, key, t0 + duration, random.Random(rng.random()), stats) for _ in range(clients)))
    wall = time.monotonic() - t0
    return {"clients": clients, "duration_s": duration, "wall_s": round(wall, 1), "requests": stats["requests"],
            "failed": stats["failed"], "output_tokens": stats["tokens"],
            "output_tokens_per_s": round(stats["tokens"] / wall, 1), "requests_per_s": round(stats["requests"] / wall, 2),
            "ttft_p50_s": pct(stats["ttft"], 50), "ttft_p99_s": pct(stats["ttft"], 99),
            "latency_p50_s": pct(stats["latency"], 50), "latency_p99_s": pct(stats["latency"], 99),
            "first_errors": stats["errors"][:5]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--duration", type=float, default=60)
    ap.add_argument("--start", action="store_true", help="start `python -m atlas_jax.serve` (default model) first")
    ap.add_argument("--server-args", default="--max-num-seqs 16 --max-model-len 256 --page-size 8",
                    help="extra arguments for the started server")
    args = ap.parse_args()
    if not args.url.startswith(("http://127.0.0.1", "http://localhost")):
        raise SystemExit("load tests run against loopback only")
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
        result = asyncio.run(run(args.url, args.api_key, args.clients, args.duration))
        metrics = httpx.get(args.url + "/metrics").text
        for line in metrics.splitlines():
            if line.startswith(("atlas_num_compiles ", "atlas_free_kv_pages ", "atlas_kv_pages ")):
                name, value = line.split()
                result[name] = float(value)
        print(json.dumps(result))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            result_code = proc.wait(120)
            if result_code != 0:
                print(json.dumps({"server_exit_code": result_code}), file=sys.stderr)


if __name__ == "__main__":
    main()
