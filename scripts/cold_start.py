"""Cold start of `python -m atlas_jax.serve` with the compile cache off: seconds until /health is 200, until
the first completion answers, and until background warm-up has compiled every shape (atlas_warmup_pending 0).

    python scripts/cold_start.py [-- extra serve flags, e.g. --speculative mtp:3 --enable-prefix-caching]

Prints one JSON object.
"""
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""
    except OSError:
        return 0, ""


def metric(text: str, name: str) -> float | None:
    m = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else None


def main(argv: list[str]) -> None:
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    port = free_port()
    env = dict(os.environ, ATLAS_JAX_DISABLE_COMPILE_CACHE="1")
    cmd = [sys.executable, "-m", "atlas_jax.serve", "--port", str(port), "--public-metrics",
           "--log-level", "warning", *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    out: dict = {"flags": extra}
    try:
        while get(base + "/health")[0] != 200:
            if proc.poll() is not None:
                raise SystemExit(f"server exited {proc.returncode}: {proc.stderr.read()[-2000:]}")
            time.sleep(0.5)
        out["healthy_s"] = round(time.perf_counter() - t0, 1)
        _, text = get(base + "/metrics")
        out["compiled_at_healthy"] = metric(text, "atlas_num_compiles")
        out["pending_at_healthy"] = metric(text, "atlas_warmup_pending")
        model = json.loads(get(base + "/v1/models")[1])["data"][0]["id"]
        body = json.dumps({"model": model, "prompt": "The quick brown fox", "max_tokens": 16,
                           "temperature": 0}).encode()
        t1 = time.perf_counter()
        req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            ans = json.loads(r.read())
        out["first_completion_s"] = round(time.perf_counter() - t1, 2)
        out["first_completion_tokens"] = ans["usage"]["completion_tokens"]
        while True:
            _, text = get(base + "/metrics")
            pending = metric(text, "atlas_warmup_pending")
            if pending == 0:
                break
            if proc.poll() is not None:
                raise SystemExit(f"server exited {proc.returncode}")
            time.sleep(1.0)
        out["all_compiled_s"] = round(time.perf_counter() - t0, 1)
        out["compiles"] = metric(text, "atlas_num_compiles")
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
